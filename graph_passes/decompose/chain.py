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
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from graph_passes._torch_compat import OpOverload
from graph_passes.collective_matches import AllGatherChain
from graph_passes.decompose.all_gather_site import AllGatherSite
from graph_passes.decompose.emit import Emitter, val
from graph_passes.decompose.reduce_scatter_site import ReduceScatterSite
from graph_passes.decompose.site import (
    PerPeerOnly,
    Site,
    SkipSite,
    Variant,
    hoist,
    late_operands,
    node_positions,
    per_peer_name,
    send_shard_pieces,
    transfer_tag,
    ways,
)
from graph_passes.node_args import as_node
from graph_passes.op_groups import MATMULS, RESHAPES

aten = torch.ops.aten


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
        self.region = self._region(position)
        for node in self.region:
            if not (node.target in RESHAPES or node.target in MATMULS or _pointwise(node)):
                raise SkipSite("not row-wise", f"a {node.target} between the all-gather and the reduce-scatter")
        self.sliced: set[torch.fx.Node] = set()  # outside tensors read block by block
        for node in self.region:
            self._check(node)
        inside = {*self.region, gather.gathered}
        self.outputs = [
            node
            for node in [gather.gathered, *self.region]
            if any(u not in inside and u not in self.scatter.old_nodes for u in node.users)
        ]
        first_users = [u for node in self.outputs for u in node.users if u not in inside]
        self.anchor = min([*self.own, *first_users], key=position.__getitem__)
        self.hoist: list[torch.fx.Node] = []
        for node in self.region:
            for arg in node.all_input_nodes:
                if arg not in inside and arg not in self.sliced:
                    late_operands(arg, self.anchor, position, self.hoist)
        for leaf in self.sliced:
            if position[leaf] >= position[self.anchor]:
                raise SkipSite(
                    "late operand", f"{leaf.name} ({leaf.target}), read row by row, is computed after the chain starts"
                )
        chunkers = [u for u in gather.wait.users] if gather.gathered is not gather.wait else []
        getitems = [g for c in chunkers for g in c.users]
        old = {gather.issue, gather.wait, *chunkers, *getitems, gather.gathered, *self.region, *self.scatter.old_nodes}
        self.old_nodes = sorted(old, key=position.__getitem__)

    def single_sites(self) -> list[tuple[str, Site]]:
        """The chain's all-gather and reduce-scatter as single sites, with their pattern names
        (one that is not a site of its own is left out: its nodes would stay as they are)."""
        sites: list[tuple[str, Site]] = [("matmul_reduce_scatter", self.scatter)]
        with contextlib.suppress(SkipSite):
            sites.insert(0, ("all_gather_matmul", AllGatherSite(self.m.gather, self.graph)))
        return sites

    # ------------------------------------------------------------------ analysis

    def _region(self, position: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
        """Descendants of the gathered tensor that feed the scatter's matmuls (``self.own``),
        then the pointwise ops and views only they read (to a fixpoint), in graph order."""
        gathered = self.m.gather.gathered
        matmuls = self.scatter.matmuls
        below = {gathered}
        for node in list(self.graph.nodes)[position[gathered] + 1 :]:
            if any(a in below for a in node.all_input_nodes):
                below.add(node)
        if not all(mm in below for mm in matmuls):
            raise SkipSite("matmuls not all fed", "the reduce-scatter's matmuls do not all read the gathered rows")
        above: set[torch.fx.Node] = set()
        stack = list(matmuls)
        while stack:
            node = stack.pop()
            if node not in above and node in below:
                above.add(node)
                stack.extend(node.all_input_nodes)
        self.own = above - {gathered}
        region = set(self.own)
        grew = True
        while grew:  # pull in recomputed activations: pointwise ops and views read only by the region
            grew = False
            for node in list(region):
                for arg in node.all_input_nodes:
                    if arg not in region and arg is not gathered and self._pullable(arg, node, region):
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

    def _rows(self, node: torch.fx.Node, blocks: int) -> Rows:
        rows = locate(list(val(node).shape), self.before, blocks)
        if rows is None:
            raise SkipSite(
                "unsupported layout", f"a {node.target} cuts through the blocks of {ways(self.n, blocks // self.n)}"
            )
        return rows

    def _inside(self, arg: Any) -> bool:
        return isinstance(arg, torch.fx.Node) and (arg in self.region or arg is self.m.gather.gathered)

    def _operand(self, node: torch.fx.Node, arg: Any, what: str) -> None:
        """An operand from outside the region: read block by block when it has the op's shape,
        else it must be broadcast along the blocks' dim."""
        if not isinstance(arg, torch.fx.Node) or self._inside(arg) or not isinstance(val(arg), torch.Tensor):
            return
        shape, out = list(val(arg).shape), list(val(node).shape)
        if shape == out:
            self.sliced.add(arg)
            return
        at = self._rows(node, self.n).dim - (len(out) - len(shape))  # the blocks' dim, right-aligned
        if at >= 0 and shape[at] != 1:
            raise SkipSite(
                "not row-wise", f"{what} of a {node.target} is neither broadcast along the rows nor row by row"
            )

    def _check(self, node: torch.fx.Node) -> None:
        """``node``'s operands fit block-by-block compute (``SkipSite`` otherwise)."""
        rows = self._rows(node, self.n)
        if node.target in RESHAPES:
            if not self._inside(node.args[0]):
                self.sliced.add(as_node(node.args[0]))
        elif node.target in MATMULS:
            row = node.args[0] if node.target == aten.mm.default else node.args[1]
            weight = node.args[1] if node.target == aten.mm.default else node.args[2]
            if not self._inside(row) or self._inside(weight):
                raise SkipSite("not row-wise", f"the gathered rows reach the other operand of {node.name}")
            if rows.dim != 0:
                raise SkipSite("not row-wise", f"the gathered dim is not in the rows of {node.name}")
            if node.target == aten.addmm.default:
                self._operand(node, node.args[0], "the bias")
        else:  # pointwise
            for arg in [*node.args, *node.kwargs.values()]:
                if self._inside(arg) and list(val(arg).shape) != list(val(node).shape):
                    raise SkipSite("not row-wise", f"a {node.target} broadcasts a tensor with the gathered rows")
                self._operand(node, arg, "an operand")

    # ------------------------------------------------------------------ emission

    def _block_shape(self, node: torch.fx.Node, blocks: int) -> list[int]:
        shape, rows = list(val(node).shape), self._rows(node, blocks)
        shape[rows.dim] = rows.outer * rows.inner
        return shape

    def _slice(self, e: Emitter, node: torch.fx.Node, b: int, blocks: int) -> torch.fx.Node:
        """Block ``b`` of ``blocks`` of an outside tensor, contiguous."""
        shape = self._block_shape(node, blocks)  # SkipSite when the blocks do not fit its shape
        part = e.slice(e.view(node, [self.before, blocks, -1]), 1, b, b + 1, contiguous=True)
        return e.view(part, shape)

    def _cat(self, e: Emitter, node: torch.fx.Node, parts: Sequence[torch.fx.Node]) -> torch.fx.Node:
        """``node``'s full tensor from its blocks (in block order)."""
        return e.view(e.cat([e.view(p, [self.before, 1, -1]) for p in parts], 1), list(val(node).shape))

    def _chain(self, e: Emitter, rows: torch.fx.Node, b: int, blocks: int) -> dict[torch.fx.Node, torch.fx.Node]:
        """The region on block ``b`` of ``blocks``, from the gathered tensor's block ``rows``: old node -> new."""
        env: dict[torch.fx.Node, torch.fx.Node] = {self.m.gather.gathered: rows}

        def arg(a: Any) -> Any:
            if isinstance(a, torch.fx.Node) and a not in env and a in self.sliced:
                env[a] = self._slice(e, a, b, blocks)
            return env.get(a, a) if isinstance(a, torch.fx.Node) else a

        for node in self.region:
            if node.target in RESHAPES:
                env[node] = e.view(arg(node.args[0]), self._block_shape(node, blocks))
            else:
                args = torch.fx.node.map_aggregate(node.args, arg)
                kwargs = torch.fx.node.map_aggregate(dict(node.kwargs), arg)
                env[node] = e.call(node.target, *args, **kwargs)
        return env

    def _partial(self, e: Emitter, env: dict[torch.fx.Node, torch.fx.Node], blocks: int) -> torch.fx.Node:
        """The reduce-scatter's summand on one block, in its (scatter) layout."""
        rows = locate(self.scatter.shape, self.before, blocks)
        if rows is None:
            raise SkipSite("indivisible", f"the reduce-scatter's dim does not split into {blocks} blocks")
        shape = list(self.scatter.shape)
        shape[rows.dim] = rows.outer * rows.inner  # rows.dim is the scatter dim, outer 1
        total = None
        for mm in self.scatter.matmuls:
            part = e.view(env[mm], shape)
            total = part if total is None else e.call(aten.add.Tensor, total, part)
        assert total is not None, "a reduce-scatter site has at least one matmul"
        return total

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
            envs[b] = self._chain(e, e.slice(gather.shard, d, p * size, (p + 1) * size, contiguous=True), b, blocks)
        sent: list[list[torch.fx.Node]] = []
        for step in range(1, n):
            peer = (rank + step) % n
            arriving, flights, sent_now = flights, [], []
            for p, flight in enumerate(arriving):
                rows = e.wait_exchange(flight)
                if p == pieces - 1 and step + 1 < n:
                    flights = issue(step + 1)
                b = peer * pieces + p
                envs[b] = self._chain(e, rows, b, blocks)
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
            replace.append((node, self._cat(e, node, [envs[b][node] for b in range(blocks)])))
        return Variant(per_peer_name(pieces), e, replace)

    def commit(self, variant: Variant) -> None:
        hoist(variant, self.hoist)
        old = set(self.old_nodes)
        for before, after in variant.replace:
            before.replace_all_uses_with(after, delete_user_cb=lambda user: user not in old)
        for node in reversed(self.old_nodes):
            if node.users:
                raise RuntimeError(f"decompose chain: replaced node {node.name} still has users {list(node.users)}")
            self.graph.erase_node(node)
