"""What every decomposition site is: the :class:`Site` protocol, its :class:`Variant` s, and why one does not apply.

Contract
    A *site* is built from one ``collective_matches`` match and the graph; building it checks
    that the rewrite applies and raises :class:`SkipSite` (a reason code and a detail) if not.
    It changes nothing until ``commit``:

    ``anchor``        the node before which every variant's nodes are inserted (all the
                      operands a rewrite reads exist there, or the site lists them to hoist)
    ``old_nodes``     the nodes a committed variant replaces, in graph order (what the
                      original costs: the selection simulates them)
    ``per_peer(e, rank, tag, pieces)``   emit the per-peer variant through ``e`` (P2P
                      exchanges with this rank's peers, ``pieces`` per transfer); transfer
                      ``j`` uses tag ``transfer_tag(tag, j)``
    ``chunked(e, k)`` emit the k-chunk variant (k collectives of 1/k each)
    ``commit(variant)``   hoist what must move, redirect the replaced nodes' readers to the
                      variant's results, erase the replaced nodes

    Either emitter raises ``SkipSite`` when its variant does not apply to this site (the
    caller erases whatever that emitter already inserted). A ``Variant`` not committed is
    erased with ``discard()``; the graph is then as it was.

Tags: site ``i`` uses ``TAG_BASE + i * TAG_STRIDE + 1 + j`` for its ``j``-th transfer
(``transfer_tag``: distinct per step, piece and site, as long as a site has fewer than
``TAG_STRIDE`` transfers; ``options.MAX_PIECES`` keeps it so for groups of up to 32 ranks).

Skip codes (``SkipCode``; counted as ``"<pattern>: skipped: <code>"`` for a site,
``"<pattern>: <family> skipped: <code>"`` for one family of its variants)::

    indivisible          a dim does not split into the blocks, pieces or chunks the variant needs
    uneven splits        an all_to_all_single's split sizes are not equal parts
    reduce op            a reduction other than sum / avg
    functional only      an in-place collective (only the functional form is rewritten)
    other consumers      the matmul output (or a view of it) is read outside the site
    unsupported op       an op between the matmul and the collective that the rewrite cannot split
    unsupported layout   the views / permutes around the collective do not make row blocks
    not row-wise         (chain) an op between the two collectives mixes or broadcasts rows
    scatter dim differs  (chain) the reduce-scatter splits another dim than the all-gather gathered
    matmuls not all fed  (chain) some of the reduce-scatter's matmuls do not read the gathered rows
    scatters columns     the reduce-scatter splits the matmul's output columns
    per-row bias         an addmm bias with one row per output row, which this variant cannot split
    bias shape           an addmm bias of a shape the column split cannot slice
    not 2-d              a matmul's row operand is not 2-d
    not contiguous       an operand sliced along a non-leading dim is not contiguous
    late operand         an operand the rewrite reads is computed after its first matmul (and is
                         not a free view that could move)
    weight gradient      weight-gradient matmuls the variant cannot split, or whose operand does
                         not hold the gathered rows
    no chunked form      the site has a per-peer variant only
    no pieces            the site sends whole chunks (pieces > 1 asked)
    no bmm               nothing reads the received tokens as a bmm's batch operand
    too many transfers   more than TAG_STRIDE - 1 transfers in one site
    unknown group        torch.distributed does not know the process group (or this rank is not in it)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch.fx

from cost_model.op_kinds import kind_of
from graph_passes.decompose.emit import Emitter, val

TAG_BASE = 1 << 16
TAG_STRIDE = 1 << 10

SkipCode = Literal[
    "indivisible",
    "uneven splits",
    "reduce op",
    "functional only",
    "other consumers",
    "unsupported op",
    "unsupported layout",
    "not row-wise",
    "scatter dim differs",
    "matmuls not all fed",
    "scatters columns",
    "per-row bias",
    "bias shape",
    "not 2-d",
    "not contiguous",
    "late operand",
    "weight gradient",
    "no chunked form",
    "no pieces",
    "no bmm",
    "too many transfers",
    "unknown group",
]


class SkipSite(Exception):
    """A site (or one variant of it) does not qualify: ``code`` is counted, ``detail`` explains it."""

    def __init__(self, code: SkipCode, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code: SkipCode = code
        self.detail = detail


@dataclasses.dataclass
class Variant:
    """One rewrite of a site, emitted but not committed: its name (``per_peer``, ``per_peer_2``,
    ``chunked_3``), the emitter holding its nodes, and ``(old node, its replacement)`` pairs;
    its simulated time and, where the estimator ran it on the live group, its measured time."""

    name: str
    emitter: Emitter
    replace: list[tuple[torch.fx.Node, torch.fx.Node]]
    predicted_s: float = math.inf
    measured_s: float = math.nan

    def discard(self) -> None:
        for node in reversed(self.emitter.nodes):
            self.emitter.graph.erase_node(node)


class Site(Protocol):
    """One place in the graph a decomposition may rewrite (see the module docstring)."""

    @property
    def anchor(self) -> torch.fx.Node: ...

    @property
    def old_nodes(self) -> Sequence[torch.fx.Node]: ...

    def per_peer(self, e: Emitter, rank: int, tag: int, pieces: int = 1) -> Variant: ...

    def chunked(self, e: Emitter, k: int) -> Variant: ...

    def commit(self, variant: Variant) -> None: ...


def discard_all_but(variants: Sequence[Variant], keep: Variant | None) -> None:
    """Erase every variant's emitted nodes except ``keep``'s (all of them when it is None)."""
    for v in variants:
        if v is not keep:
            v.discard()


def transfer_tag(base: int, j: int) -> int:
    """The tag of a site's ``j``-th transfer (``base``: the site's, see ``TAG_BASE``)."""
    if not 0 <= j < TAG_STRIDE - 1:
        raise SkipSite("too many transfers", f"more than {TAG_STRIDE - 1} transfers in one site")
    return base + 1 + j


def send_shard_pieces(
    e: Emitter, shard: torch.fx.Node, dim: int, pieces: int, step: int, rank: int, n: int, tag: int, group_name: str
) -> list[torch.fx.Node]:
    """Step ``step`` of a per-peer all-gather: this rank's ``shard``, cut into ``pieces`` along
    ``dim``, goes to rank r-step; rank r+step's pieces come back. One exchange per piece."""
    size = val(shard).shape[dim] // pieces
    return [
        e.exchange(
            e.slice(shard, dim, p * size, (p + 1) * size),
            (rank - step) % n,
            (rank + step) % n,
            transfer_tag(tag, (step - 1) * pieces + p),
            group_name,
        )
        for p in range(pieces)
    ]


def per_peer_name(pieces: int) -> str:
    """The variant name of a per-peer rewrite in ``pieces`` pieces per transfer."""
    return "per_peer" if pieces == 1 else f"per_peer_{pieces}"


def ways(n: int, pieces: int) -> str:
    """How a per-peer split divides a dim, for skip details: ``"2"`` or ``"2 x 4 pieces"``."""
    return f"{n}" if pieces == 1 else f"{n} x {pieces} pieces"


def node_positions(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def late_operands(
    node: Any, anchor: torch.fx.Node, position: dict[torch.fx.Node, int], out: list[torch.fx.Node]
) -> None:
    """Operands defined at or after ``anchor`` that the rewrite must move before its first node.

    Only free views (``t(weight)``) may move; anything else skips the site.
    """
    if not isinstance(node, torch.fx.Node) or position[node] < position[anchor] or node in out:
        return
    if kind_of(node) != "view":
        raise SkipSite("late operand", f"{node.name} ({node.target}) is computed after the first matmul")
    for inp in node.all_input_nodes:
        late_operands(inp, anchor, position, out)
    out.append(node)


def hoist(variant: Variant, nodes: Sequence[torch.fx.Node]) -> None:
    """Move ``nodes`` (in dependency order) in front of the variant's first emitted node: operands a
    site's rewrite reads that sat later in the graph than the collective it replaces."""
    first = variant.emitter.nodes[0]
    for node in nodes:
        first.prepend(node)


def erase_dead(graph: torch.fx.Graph, nodes: Sequence[torch.fx.Node]) -> None:
    """Erase the replaced nodes (last first); views still read by outputs stay."""
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)
        elif kind_of(node) not in ("view",) and node.op != "placeholder":
            raise RuntimeError(f"decompose: replaced node {node.name} still has users {list(node.users)}")


def commit_chain(
    graph: torch.fx.Graph, variant: Variant, hoisted: Sequence[torch.fx.Node], old_nodes: Sequence[torch.fx.Node]
) -> None:
    """Commit a chain site's variant: ``hoisted`` moved before it, every replaced node's readers
    outside ``old_nodes`` moved to its replacement, then ``old_nodes`` erased (last first); a
    replaced node still read afterwards is a bug in the site."""
    hoist(variant, hoisted)
    old = set(old_nodes)
    for before, after in variant.replace:
        before.replace_all_uses_with(after, delete_user_cb=lambda user: user not in old)
    for node in reversed(old_nodes):
        if node.users:
            raise RuntimeError(f"decompose chain: replaced node {node.name} still has users {list(node.users)}")
        graph.erase_node(node)


class PerPeerOnly:
    """A site with a per-peer variant and no chunked one."""

    def chunked(self, e: Emitter, k: int) -> Variant:
        raise SkipSite("no chunked form", "only a per-peer form exists for this pattern")


class ReplacesOutput:
    """A site whose variants replace its result node (the wait); ``commit`` drops the old nodes."""

    graph: torch.fx.Graph
    old_nodes: list[torch.fx.Node]

    def commit(self, variant: Variant) -> None:
        for old, new in variant.replace:
            old.replace_all_uses_with(new)
        erase_dead(self.graph, self.old_nodes)
