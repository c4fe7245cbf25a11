"""The matmul -> all-reduce site (tensor parallelism without sequence parallelism): the matmul's output rows split.

Contract
    ``AllReduceSite(match, graph, group_size)`` for a ``MatmulAllReduce`` (a functional
    ``all_reduce`` with ``sum`` or ``avg`` of a matmul's output, through views); see
    ``site.Site``. Its variants replace the wait; the result equals the original up to the
    order of the reduction's additions. Skips: ``functional only``, ``reduce op``, ``other
    consumers``, ``not 2-d``; ``indivisible`` (either variant).

Per peer: the reduce-scatter on row blocks (``row_blocks.reduce_per_peer``: remote blocks
first, each sent when ready, local last), then the reduced block sent to every peer while
theirs arrive; ``out = cat(blocks)``. Same bytes as a ring all-reduce; the scatter half runs
under the matmul.

Chunked, k row blocks: block c's all_reduce is in flight while block c+1's matmul runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx

from graph_passes.collective_matches import MatmulAllReduce
from graph_passes.decompose.emit import Emitter, val
from graph_passes.decompose.row_blocks import chunk_rows, matmul_on_rows, reduce_per_peer, row_operand
from graph_passes.decompose.site import (
    ReplacesOutput,
    SkipSite,
    Variant,
    node_positions,
    per_peer_name,
    transfer_tag,
    ways,
)
from graph_passes.node_args import as_node

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class AllReduceSite(ReplacesOutput):
    """``wait(all_reduce(matmul))``, the matmul's output rows split (Megatron TP without SP)."""

    def __init__(self, m: MatmulAllReduce, graph: torch.fx.Graph, group_size: int) -> None:
        self.m, self.graph, self.n = m, graph, group_size
        if m.issue.target != c10d.all_reduce.default:
            raise SkipSite("functional only", f"{m.issue.target} (only the functional all_reduce)")
        if m.reduce_op not in ("sum", "avg"):
            raise SkipSite("reduce op", f"reduce op {m.reduce_op!r}")
        chain: list[torch.fx.Node] = []
        node = as_node(m.issue.args[0])
        while node is not m.matmul:  # views from the all-reduce's input back to the matmul
            chain.append(node)
            node = as_node(node.args[0])
        inside = {*chain, m.issue}
        for node in [m.matmul, *chain]:
            if any(u not in inside for u in node.users):
                raise SkipSite(
                    "other consumers", f"{node.name}, the matmul output or a view of it, has other consumers"
                )
        if len(val(row_operand(m.matmul)).shape) != 2:
            raise SkipSite("not 2-d", f"the row operand of {m.matmul.name} is not 2-d")
        position = node_positions(graph)
        self.old_nodes = sorted([m.matmul, *chain, m.issue, m.wait], key=position.__getitem__)
        self.anchor = m.matmul
        self.rows = int(val(m.matmul).shape[0])

    def _part(self, e: Emitter, j: int, parts: int) -> torch.fx.Node:
        """The matmul on row block ``j`` of ``parts``."""
        mm = self.m.matmul
        rows = chunk_rows(e, row_operand(mm), [self.rows], 0, j, parts)
        return matmul_on_rows(e, mm, rows, ([self.rows], 0, j, parts))

    def _result(self, e: Emitter, blocks: Sequence[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
        return [(self.m.wait, e.view(e.cat(blocks, 0), list(val(self.m.wait).shape)))]

    def per_peer(self, e: Emitter, rank: int, tag: int, pieces: int = 1) -> Variant:
        """Reduce-scatter per peer (remote row blocks first, in pieces, local last), then all-gather per peer."""
        m, n = self.m, self.n
        if self.rows % (n * pieces):
            raise SkipSite("indivisible", f"rows ({self.rows}) not divisible by {ways(n, pieces)}")
        partial = lambda i, count: self._part(e, i, count)  # noqa: E731
        mine = reduce_per_peer(e, partial, 0, rank, n, pieces, tag, m.group_name, m.reduce_op)
        gathers = [
            e.exchange(mine, (rank + s) % n, (rank - s) % n, transfer_tag(tag, (n - 1) * pieces + s - 1), m.group_name)
            for s in range(1, n)
        ]
        blocks = {rank: mine}
        for s, flight in enumerate(gathers, start=1):
            blocks[(rank - s) % n] = e.wait_exchange(flight)
        return Variant(per_peer_name(pieces), e, self._result(e, [blocks[j] for j in range(n)]))

    def chunked(self, e: Emitter, k: int) -> Variant:
        """k row blocks: block c's all-reduce in flight while block c+1's matmul runs."""
        if self.rows % k:
            raise SkipSite("indivisible", f"rows ({self.rows}) not divisible by {k}")
        op = c10d.all_reduce.default
        flights = [e.call(op, self._part(e, c, k), self.m.reduce_op, self.m.group_name) for c in range(k)]
        outs = [e.call(c10d.wait_tensor.default, f) for f in flights]
        return Variant(f"chunked_{k}", e, self._result(e, outs))
