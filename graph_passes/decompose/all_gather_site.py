"""The all-gather -> matmul site: a gathered tensor's matmuls computed shard by shard, per peer or in k chunks.

Contract
    ``AllGatherSite(match, graph)`` for an ``AllGatherMatmul`` (the gathered tensor is the row
    operand of one or more matmuls, maybe through views, and of weight-gradient matmuls
    ``t(gathered) @ g``); see ``site.Site``. Its variants replace every matmul (and the gathered
    tensor, when something else reads it: a graph output saved for the backward) with a cat of
    the same values; the result equals the original exactly (no sum changes order, except the
    weight gradients' ``t(x) @ g``, summed shard by shard). Skips: ``not 2-d``, ``weight
    gradient``, ``not contiguous``, ``late operand`` (the site); ``indivisible``, ``per-row
    bias``, ``weight gradient`` (chunked).

Per peer, Flash-Overlap order (rank ``r`` of ``n``; ``x`` the local shard, ``W`` the weight)::

    p1 = send x to r-1, recv from r+1
    y[r] = x @ W
    for s in 1..n-1:
      xs = wait(p_s)
      p_{s+1} = send x to r-s-1, recv from r+s+1
      y[r+s] = xs @ W
    out = cat(y[0..n-1] along the gather dim)

In P pieces (option ``pieces``, or P in ``AUTO_PIECES`` chosen with the rest): each step's shard
goes as P exchanges of 1/P of it along the gather dim; the matmul on a received piece runs
while the next piece is in flight. The local shard stays one piece: nothing waits for it, and
one matmul over it is cheaper than several.

Backward form: a weight gradient ``t(gathered) @ g`` is summed shard by shard
(``t(x_j) @ g[rows of j]``, accumulated in arrival order).

Chunked, k chunks (data slicing): the shard split along the gather dim; chunk c+1's all-gather
is in flight while chunk c's matmul runs; rows re-interleaved (rank-major) by one cat.

Picture (2 ranks, all-gather along the sequence dim feeding Q/K/V)::

    before:  all_gather  wait  split  cat  view  mm_q  mm_k  mm_v        comm: [ag........]
    after:   exchange  mm_q[r] mm_k[r] mm_v[r]  wait  mm_q[r+1] mm_k[r+1] mm_v[r+1]  cat x3
                                                               comm: [p2p.....] (under mm[r])
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from graph_passes.collective_matches import AllGatherMatmul, consumers_through
from graph_passes.decompose.emit import Emitter, val
from graph_passes.decompose.row_blocks import check_bias, chunk_rows, full_bias, matmul_on_rows, row_operand
from graph_passes.decompose.site import (
    SkipSite,
    Variant,
    erase_dead,
    hoist,
    late_operands,
    node_positions,
    per_peer_name,
    send_shard_pieces,
)
from graph_passes.node_args import as_node

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _chain_to(node: torch.fx.Node, stop: torch.fx.Node) -> list[torch.fx.Node]:
    """View nodes from ``stop`` (excluded) down to ``node`` (included, unless it is ``stop``)."""
    chain = []
    while node is not stop:
        chain.append(node)
        node = as_node(node.args[0])
    return chain


class AllGatherSite:
    """``matmuls(wait(all_gather(shard)))`` along ``gather_dim`` ``d``, and the weight-gradient
    matmuls over the gathered rows."""

    def __init__(self, m: AllGatherMatmul, graph: torch.fx.Graph) -> None:
        self.m, self.graph = m, graph
        position = node_positions(graph)
        self.shard_shape = list(val(m.shard).shape)
        self.d = m.gather_dim % len(self.shard_shape)
        self.k_dim = self.shard_shape[-1]
        self.transposes = [as_node(mm.args[0]) for mm in m.transposed]  # t(view(gathered)) nodes
        self.views = [v for mm in m.matmuls for v in _chain_to(row_operand(mm), m.gathered)]
        self.views += [v for t in self.transposes for v in _chain_to(as_node(t.args[0]), m.gathered)]
        region = {
            m.issue,
            m.wait,
            m.gathered,
            *m.chunking,
            *self.views,
            *m.matmuls,
            *self.transposes,
            *m.transposed,
        }
        self.old_nodes = sorted(region, key=position.__getitem__)
        self.anchor = min([*m.matmuls, *m.transposed], key=position.__getitem__)
        self.lead = list(val(m.gathered).shape[:-1])
        for mm in m.matmuls:
            if len(val(row_operand(mm)).shape) != 2:
                raise SkipSite("not 2-d", f"the row operand of {mm.name} is not 2-d")
            check_bias(mm, self.d)
        for mm in m.transposed:
            other = val(mm.args[1])
            if other.dim() != 2 or other.shape[0] != math.prod(self.lead):
                raise SkipSite("weight gradient", f"the other operand of {mm.name} does not have the gathered rows")
            if self.d != 0 and not other.is_contiguous():
                raise SkipSite(
                    "not contiguous", f"the other operand of the weight-gradient matmul {mm.name} is not contiguous"
                )
        consumers = consumers_through(m.gathered)
        self.needs_gathered = any(c not in m.matmuls and c not in self.transposes for c in consumers)
        self.hoist: list[torch.fx.Node] = []  # moved before the rewrite when it is committed
        for mm in m.matmuls:
            for arg in mm.args:
                if arg is not row_operand(mm):
                    late_operands(arg, self.anchor, position, self.hoist)
        for mm in m.transposed:
            late_operands(mm.args[1], self.anchor, position, self.hoist)

    def _weight_grads(self, e: Emitter, rows: torch.fx.Node, i: int, count: int) -> list[torch.fx.Node]:
        """Each weight-gradient matmul on block ``i`` of ``count`` of the gathered rows (``rows``
        holds them, 2-d): ``t(rows) @ other[block i]``."""
        out = []
        for mm in self.m.transposed:
            other = chunk_rows(e, as_node(mm.args[1]), self.lead, self.d, i, count)
            out.append(e.call(aten.mm.default, e.call(aten.permute.default, rows, [1, 0]), other))
        return out

    def _outputs(self, e: Emitter, outputs: dict[int, list[torch.fx.Node]], gathered: list[torch.fx.Node]) -> list:
        """Assemble each matmul's full output from its outputs on the ``gathered`` row blocks (in gathered order)."""
        lead = list(val(self.m.gathered).shape[:-1])
        replace = []
        for i, mm in enumerate(self.m.matmuls):
            n_out = val(mm).shape[-1]
            parts = [e.view(y, [*val(g).shape[:-1], n_out]) for y, g in zip(outputs[i], gathered)]
            full = e.cat(parts, self.d) if self.d != 0 else e.cat(outputs[i], 0)
            replace.append((mm, e.view(full, [math.prod(lead), n_out])))
        if self.needs_gathered:
            replace.append((self.m.gathered, e.cat(gathered, self.d)))
        return replace

    def per_peer(self, e: Emitter, rank: int, tag: int, pieces: int = 1) -> Variant:
        m, n, d = self.m, self.m.group_size, self.d
        if self.shard_shape[d] % pieces:
            raise SkipSite("indivisible", f"shard dim {d} ({self.shard_shape[d]}) not divisible by {pieces} pieces")

        def issue(s: int) -> list[torch.fx.Node]:
            """Step ``s``: the local shard, piece by piece, to rank r-s; rank r+s's pieces from it."""
            return send_shard_pieces(e, m.shard, d, pieces, s, rank, n, tag, m.group_name)

        # (rank, piece) -> (its rows of the gathered tensor, each matmul's output on them); the
        # outputs are assembled in gathered order (the local shard is piece 0 of its rank)
        parts: dict[tuple[int, int], tuple[torch.fx.Node, list[torch.fx.Node]]] = {}
        sums: list[torch.fx.Node] = []

        def compute(key: tuple[int, int], shard: torch.fx.Node, i: int, count: int) -> None:
            nonlocal sums
            rows = e.view(shard, [-1, self.k_dim])
            parts[key] = (shard, [matmul_on_rows(e, mm, rows, (self.lead, d, i, count)) for mm in m.matmuls])
            partials = self._weight_grads(e, rows, i, count)
            sums = [e.call(aten.add.Tensor, a, b) for a, b in zip(sums, partials)] if sums else partials

        flights = issue(1)
        # the local shard in one piece: it is here from the start, and one matmul over it is
        # cheaper than several (every rank still runs ops of the same shapes; the cats below take
        # the parts in gathered order, which differs by rank, and cost the same either way)
        compute((rank, 0), e.slice(m.shard, d, 0, self.shard_shape[d], contiguous=True), rank, n)
        for s in range(1, n):
            peer = (rank + s) % n
            arriving, flights = flights, []
            for p, flight in enumerate(arriving):
                shard = e.wait_exchange(flight)
                if p == pieces - 1 and s + 1 < n:
                    flights = issue(s + 1)
                compute((peer, p), shard, peer * pieces + p, n * pieces)
        order = sorted(parts)  # gathered order: by rank, then piece
        outputs = {i: [parts[key][1][i] for key in order] for i in range(len(m.matmuls))}
        replace = self._outputs(e, outputs, [parts[key][0] for key in order]) + list(zip(m.transposed, sums))
        return Variant(per_peer_name(pieces), e, replace)

    def chunked(self, e: Emitter, k: int) -> Variant:
        m, n, d = self.m, self.m.group_size, self.d
        if self.shard_shape[d] % k:
            raise SkipSite("indivisible", f"shard dim {d} ({self.shard_shape[d]}) not divisible by {k}")
        if any(full_bias(mm) is not None for mm in m.matmuls):
            raise SkipSite(
                "per-row bias", "an addmm bias with a row per output row (the chunks gather rows of every rank)"
            )
        if m.transposed:
            raise SkipSite("weight gradient", "weight-gradient matmuls (only per-peer splits them)")
        size = self.shard_shape[d] // k

        def issue(c: int) -> torch.fx.Node:
            part = e.slice(m.shard, d, c * size, (c + 1) * size, contiguous=True)
            return e.call(c10d.all_gather_into_tensor.default, part, n, m.group_name)

        flights = [issue(0)]
        gathered_chunks, outs = [], []
        for c in range(k):
            if c + 1 < k:
                flights.append(issue(c + 1))
            full = e.call(c10d.wait_tensor.default, flights[c])
            if d != 0:  # rank-major along dim 0 -> along d, as the original graph does
                split = e.call(aten.split.Tensor, full, val(full).shape[0] // n)
                full = e.cat([e.call(operator.getitem, split, j) for j in range(n)], d)
            gathered_chunks.append(full)
            rows = e.view(full, [-1, self.k_dim])
            outs.append([matmul_on_rows(e, mm, rows) for mm in m.matmuls])  # a per-row bias: SkipSite
        # piece (rank j, chunk c) of the gathered tensor is rows [j*size, (j+1)*size) of chunk c along d
        order = [(j, c) for j in range(n) for c in range(k)]
        gathered = [e.slice(gathered_chunks[c], d, j * size, (j + 1) * size) for j, c in order]
        pieces: dict[int, list[torch.fx.Node]] = {}
        for i, mm in enumerate(m.matmuls):
            n_out = val(mm).shape[-1]
            per_chunk = [e.view(outs[c][i], [*val(gathered_chunks[c]).shape[:-1], n_out]) for c in range(k)]
            pieces[i] = [e.slice(per_chunk[c], d, j * size, (j + 1) * size) for j, c in order]
        lead = list(val(m.gathered).shape[:-1])
        replace = []
        for i, mm in enumerate(m.matmuls):
            n_out = val(mm).shape[-1]
            replace.append((mm, e.view(e.cat(pieces[i], d), [math.prod(lead), n_out])))
        if self.needs_gathered:
            replace.append((m.gathered, e.cat(gathered, d)))
        return Variant(f"chunked_{k}", e, replace)

    def commit(self, variant: Variant) -> None:
        hoist(variant, self.hoist)
        gathered_new = None
        for old, new in variant.replace:
            if old is self.m.gathered:
                gathered_new = new
                continue
            old.replace_all_uses_with(new)
        if gathered_new is not None:
            self.m.gathered.replace_all_uses_with(gathered_new)
            # views of the gathered tensor that outputs still read now follow the new cat
            position = node_positions(self.graph)
            late = sorted(
                {v: None for v in self.views if v.users and position[v] < position[gathered_new]},
                key=position.__getitem__,
                reverse=True,
            )
            for v in late:
                gathered_new.append(v)
        erase_dead(self.graph, self.old_nodes)
