"""The compute between two collectives that works block of rows by block: what both chain sites share.

Contract
    ``RowRegion(graph, start, ends, before, n)``: the *region* is every node that descends from
    ``start`` and is an ancestor of (or is) one of ``ends`` (the matmuls whose outputs the second
    collective sends), plus the pointwise ops and views that only the region reads (a backward's
    recomputed activations). A region tensor viewed ``[before, K, rest]`` (``before``: ``start``'s
    elements ahead of its block dim, the same for every region tensor since views keep the
    row-major order, matmuls keep rows and pointwise ops keep shapes) has block ``b`` at index
    ``b`` of the middle dim; ``n`` is the number of blocks every tensor must divide into (the
    group's size; a rewrite cuts each into more, its pieces). Every region op must keep the blocks
    whole, else ``SkipSite``:

    - views (``view``/``reshape``) that do not split a block;
    - ``mm``/``addmm`` with the region tensor as the row operand (``addmm``'s bias: broadcast, or
      one row per output row, then sliced like the rows); ``bmm`` with the region tensor as the
      first operand, its batch dim ahead of the blocks (``before``) and the blocks in its rows;
    - pointwise ops (``torch.Tag.pointwise``, ``_to_copy``) whose region operands have the op's
      shape; other operands have the op's shape (sliced per block, ``sliced``) or are broadcast
      along the blocks' dim (read whole).

    ``chain(e, first, b, blocks)`` emits the region on block ``b`` of ``blocks`` from ``start``'s
    block ``first``; ``cat`` puts a region tensor back together from its blocks (for readers
    outside the region: tensors saved for the backward, weight gradients). Nothing here changes
    existing nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from graph_passes._torch_compat import OpOverload
from graph_passes.decompose.emit import Emitter, val
from graph_passes.decompose.site import SkipSite, late_operands, ways
from graph_passes.node_args import as_node
from graph_passes.op_groups import MATMULS, RESHAPES

aten = torch.ops.aten

#: The matmuls a region may hold: 2-d (rows first) and batched (rows in dim 1).
REGION_MATMULS: tuple[OpOverload, ...] = (*MATMULS, aten.bmm.default)


def _pointwise(node: torch.fx.Node) -> bool:
    target = node.target
    return target == aten._to_copy.default or (isinstance(target, OpOverload) and torch.Tag.pointwise in target.tags)


@dataclasses.dataclass(frozen=True)
class Rows:
    """Where the blocks sit in a region tensor viewed ``[before, K, rest]`` (``K`` blocks, the
    same ``before`` for the whole region): inside dim ``dim``, of size ``outer * K * inner``;
    a block has ``outer * inner`` there."""

    dim: int
    outer: int
    inner: int


def locate(shape: Sequence[int], before: int, blocks: int) -> Rows | None:
    """The ``Rows`` of a tensor of ``shape`` viewed ``[before, blocks, rest]``; None when a dim
    boundary cuts through a block (such a view mixes rows of different blocks)."""
    prefix = 1
    for t, size in enumerate(shape):
        if before % prefix == 0 and (prefix * size) % (before * blocks) == 0:
            return Rows(t, before // prefix, prefix * size // (before * blocks))
        prefix *= size
    return None


class RowRegion:
    """The region from ``start`` to ``ends``; see the module docstring."""

    def __init__(
        self,
        graph: torch.fx.Graph,
        start: torch.fx.Node,
        ends: Sequence[torch.fx.Node],
        before: int,
        n: int,
        position: dict[torch.fx.Node, int],
    ) -> None:
        self.graph, self.start, self.before, self.n = graph, start, before, n
        self.nodes = self._region(ends, position)
        for node in self.nodes:
            if not (node.target in RESHAPES or node.target in REGION_MATMULS or _pointwise(node)):
                raise SkipSite("not row-wise", f"a {node.target} between the two collectives")
        self.sliced: set[torch.fx.Node] = set()  # outside tensors read block by block
        for node in self.nodes:
            self._check(node)

    def edges(
        self, replaced: set[torch.fx.Node], position: dict[torch.fx.Node, int]
    ) -> tuple[list[torch.fx.Node], torch.fx.Node, list[torch.fx.Node]]:
        """``(outputs, anchor, hoist)`` of a rewrite that replaces the region and ``replaced``:
        the region tensors (``start`` included) read by other nodes, which the rewrite rebuilds
        from their blocks; the node its new nodes go before (the first of the region's own nodes
        and those readers); the operands defined at or after it that must move before it (free
        views only). ``SkipSite`` for other late operands, and for a tensor read block by block
        that is computed after the anchor."""
        inside = {*self.nodes, self.start}
        outputs = [
            node for node in [self.start, *self.nodes] if any(u not in inside and u not in replaced for u in node.users)
        ]
        first_users = [u for node in outputs for u in node.users if u not in inside]
        anchor = min([*self.own, *first_users], key=position.__getitem__)
        hoist: list[torch.fx.Node] = []
        for node in self.nodes:
            for arg in node.all_input_nodes:
                if arg not in inside and arg not in self.sliced:
                    late_operands(arg, anchor, position, hoist)
        for leaf in self.sliced:
            if position[leaf] >= position[anchor]:
                raise SkipSite(
                    "late operand", f"{leaf.name} ({leaf.target}), read row by row, is computed after the chain starts"
                )
        return outputs, anchor, hoist

    # ------------------------------------------------------------------ analysis

    def _region(self, ends: Sequence[torch.fx.Node], position: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
        """Descendants of ``start`` that feed ``ends`` (``self.own``), then the pointwise ops
        and views only they read (to a fixpoint), in graph order."""
        start = self.start
        below = {start}
        for node in list(self.graph.nodes)[position[start] + 1 :]:
            if any(a in below for a in node.all_input_nodes):
                below.add(node)
        if not all(end in below for end in ends):
            raise SkipSite("matmuls not all fed", "the second collective's matmuls do not all read the first's rows")
        above: set[torch.fx.Node] = set()
        stack = list(ends)
        while stack:
            node = stack.pop()
            if node not in above and node in below:
                above.add(node)
                stack.extend(node.all_input_nodes)
        self.own = above - {start}
        region = set(self.own)
        grew = True
        while grew:  # pull in recomputed activations: pointwise ops and views read only by the region
            grew = False
            for node in list(region):
                for arg in node.all_input_nodes:
                    if arg not in region and arg is not start and self._pullable(arg, node, region):
                        region.add(arg)
                        grew = True
        return sorted(region, key=position.__getitem__)

    def _pullable(self, arg: torch.fx.Node, reader: torch.fx.Node, region: set[torch.fx.Node]) -> bool:
        """Whether ``arg`` (outside the region) can be computed block by block inside it: a
        pointwise op or view, read only by the region, with whole blocks, read by a view, or
        elementwise (same shape) by a pointwise op."""
        if arg.op != "call_function" or not (_pointwise(arg) or arg.target in RESHAPES):
            return False
        if not all(u in region for u in arg.users) or locate(val(arg).shape, self.before, self.n) is None:
            return False
        return reader.target in RESHAPES or (_pointwise(reader) and val(arg).shape == val(reader).shape)

    def rows(self, node: torch.fx.Node, blocks: int) -> Rows:
        rows = locate(list(val(node).shape), self.before, blocks)
        if rows is None:
            raise SkipSite(
                "unsupported layout", f"a {node.target} cuts through the blocks of {ways(self.n, blocks // self.n)}"
            )
        return rows

    def inside(self, arg: Any) -> bool:
        return isinstance(arg, torch.fx.Node) and (arg in self.nodes or arg is self.start)

    def _operand(self, node: torch.fx.Node, arg: Any, what: str) -> None:
        """An operand from outside the region: read block by block when it has the op's shape,
        else it must be broadcast along the blocks' dim."""
        if not isinstance(arg, torch.fx.Node) or self.inside(arg) or not isinstance(val(arg), torch.Tensor):
            return
        shape, out = list(val(arg).shape), list(val(node).shape)
        if shape == out:
            self.sliced.add(arg)
            return
        at = self.rows(node, self.n).dim - (len(out) - len(shape))  # the blocks' dim, right-aligned
        if at >= 0 and shape[at] != 1:
            raise SkipSite(
                "not row-wise", f"{what} of a {node.target} is neither broadcast along the rows nor row by row"
            )

    def _check(self, node: torch.fx.Node) -> None:
        """``node``'s operands fit block-by-block compute (``SkipSite`` otherwise)."""
        rows = self.rows(node, self.n)
        if node.target in RESHAPES:
            if not self.inside(node.args[0]):
                self.sliced.add(as_node(node.args[0]))
        elif node.target in REGION_MATMULS:
            row = node.args[1] if node.target == aten.addmm.default else node.args[0]
            weight = node.args[2] if node.target == aten.addmm.default else node.args[1]
            if not self.inside(row) or self.inside(weight):
                raise SkipSite("not row-wise", f"the rows reach the other operand of {node.name}")
            batched = node.target == aten.bmm.default
            if rows.dim != (1 if batched else 0) or (batched and val(node).shape[0] != self.before):
                raise SkipSite("not row-wise", f"the blocks are not in the rows of {node.name}")
            if node.target == aten.addmm.default:
                self._operand(node, node.args[0], "the bias")
        else:  # pointwise
            for arg in [*node.args, *node.kwargs.values()]:
                if self.inside(arg) and list(val(arg).shape) != list(val(node).shape):
                    raise SkipSite("not row-wise", f"a {node.target} broadcasts a tensor with the blocks' rows")
                self._operand(node, arg, "an operand")

    # ------------------------------------------------------------------ emission

    def block_shape(self, node: torch.fx.Node, blocks: int) -> list[int]:
        shape, rows = list(val(node).shape), self.rows(node, blocks)
        shape[rows.dim] = rows.outer * rows.inner
        return shape

    def slice(self, e: Emitter, node: torch.fx.Node, b: int, blocks: int) -> torch.fx.Node:
        """Block ``b`` of ``blocks`` of a tensor, contiguous."""
        shape = self.block_shape(node, blocks)  # SkipSite when the blocks do not fit its shape
        part = e.slice(e.view(node, [self.before, blocks, -1]), 1, b, b + 1, contiguous=True)
        return e.view(part, shape)

    def cat(self, e: Emitter, node: torch.fx.Node, parts: Sequence[torch.fx.Node]) -> torch.fx.Node:
        """``node``'s full tensor from its blocks (in block order)."""
        return e.view(e.cat([e.view(p, [self.before, 1, -1]) for p in parts], 1), list(val(node).shape))

    def chain(self, e: Emitter, first: torch.fx.Node, b: int, blocks: int) -> dict[torch.fx.Node, torch.fx.Node]:
        """The region on block ``b`` of ``blocks``, from ``start``'s block ``first``: old node -> new."""
        env: dict[torch.fx.Node, torch.fx.Node] = {self.start: first}

        def arg(a: Any) -> Any:
            if isinstance(a, torch.fx.Node) and a not in env and a in self.sliced:
                env[a] = self.slice(e, a, b, blocks)
            return env.get(a, a) if isinstance(a, torch.fx.Node) else a

        for node in self.nodes:
            if node.target in RESHAPES:
                env[node] = e.view(arg(node.args[0]), self.block_shape(node, blocks))
            else:
                args = torch.fx.node.map_aggregate(node.args, arg)
                kwargs = torch.fx.node.map_aggregate(dict(node.kwargs), arg)
                env[node] = e.call(node.target, *args, **kwargs)
        return env
