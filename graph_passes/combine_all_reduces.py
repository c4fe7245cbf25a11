"""combine_all_reduces: all-reduces whose results are only added together become one all-reduce.

Tensor parallelism without sequence parallelism all-reduces an input gradient once per
column-parallel projection that reads the input: PyTorch's TP plan on a Llama layer (q, k, v
and gate, up column-wise) issues five all-reduces in the backward, summed in two ``add``
trees, where Megatron, which fuses q/k/v and gate/up, issues two. All-reduce is linear, so::

    AR(a) + AR(b) + AR(c)  =  AR(a + b + c)          (reduce op "sum"; also "avg" on floats)

The right side moves one tensor instead of three, and its result is ready no later than the
left side's. The left side's last all-reduce starts once ``c`` exists and takes as long as the
single one, and the channel also carries the other two. So the rewrite needs no cost model.
The sum is reassociated, as float addition in another order: results equal eager's within
rounding, not bit for bit.

Contract
    Input: an aten graph (a partition, or a merged helix graph). Before ``annotate``.
    Finds, with ``find_summed_all_reduces``, every maximal tree of plain ``aten.add.Tensor``
    nodes (two tensor arguments, no ``alpha``, each inner node read only by its parent) whose
    nodes and leaves all have the root's shape and dtype, and whose leaves include at least two
    ``wait_tensor(all_reduce(p, op, group))`` with the same ``op`` and ``group``, where the wait
    is read only by the tree and the issue only by its wait. Each such group of leaves becomes
    one all-reduce of their partials' sum; the other leaves are added as before. New nodes get
    ``meta["val"]`` and the root's ``phase`` and ``strand``. The graph stays functional and its
    order valid; nothing else moves.

    Counts (``ctx.stats["combine_all_reduces"]``): ``combined`` per all-reduce that replaced
    several, ``all-reduces removed``; and for an all-reduce in such a sum that stays on its own:
    ``not combined: reduce op`` (not sum, or avg on integers), ``not combined: no partner``
    (no other all-reduce of its op and group in the sum), ``not combined: result read
    elsewhere`` (its wait also feeds something besides the sum). Details in ``ctx.notes``.

Pseudo-code::

    for match in find_summed_all_reduces(graph):          # graph order; matches are disjoint
        for (op, group), leaves in match.groups:          # two or more leaves each
            s = p1 + p2 + ...      after the last partial   (partials of the leaves, in tree order)
            w = wait(all_reduce(s, op, group))  before the root
        root := fold(+, [w in place of each group's first leaf, other leaves as they were])
        erase the old adds, waits and all-reduces

Picture (the backward of q, k, v column-parallel projections of one input)::

    dq ─ mm ─ all_reduce ─ wait ─┐
    dk ─ mm ─ all_reduce ─ wait ─┼─ add ─ add ─► dx
    dv ─ mm ─ all_reduce ─ wait ─┘

    dq ─ mm ─┐
    dk ─ mm ─┼─ add ─ add ─ all_reduce ─ wait ─► dx
    dv ─ mm ─┘
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.fx

from graph_passes._torch_compat import fake_mode_of
from graph_passes.context import PassContext
from graph_passes.decompose.emit import Emitter
from graph_passes.decompose.site import node_positions
from graph_passes.node_args import as_node

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

PASS = "combine_all_reduces"
#: Reduce ops that distribute over addition (``avg`` only on floating-point tensors).
LINEAR_OPS = ("sum", "avg")


@dataclasses.dataclass(frozen=True)
class SummedAllReduce:
    """One ``wait_tensor(all_reduce(partial, op, group))`` leaf of a sum."""

    issue: torch.fx.Node
    wait: torch.fx.Node

    @property
    def partial(self) -> torch.fx.Node:
        """The tensor all-reduced, read from the graph (an earlier rewrite may have replaced it)."""
        return as_node(self.issue.args[0])

    @property
    def key(self) -> tuple[str, str]:
        """(reduce op, group name): leaves with equal keys combine."""
        return str(self.issue.args[1]), str(self.issue.args[2])


@dataclasses.dataclass(frozen=True)
class SummedAllReduces:
    """A tree of adds at ``root``; its ``terms`` in tree order (leaves that are not combined are
    plain nodes); ``groups``: the leaves that combine, by key, in order of first appearance."""

    root: torch.fx.Node
    adds: tuple[torch.fx.Node, ...]
    terms: tuple[torch.fx.Node | SummedAllReduce, ...]
    groups: tuple[tuple[SummedAllReduce, ...], ...]


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _like(node: object, root_val: torch.Tensor) -> bool:
    val = _val(node)
    return val is not None and val.shape == root_val.shape and val.dtype == root_val.dtype


def _is_plain_add(node: torch.fx.Node, root_val: torch.Tensor) -> bool:
    """``aten.add.Tensor(a, b)`` of two tensors, no alpha, all three of ``root_val``'s shape and dtype."""
    return (
        node.op == "call_function"
        and node.target == aten.add.Tensor
        and len(node.args) == 2
        and not node.kwargs
        and all(_like(n, root_val) for n in (node, *node.args))
    )


def _summed_all_reduce(node: torch.fx.Node) -> SummedAllReduce | None:
    """``node`` as ``wait_tensor(all_reduce(partial, ...))`` (functional, not in place), else None."""
    if node.target != c10d.wait_tensor.default:
        return None
    issue = node.args[0]
    if not isinstance(issue, torch.fx.Node) or issue.target != c10d.all_reduce.default:
        return None
    return SummedAllReduce(issue, node)


def _why_alone(leaf: SummedAllReduce, root_val: torch.Tensor) -> str | None:
    """The reason code that keeps ``leaf`` out of a combination, or None if it may combine."""
    op, _ = leaf.key
    if op not in LINEAR_OPS or (op == "avg" and not root_val.is_floating_point()):
        return "not combined: reduce op"
    if len(leaf.wait.users) != 1 or len(leaf.issue.users) != 1:
        return "not combined: result read elsewhere"
    return None


def _tree(root: torch.fx.Node, root_val: torch.Tensor) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """The inner adds (root first) and the leaves (in argument order) of the add tree at ``root``."""
    adds: list[torch.fx.Node] = []
    leaves: list[torch.fx.Node] = []

    def walk(node: torch.fx.Node, is_root: bool) -> None:
        if is_root or (len(node.users) == 1 and _is_plain_add(node, root_val)):
            adds.append(node)
            for arg in node.args:
                walk(as_node(arg), False)
        else:
            leaves.append(node)

    walk(root, True)
    return adds, leaves


def _is_root(node: torch.fx.Node, root_val: torch.Tensor) -> bool:
    """A plain add (of ``root_val``, its value) that is not an inner node of a larger tree."""
    if not _is_plain_add(node, root_val):
        return False
    users = list(node.users)
    return not (len(users) == 1 and _is_plain_add(users[0], root_val))


def find_summed_all_reduces(graph: torch.fx.Graph, skipped: Counter[str] | None = None) -> list[SummedAllReduces]:
    """Every add tree with all-reduces to combine (see the module docstring), in graph order.

    Changes nothing. All-reduce leaves of a tree that stay alone are counted in ``skipped``
    by reason code.
    """
    matches: list[SummedAllReduces] = []
    for root in graph.nodes:
        root_val = _val(root)
        if root_val is None or not _is_root(root, root_val):
            continue
        adds, leaves = _tree(root, root_val)
        by_key: dict[tuple[str, str], list[SummedAllReduce]] = {}
        alone: list[str] = []
        for leaf in leaves:
            summed = _summed_all_reduce(leaf)
            if summed is None:
                continue
            twice = leaves.count(leaf) > 1  # x + x: one wait, two terms
            why = "not combined: result read elsewhere" if twice else _why_alone(summed, root_val)
            if why is None:
                by_key.setdefault(summed.key, []).append(summed)
            else:
                alone.append(why)
        groups = tuple(tuple(g) for g in by_key.values() if len(g) > 1)
        if skipped is not None and (groups or len(alone) + sum(len(g) for g in by_key.values()) > 1):
            skipped.update(alone)
            skipped.update("not combined: no partner" for g in by_key.values() if len(g) == 1)
        if not groups:
            continue
        combined = {leaf.wait: leaf for group in groups for leaf in group}
        terms = tuple(combined.get(leaf, leaf) for leaf in leaves)
        matches.append(SummedAllReduces(root, tuple(adds), terms, groups))
    return matches


class _Combiner:
    """Rewrites one match (module docstring)."""

    def __init__(self, graph: torch.fx.Graph, match: SummedAllReduces) -> None:
        self.graph, self.match = graph, match
        self.positions = node_positions(graph)
        root_meta = match.root.meta.get("dhelix", {})
        self.meta = {k: root_meta[k] for k in ("phase", "strand") if k in root_meta}
        self.fake_mode = fake_mode_of([_val(match.root)])
        self.new_nodes: list[torch.fx.Node] = []

    def _emitter(self, anchor: torch.fx.Node) -> Emitter:
        emitter = Emitter(self.graph, anchor, self.fake_mode, None)
        emitter.nodes = self.new_nodes
        return emitter

    def _combined(self, group: tuple[SummedAllReduce, ...]) -> torch.fx.Node:
        """One all-reduce of the group's partials' sum, issued right after the last partial; its wait."""
        anchor = max((leaf.partial for leaf in group), key=self.positions.__getitem__).next
        while anchor.op == "placeholder":  # a partial that is a graph input: after the last input
            anchor = anchor.next
        early = self._emitter(anchor)
        total = group[0].partial
        for leaf in group[1:]:
            total = early.call(aten.add.Tensor, total, leaf.partial)
        op, group_name = group[0].key
        issue = early.call(c10d.all_reduce.default, total, op, group_name)
        return self._emitter(self.match.root).call(c10d.wait_tensor.default, issue)

    def run(self) -> None:
        match = self.match
        replaced = {group[0].wait: self._combined(group) for group in match.groups}
        terms = [
            replaced.get(t.wait) if isinstance(t, SummedAllReduce) else t
            for t in match.terms
            if not isinstance(t, SummedAllReduce) or t.wait in replaced
        ]
        late = self._emitter(match.root)
        total = terms[0]
        for term in terms[1:]:
            assert term is not None
            total = late.call(aten.add.Tensor, total, term)
        assert total is not None
        for node in self.new_nodes:
            node.meta["dhelix"] = dict(self.meta)
        match.root.replace_all_uses_with(total)
        old = [
            *match.adds,
            *(leaf.wait for g in match.groups for leaf in g),
            *(leaf.issue for g in match.groups for leaf in g),
        ]
        for node in old:  # root first, then inner adds parent before child, then waits, then issues
            self.graph.erase_node(node)


def combine_all_reduces_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Combine the all-reduces of every sum that has several; see the module docstring."""
    skipped: Counter[str] = Counter()
    matches = find_summed_all_reduces(gm.graph, skipped)
    for code, n in skipped.items():
        ctx.count(PASS, code, n)
    removed = 0
    for match in matches:
        _Combiner(gm.graph, match).run()
        for group in match.groups:
            ctx.explain(
                PASS,
                "combined",
                f"{ctx.graph_name}: {', '.join(leaf.issue.name for leaf in group)} summed into {match.root.name}",
            )
            removed += len(group) - 1
    if removed:
        ctx.count(PASS, "all-reduces removed", removed)
    ctx.record(PASS, all_reduces_removed=float(removed))
    return gm
