"""The all-to-all chain site: dispatch -> the experts -> combine as one per-peer pipeline.

The decompose pass's cross-site rewrite for expert parallelism (pattern ``A2A_CHAIN``). An MoE
layer sends each rank's tokens to the ranks of their experts (the dispatch all-to-all), runs the
experts, and sends each result back to the rank the tokens came from (the combine). The experts
work token by token, and the combine hands rank ``j`` exactly the slots that came from rank
``j``. So rank ``r`` can run the experts on a peer's tokens as soon as they land and send the
result straight back, with no full-size tensor in between::

    rank r of n, each peer's slots in P pieces (option ``pieces``)
      exchange(tokens piece p -> r+s, <- r-s) for every s, p       in flight from the start
      y[r, p] = experts(local piece p)          for every p          under the first transfers
      for s in 1..n-1, for each piece p of rank r-s's tokens:
        y[r-s, p] = experts(wait(piece))
        exchange(y[r-s, p] -> r-s, <- r+s)                         sent as soon as it is ready
      out = [cat(y[r, :]), cat(received from r+1), ...] in source order

The two single sites (``all_to_all_sites``) move the same bytes, but the combine's first chunk
can only be sent once the whole dispatch has landed and every expert has run on it; here the
first result leaves after one piece.

Contract
    Input: an ``AllToAllChain`` match, the graph (functional aten IR, ``meta["val"]`` on every
    node) and the group's size. The dispatch and the combine must each be a single site of their
    own (``AllToAllSite``, ``BmmAllToAllSite``: their layout checks and skips), with the same
    experts and slots, the dispatch's received tensor read only by its regrouping. The compute
    between them is a ``row_region.RowRegion`` from the regrouped tokens ``[A, W*B, ...]`` (A
    local experts, W source ranks, B slots each) to the combine's bmms, its blocks the sources'
    slots (``before = A``); its skips are the region's. Region tensors read outside the region
    (saved for the backward) get their blocks concatenated back. The result equals the original
    exactly: every op runs on whole rows, and no sum changes order. Rank consistency: every rank
    emits ops of the same shapes in the same order (only slice offsets and peers depend on the
    rank). Skips (``site.SkipCode``): the two sites' own, ``unsupported layout``, ``late
    operand``, ``indivisible``, the region's.

    ``single_sites()`` gives the dispatch and the combine as single sites, for the selection to
    price the chain against them (``selection``).
"""

from __future__ import annotations

import torch
import torch.fx

from graph_passes.collective_matches import AllToAllChain
from graph_passes.decompose.all_to_all_sites import AllToAllSite, BmmAllToAllSite
from graph_passes.decompose.emit import Emitter, val
from graph_passes.decompose.row_region import RowRegion
from graph_passes.decompose.site import (
    PerPeerOnly,
    Site,
    SkipSite,
    Variant,
    commit_chain,
    node_positions,
    per_peer_name,
    transfer_tag,
)
from graph_passes.node_args import as_node


class AllToAllChainSite(PerPeerOnly):
    """One dispatch -> experts -> combine chain; ``per_peer`` builds its variants."""

    def __init__(self, m: AllToAllChain, graph: torch.fx.Graph, group_size: int) -> None:
        self.m, self.graph, self.n = m, graph, group_size
        self.dispatch = AllToAllSite(m.dispatch, graph, group_size)
        self.combine = BmmAllToAllSite(m.combine, graph, group_size)
        self.experts, self.slots = self.dispatch.block_shape[:2]
        if list(val(m.combine.output).shape[:2]) != [self.experts, group_size * self.slots]:
            raise SkipSite("unsupported layout", "the combine's experts or slots differ from the dispatch's")
        if len(m.dispatch.wait.users) != 1:
            raise SkipSite("unsupported layout", "the dispatched tokens are read besides their regrouping")
        position = node_positions(graph)
        tokens = self.dispatch.merged
        self.region = RowRegion(graph, tokens, m.combine.bmms, self.experts, group_size, position)
        regroup = [n for n in self.dispatch.old_nodes if n not in self.dispatch.bmms]
        combine_nodes = set(self.combine.old_nodes)
        self.outputs, self.anchor, self.hoist = self.region.edges(combine_nodes, position)
        old = {*regroup, *self.region.nodes, *combine_nodes}
        self.old_nodes = sorted(old, key=position.__getitem__)

    def single_sites(self) -> list[tuple[str, Site]]:
        """The dispatch and the combine as single sites, with their pattern names."""
        return [("all_to_all_compute", self.dispatch), ("bmm_all_to_all", self.combine)]

    # ------------------------------------------------------------------ emission

    def _result(self, e: Emitter, env: dict[torch.fx.Node, torch.fx.Node]) -> torch.fx.Node:
        """The combine's bmm(s) on one block, summed in the combine site's order."""
        return e.sum(env[bmm] for bmm in self.m.combine.bmms)

    def per_peer(self, e: Emitter, rank: int, tag: int, pieces: int = 1) -> Variant:
        n, experts, slots, group = self.n, self.experts, self.slots, self.m.group_name
        if slots % pieces:
            raise SkipSite("indivisible", f"{slots} slots per source not divisible by {pieces} pieces")
        size, blocks = slots // pieces, n * pieces
        tokens = as_node(self.m.dispatch.issue.args[0])  # [W*A*B, ...], destination-major
        rest = list(val(tokens).shape[1:])
        chunks: dict[int, torch.fx.Node] = {}

        def piece(j: int, p: int) -> torch.fx.Node:
            """Piece ``p`` of the tokens this rank sends to rank ``j``: ``[A, B/P, ...]``."""
            if j not in chunks:
                rows = experts * slots
                chunks[j] = e.view(e.slice(tokens, 0, j * rows, (j + 1) * rows), [experts, slots, *rest])
            return e.slice(chunks[j], 1, p * size, (p + 1) * size, contiguous=True)

        flights = [
            [
                e.exchange(
                    piece((rank + s) % n, p),
                    (rank + s) % n,
                    (rank - s) % n,
                    transfer_tag(tag, (s - 1) * pieces + p),
                    group,
                )
                for p in range(pieces)
            ]
            for s in range(1, n)
        ]
        envs = {
            rank * pieces + p: self.region.chain(e, piece(rank, p), rank * pieces + p, blocks) for p in range(pieces)
        }
        back: list[list[torch.fx.Node]] = []
        for s in range(1, n):
            source = (rank - s) % n
            sent = []
            for p, flight in enumerate(flights[s - 1]):
                b = source * pieces + p
                envs[b] = self.region.chain(e, e.wait_exchange(flight), b, blocks)
                tag_j = transfer_tag(tag, (n - 1 + s - 1) * pieces + p)
                sent.append(e.exchange(self._result(e, envs[b]), source, (rank + s) % n, tag_j, group))
            back.append(sent)
        rows = [experts * slots, *list(val(self.m.combine.wait).shape[1:])]
        results = {rank: [self._result(e, envs[rank * pieces + p]) for p in range(pieces)]}
        for s in range(1, n):
            results[(rank + s) % n] = [e.wait_exchange(f) for f in back[s - 1]]
        total = e.cat([e.view(e.cat(results[j], 1), rows) for j in range(n)], 0)
        replace = [(self.m.combine.wait, total)]
        for node in self.outputs:
            replace.append((node, self.region.cat(e, node, [envs[b][node] for b in range(blocks)])))
        return Variant(per_peer_name(pieces), e, replace)

    def commit(self, variant: Variant) -> None:
        commit_chain(self.graph, variant, self.hoist, self.old_nodes)
