"""Find the collective/compute patterns that decomposition rewrites (find first, rewrite second).

Contract
    Each ``find_*(graph, skipped=None)`` returns the matches of one pattern, in graph order, and
    changes nothing. A candidate that does not qualify is skipped and its reason code counted in
    ``skipped`` (``Counter[code]``) so that "why was this not decomposed?" has an answer (the
    decompose pass counts them as ``"not matched: <code>"``). Works on forward and backward
    graphs alike (it matches ops, not phases).

Reason codes (``<collective>: <why>``)::

    all_gather: no single wait           the issue is not read by exactly one wait_tensor
    all_gather: unrecognised layout      the wait's readers are not the chunk + cat of a gather along a dim
    all_gather: unsupported gather dim   gathers the last (contraction) dim, or has no shape
    all_gather: non-matmul consumer      the gathered tensor feeds something besides matmul rows,
                                         weight-gradient matmuls and graph outputs
    reduce_scatter: no single wait
    reduce_scatter: not fed by matmuls   the input is not a matmul output (through views) or a sum of them
    all_reduce: no single wait
    all_reduce: not fed by a matmul      the input is not a matmul output (through views)
    all_to_all: no single wait
    all_to_all: not fed by bmms          the input is not a bmm output or a sum of them (through regrouping)
    all_to_all: feeds no matmul          the output reaches no mm / addmm / bmm (through regrouping)
    chain: no feeding all-gather         no all-gather on the reduce-scatter's group feeds its matmuls
    all_to_all chain: no feeding dispatch
                                         no all-to-all on the combine's group feeds its bmms

Patterns (aten IR as AOTAutograd hands it to dhelix)::

    AllGatherMatmul          x ─ all_gather_into_tensor ─ wait ─[chunk ─ cat(dim=d)]─[views]─ mm/addmm  (one or more)
                                                                          └─[views]─ t ─ mm(·, y)  (weight grads, optional)
    MatmulReduceScatter      mm/addmm ─[views]─[add ─ mm ...]─[chunk(dim=d) ─ cat]─ reduce_scatter_tensor ─ wait
    MatmulAllReduce          mm/addmm ─[views]─ all_reduce ─ wait
    AllToAllCompute          x ─ all_to_all_single ─ wait ─[views, transposes, clones]─ mm/addmm/bmm
    BmmAllToAll              bmm ─[add ─ bmm ...]─[views, transposes, clones]─ all_to_all_single ─ wait
    AllGatherChain           AllGatherMatmul ─ ... compute ... ─ MatmulReduceScatter  (same group; the
                             scatter's matmuls descend from the gathered tensor: SP's MLP block)
    AllToAllChain            AllToAllCompute ─ ... compute ... ─ BmmAllToAll  (same group; the combine's
                             bmms descend from the dispatched tokens: an MoE layer's experts)

``all_gather_into_tensor`` always gathers along dim 0; a gather along dim ``d`` (sequence
parallelism gathers the sequence dim) appears as the dim-0 gather followed by
a chunking into ``group_size`` pieces (``split`` + ``getitem``, or ``slice``s) and ``cat(dim=d)``
— ``gather_dim`` records ``d``. Likewise a reduce-scatter along dim ``d`` is a chunking along
``d`` + ``cat(dim=0)`` before the dim-0 collective.

The matmul's row operand may be reached through views that keep the contraction (last) dim:
the rows then come from several shards, which a per-peer rewrite can compute shard by shard.
In a training forward graph the gathered tensor (or a view of it) is usually also a graph
output, saved for the backward's weight gradient; that consumer is allowed (a rewrite must
still assemble the full tensor for it), any other non-matmul consumer disqualifies the match.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.fx

from cost_model.op_kinds import kind_of
from graph_passes.node_args import as_int, as_ints, as_node
from graph_passes.op_groups import MATMULS, RESHAPES

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class GatheredTensor:
    """``wait(all_gather(shard))`` as the tensor gathered along ``gather_dim`` (whatever reads it)."""

    shard: torch.fx.Node
    issue: torch.fx.Node
    wait: torch.fx.Node
    gathered: torch.fx.Node  # the wait, or the cat of its chunks
    gather_dim: int
    group_size: int
    group_name: str
    chunking: tuple[torch.fx.Node, ...]
    """The nodes between the wait and the cat (``split`` and its ``getitem``s, or ``slice``s)."""


@dataclasses.dataclass(frozen=True)
class AllGatherMatmul:
    """``wait(all_gather(shard))`` (gathered along ``gather_dim``) is the row operand of ``matmuls``."""

    shard: torch.fx.Node
    issue: torch.fx.Node
    wait: torch.fx.Node
    gathered: torch.fx.Node  # the gathered tensor in gather_dim layout (the wait, or the cat)
    gather_dim: int
    matmuls: tuple[torch.fx.Node, ...]
    group_size: int
    group_name: str
    transposed: tuple[torch.fx.Node, ...] = ()
    """Matmuls ``mm(t(rows), x)`` that contract over the gathered rows (a weight gradient)."""
    chunking: tuple[torch.fx.Node, ...] = ()
    """The nodes between the wait and the cat (:attr:`GatheredTensor.chunking`)."""


@dataclasses.dataclass(frozen=True)
class MatmulReduceScatter:
    """``wait(reduce_scatter(matmul))``, scattered along ``scatter_dim``."""

    matmul: torch.fx.Node
    issue: torch.fx.Node
    wait: torch.fx.Node
    scatter_dim: int
    reduce_op: str
    group_size: int
    group_name: str
    addends: tuple[torch.fx.Node, ...] = ()
    """Further matmuls whose outputs (same shape, through views) are added to ``matmul``'s."""


@dataclasses.dataclass(frozen=True)
class AllGatherChain:
    """An all-gather whose gathered tensor reaches, through compute, the matmul(s) of a
    reduce-scatter on the same group (sequence parallelism's MLP block: gather -> w1, w3 ->
    silu * mul -> w2 -> scatter, and its backward). Whether every op between them works row by
    row is the rewrite's check, not the finder's."""

    gather: AllGatherMatmul
    scatter: MatmulReduceScatter

    @property
    def issue(self) -> torch.fx.Node:
        return self.gather.issue

    @property
    def group_name(self) -> str:
        return self.gather.group_name

    @property
    def group_size(self) -> int:
        return self.gather.group_size


@dataclasses.dataclass(frozen=True)
class MatmulAllReduce:
    """``wait(all_reduce(matmul))`` (tensor parallelism without sequence parallelism)."""

    matmul: torch.fx.Node
    issue: torch.fx.Node
    wait: torch.fx.Node
    reduce_op: str
    group_name: str


@dataclasses.dataclass(frozen=True)
class AllToAllCompute:
    """``wait(all_to_all_single(x))`` feeding expert compute."""

    issue: torch.fx.Node
    wait: torch.fx.Node
    consumers: tuple[torch.fx.Node, ...]
    group_name: str


@dataclasses.dataclass(frozen=True)
class BmmAllToAll:
    """``all_to_all_single`` of a ``bmm``'s output (or a sum of bmm outputs), regrouped
    (expert parallelism's combine, and the backward's gradient of its dispatch)."""

    output: torch.fx.Node
    """The bmm, or the root of the ``add`` tree over ``bmms``."""
    bmms: tuple[torch.fx.Node, ...]
    issue: torch.fx.Node
    wait: torch.fx.Node
    group_name: str


@dataclasses.dataclass(frozen=True)
class AllToAllChain:
    """A dispatch all-to-all whose received tokens reach, through compute, the bmm(s) of a combine
    all-to-all on the same group (an MoE layer's experts between the two). Whether every op
    between them works row by row is the rewrite's check, not the finder's."""

    dispatch: AllToAllCompute
    combine: BmmAllToAll

    @property
    def issue(self) -> torch.fx.Node:
        return self.dispatch.issue

    @property
    def group_name(self) -> str:
        return self.dispatch.group_name


def _count(skipped: Counter[str] | None, code: str) -> None:
    if skipped is not None:
        skipped[code] += 1


def _single_wait(issue: torch.fx.Node) -> torch.fx.Node | None:
    users = list(issue.users)
    return users[0] if len(users) == 1 and kind_of(users[0]) == "wait" else None


def _issues_with_wait(
    graph: torch.fx.Graph, targets: tuple[object, ...], label: str, skipped: Counter[str] | None
) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(issue, wait)`` for every issue of ``targets`` completed by exactly one wait, in order."""
    for issue in graph.nodes:
        if issue.target not in targets:
            continue
        wait = _single_wait(issue)
        if wait is None:
            _count(skipped, f"{label}: no single wait")
            continue
        yield issue, wait


def _val(node: torch.fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _through_views_to_rows(node: torch.fx.Node, last_dim: int) -> list[torch.fx.Node]:
    """Matmuls whose row operand is ``node`` or a view chain of it keeping the last dim."""
    found: list[torch.fx.Node] = []
    for user in node.users:
        if user.target in RESHAPES:
            val = _val(user)
            if val is not None and val.shape[-1] == last_dim:
                found.extend(_through_views_to_rows(user, last_dim))
        elif (user.target == aten.mm.default and user.args[0] is node) or (
            user.target == aten.addmm.default and user.args[1] is node
        ):
            found.append(user)
    return found


def _transposed_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Matmuls ``mm(t(v), x)`` with ``v`` = ``node`` or a 2-d view chain of it keeping the last dim."""
    found: list[torch.fx.Node] = []
    for user in node.users:
        if user.target in RESHAPES:
            found.extend(_transposed_users(user))
        elif _is_transpose(user) and len(user.users) == 1:
            (mm,) = user.users
            if mm.target == aten.mm.default and mm.args[0] is user and mm.args[1] is not user:
                found.append(mm)
    return found


def _is_transpose(node: torch.fx.Node) -> bool:
    val = _val(node)
    if val is None or val.dim() != 2:
        return False
    return node.target == aten.t.default or (node.target == aten.permute.default and as_ints(node.args[1]) == [1, 0])


def _chunks(parts: torch.fx.node.Argument, group_size: int) -> tuple[torch.fx.Node, int] | None:
    """``(x, d)`` if ``parts`` (a cat's tensors) are ``x``'s ``group_size`` equal chunks along ``d``, in order.

    Two spellings appear in AOTAutograd graphs: ``getitem(split(x, n, d), i)`` and
    ``slice(x, d, i*n, (i+1)*n)``.
    """
    if not isinstance(parts, (list, tuple)) or len(parts) != group_size:
        return None
    nodes = [p for p in parts if isinstance(p, torch.fx.Node)]
    if len(nodes) != len(parts):
        return None
    if all(p.target is operator.getitem for p in nodes):
        split = nodes[0].args[0]
        if (
            isinstance(split, torch.fx.Node)
            and split.target == aten.split.Tensor
            and all(p.args[0] is split and p.args[1] == i for i, p in enumerate(nodes))
            and len(split.users) == group_size
        ):
            return as_node(split.args[0]), as_int(split.args[2]) if len(split.args) > 2 else 0
        return None
    if all(p.target == aten.slice.Tensor for p in nodes):
        source, dim = as_node(nodes[0].args[0]), as_int(nodes[0].args[1])
        size = as_int(nodes[0].args[3]) - as_int(nodes[0].args[2])
        for i, p in enumerate(nodes):
            start, end = as_int(p.args[2]), as_int(p.args[3])
            if p.args[0] is not source or as_int(p.args[1]) != dim or (start, end) != (i * size, (i + 1) * size):
                return None
        return source, dim
    return None


def _cat_dim(cat: torch.fx.Node) -> int:
    return as_int(cat.args[1]) if len(cat.args) > 1 else as_int(cat.kwargs.get("dim", 0))


def _gathered_layout(wait: torch.fx.Node, group_size: int) -> tuple[torch.fx.Node, int] | None:
    """The gathered tensor and its gather dim: ``(wait, 0)``, or ``(cat, d)`` after chunk + cat."""
    chunkers = [u for u in wait.users if u.target in (aten.split.Tensor, aten.slice.Tensor)]
    if not chunkers:
        return wait, 0
    cats = {c for u in wait.users for g in ([u] if u.target == aten.slice.Tensor else u.users) for c in g.users}
    if len(cats) != 1 or len(chunkers) != len(wait.users):
        return None
    (cat,) = cats
    if cat.target != aten.cat.default:
        return None
    chunked = _chunks(cat.args[0], group_size)
    if chunked is None or chunked[0] is not wait or chunked[1] != 0:
        return None
    return cat, _cat_dim(cat)


def find_gathered_tensors(graph: torch.fx.Graph, skipped: Counter[str] | None = None) -> list[GatheredTensor]:
    """Every all-gather with one wait, as its gathered tensor and gather dim, in graph order."""
    found = []
    for issue, wait in _issues_with_wait(graph, (c10d.all_gather_into_tensor.default,), "all_gather", skipped):
        group_size = as_int(issue.args[1])
        layout = _gathered_layout(wait, group_size)
        if layout is None:
            _count(skipped, "all_gather: unrecognised layout")
            continue
        gathered, gather_dim = layout
        chunking = (
            () if gathered is wait else (*wait.users, *(g for u in wait.users for g in u.users if g is not gathered))
        )
        found.append(
            GatheredTensor(
                as_node(issue.args[0]), issue, wait, gathered, gather_dim, group_size, str(issue.args[2]), chunking
            )
        )
    return found


def find_all_gather_matmuls(graph: torch.fx.Graph, skipped: Counter[str] | None = None) -> list[AllGatherMatmul]:
    """All-gathers whose gathered tensor is the row operand of one or more matmuls."""
    matches = []
    for g in find_gathered_tensors(graph, skipped):
        gathered = g.gathered
        val = _val(gathered)
        if val is None or g.gather_dim in (-1, val.dim() - 1):
            _count(skipped, "all_gather: unsupported gather dim")
            continue
        matmuls = _through_views_to_rows(gathered, int(val.shape[-1]))
        transposed = _transposed_users(gathered)
        transposes = [t for mm in transposed for t in mm.all_input_nodes if _is_transpose(t)]
        others = [
            c for c in consumers_through(gathered) if c not in matmuls and c not in transposes and c.op != "output"
        ]
        if not matmuls or others:
            _count(skipped, "all_gather: non-matmul consumer")
            continue
        matches.append(
            AllGatherMatmul(
                g.shard,
                g.issue,
                g.wait,
                gathered,
                g.gather_dim,
                tuple(matmuls),
                g.group_size,
                g.group_name,
                tuple(transposed),
                g.chunking,
            )
        )
    return matches


def consumers_through(node: torch.fx.Node, through: tuple[object, ...] = RESHAPES) -> list[torch.fx.Node]:
    """Consumers of ``node`` other than ``through`` (reshapes), looking through chains of those."""
    out: list[torch.fx.Node] = []
    for user in node.users:
        if user.target in through:
            out.extend(consumers_through(user, through))
        else:
            out.append(user)
    return out


def _matmul_behind_views(node: torch.fx.Node) -> torch.fx.Node | None:
    """The matmul that produced ``node`` through views; its output must have no other use."""
    while node.target in RESHAPES:
        node = as_node(node.args[0])
    return node if node.target in MATMULS and len(node.users) == 1 else None


def _matmuls_of_sum(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The matmuls whose outputs (through views) ``node`` is, or is the sum of (``add`` trees).

    Every node between them and ``node`` must have one user (the sum is all they feed) and
    every matmul output must have ``node``'s number of elements. A backward graph's input
    gradient through two projections (SwiGLU's w1 and w3) is such a sum.
    """
    out = _add_tree_leaves(node, _matmul_behind_views)
    if out is None:
        return None
    val = _val(node)
    numel = val.numel() if val is not None else None
    for mm in out:
        mm_val = _val(mm)
        if mm_val is None or mm_val.numel() != numel:
            return None
    return out


def _add_tree_leaves(node: torch.fx.Node, leaf_of: Any) -> list[torch.fx.Node] | None:
    """``[leaf_of(node)]`` when that is a node; else the leaves of the ``add`` tree at ``node``
    (through views), each inner node read only by the sum; None if any branch has no leaf."""
    single = leaf_of(node)
    if single is not None:
        return [single]
    while node.target in RESHAPES:
        node = as_node(node.args[0])
    if node.target != aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return None
    out: list[torch.fx.Node] = []
    for arg in node.args:
        if not isinstance(arg, torch.fx.Node) or len(arg.users) != 1:
            return None
        inner = _add_tree_leaves(arg, leaf_of)
        if inner is None:
            return None
        out.extend(inner)
    return out


def _scatter_source(issue_input: torch.fx.Node, group_size: int) -> tuple[torch.fx.Node, int]:
    """The tensor reduce-scattered and its scatter dim: ``(input, 0)``, or ``(x, d)`` for chunk + cat."""
    if issue_input.target == aten.cat.default and _cat_dim(issue_input) == 0:
        chunked = _chunks(issue_input.args[0], group_size)
        if chunked is not None:
            return chunked
    return issue_input, 0


def find_matmul_reduce_scatters(
    graph: torch.fx.Graph, skipped: Counter[str] | None = None
) -> list[MatmulReduceScatter]:
    """Reduce-scatters of a matmul's output (through views, and split + cat for dim != 0)."""
    matches = []
    for issue, wait in _issues_with_wait(graph, (c10d.reduce_scatter_tensor.default,), "reduce_scatter", skipped):
        reduce_op, group_size, group_name = str(issue.args[1]), as_int(issue.args[2]), str(issue.args[3])
        source, scatter_dim = _scatter_source(as_node(issue.args[0]), group_size)
        summed = _matmuls_of_sum(source)
        if not summed:
            _count(skipped, "reduce_scatter: not fed by matmuls")
            continue
        matches.append(
            MatmulReduceScatter(
                summed[0], issue, wait, scatter_dim, reduce_op, group_size, group_name, tuple(summed[1:])
            )
        )
    return matches


def find_matmul_all_reduces(graph: torch.fx.Graph, skipped: Counter[str] | None = None) -> list[MatmulAllReduce]:
    """All-reduces of a matmul's output (tensor parallelism without sequence parallelism)."""
    matches = []
    all_reduces = (c10d.all_reduce.default, c10d.all_reduce_.default)
    for issue, wait in _issues_with_wait(graph, all_reduces, "all_reduce", skipped):
        matmul = _matmul_behind_views(as_node(issue.args[0]))
        if matmul is None:
            _count(skipped, "all_reduce: not fed by a matmul")
            continue
        matches.append(MatmulAllReduce(matmul, issue, wait, str(issue.args[1]), str(issue.args[2])))
    return matches


def find_all_gather_chains(graph: torch.fx.Graph, skipped: Counter[str] | None = None) -> list[AllGatherChain]:
    """Each reduce-scatter paired with the latest all-gather (same group, each used once) whose
    gathered tensor its matmuls descend from. The two finders' own skips are theirs to count."""
    pairs = _paired(
        find_all_gather_matmuls(graph),
        find_matmul_reduce_scatters(graph),
        lambda gather: gather.gathered,
        lambda scatter: [scatter.matmul, *scatter.addends],
        skipped,
        "chain: no feeding all-gather",
    )
    return [AllGatherChain(gather, scatter) for gather, scatter in pairs]


_First = TypeVar("_First", AllGatherMatmul, AllToAllCompute)
_Second = TypeVar("_Second", MatmulReduceScatter, BmmAllToAll)


def _paired(
    firsts: list[_First],
    seconds: Sequence[_Second],
    output: Callable[[_First], torch.fx.Node],
    inputs: Callable[[_Second], Sequence[torch.fx.Node]],
    skipped: Counter[str] | None,
    code: str,
) -> list[tuple[_First, _Second]]:
    """Each of ``seconds`` paired with the latest of ``firsts`` on its group (each used once)
    whose ``output`` its ``inputs`` descend from; ``code`` counted for one with none."""
    pairs = []
    for second in seconds:
        ancestors = _ancestors(inputs(second))
        paired = [f for f in firsts if f.group_name == second.group_name and output(f) in ancestors]
        if not paired:
            _count(skipped, code)
            continue
        firsts.remove(paired[-1])
        pairs.append((paired[-1], second))
    return pairs


def _ancestors(nodes: Sequence[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


#: How expert parallelism regroups tokens around an all-to-all: views, a transpose, the copy a
#: reshape of a transpose makes.
_REGROUP = (*RESHAPES, aten.permute.default, aten.transpose.int, aten.clone.default)


def find_bmm_all_to_alls(graph: torch.fx.Graph, skipped: Counter[str] | None = None) -> list[BmmAllToAll]:
    """All-to-alls whose input is a ``bmm``'s output or a sum of them (SwiGLU's input gradient
    through w1 and w3), through views, transposes and copies."""
    matches = []
    for issue, wait in _issues_with_wait(graph, (c10d.all_to_all_single.default,), "all_to_all", skipped):
        node = issue.args[0]
        while isinstance(node, torch.fx.Node) and node.target in _REGROUP:
            node = node.args[0]
        bmms = _bmms_of_sum(node) if isinstance(node, torch.fx.Node) else None
        if bmms is None or not isinstance(node, torch.fx.Node):
            _count(skipped, "all_to_all: not fed by bmms")
            continue
        matches.append(BmmAllToAll(node, tuple(bmms), issue, wait, str(issue.args[3])))
    return matches


def _bmms_of_sum(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """``[node]`` for a bmm; the bmms of an ``add`` tree of bmm outputs of ``node``'s shape,
    each read only by the sum; else None."""
    out = _add_tree_leaves(node, lambda n: n if n.target == aten.bmm.default else None)
    if out is None:
        return None
    val = _val(node)
    shape = val.shape if val is not None else None
    for b in out:
        b_val = _val(b)
        if b_val is None or b_val.shape != shape:
            return None
    return out


def find_all_to_all_computes(graph: torch.fx.Graph, skipped: Counter[str] | None = None) -> list[AllToAllCompute]:
    """All-to-alls (expert parallelism) whose output feeds matmuls, through views."""
    matches = []
    for issue, wait in _issues_with_wait(graph, (c10d.all_to_all_single.default,), "all_to_all", skipped):
        consumers = consumers_through(wait, _REGROUP)
        compute = tuple(c for c in consumers if c.target in (*MATMULS, aten.bmm.default))
        if not compute:
            _count(skipped, "all_to_all: feeds no matmul")
            continue
        matches.append(AllToAllCompute(issue, wait, compute, str(issue.args[3])))
    return matches


def find_all_to_all_chains(graph: torch.fx.Graph, skipped: Counter[str] | None = None) -> list[AllToAllChain]:
    """Each combine paired with the latest dispatch (same group, each used once) whose received
    tokens its bmms descend from. The two finders' own skips are theirs to count."""
    pairs = _paired(
        find_all_to_all_computes(graph),
        find_bmm_all_to_alls(graph),
        lambda dispatch: dispatch.wait,
        lambda combine: combine.bmms,
        skipped,
        "all_to_all chain: no feeding dispatch",
    )
    return [AllToAllChain(dispatch, combine) for dispatch, combine in pairs]


def find_all(graph: torch.fx.Graph) -> tuple[dict[str, Sequence[object]], Counter[str]]:
    """Every pattern of this module, by name, and the skip reason codes."""
    skipped: Counter[str] = Counter()
    found: dict[str, Sequence[object]] = {
        "all_gather_matmul": find_all_gather_matmuls(graph, skipped),
        "matmul_reduce_scatter": find_matmul_reduce_scatters(graph, skipped),
        "matmul_all_reduce": find_matmul_all_reduces(graph, skipped),
        "all_to_all_compute": find_all_to_all_computes(graph, skipped),
        "bmm_all_to_all": find_bmm_all_to_alls(graph, skipped),
        "all_gather_chain": find_all_gather_chains(graph, skipped),
        "all_to_all_chain": find_all_to_all_chains(graph, skipped),
    }
    return found, skipped
