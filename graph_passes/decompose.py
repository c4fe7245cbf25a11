"""decompose: all-gather→matmul, matmul→reduce-scatter, matmul→all-reduce and all-to-all→bmm as per-peer or chunked steps over partitioned compute.

Contract
    Input: an annotated AOTAutograd partition (functional aten IR, ``meta["val"]`` on every
    node). New nodes take the strand of the collective they replace; when the pass rewrote
    anything it re-runs ``annotate`` (its counts go to a scratch context), so every node, new or
    old, carries ``meta["dhelix"]`` with comm ids numbered in graph order again. For each site that ``collective_matches`` finds, the pass builds the
    rewrites that apply next to it, prices the original and every rewrite with
    ``cost_model.simulate`` on ``ctx.estimator``, and keeps the cheapest rewrite only when it is
    predicted to be at least ``min_gain_ratio`` faster than the original (mode ``"auto"``), or
    the best of the forced family (modes ``"per_peer"`` / ``"chunked"``). Every decision and skip
    is counted in ``ctx.stats["decompose"]``; predictions are in ``ctx.records["decompose"]``.

    - Semantics: the result equals the original up to the order of floating-point additions
      (a reduce-scatter's sum is formed in another order). Shapes that do not split evenly,
      unknown process groups, non-contiguous operands, or consumers other than the matmuls
      (and graph outputs) leave the site alone with a counted reason.
    - Functional: new transfers are ``dhelix::exchange`` (``_torch_compat.P2P_EXCHANGE``: send
      + receive in one op, peers are *group* ranks, returns ``[send_done, received]``; why not
      ``_c10d_functional.batch_p2p_ops``: see ``_torch_compat``) and ``all_gather_into_tensor`` /
      ``reduce_scatter_tensor``; every issue is followed by a ``wait_tensor`` on each of its
      outputs (the send's wait has no reader: it completes the send). No in-place op is added.
    - Rank consistency: peers depend on the rank, everything else (which sites, which variant,
      tags, the order) only on the graph and the agreed costs, so every rank makes the same
      choices; a rank that did not would issue other collectives, which the compile-time
      collective-sequence check reports.
    - Order: issues come before the compute they should hide, waits right before the first use.
      ``reorder`` may move them further (it keeps a valid order; every rank the same).

Variants (rank ``r`` of a group of ``n``; ``x`` the local shard, ``W`` the weight)::

    all-gather -> matmul, per peer (Flash-Overlap order)      matmul -> reduce-scatter, per peer
      p1 = send x to r-1, recv from r+1                         for s in 1..n-1:
      y[r] = x @ W                                                y[r+s] = A[rows of r+s] @ W
      for s in 1..n-1:                                            p_s = send y[r+s] to r+s, recv from r-s
        xs = wait(p_s)                                          y[r] = A[rows of r] @ W     (local last)
        p_{s+1} = send x to r-s-1, recv from r+s+1              out = y[r] + wait(p_1) + ... + wait(p_{n-1})
        y[r+s] = xs @ W
      out = cat(y[0..n-1] along the gather dim)

    in P pieces (option ``pieces``, or P in ``AUTO_PIECES`` chosen with the rest): each step's shard
    goes as P exchanges of 1/P of it along the gather (scatter) dim; the matmul on a received
    piece runs while the next piece is in flight, and a remote partial is computed and sent
    piece by piece, so the first bytes leave after 1/P of its compute. The local shard (and
    the local partial) stays one piece: nothing waits for it.

    backward forms: a weight gradient ``t(gathered) @ g`` is summed shard by shard
    (``t(x_j) @ g[rows of j]``, accumulated in arrival order); a reduce-scatter of a *sum* of
    matmuls (SwiGLU's input gradient via w1 and w3) sends the sum of their partials.

    chunked, k chunks (data slicing)
      all-gather: the shard split along the gather dim; chunk c+1's all-gather is in flight
                  while chunk c's matmul runs; rows re-interleaved (rank-major) by one cat
      reduce-scatter: W's output columns split; chunk c's reduce-scatter is in flight while
                  chunk c+1's matmul runs; results concatenated along the last dim

    matmul -> all-reduce (TP without SP), the matmul's output rows split
      per peer: the reduce-scatter above on row blocks (remote blocks first, each sent when
                ready, local last), then the reduced block sent to every peer while theirs
                arrive; out = cat(blocks). Same bytes as a ring all-reduce; the scatter half
                runs under the matmul.
      chunked:  k row blocks; block c's all_reduce is in flight while block c+1's matmul runs

    all_to_all_single -> bmm (expert parallelism's dispatch), per peer: the received tensor viewed
    [W, A, B, ...] (source rank first), the first two dims swapped and merged into [A, W*B, ...]
    (per local expert, each source's B slots) -> every chunk sent up front; bmm on the local
    chunk, then on each source's chunk as it lands; outputs concatenated along dim 1. Any other
    layout (a source dim that does not become a row block) is left alone with its reason.

    bmm -> all_to_all_single (the combine), per peer: the mirror image -- each destination's
    chunk (the bmm on its slots of every expert) computed and sent as soon as it is ready,
    remote destinations first, the local chunk last under the transfers.

    all-gather -> row-wise compute -> reduce-scatter (pattern ``CHAIN``, opt-in, tried first;
    ``decompose_chain``): each peer's rows go through the whole block (w1, w3, silu * mul, w2)
    as they land and go straight back as that peer's partial -- the two per-peer forms above
    fused, with no full-size tensor between them. With an estimator, a chain competes with its
    two collectives decomposed on their own: the whole graph (current order) is simulated with
    the chain's best variant and with each single site's best variant (those that have one),
    and the chain is rewritten only if it predicts less; otherwise the single-site patterns
    rewrite the two collectives ("left to the single sites").

Picture (2 ranks, all-gather along the sequence dim feeding Q/K/V)::

    before:  all_gather  wait  split  cat  view  mm_q  mm_k  mm_v        comm: [ag........]
    after:   exchange  mm_q[r] mm_k[r] mm_v[r]  wait  mm_q[r+1] mm_k[r+1] mm_v[r+1]  cat ×3
                                                               comm: [p2p.....] (under mm[r])
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.fx

from cost_model.estimator import MemoizedEstimator
from cost_model.op_kinds import kind_of
from cost_model.simulator import simulate
from graph_passes.annotate import annotate_pass
from graph_passes.collective_matches import (
    AllGatherMatmul,
    AllToAllCompute,
    BmmAllToAll,
    MatmulAllReduce,
    MatmulReduceScatter,
    find_all_gather_chains,
    find_all_gather_matmuls,
    find_all_to_all_computes,
    find_bmm_all_to_alls,
    find_matmul_all_reduces,
    find_matmul_reduce_scatters,
)
from graph_passes.context import PassContext

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

PASS = "decompose"
#: The cross-site pattern (``decompose_chain``), opt-in.
CHAIN = "all_gather_chain"
Mode = Literal["auto", "per_peer", "chunked", "off"]
MODES: tuple[str, ...] = ("auto", "per_peer", "chunked", "off")

#: P2P tags: site ``i`` uses ``TAG_BASE + i * TAG_STRIDE + 1 + j`` for its ``j``-th transfer
#: (``_tag``: distinct per step, piece and site, as long as a site has fewer than
#: ``TAG_STRIDE`` transfers; ``MAX_PIECES`` keeps it so for groups of up to 32 ranks).
TAG_BASE = 1 << 16
TAG_STRIDE = 1 << 10
MAX_PIECES = 16
#: The piece counts the cost model chooses from when ``DecomposeOptions.pieces`` is 0.
AUTO_PIECES: tuple[int, ...] = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class DecomposeOptions:
    """Knobs of the decompose pass (``pass_options()["decompose"]``)."""

    mode: Mode = "off"
    """``"auto"``: per site, the cheapest of per-peer and chunked(k), only if the cost model
    predicts a gain; ``"per_peer"`` / ``"chunked"``: that family wherever it applies, gain or
    not (tests, benchmarks); ``"off"`` (default until the P2P path is checked on NCCL): the pass
    does nothing."""
    max_chunks: int = 4
    """Largest k tried by the chunked variant (k = 2..max_chunks that divide the shape)."""
    pieces: int = 1
    """How many pieces each per-peer transfer is split into: ``P >= 1`` forces P, ``0`` lets the
    cost model pick among ``AUTO_PIECES`` (those that divide the shape). The compute on piece p
    of a peer's shard runs while piece p+1 is in flight, and a remote partial's piece is sent as
    soon as it is computed. One piece by default: measured, pieces pay on the dim-512 MLP block
    and cost more than they hide on the dim-256 TP+SP model, where the cost model misses the
    overhead of the smaller kernels (BENCHMARKS.md)."""
    min_gain_ratio: float = 0.02
    """``"auto"`` rewrites a site only if the predicted time drops by at least this fraction."""
    patterns: tuple[str, ...] = (
        "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_to_all_compute", "bmm_all_to_all"
    )
    """Which patterns may be rewritten. Add ``CHAIN`` (an all-gather and a reduce-scatter with
    row-wise compute between them as one pipeline, ``decompose_chain``; tried before the single
    sites, whose two collectives stay sites of their own when it is not rewritten). Not by
    default: measured slower than the two sites in pieces on the MLP block, and the whole-graph
    comparison is within the cost model's error there (BENCHMARKS.md)."""

    def validate(self) -> DecomposeOptions:
        if self.mode not in MODES:
            raise ValueError(f"decompose mode {self.mode!r}: choose one of {MODES}")
        if self.max_chunks < 1:
            raise ValueError(f"decompose max_chunks={self.max_chunks}: must be >= 1")
        if not 0 <= self.pieces <= MAX_PIECES:
            raise ValueError(f"decompose pieces={self.pieces}: must be in [0, {MAX_PIECES}] (0: the cost model picks)")
        if not 0.0 <= self.min_gain_ratio < 1.0:
            raise ValueError(f"decompose min_gain_ratio={self.min_gain_ratio}: must be in [0, 1)")
        return self


class SkipSite(Exception):
    """A site (or one variant of it) does not qualify; the message is the counted reason."""


# ---------------------------------------------------------------------------------- emission


def _val(node: Any) -> Any:
    if isinstance(node, torch.fx.Node):
        return node.meta.get("val")
    return node


class _Emitter:
    """Inserts new nodes before ``anchor``, each with ``meta["val"]`` (run under the fake mode)."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake_mode: Any, strand: int | None) -> None:
        self.graph, self.anchor, self.fake_mode, self.strand = graph, anchor, fake_mode, strand
        self.nodes: list[torch.fx.Node] = []

    def call(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        vargs = torch.fx.node.map_aggregate(args, _val)
        vkwargs = torch.fx.node.map_aggregate(kwargs, _val)
        if target is operator.getitem:
            node.meta["val"] = vargs[0][vargs[1]]
        else:
            with self.fake_mode:
                node.meta["val"] = target(*vargs, **vkwargs)
        if self.strand is not None:
            node.meta["dhelix"] = {"strand": self.strand}
        self.nodes.append(node)
        return node

    def view(self, node: torch.fx.Node, shape: Sequence[int]) -> torch.fx.Node:
        if list(_val(node).shape) == list(shape):
            return node
        return self.call(aten.view.default, node, list(shape))

    def slice(self, node: torch.fx.Node, dim: int, start: int, end: int, *, contiguous: bool = False) -> torch.fx.Node:
        size = _val(node).shape[dim]
        out = node if (start, end) == (0, size) else self.call(aten.slice.Tensor, node, dim, start, end)
        if contiguous and not _val(out).is_contiguous():
            out = self.call(aten.clone.default, out, memory_format=torch.contiguous_format)
        return out

    def cat(self, parts: Sequence[torch.fx.Node], dim: int) -> torch.fx.Node:
        return parts[0] if len(parts) == 1 else self.call(aten.cat.default, list(parts), dim)

    def exchange(
        self, send: torch.fx.Node, to_peer: int, from_peer: int, tag: int, group_name: str
    ) -> torch.fx.Node:
        """Send ``send`` to ``to_peer`` and receive a tensor of its shape from ``from_peer``."""
        from dhelix_compile.ops.exchange import P2P_EXCHANGE

        return self.call(P2P_EXCHANGE, send, to_peer, from_peer, tag, group_name)

    def wait_exchange(self, p2p: torch.fx.Node) -> torch.fx.Node:
        """Wait for both halves of an exchange; return the received tensor."""
        self.call(c10d.wait_tensor.default, self.call(operator.getitem, p2p, 0))
        return self.call(c10d.wait_tensor.default, self.call(operator.getitem, p2p, 1))


def _chunk_rows(e: _Emitter, t: torch.fx.Node, lead: Sequence[int], d: int, j: int, n: int) -> torch.fx.Node:
    """Rows of chunk ``j`` of ``n`` along ``d`` of ``t`` (2-d, rows = ``lead`` dims flattened row-major)."""
    rows, cols = _val(t).shape
    if d == 0:
        return e.slice(t, 0, j * rows // n, (j + 1) * rows // n)
    size = lead[d] // n
    part = e.slice(e.view(t, [*lead, cols]), d, j * size, (j + 1) * size, contiguous=True)
    return e.view(part, [-1, cols])


def _full_bias(mm: torch.fx.Node) -> torch.fx.Node | None:
    """An addmm's bias when it has one value per row (it must then be split like the rows)."""
    if mm.target != aten.addmm.default:
        return None
    bias = _val(mm.args[0])
    return mm.args[0] if bias.dim() == 2 and bias.shape[0] != 1 else None  # type: ignore[return-value]


def _check_bias(mm: torch.fx.Node, d: int) -> None:
    bias = _full_bias(mm)
    if bias is not None and d != 0 and not _val(bias).is_contiguous():
        raise SkipSite("addmm bias with a row per output row is not contiguous")


def _matmul(
    e: _Emitter,
    mm: torch.fx.Node,
    rows: torch.fx.Node,
    chunk: tuple[Sequence[int], int, int, int] | None = None,
) -> torch.fx.Node:
    """``mm``'s op with ``rows`` as its row operand; ``chunk = (lead, d, j, n)`` splits a per-row bias too."""
    if mm.target == aten.mm.default:
        return e.call(aten.mm.default, rows, mm.args[1])
    bias, _, w = mm.args[:3]
    if _full_bias(mm) is not None:
        if chunk is None:
            raise SkipSite("addmm bias with a row per output row")
        bias = _chunk_rows(e, bias, *chunk)  # type: ignore[arg-type]
    return e.call(aten.addmm.default, bias, rows, w, **dict(mm.kwargs))


# ---------------------------------------------------------------------------------- sites


def _tag(base: int, j: int) -> int:
    """The tag of a site's ``j``-th transfer (``base``: the site's, see ``TAG_BASE``)."""
    if not 0 <= j < TAG_STRIDE - 1:
        raise SkipSite(f"more than {TAG_STRIDE - 1} transfers in one site")
    return base + 1 + j


def _reduce_per_peer(
    e: _Emitter, partial: Any, dim: int, rank: int, n: int, pieces: int, tag: int, group_name: str, reduce_op: str
) -> torch.fx.Node:
    """This rank's block of a sum over ranks, per peer.

    ``partial(i, count)`` is block ``i`` of ``count`` along ``dim`` of this rank's summand (block
    ``j`` of ``n`` is what rank ``j`` keeps). For each remote rank, first, its block is computed in
    ``pieces`` pieces, each sent as soon as it is ready; the local block is computed last; then
    the received blocks are added (divided by ``n`` for ``"avg"``). Tags: transfers ``0 ..
    (n-1)*pieces - 1`` of ``tag``.
    """
    flights = []
    for s in range(1, n):
        peer = (rank + s) % n
        flights.append([
            e.exchange(partial(peer * pieces + p, n * pieces), peer, (rank - s) % n, _tag(tag, (s - 1) * pieces + p), group_name)
            for p in range(pieces)
        ])
    total = partial(rank, n)
    for step in flights:
        total = e.call(aten.add.Tensor, total, e.cat([e.wait_exchange(f) for f in step], dim))
    if reduce_op == "avg":
        total = e.call(aten.div.Tensor, total, n)
    return total


def _ways(n: int, pieces: int) -> str:
    """How a per-peer split divides a dim, for skip reasons: ``"2"`` or ``"2 x 4 pieces"``."""
    return f"{n}" if pieces == 1 else f"{n} x {pieces} pieces"


def _per_peer_name(pieces: int) -> str:
    return "per_peer" if pieces == 1 else f"per_peer_{pieces}"


@dataclasses.dataclass
class _Variant:
    name: str
    emitter: _Emitter
    replace: list[tuple[torch.fx.Node, torch.fx.Node]]
    predicted_s: float = math.inf

    def discard(self) -> None:
        for node in reversed(self.emitter.nodes):
            self.emitter.graph.erase_node(node)


def _discard_all_but(variants: Sequence[_Variant], keep: _Variant | None) -> None:
    """Erase every variant's emitted nodes except ``keep``'s (all of them when it is None)."""
    for v in variants:
        if v is not keep:
            v.discard()


def _hoist(variant: _Variant, nodes: Sequence[torch.fx.Node]) -> None:
    """Move ``nodes`` (in dependency order) in front of the variant's first emitted node: operands a
    site's rewrite reads that sat later in the graph than the collective it replaces."""
    first = variant.emitter.nodes[0]
    for node in nodes:
        first.prepend(node)


class _PerPeerOnly:
    """A site with a per-peer variant and no chunked one."""

    def chunked(self, e: _Emitter, k: int) -> _Variant:
        raise SkipSite("no chunked form (per-peer only)")


def _position(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _late_operands(node: Any, anchor: torch.fx.Node, position: dict[torch.fx.Node, int], out: list[torch.fx.Node]) -> None:
    """Operands defined at or after ``anchor`` that the rewrite must move before its first node.

    Only free views (``t(weight)``) may move; anything else skips the site.
    """
    if not isinstance(node, torch.fx.Node) or position[node] < position[anchor] or node in out:
        return
    if kind_of(node) != "view":
        raise SkipSite("a matmul operand is computed after the first matmul")
    for inp in node.all_input_nodes:
        _late_operands(inp, anchor, position, out)
    out.append(node)


def _row_operand(mm: torch.fx.Node) -> torch.fx.Node:
    return mm.args[0] if mm.target == aten.mm.default else mm.args[1]  # type: ignore[return-value]


def _chain_to(node: torch.fx.Node, stop: torch.fx.Node) -> list[torch.fx.Node]:
    """View nodes from ``stop`` (excluded) down to ``node`` (included, unless it is ``stop``)."""
    chain = []
    while node is not stop:
        chain.append(node)
        node = node.args[0]  # type: ignore[assignment]
    return chain


class _AllGatherSite:
    def __init__(self, m: AllGatherMatmul, graph: torch.fx.Graph) -> None:
        self.m, self.graph = m, graph
        position = _position(graph)
        self.shard_shape = list(_val(m.shard).shape)
        self.d = m.gather_dim % len(self.shard_shape)
        self.k_dim = self.shard_shape[-1]
        self.transposes = [mm.args[0] for mm in m.transposed]  # t(view(gathered)) nodes
        self.views = [v for mm in m.matmuls for v in _chain_to(_row_operand(mm), m.gathered)]
        self.views += [v for t in self.transposes for v in _chain_to(t.args[0], m.gathered)]  # type: ignore[union-attr,arg-type]
        chunkers = [u for u in m.wait.users] if m.gathered is not m.wait else []
        getitems = [g for c in chunkers for g in c.users if g.target is operator.getitem]
        region = {m.issue, m.wait, m.gathered, *chunkers, *getitems, *self.views, *m.matmuls, *self.transposes, *m.transposed}
        self.old_nodes = sorted(region, key=position.__getitem__)  # type: ignore[arg-type]
        self.anchor = min([*m.matmuls, *m.transposed], key=position.__getitem__)
        self.lead = list(_val(m.gathered).shape[:-1])
        for mm in m.matmuls:
            if len(_val(_row_operand(mm)).shape) != 2:
                raise SkipSite("row operand is not 2-d")
            _check_bias(mm, self.d)
        for mm in m.transposed:
            other = _val(mm.args[1])
            if other.dim() != 2 or other.shape[0] != math.prod(self.lead):
                raise SkipSite("a weight-gradient matmul's other operand does not have the gathered rows")
            if self.d != 0 and not other.is_contiguous():
                raise SkipSite("a weight-gradient matmul's other operand is not contiguous")
        consumers = _consumers_through_views(m.gathered)
        self.needs_gathered = any(c not in m.matmuls and c not in self.transposes for c in consumers)
        self.hoist: list[torch.fx.Node] = []  # moved before the rewrite when it is committed
        for mm in m.matmuls:
            for arg in mm.args:
                if arg is not _row_operand(mm):
                    _late_operands(arg, self.anchor, position, self.hoist)
        for mm in m.transposed:
            _late_operands(mm.args[1], self.anchor, position, self.hoist)

    def _weight_grads(self, e: _Emitter, rows: torch.fx.Node, i: int, count: int) -> list[torch.fx.Node]:
        """Each weight-gradient matmul on block ``i`` of ``count`` of the gathered rows (``rows``
        holds them, 2-d): ``t(rows) @ other[block i]``."""
        out = []
        for mm in self.m.transposed:
            other = _chunk_rows(e, mm.args[1], self.lead, self.d, i, count)  # type: ignore[arg-type]
            out.append(e.call(aten.mm.default, e.call(aten.permute.default, rows, [1, 0]), other))
        return out

    def _outputs(self, e: _Emitter, outputs: dict[int, list[torch.fx.Node]], gathered: list[torch.fx.Node]) -> list:
        """Assemble each matmul's full output from its outputs on the ``gathered`` row blocks (in gathered order)."""
        lead = list(_val(self.m.gathered).shape[:-1])
        replace = []
        for i, mm in enumerate(self.m.matmuls):
            n_out = _val(mm).shape[-1]
            parts = [e.view(y, [*_val(g).shape[:-1], n_out]) for y, g in zip(outputs[i], gathered)]
            full = e.cat(parts, self.d) if self.d != 0 else e.cat(outputs[i], 0)
            replace.append((mm, e.view(full, [math.prod(lead), n_out])))
        if self.needs_gathered:
            replace.append((self.m.gathered, e.cat(gathered, self.d)))
        return replace

    def per_peer(self, e: _Emitter, rank: int, tag: int, pieces: int = 1) -> _Variant:
        m, n, d = self.m, self.m.group_size, self.d
        if self.shard_shape[d] % pieces:
            raise SkipSite(f"shard dim {d} ({self.shard_shape[d]}) not divisible by {pieces} pieces")
        size = self.shard_shape[d] // pieces

        def issue(s: int) -> list[torch.fx.Node]:
            """Step ``s``: the local shard, piece by piece, to rank r-s; rank r+s's pieces from it."""
            return [
                e.exchange(
                    e.slice(m.shard, d, p * size, (p + 1) * size),
                    (rank - s) % n, (rank + s) % n, _tag(tag, (s - 1) * pieces + p), m.group_name,
                )
                for p in range(pieces)
            ]

        # (rank, piece) -> (its rows of the gathered tensor, each matmul's output on them); the
        # outputs are assembled in gathered order (the local shard is piece 0 of its rank)
        parts: dict[tuple[int, int], tuple[torch.fx.Node, list[torch.fx.Node]]] = {}
        sums: list[torch.fx.Node] = []

        def compute(key: tuple[int, int], shard: torch.fx.Node, i: int, count: int) -> None:
            nonlocal sums
            rows = e.view(shard, [-1, self.k_dim])
            parts[key] = (shard, [_matmul(e, mm, rows, (self.lead, d, i, count)) for mm in m.matmuls])
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
        return _Variant(_per_peer_name(pieces), e, replace)

    def chunked(self, e: _Emitter, k: int) -> _Variant:
        m, n, d = self.m, self.m.group_size, self.d
        if self.shard_shape[d] % k:
            raise SkipSite(f"shard dim {d} ({self.shard_shape[d]}) not divisible by {k}")
        if any(_full_bias(mm) is not None for mm in m.matmuls):
            raise SkipSite("addmm bias with a row per output row")
        if m.transposed:
            raise SkipSite("weight-gradient matmuls (only per-peer splits them)")
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
                split = e.call(aten.split.Tensor, full, _val(full).shape[0] // n)
                full = e.cat([e.call(operator.getitem, split, j) for j in range(n)], d)
            gathered_chunks.append(full)
            rows = e.view(full, [-1, self.k_dim])
            outs.append([_matmul(e, mm, rows) for mm in m.matmuls])  # a per-row bias: SkipSite
        # piece (rank j, chunk c) of the gathered tensor is rows [j*size, (j+1)*size) of chunk c along d
        order = [(j, c) for j in range(n) for c in range(k)]
        gathered = [e.slice(gathered_chunks[c], d, j * size, (j + 1) * size) for j, c in order]
        pieces: dict[int, list[torch.fx.Node]] = {}
        for i, mm in enumerate(m.matmuls):
            n_out = _val(mm).shape[-1]
            per_chunk = [e.view(outs[c][i], [*_val(gathered_chunks[c]).shape[:-1], n_out]) for c in range(k)]
            pieces[i] = [e.slice(per_chunk[c], d, j * size, (j + 1) * size) for j, c in order]
        lead = list(_val(m.gathered).shape[:-1])
        replace = []
        for i, mm in enumerate(m.matmuls):
            n_out = _val(mm).shape[-1]
            replace.append((mm, e.view(e.cat(pieces[i], d), [math.prod(lead), n_out])))
        if self.needs_gathered:
            replace.append((m.gathered, e.cat(gathered, d)))
        return _Variant(f"chunked_{k}", e, replace)

    def commit(self, variant: _Variant) -> None:
        _hoist(variant, self.hoist)
        gathered_new = None
        for old, new in variant.replace:
            if old is self.m.gathered:
                gathered_new = new
                continue
            old.replace_all_uses_with(new)
        if gathered_new is not None:
            self.m.gathered.replace_all_uses_with(gathered_new)
            # views of the gathered tensor that outputs still read now follow the new cat
            position = _position(self.graph)
            late = sorted(
                {v: None for v in self.views if v.users and position[v] < position[gathered_new]},
                key=position.__getitem__, reverse=True,
            )
            for v in late:
                gathered_new.append(v)
        _erase_dead(self.graph, self.old_nodes)


class _ReplacesOutput:
    """A site whose variants replace its result node (the wait); ``commit`` drops the old nodes."""

    graph: torch.fx.Graph
    old_nodes: list[torch.fx.Node]

    def commit(self, variant: _Variant) -> None:
        for old, new in variant.replace:
            old.replace_all_uses_with(new)
        _erase_dead(self.graph, self.old_nodes)


class _ReduceScatterSite(_ReplacesOutput):
    def __init__(self, m: MatmulReduceScatter, graph: torch.fx.Graph) -> None:
        self.m, self.graph = m, graph
        self.matmuls = [m.matmul, *m.addends]
        if m.reduce_op not in ("sum", "avg"):
            raise SkipSite(f"reduce op {m.reduce_op!r}")
        position = _position(graph)
        region: list[torch.fx.Node] = []
        stack = [m.issue.args[0]]
        while stack:  # everything between the matmuls and the issue
            node = stack.pop()
            if node in region or node in self.matmuls:
                continue
            region.append(node)  # type: ignore[arg-type]
            stack.extend(node.all_input_nodes)  # type: ignore[union-attr]
        allowed = (aten.split.Tensor, aten.slice.Tensor, operator.getitem, aten.cat.default, aten.add.Tensor)
        for node in region:
            if node.target not in allowed and kind_of(node) != "view":
                raise SkipSite(f"a {node.target} between the matmul and the reduce-scatter")
        inside = {*self.matmuls, *region, m.issue}
        for node in [*self.matmuls, *region]:
            if any(u not in inside for u in node.users):
                raise SkipSite("the matmul output (or a view of it) has other consumers")
        self.old_nodes = sorted([*self.matmuls, *region, m.issue, m.wait], key=position.__getitem__)
        # the tensor that is chunked along scatter_dim: the matmul output in its viewed shape
        source = m.issue.args[0]
        if source.target == aten.cat.default:  # type: ignore[union-attr]
            first = source.args[0][0]  # type: ignore[union-attr,index]
            source = first.args[0] if first.target is operator.getitem else first  # type: ignore[union-attr]
            source = source.args[0]  # the split's / slice's input
        self.shape = list(_val(source).shape)
        self.d = m.scatter_dim % len(self.shape)
        if self.shape[self.d] % m.group_size:
            raise SkipSite(f"scatter dim {self.d} ({self.shape[self.d]}) not divisible by {m.group_size}")
        if self.d == len(self.shape) - 1:
            raise SkipSite("scatters the matmul's output columns")
        for mm in self.matmuls:
            rows = _val(_row_operand(mm))
            if math.prod(self.shape[:-1]) != rows.shape[0] or self.shape[-1] != _val(mm).shape[-1]:
                raise SkipSite("the matmul output is not viewed by its leading dims only")
            if not rows.is_contiguous():
                raise SkipSite("the matmul's row operand is not contiguous")
            _check_bias(mm, self.d)
        # every operand of every matmul is defined before the last matmul
        self.anchor = max(self.matmuls, key=position.__getitem__)

    def _sum(self, e: _Emitter, parts: Sequence[torch.fx.Node]) -> torch.fx.Node:
        total = parts[0]
        for part in parts[1:]:
            total = e.call(aten.add.Tensor, total, part)
        return total

    def _partial(self, e: _Emitter, i: int, count: int) -> torch.fx.Node:
        """The matmul(s) on block ``i`` of ``count`` along the scatter dim (block ``j`` of
        ``group_size``: the part of the output rank ``j`` keeps)."""
        chunk = (self.shape[:-1], self.d, i, count)
        shape = list(self.shape)
        shape[self.d] //= count
        parts = []
        for mm in self.matmuls:
            rows = _chunk_rows(e, _row_operand(mm), *chunk)
            parts.append(e.view(_matmul(e, mm, rows, chunk), shape))
        return self._sum(e, parts)

    def per_peer(self, e: _Emitter, rank: int, tag: int, pieces: int = 1) -> _Variant:
        m, n = self.m, self.m.group_size
        if self.shape[self.d] % (n * pieces):
            raise SkipSite(f"scatter dim {self.d} ({self.shape[self.d]}) not divisible by {_ways(n, pieces)}")
        partial = lambda i, count: self._partial(e, i, count)  # noqa: E731
        total = _reduce_per_peer(e, partial, self.d, rank, n, pieces, tag, m.group_name, m.reduce_op)
        return _Variant(_per_peer_name(pieces), e, [(m.wait, total)])

    def _columns(self, e: _Emitter, mm: torch.fx.Node, c: int, cols: int) -> torch.fx.Node:
        """``mm`` restricted to output columns ``[c*cols, (c+1)*cols)``."""
        n_out = self.shape[-1]
        weight = mm.args[1] if mm.target == aten.mm.default else mm.args[2]
        w = e.slice(weight, 1, c * cols, (c + 1) * cols)  # type: ignore[arg-type]
        if mm.target == aten.mm.default:
            return e.call(aten.mm.default, _row_operand(mm), w)
        bias = mm.args[0]
        if _val(bias).dim() and _val(bias).shape[-1] == n_out:
            bias = e.slice(bias, _val(bias).dim() - 1, c * cols, (c + 1) * cols)  # type: ignore[arg-type]
        return e.call(aten.addmm.default, bias, _row_operand(mm), w, **dict(mm.kwargs))

    def chunked(self, e: _Emitter, k: int) -> _Variant:
        m, n, d = self.m, self.m.group_size, self.d
        n_out = self.shape[-1]
        if n_out % k:
            raise SkipSite(f"matmul output columns ({n_out}) not divisible by {k}")
        for mm in self.matmuls:
            bias = _val(mm.args[0]) if mm.target == aten.addmm.default else None
            if bias is not None and bias.dim() and bias.shape[-1] not in (1, n_out):
                raise SkipSite("addmm bias of an unexpected shape")
        cols = n_out // k
        flights = []
        for c in range(k):
            y = self._sum(e, [e.view(self._columns(e, mm, c, cols), [*self.shape[:-1], cols]) for mm in self.matmuls])
            if d != 0:  # chunks along d stacked along dim 0, as the original graph does
                split = e.call(aten.split.Tensor, y, self.shape[d] // n, d)
                y = e.cat([e.call(operator.getitem, split, j) for j in range(n)], 0)
            flights.append(e.call(c10d.reduce_scatter_tensor.default, y, m.reduce_op, n, m.group_name))
        outs = [e.call(c10d.wait_tensor.default, f) for f in flights]
        return _Variant(f"chunked_{k}", e, [(m.wait, e.cat(outs, len(self.shape) - 1))])



class _AllReduceSite(_ReplacesOutput):
    """``wait(all_reduce(matmul))``, the matmul's output rows split (Megatron TP without SP)."""

    def __init__(self, m: MatmulAllReduce, graph: torch.fx.Graph, group_size: int) -> None:
        self.m, self.graph, self.n = m, graph, group_size
        if m.issue.target != c10d.all_reduce.default:
            raise SkipSite(f"{m.issue.target} (only the functional all_reduce)")
        if m.reduce_op not in ("sum", "avg"):
            raise SkipSite(f"reduce op {m.reduce_op!r}")
        chain: list[torch.fx.Node] = []
        node = m.issue.args[0]
        while node is not m.matmul:  # views from the all-reduce's input back to the matmul
            chain.append(node)  # type: ignore[arg-type]
            node = node.args[0]  # type: ignore[union-attr]
        inside = {*chain, m.issue}
        for node in [m.matmul, *chain]:
            if any(u not in inside for u in node.users):
                raise SkipSite("the matmul output (or a view of it) has other consumers")
        if len(_val(_row_operand(m.matmul)).shape) != 2:
            raise SkipSite("row operand is not 2-d")
        position = _position(graph)
        self.old_nodes = sorted([m.matmul, *chain, m.issue, m.wait], key=position.__getitem__)
        self.anchor = m.matmul
        self.rows = int(_val(m.matmul).shape[0])

    def _part(self, e: _Emitter, j: int, parts: int) -> torch.fx.Node:
        """The matmul on row block ``j`` of ``parts``."""
        mm = self.m.matmul
        rows = _chunk_rows(e, _row_operand(mm), [self.rows], 0, j, parts)
        return _matmul(e, mm, rows, ([self.rows], 0, j, parts))

    def _result(self, e: _Emitter, blocks: Sequence[torch.fx.Node]) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
        return [(self.m.wait, e.view(e.cat(blocks, 0), list(_val(self.m.wait).shape)))]

    def per_peer(self, e: _Emitter, rank: int, tag: int, pieces: int = 1) -> _Variant:
        """Reduce-scatter per peer (remote row blocks first, in pieces, local last), then all-gather per peer."""
        m, n = self.m, self.n
        if self.rows % (n * pieces):
            raise SkipSite(f"rows ({self.rows}) not divisible by {_ways(n, pieces)}")
        partial = lambda i, count: self._part(e, i, count)  # noqa: E731
        mine = _reduce_per_peer(e, partial, 0, rank, n, pieces, tag, m.group_name, m.reduce_op)
        gathers = [
            e.exchange(mine, (rank + s) % n, (rank - s) % n, _tag(tag, (n - 1) * pieces + s - 1), m.group_name)
            for s in range(1, n)
        ]
        blocks = {rank: mine}
        for s, flight in enumerate(gathers, start=1):
            blocks[(rank - s) % n] = e.wait_exchange(flight)
        return _Variant(_per_peer_name(pieces), e, self._result(e, [blocks[j] for j in range(n)]))

    def chunked(self, e: _Emitter, k: int) -> _Variant:
        """k row blocks: block c's all-reduce in flight while block c+1's matmul runs."""
        if self.rows % k:
            raise SkipSite(f"rows ({self.rows}) not divisible by {k}")
        op = c10d.all_reduce.default
        flights = [e.call(op, self._part(e, c, k), self.m.reduce_op, self.m.group_name) for c in range(k)]
        outs = [e.call(c10d.wait_tensor.default, f) for f in flights]
        return _Variant(f"chunked_{k}", e, self._result(e, outs))



class _AllToAllSite(_PerPeerOnly, _ReplacesOutput):
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
        view = _only_user(m.wait, _RESHAPES)
        shape = list(_val(view).shape)
        if len(shape) < 3 or shape[0] != n:
            raise SkipSite("the received tensor is not viewed with the source rank first")
        swap = _swap_of_first_two_dims(view, "the source dim is permuted by {}, not swapped with the next")
        node = swap
        chain = [view, swap]
        copy = _only_user(node, (aten.clone.default,), required=False)
        if copy is not None:
            chain.append(copy)
            node = copy
        merged = _only_user(node, _RESHAPES)
        chain.append(merged)
        self.block_shape = [shape[1], *shape[2:]]  # one source's part: [A, B, ...]
        if list(_val(merged).shape) != [shape[1], n * shape[2], *shape[3:]]:
            raise SkipSite("the swapped tensor is not reshaped to [A, W*B, ...]")
        self.merged = merged
        self.bmms = [u for u in merged.users if u.target == aten.bmm.default and u.args[0] is merged]
        if not self.bmms:
            raise SkipSite("no bmm reads the received tokens as its first operand")
        position = _position(graph)
        others = [u for u in merged.users if u not in self.bmms] + [u for u in m.wait.users if u is not view]
        self.anchor = min([*self.bmms, *others], key=position.__getitem__)  # the first reader
        self.hoist: list[torch.fx.Node] = []
        for mm in self.bmms:
            _late_operands(mm.args[1], self.anchor, position, self.hoist)
        self.old_nodes = sorted([m.issue, m.wait, *chain, *self.bmms], key=position.__getitem__)

    def per_peer(self, e: _Emitter, rank: int, tag: int, pieces: int = 1) -> _Variant:
        """Send each peer its chunk (all at once), compute on the local chunk, then on each peer's
        chunk as it arrives."""
        if pieces != 1:
            raise SkipSite("pieces (all-to-all sites send whole chunks)")
        m, n, size = self.m, self.n, self.chunk_rows
        inp = m.issue.args[0]
        flights = {
            (rank - s) % n: e.exchange(e.slice(inp, 0, (rank + s) % n * size, ((rank + s) % n + 1) * size),  # type: ignore[arg-type]
                                      (rank + s) % n, (rank - s) % n, _tag(tag, s - 1), m.group_name)
            for s in range(1, n)
        }
        chunks = {rank: e.slice(inp, 0, rank * size, (rank + 1) * size, contiguous=True)}  # type: ignore[arg-type]
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
        return _Variant("per_peer", e, replace)

    def commit(self, variant: _Variant) -> None:
        _hoist(variant, self.hoist)
        super().commit(variant)


class _BmmAllToAllSite(_PerPeerOnly, _ReplacesOutput):
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
        view = _only_user(m.output, _RESHAPES)
        experts, rows = _val(m.output).shape[:2]
        shape = list(_val(view).shape)
        if shape[:3] != [experts, n, rows // n] or rows % n:
            raise SkipSite(f"the bmm output is not viewed [experts, {n} destinations, slots, ...]")
        swap = _swap_of_first_two_dims(view, "the destination dim is permuted by {}, not swapped with the first")
        chain, node = [view, swap], swap
        while node is not m.issue.args[0]:
            node = _only_user(node, (aten.clone.default, *_RESHAPES))
            chain.append(node)
        self.slots = rows // n
        self.chunk_shape = [experts * self.slots, *shape[3:]]
        position = _position(graph)
        self.old_nodes = sorted([*m.bmms, *_nodes_between(m.output, m.bmms), *chain, m.issue, m.wait], key=position.__getitem__)
        self.anchor = max(m.bmms, key=position.__getitem__)  # every operand exists there

    def _part(self, e: _Emitter, j: int) -> torch.fx.Node:
        """Destination ``j``'s chunk: the bmm(s) on its slots of every expert (summed), rows flattened."""
        total = None
        for bmm in self.m.bmms:
            tokens, weight = bmm.args[:2]
            rows = e.slice(tokens, 1, j * self.slots, (j + 1) * self.slots)  # type: ignore[arg-type]
            part = e.call(aten.bmm.default, rows, weight)
            total = part if total is None else e.call(aten.add.Tensor, total, part)
        return e.view(total, self.chunk_shape)  # type: ignore[arg-type]

    def per_peer(self, e: _Emitter, rank: int, tag: int, pieces: int = 1) -> _Variant:
        if pieces != 1:
            raise SkipSite("pieces (all-to-all sites send whole chunks)")
        m, n = self.m, self.n
        flights = {
            (rank - s) % n: e.exchange(self._part(e, (rank + s) % n), (rank + s) % n, (rank - s) % n, _tag(tag, s - 1), m.group_name)
            for s in range(1, n)
        }
        chunks = {rank: self._part(e, rank)}
        for j, flight in flights.items():
            chunks[j] = e.wait_exchange(flight)
        return _Variant("per_peer", e, [(m.wait, e.cat([chunks[j] for j in range(n)], 0))])


def _nodes_between(root: torch.fx.Node, leaves: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """The nodes of the ``add`` tree from ``root`` down to (not including) ``leaves``."""
    if root in leaves:
        return []
    return [root, *(n for arg in root.all_input_nodes for n in _nodes_between(arg, leaves))]


def _equal_chunk_rows(issue: torch.fx.Node, n: int) -> int:
    """Rows per rank of an ``all_to_all_single`` whose split sizes are ``n`` equal parts (or None)."""
    rows = int(_val(issue.args[0]).shape[0])  # type: ignore[arg-type]
    for splits in issue.args[1:3]:
        if splits is not None and (len(splits) != n or len(set(splits)) != 1 or sum(splits) != rows):  # type: ignore[arg-type]
            raise SkipSite(f"split sizes {splits} are not {n} equal parts of {rows} rows")
    if rows % n:
        raise SkipSite(f"rows ({rows}) not divisible by {n}")
    return rows // n


def _only_user(node: torch.fx.Node, targets: tuple[Any, ...], *, required: bool = True) -> Any:
    """``node``'s single user when it is one of ``targets``; else None (``required``: SkipSite)."""
    users = list(node.users)
    if len(users) == 1 and users[0].target in targets:
        return users[0]
    if required:
        raise SkipSite(f"{node.name} is read by {[u.name for u in users]}, not by one of {[str(t) for t in targets]}")
    return None


#: Ops that reshape without moving data (a reshape of a non-contiguous tensor is a clone first).
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _swap_of_first_two_dims(view: torch.fx.Node, reason: str) -> torch.fx.Node:
    """``view``'s single user when it swaps dims 0 and 1 and keeps the rest; else SkipSite with
    ``reason`` formatted with the permutation."""
    swap = _only_user(view, (aten.permute.default, aten.transpose.int))
    rank = len(_val(view).shape)
    if swap.target == aten.permute.default:
        perm = list(swap.args[1])
    else:
        perm = list(range(rank))
        a, b = swap.args[1] % rank, swap.args[2] % rank
        perm[a], perm[b] = perm[b], perm[a]
    if perm != [1, 0, *range(2, rank)]:
        raise SkipSite(reason.format(perm))
    return swap


def _consumers_through_views(node: torch.fx.Node) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    for user in node.users:
        if user.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            out.extend(_consumers_through_views(user))
        else:
            out.append(user)
    return out


def _erase_dead(graph: torch.fx.Graph, nodes: Sequence[torch.fx.Node]) -> None:
    """Erase the replaced nodes (last first); views still read by outputs stay."""
    for node in reversed(nodes):
        if not node.users:
            graph.erase_node(node)
        elif kind_of(node) not in ("view",) and node.op != "placeholder":
            raise RuntimeError(f"decompose: replaced node {node.name} still has users {list(node.users)}")


# ---------------------------------------------------------------------------------- the pass


class _Decomposer:
    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext, options: DecomposeOptions) -> None:
        from dhelix_compile import (
            _torch_compat as compat,  # lazily: dhelix_compile imports graph_passes
        )

        self.compat = compat
        self.gm, self.ctx, self.options = gm, ctx, options
        self.graph = gm.graph
        self.estimator = MemoizedEstimator(ctx.estimator) if ctx.estimator is not None else None
        vals = [n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"]
        self.fake_mode = self.compat.fake_mode_of([v for v in vals if isinstance(v, torch.Tensor)])
        self.sites = 0
        self.saved_s = 0.0
        self.rewrote = False

    def count(self, reason: str) -> None:
        self.ctx.count(PASS, reason)

    def run(self) -> None:
        from graph_passes.decompose_chain import _ChainSite  # it builds on this module's sites

        skipped: Counter[str] = Counter()
        kinds = (  # pattern, its finder, its site (given the match and the group size)
            (CHAIN, find_all_gather_chains, lambda m, n: _ChainSite(m, self.graph)),
            ("all_gather_matmul", find_all_gather_matmuls, lambda m, n: _AllGatherSite(m, self.graph)),
            ("matmul_reduce_scatter", find_matmul_reduce_scatters, lambda m, n: _ReduceScatterSite(m, self.graph)),
            ("matmul_all_reduce", find_matmul_all_reduces, lambda m, n: _AllReduceSite(m, self.graph, n)),
            ("all_to_all_compute", find_all_to_all_computes, lambda m, n: _AllToAllSite(m, self.graph, n)),
            ("bmm_all_to_all", find_bmm_all_to_alls, lambda m, n: _BmmAllToAllSite(m, self.graph, n)),
        )
        for label, find, make in kinds:
            if label not in self.options.patterns:
                continue
            for m in find(self.graph, skipped):
                size = getattr(m, "group_size", None) or self.compat.group_size(m.group_name)
                if size is None:
                    self.count(f"{label}: skipped: unknown process group {m.group_name!r}")
                    continue
                self._site(label, lambda m=m, size=size, make=make: make(m, size), m.group_name, size, m.issue)
        for reason, n in sorted(skipped.items()):
            self.ctx.count(PASS, f"not matched: {reason}", n)
        self.ctx.record(PASS, predicted_saved_s=self.saved_s)

    def _measure(self, nodes: Sequence[torch.fx.Node]) -> None:
        """Let a profiled estimator measure the variants' new ops (same sites, same order on every rank)."""
        measure_new = getattr(self.ctx.estimator, "measure_new", None)
        if measure_new is not None:
            measure_new(nodes)

    def _simulate(self, nodes: Sequence[torch.fx.Node]) -> float:
        if self.estimator is None:
            return math.nan
        return simulate(nodes, self.estimator).makespan_s

    def _site(self, label: str, make: Any, group_name: str, group_size: int, issue: torch.fx.Node) -> None:
        index = self.sites
        self.sites += 1
        name = f"{label}{index}"
        try:
            site = make()
        except SkipSite as why:
            self.count(f"{label}: skipped: {why}")
            return
        if group_size < 2:
            self.count(f"{label}: skipped: group of one rank")
            return
        if self.options.mode == "auto" and self.estimator is None:
            self.count(f"{label}: skipped: no estimator")
            return
        strand = issue.meta.get("dhelix", {}).get("strand")
        # a chain competes with its two collectives decomposed on their own (built first, on the
        # graph as it is)
        rivals = self._single_site_rivals(site, group_name, strand) if label == CHAIN and self.estimator else []
        variants, original_s = self._priced_variants(label, site, group_name, TAG_BASE + index * TAG_STRIDE, strand)
        if not variants:
            for rival, _ in rivals:
                rival.discard()
            self.count(f"{label}: skipped: no variant applies")
            return
        self.ctx.record(PASS, **{f"{name}_original_s": original_s}, **{f"{name}_{v.name}_s": v.predicted_s for v in variants})
        best = self._choose(variants, original_s)
        why_not = "kept: no predicted gain"
        if label == CHAIN and best is not None and rivals:
            emitted = {n for v in [*variants, *(r for r, _ in rivals)] for n in v.emitter.nodes}
            chain_s = self._graph_s([(best, site.old_nodes)], emitted)
            sites_s = self._graph_s(rivals, emitted)
            self.ctx.record(PASS, **{f"{name}_graph_chain_s": chain_s, f"{name}_graph_single_sites_s": sites_s})
            if sites_s <= chain_s:
                best, why_not = None, "left to the single sites: the graph predicts less with them"
        for rival, _ in rivals:
            rival.discard()
        _discard_all_but(variants, best)
        if best is None:
            self.count(f"{label}: {why_not}")
            return
        site.commit(best)
        self.rewrote = True
        if not math.isnan(original_s):
            self.saved_s += original_s - best.predicted_s
        self.count(f"{label}: {best.name}")
        self.ctx.record(PASS, **{f"{name}_chosen_s": best.predicted_s})

    def _priced_variants(
        self, label: str, site: Any, group_name: str, tag: int, strand: int | None, *, counted: bool = True
    ) -> tuple[list[_Variant], float]:
        """The site's variants for the configured mode, emitted (not committed), their new ops
        measured and each priced; and the original's predicted time (NaN without an estimator).
        The caller commits one or discards them all. ``counted``: count the variants skipped."""
        mode = self.options.mode
        variants: list[_Variant] = []
        count = self.count if counted else lambda reason: None

        def build(family: str, builder: Any, *args: Any) -> None:
            emitter = _Emitter(self.graph, site.anchor, self.fake_mode, strand)
            try:
                variants.append(builder(emitter, *args))
            except SkipSite as why:
                _Variant(family, emitter, []).discard()  # whatever was emitted before the skip
                count(f"{label}: {family} skipped: {why}")

        if mode in ("auto", "per_peer"):
            rank = self.compat.group_rank(group_name)
            if rank is None:
                count(f"{label}: per_peer skipped: unknown process group {group_name!r}")
            else:
                for pieces in (self.options.pieces,) if self.options.pieces else AUTO_PIECES:
                    build("per_peer", site.per_peer, rank, tag, pieces)
        if mode in ("auto", "chunked"):
            for k in range(2, self.options.max_chunks + 1):
                build("chunked", site.chunked, k)
        if not variants:
            return [], math.nan
        self._measure([n for v in variants for n in v.emitter.nodes])
        for v in variants:
            v.predicted_s = self._simulate(v.emitter.nodes)
        return variants, self._simulate(site.old_nodes)

    def _choose(self, variants: Sequence[_Variant], original_s: float) -> _Variant | None:
        """The variant to commit, or None to keep the original (``auto`` and no predicted gain)."""
        if self.estimator is None:  # forced mode without costs: the largest k, or per-peer in one piece
            return variants[-1] if self.options.mode == "chunked" else variants[0]
        best = min(variants, key=lambda v: v.predicted_s)  # stable: first of equals
        if self.options.mode != "auto" or best.predicted_s < original_s * (1.0 - self.options.min_gain_ratio):
            return best
        return None

    def _single_site_rivals(
        self, chain: Any, group_name: str, strand: int | None
    ) -> list[tuple[_Variant, Sequence[torch.fx.Node]]]:
        """The chain's all-gather and reduce-scatter as single sites, each at the variant
        ``_choose`` picks (none when it keeps the original), with the nodes it would replace:
        emitted, not committed (the caller discards them; if the chain loses, the single-site
        patterns build them again)."""
        rivals = []
        for label, make in (
            ("all_gather_matmul", lambda: _AllGatherSite(chain.m.gather, self.graph)),
            ("matmul_reduce_scatter", lambda: chain.scatter),
        ):
            try:
                site = make()
            except SkipSite:  # not a site of its own: its nodes stay as they are
                continue
            variants, original_s = self._priced_variants(label, site, group_name, TAG_BASE, strand, counted=False)
            best = self._choose(variants, original_s) if variants else None
            _discard_all_but(variants, best)
            if best is not None:
                rivals.append((best, site.old_nodes))
        return rivals

    def _graph_s(self, chosen: Sequence[tuple[_Variant, Sequence[torch.fx.Node]]], emitted: set[torch.fx.Node]) -> float:
        """The whole graph's predicted makespan in its current order with each ``chosen`` variant
        in place of the nodes it replaces, and every other ``emitted`` (uncommitted) node left out.
        Nodes after a rewrite that read a replaced node count as reading a ready input."""
        keep = {n for v, _ in chosen for n in v.emitter.nodes}
        skip = (emitted - keep).union(*(old for _, old in chosen))
        return self._simulate([n for n in self.graph.nodes if n not in skip])


def decompose_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Decompose collectives next to their matmuls; see the module docstring."""
    options = ctx.pass_options.get(PASS, DecomposeOptions())
    assert isinstance(options, DecomposeOptions)
    options.validate()
    if options.mode == "off":
        ctx.count(PASS, "off")
        return gm
    decomposer = _Decomposer(gm, ctx, options)
    decomposer.run()
    if decomposer.rewrote:  # new nodes (and new comm ids): annotate again, counting into a scratch context
        annotate_pass(gm, PassContext(ctx.graph_name, ctx.phase, ctx.example_inputs, strand=ctx.strand))
    return gm
