"""The matmul -> reduce-scatter site: each rank's block of the sum computed and sent per peer, or the matmul's columns in k chunks.

Contract
    ``ReduceScatterSite(match, graph)`` for a ``MatmulReduceScatter`` (a matmul's output, or a
    sum of matmul outputs -- SwiGLU's input gradient via w1 and w3 --, through views and the
    chunk + cat of a scatter along a dim, reduce-scattered with ``sum`` or ``avg``); see
    ``site.Site``. Its variants replace the wait; the result equals the original up to the
    order of the reduction's additions. Skips: ``reduce op``, ``unsupported op``, ``other
    consumers``, ``indivisible``, ``scatters columns``, ``unsupported layout``, ``not
    contiguous`` (the row operand, a per-row bias); ``indivisible`` (per peer); ``indivisible``,
    ``bias shape`` (chunked).

Per peer (``row_blocks.reduce_per_peer``)::

    for s in 1..n-1:
      y[r+s] = A[rows of r+s] @ W            remote partials first, each sent when ready
      p_s = send y[r+s] to r+s, recv from r-s
    y[r] = A[rows of r] @ W                  local last
    out = y[r] + wait(p_1) + ... + wait(p_{n-1})

In P pieces a remote partial is computed and sent piece by piece, so the first bytes leave
after 1/P of its compute; the local partial stays one piece. A reduce-scatter of a *sum* of
matmuls sends the sum of their partials.

Chunked, k chunks: W's output columns split; chunk c's reduce-scatter is in flight while chunk
c+1's matmul runs; results concatenated along the last dim.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import torch.fx

from cost_model.op_kinds import kind_of
from graph_passes.collective_matches import MatmulReduceScatter
from graph_passes.decompose.emit import Emitter, val
from graph_passes.decompose.row_blocks import check_bias, chunk_rows, matmul_on_rows, reduce_per_peer, row_operand
from graph_passes.decompose.site import ReplacesOutput, SkipSite, Variant, node_positions, per_peer_name, ways
from graph_passes.node_args import as_node, as_nodes

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class ReduceScatterSite(ReplacesOutput):
    """``wait(reduce_scatter(matmul [+ matmul ...]))``; ``shape`` / ``d``: the summand viewed as
    the collective chunks it, and the scatter dim."""

    def __init__(self, m: MatmulReduceScatter, graph: torch.fx.Graph) -> None:
        self.m, self.graph = m, graph
        self.matmuls = [m.matmul, *m.addends]
        if m.reduce_op not in ("sum", "avg"):
            raise SkipSite("reduce op", f"reduce op {m.reduce_op!r}")
        position = node_positions(graph)
        region: list[torch.fx.Node] = []
        stack = [as_node(m.issue.args[0])]
        while stack:  # everything between the matmuls and the issue
            node = stack.pop()
            if node in region or node in self.matmuls:
                continue
            region.append(node)
            stack.extend(node.all_input_nodes)
        allowed = (aten.split.Tensor, aten.slice.Tensor, operator.getitem, aten.cat.default, aten.add.Tensor)
        for node in region:
            if node.target not in allowed and kind_of(node) != "view":
                raise SkipSite("unsupported op", f"a {node.target} between the matmul and the reduce-scatter")
        inside = {*self.matmuls, *region, m.issue}
        for node in [*self.matmuls, *region]:
            if any(u not in inside for u in node.users):
                raise SkipSite(
                    "other consumers", f"{node.name}, the matmul output or a view of it, has other consumers"
                )
        self.old_nodes = sorted([*self.matmuls, *region, m.issue, m.wait], key=position.__getitem__)
        # the tensor that is chunked along scatter_dim: the matmul output in its viewed shape
        source = as_node(m.issue.args[0])
        if source.target == aten.cat.default:
            first = as_nodes(source.args[0])[0]
            source = as_node(first.args[0]) if first.target is operator.getitem else first
            source = as_node(source.args[0])  # the split's / slice's input
        self.shape = list(val(source).shape)
        self.d = m.scatter_dim % len(self.shape)
        if self.shape[self.d] % m.group_size:
            raise SkipSite(
                "indivisible", f"scatter dim {self.d} ({self.shape[self.d]}) not divisible by {m.group_size}"
            )
        if self.d == len(self.shape) - 1:
            raise SkipSite("scatters columns", "scatters the matmul's output columns")
        for mm in self.matmuls:
            rows = val(row_operand(mm))
            if math.prod(self.shape[:-1]) != rows.shape[0] or self.shape[-1] != val(mm).shape[-1]:
                raise SkipSite("unsupported layout", f"the output of {mm.name} is not viewed by its leading dims only")
            if not rows.is_contiguous():
                raise SkipSite("not contiguous", f"the row operand of {mm.name} is not contiguous")
            check_bias(mm, self.d)
        # every operand of every matmul is defined before the last matmul
        self.anchor = max(self.matmuls, key=position.__getitem__)

    def _sum(self, e: Emitter, parts: Sequence[torch.fx.Node]) -> torch.fx.Node:
        total = parts[0]
        for part in parts[1:]:
            total = e.call(aten.add.Tensor, total, part)
        return total

    def _partial(self, e: Emitter, i: int, count: int) -> torch.fx.Node:
        """The matmul(s) on block ``i`` of ``count`` along the scatter dim (block ``j`` of
        ``group_size``: the part of the output rank ``j`` keeps)."""
        chunk = (self.shape[:-1], self.d, i, count)
        shape = list(self.shape)
        shape[self.d] //= count
        parts = []
        for mm in self.matmuls:
            rows = chunk_rows(e, row_operand(mm), *chunk)
            parts.append(e.view(matmul_on_rows(e, mm, rows, chunk), shape))
        return self._sum(e, parts)

    def per_peer(self, e: Emitter, rank: int, tag: int, pieces: int = 1) -> Variant:
        m, n = self.m, self.m.group_size
        if self.shape[self.d] % (n * pieces):
            raise SkipSite(
                "indivisible", f"scatter dim {self.d} ({self.shape[self.d]}) not divisible by {ways(n, pieces)}"
            )
        partial = lambda i, count: self._partial(e, i, count)  # noqa: E731
        total = reduce_per_peer(e, partial, self.d, rank, n, pieces, tag, m.group_name, m.reduce_op)
        return Variant(per_peer_name(pieces), e, [(m.wait, total)])

    def _columns(self, e: Emitter, mm: torch.fx.Node, c: int, cols: int) -> torch.fx.Node:
        """``mm`` restricted to output columns ``[c*cols, (c+1)*cols)``."""
        n_out = self.shape[-1]
        weight = as_node(mm.args[1] if mm.target == aten.mm.default else mm.args[2])
        w = e.slice(weight, 1, c * cols, (c + 1) * cols)
        if mm.target == aten.mm.default:
            return e.call(aten.mm.default, row_operand(mm), w)
        bias = as_node(mm.args[0])
        if val(bias).dim() and val(bias).shape[-1] == n_out:
            bias = e.slice(bias, val(bias).dim() - 1, c * cols, (c + 1) * cols)
        return e.call(aten.addmm.default, bias, row_operand(mm), w, **dict(mm.kwargs))

    def chunked(self, e: Emitter, k: int) -> Variant:
        m, n, d = self.m, self.m.group_size, self.d
        n_out = self.shape[-1]
        if n_out % k:
            raise SkipSite("indivisible", f"matmul output columns ({n_out}) not divisible by {k}")
        for mm in self.matmuls:
            bias = val(mm.args[0]) if mm.target == aten.addmm.default else None
            if bias is not None and bias.dim() and bias.shape[-1] not in (1, n_out):
                raise SkipSite("bias shape", f"the bias of {mm.name} has shape {list(bias.shape)}")
        cols = n_out // k
        flights = []
        for c in range(k):
            y = self._sum(e, [e.view(self._columns(e, mm, c, cols), [*self.shape[:-1], cols]) for mm in self.matmuls])
            if d != 0:  # chunks along d stacked along dim 0, as the original graph does
                split = e.call(aten.split.Tensor, y, self.shape[d] // n, d)
                y = e.cat([e.call(operator.getitem, split, j) for j in range(n)], 0)
            flights.append(e.call(c10d.reduce_scatter_tensor.default, y, m.reduce_op, n, m.group_name))
        outs = [e.call(c10d.wait_tensor.default, f) for f in flights]
        return Variant(f"chunked_{k}", e, [(m.wait, e.cat(outs, len(self.shape) - 1))])
