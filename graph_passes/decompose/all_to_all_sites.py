"""The all-to-all sites of expert parallelism: the dispatch feeding the experts' bmm, and the combine sending a bmm's output.

Contract
    ``AllToAllSite(match, graph, group_size)`` (an ``AllToAllCompute``) and
    ``BmmAllToAllSite(match, graph, group_size)`` (a ``BmmAllToAll``); see ``site.Site``. Both
    are per-peer only (``no chunked form``) and send whole chunks (``no pieces``). Their
    variants compute exactly what the original does (no sum changes order). Any layout other
    than the one below (a source dim that does not become a row block) is left alone:
    ``uneven splits``, ``indivisible``, ``unsupported layout``, ``no bmm``, ``late operand``.

all_to_all_single -> bmm (the dispatch), per peer: the received tensor viewed ``[W, A, B,
...]`` (source rank first), the first two dims swapped and merged into ``[A, W*B, ...]`` (per
local expert, each source's B slots)::

    every chunk sent up front
    bmm on the local chunk
    for each source, as its chunk lands: bmm on it
    outputs concatenated along dim 1

bmm -> all_to_all_single (the combine), per peer: the mirror image -- each destination's chunk
(the bmm on its slots of every expert) computed and sent as soon as it is ready, remote
destinations first, the local chunk last under the transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from graph_passes.collective_matches import AllToAllCompute, BmmAllToAll
from graph_passes.decompose.emit import Emitter, val
from graph_passes.decompose.site import (
    PerPeerOnly,
    ReplacesOutput,
    SkipSite,
    Variant,
    hoist,
    late_operands,
    node_positions,
    transfer_tag,
)
from graph_passes.node_args import as_ints, as_node
from graph_passes.op_groups import RESHAPES

aten = torch.ops.aten


class AllToAllSite(PerPeerOnly, ReplacesOutput):
    """``wait(all_to_all_single(x))`` -> view ``[W, A, B, ...]`` -> swap the first two dims ->
    reshape ``[A, W*B, ...]`` -> ``bmm`` (expert parallelism's dispatch: W source ranks, A local
    experts, B slots each).

    Rows ``[j*B, (j+1)*B)`` of every expert's batch are source ``j``'s chunk of the received
    tensor viewed ``[A, B, ...]``, so a ``bmm`` whose first operand is that tensor is computed per
    source as the chunk arrives and its outputs concatenated along dim 1. Other readers of the
    layout (a weight gradient reading it as its second operand, a graph output) get it
    concatenated from the chunks.
    """

    def __init__(self, m: AllToAllCompute, graph: torch.fx.Graph, group_size: int) -> None:
        self.m, self.graph, self.n = m, graph, group_size
        n = group_size
        self.chunk_rows = _equal_chunk_rows(m.issue, n)
        # the chain: view [W, A, B, ...] -> permute [1, 0, ...] -> (clone) -> view [A, W*B, ...]
        view = _only_user(m.wait, RESHAPES)
        shape = list(val(view).shape)
        if len(shape) < 3 or shape[0] != n:
            raise SkipSite("unsupported layout", "the received tensor is not viewed with the source rank first")
        swap = _swap_of_first_two_dims(view, "the source dim is permuted by {}, not swapped with the next")
        node = swap
        chain = [view, swap]
        copy = _only_user(node, (aten.clone.default,), required=False)
        if copy is not None:
            chain.append(copy)
            node = copy
        merged = _only_user(node, RESHAPES)
        chain.append(merged)
        self.block_shape = [shape[1], *shape[2:]]  # one source's part: [A, B, ...]
        if list(val(merged).shape) != [shape[1], n * shape[2], *shape[3:]]:
            raise SkipSite("unsupported layout", "the swapped tensor is not reshaped to [A, W*B, ...]")
        self.merged = merged
        self.bmms = [u for u in merged.users if u.target == aten.bmm.default and u.args[0] is merged]
        if not self.bmms:
            raise SkipSite("no bmm", "no bmm reads the received tokens as its first operand")
        position = node_positions(graph)
        others = [u for u in merged.users if u not in self.bmms] + [u for u in m.wait.users if u is not view]
        self.anchor = min([*self.bmms, *others], key=position.__getitem__)  # the first reader
        self.hoist: list[torch.fx.Node] = []
        for mm in self.bmms:
            late_operands(mm.args[1], self.anchor, position, self.hoist)
        self.old_nodes = sorted([m.issue, m.wait, *chain, *self.bmms], key=position.__getitem__)

    def per_peer(self, e: Emitter, rank: int, tag: int, pieces: int = 1) -> Variant:
        """Send each peer its chunk (all at once), compute on the local chunk, then on each peer's
        chunk as it arrives."""
        if pieces != 1:
            raise SkipSite("no pieces", f"{pieces} pieces asked; all-to-all sites send whole chunks")
        m, n, size = self.m, self.n, self.chunk_rows
        inp = as_node(m.issue.args[0])
        flights = {
            (rank - s) % n: e.exchange(
                e.slice(inp, 0, (rank + s) % n * size, ((rank + s) % n + 1) * size),
                (rank + s) % n,
                (rank - s) % n,
                transfer_tag(tag, s - 1),
                m.group_name,
            )
            for s in range(1, n)
        }
        chunks = {rank: e.slice(inp, 0, rank * size, (rank + 1) * size, contiguous=True)}
        blocks, outs = {}, {}
        for j in [rank, *flights]:
            if j != rank:
                chunks[j] = e.wait_exchange(flights[j])
            blocks[j] = e.view(chunks[j], self.block_shape)
            outs[j] = [e.call(aten.bmm.default, blocks[j], mm.args[1]) for mm in self.bmms]
        replace = [(mm, e.cat([outs[j][i] for j in range(n)], 1)) for i, mm in enumerate(self.bmms)]
        if any(u not in self.bmms for u in self.merged.users):
            replace.append((self.merged, e.cat([blocks[j] for j in range(n)], 1)))
        if len(m.wait.users) > 1:
            replace.append((m.wait, e.cat([chunks[j] for j in range(n)], 0)))
        return Variant("per_peer", e, replace)

    def commit(self, variant: Variant) -> None:
        hoist(variant, self.hoist)
        super().commit(variant)


class BmmAllToAllSite(PerPeerOnly, ReplacesOutput):
    """``bmm`` (or a sum of bmms) -> view ``[A, W, B, ...]`` -> swap the first two dims -> reshape
    ``[W*A*B, ...]`` -> ``all_to_all_single`` (expert parallelism's combine: A local experts, B
    slots per source; in the backward, the gradient of the dispatch).

    Destination ``j``'s chunk is the bmm on rows ``[j*B, (j+1)*B)`` of every expert's batch, so it
    is computed and sent per destination, remote ones first, the local one last (under the
    transfers); the received chunks are concatenated in source order.
    """

    def __init__(self, m: BmmAllToAll, graph: torch.fx.Graph, group_size: int) -> None:
        self.m, self.graph, self.n = m, graph, group_size
        n = group_size
        _equal_chunk_rows(m.issue, n)
        view = _only_user(m.output, RESHAPES)
        experts, rows = val(m.output).shape[:2]
        shape = list(val(view).shape)
        if shape[:3] != [experts, n, rows // n] or rows % n:
            raise SkipSite(
                "unsupported layout", f"the bmm output is not viewed [experts, {n} destinations, slots, ...]"
            )
        swap = _swap_of_first_two_dims(view, "the destination dim is permuted by {}, not swapped with the first")
        chain, node = [view, swap], swap
        while node is not m.issue.args[0]:
            node = _only_user(node, (aten.clone.default, *RESHAPES))
            chain.append(node)
        self.slots = rows // n
        self.chunk_shape = [experts * self.slots, *shape[3:]]
        position = node_positions(graph)
        self.old_nodes = sorted(
            [*m.bmms, *_nodes_between(m.output, m.bmms), *chain, m.issue, m.wait], key=position.__getitem__
        )
        self.anchor = max(m.bmms, key=position.__getitem__)  # every operand exists there

    def _part(self, e: Emitter, j: int) -> torch.fx.Node:
        """Destination ``j``'s chunk: the bmm(s) on its slots of every expert (summed), rows flattened."""
        parts = (
            e.call(
                aten.bmm.default, e.slice(as_node(bmm.args[0]), 1, j * self.slots, (j + 1) * self.slots), bmm.args[1]
            )
            for bmm in self.m.bmms
        )
        return e.view(e.sum(parts), self.chunk_shape)

    def per_peer(self, e: Emitter, rank: int, tag: int, pieces: int = 1) -> Variant:
        if pieces != 1:
            raise SkipSite("no pieces", f"{pieces} pieces asked; all-to-all sites send whole chunks")
        m, n = self.m, self.n
        flights = {
            (rank - s) % n: e.exchange(
                self._part(e, (rank + s) % n), (rank + s) % n, (rank - s) % n, transfer_tag(tag, s - 1), m.group_name
            )
            for s in range(1, n)
        }
        chunks = {rank: self._part(e, rank)}
        for j, flight in flights.items():
            chunks[j] = e.wait_exchange(flight)
        return Variant("per_peer", e, [(m.wait, e.cat([chunks[j] for j in range(n)], 0))])


def _nodes_between(root: torch.fx.Node, leaves: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """The nodes of the ``add`` tree from ``root`` down to (not including) ``leaves``."""
    if root in leaves:
        return []
    return [root, *(n for arg in root.all_input_nodes for n in _nodes_between(arg, leaves))]


def _equal_chunk_rows(issue: torch.fx.Node, n: int) -> int:
    """Rows per rank of an ``all_to_all_single`` whose split sizes are ``n`` equal parts (or None)."""
    rows = int(val(issue.args[0]).shape[0])
    for splits in issue.args[1:3]:
        sizes = as_ints(splits) if splits is not None else None
        if sizes is not None and (len(sizes) != n or len(set(sizes)) != 1 or sum(sizes) != rows):
            raise SkipSite("uneven splits", f"split sizes {splits} are not {n} equal parts of {rows} rows")
    if rows % n:
        raise SkipSite("indivisible", f"rows ({rows}) not divisible by {n}")
    return rows // n


def _only_user(node: torch.fx.Node, targets: tuple[Any, ...], *, required: bool = True) -> Any:
    """``node``'s single user when it is one of ``targets``; else None (``required``: SkipSite)."""
    users = list(node.users)
    if len(users) == 1 and users[0].target in targets:
        return users[0]
    if required:
        raise SkipSite(
            "unsupported layout",
            f"{node.name} is read by {[u.name for u in users]}, not by one of {[str(t) for t in targets]}",
        )
    return None


def _swap_of_first_two_dims(view: torch.fx.Node, reason: str) -> torch.fx.Node:
    """``view``'s single user when it swaps dims 0 and 1 and keeps the rest; else SkipSite with
    ``reason`` formatted with the permutation."""
    swap = _only_user(view, (aten.permute.default, aten.transpose.int))
    rank = len(val(view).shape)
    if swap.target == aten.permute.default:
        perm = list(swap.args[1])
    else:
        perm = list(range(rank))
        a, b = swap.args[1] % rank, swap.args[2] % rank
        perm[a], perm[b] = perm[b], perm[a]
    if perm != [1, 0, *range(2, rank)]:
        raise SkipSite("unsupported layout", reason.format(perm))
    return swap
