"""The chain site: all-gather -> row-wise compute -> reduce-scatter as one per-peer pipeline.

The decompose pass's cross-site rewrite (pattern ``CHAIN``, opt-in; tried before the single-site
patterns). In sequence parallelism the MLP block is ``all_gather(x) -> x @ W1, x @ W3 -> silu(.) * (.) ->
@ W2 -> reduce_scatter``, and its backward mirrors it. Every op between the two collectives
works row by row, and the reduce-scatter hands rank ``j`` exactly the rows that came from rank
``j``. So rank ``r`` can run the whole chain on a peer's rows as soon as they land and send the
result straight back as that peer's partial, with no full-size tensor in between::

    rank r of n, rows in P pieces per rank (option ``pieces``)
      exchange(shard piece p -> r-1, <- r+1) for every p          in flight from the start
      y[r, p] = chain(local piece p)            for every p          under the first transfers
      for s in 1..n-1, for each piece p of rank r+s's rows:
        y[r+s, p] = chain(wait(piece))
        exchange(y[r+s, p] -> r+s, <- r-s)                         sent as soon as it is ready
      out = cat(y[r, :]) + cat(received from r-1) + ... + cat(received from r-n+1)

The separate per-peer sites (``all_gather_site``, ``reduce_scatter_site``) move the same bytes,
but the reduce-scatter's first partial can only be sent once the all-gather's last matmul is
done; here the first partial leaves after one piece of the chain.

Contract
    Input: an ``AllGatherChain`` match and the graph (functional aten IR, ``meta["val"]`` on
    every node). The *region* is every node that descends from the gathered tensor and is an
    ancestor of (or is) one of the reduce-scatter's matmuls, plus the pointwise ops and views
    that only the region reads (the backward's recomputed activations). Every region op must
    keep the gathered dim whole, else the site is skipped with its reason (``SkipSite``):

    - views (``view``/``reshape``) that do not split the gathered dim;
    - ``mm``/``addmm`` with the region tensor as the row operand (its bias: broadcast, or one
      row per output row, then sliced like the rows);
    - pointwise ops (``torch.Tag.pointwise``, ``_to_copy``) whose region operands have the
      op's shape; other operands have the op's shape (sliced per block) or are broadcast along
      the gathered dim (read whole).

    Region tensors read outside the region (saved for the backward, weight gradients) get
    their blocks concatenated back. The result equals the original up to the order of the
    reduce-scatter's additions. Rank consistency: every rank emits ops of the same shapes in
    the same order (only slice offsets and peers depend on the rank). Skips (``site.SkipCode``):
    the reduce-scatter site's own, ``scatter dim differs``, ``matmuls not all fed``, ``not
    row-wise``, ``unsupported layout``, ``late operand``, ``indivisible``.

    ``single_sites()`` gives the chain's two collectives as single sites (those that are
    sites), for the selection to price the chain against them (``selection``).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.fx

from graph_passes.collective_matches import AllGatherChain
from graph_passes.decompose.all_gather_site import AllGatherSite
from graph_passes.decompose.emit import Emitter, val
from graph_passes.decompose.reduce_scatter_site import ReduceScatterSite
from graph_passes.decompose.row_region import RowRegion, locate
from graph_passes.decompose.site import (
    PerPeerOnly,
    Site,
    SkipSite,
    Variant,
    commit_chain,
    node_positions,
    per_peer_name,
    send_shard_pieces,
    transfer_tag,
)

aten = torch.ops.aten


class ChainSite(PerPeerOnly):
    """One all-gather -> ... -> reduce-scatter chain; ``per_peer`` builds its variants.

    Blocks: a region tensor viewed ``[before, K, rest]`` (``before``: the gathered tensor's
    elements ahead of the gathered dim, the same for every region tensor since views keep the
    row-major order, matmuls keep rows and pointwise ops keep shapes) has block ``b`` at index
    ``b`` of the middle dim. With ``K = n * pieces``, block ``j * pieces + p`` is piece ``p`` of
    the rows rank ``j`` contributed, and of the rows the reduce-scatter gives rank ``j``.
    """

    def __init__(self, m: AllGatherChain, graph: torch.fx.Graph) -> None:
        self.m, self.graph = m, graph
        gather = m.gather
        self.scatter = ReduceScatterSite(m.scatter, graph)  # its checks (reduce op, consumers, views)
        shape = list(val(gather.gathered).shape)
        self.gather_d, self.n = gather.gather_dim % len(shape), gather.group_size
        self.before = math.prod(shape[: self.gather_d])
        if math.prod(self.scatter.shape[: self.scatter.d]) != self.before:
            raise SkipSite("scatter dim differs", "the reduce-scatter splits another dim than the all-gather gathered")
        position = node_positions(graph)
        self.region = RowRegion(graph, gather.gathered, self.scatter.matmuls, self.before, self.n, position)
        self.outputs, self.anchor, self.hoist = self.region.edges(set(self.scatter.old_nodes), position)
        old = {
            gather.issue,
            gather.wait,
            *gather.chunking,
            gather.gathered,
            *self.region.nodes,
            *self.scatter.old_nodes,
        }
        self.old_nodes = sorted(old, key=position.__getitem__)

    def single_sites(self) -> list[tuple[str, Site]]:
        """The chain's all-gather and reduce-scatter as single sites, with their pattern names
        (one that is not a site of its own is left out: its nodes would stay as they are)."""
        sites: list[tuple[str, Site]] = [("matmul_reduce_scatter", self.scatter)]
        with contextlib.suppress(SkipSite):
            sites.insert(0, ("all_gather_matmul", AllGatherSite(self.m.gather, self.graph)))
        return sites

    # ------------------------------------------------------------------ emission

    def _partial(self, e: Emitter, env: dict[torch.fx.Node, torch.fx.Node], blocks: int) -> torch.fx.Node:
        """The reduce-scatter's summand on one block, in its (scatter) layout."""
        rows = locate(self.scatter.shape, self.before, blocks)
        if rows is None:
            raise SkipSite("indivisible", f"the reduce-scatter's dim does not split into {blocks} blocks")
        shape = list(self.scatter.shape)
        shape[rows.dim] = rows.outer * rows.inner  # rows.dim is the scatter dim, outer 1
        return e.sum(e.view(env[mm], shape) for mm in self.scatter.matmuls)

    def per_peer(self, e: Emitter, rank: int, tag: int, pieces: int = 1) -> Variant:
        gather, n, d = self.m.gather, self.n, self.gather_d
        shard = val(gather.shard).shape[d]
        if shard % pieces:
            raise SkipSite("indivisible", f"shard dim {d} ({shard}) not divisible by {pieces} pieces")
        blocks, size = n * pieces, shard // pieces
        envs: dict[int, dict[torch.fx.Node, torch.fx.Node]] = {}  # block (rank * pieces + piece) -> env

        def issue(step: int) -> list[torch.fx.Node]:
            return send_shard_pieces(e, gather.shard, d, pieces, step, rank, n, tag, gather.group_name)

        flights = issue(1)
        for p in range(pieces):
            b = rank * pieces + p
            envs[b] = self.region.chain(
                e, e.slice(gather.shard, d, p * size, (p + 1) * size, contiguous=True), b, blocks
            )
        sent: list[list[torch.fx.Node]] = []
        for step in range(1, n):
            peer = (rank + step) % n
            arriving, flights, sent_now = flights, [], []
            for p, flight in enumerate(arriving):
                rows = e.wait_exchange(flight)
                if p == pieces - 1 and step + 1 < n:
                    flights = issue(step + 1)
                b = peer * pieces + p
                envs[b] = self.region.chain(e, rows, b, blocks)
                tag_j = transfer_tag(tag, (n - 1 + step - 1) * pieces + p)
                sent_now.append(
                    e.exchange(self._partial(e, envs[b], blocks), peer, (rank - step) % n, tag_j, gather.group_name)
                )
            sent.append(sent_now)
        sd = self.scatter.d
        total = e.cat([self._partial(e, envs[rank * pieces + p], blocks) for p in range(pieces)], sd)
        for step_flights in sent:
            total = e.call(aten.add.Tensor, total, e.cat([e.wait_exchange(f) for f in step_flights], sd))
        if self.m.scatter.reduce_op == "avg":
            total = e.call(aten.div.Tensor, total, n)
        replace = [(self.m.scatter.wait, total)]
        for node in self.outputs:
            replace.append((node, self.region.cat(e, node, [envs[b][node] for b in range(blocks)])))
        return Variant(per_peer_name(pieces), e, replace)

    def commit(self, variant: Variant) -> None:
        commit_chain(self.graph, variant, self.hoist, self.old_nodes)
