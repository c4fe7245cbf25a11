"""The decompose pass: traced graphs with stub costs (fake world), then numerics on real gloo ranks.

Layers: the rewritten graph's order (FileCheck-style subsequences), the gating by predicted gain,
the skip reasons; then, on 2 and 4 gloo ranks, decomposed == undecomposed (eager functional
collectives) for all-gather->matmul and matmul->reduce-scatter over explicit shapes (both layouts),
forward and backward, the TP+SP reference model, and one case through Inductor codegen.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx

from cost_model import ProfiledEstimator, compile_clock
from cost_model.estimator import AnalyticEstimator, EstimatorBase, TableEstimator
from cost_model.hardware import Device, Link
from cost_model.testing import fake_world, trace_aten
from dhelix_compile.ops.exchange import P2P_EXCHANGE
from dhelix_compile.testing.multirank import run_on_ranks
from graph_passes import PassContext
from graph_passes.annotate import annotate_pass
from graph_passes.decompose import DecomposeOptions, decompose_pass
from graph_passes.reorder import reorder_pass
from graph_passes.verify import verify_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

#: Comm slow, compute moderate: overlap pays (all per node, in seconds).
SLOW_LINK = TableEstimator(kind_times_s={"compute": 1.0, "collective": 10.0, "p2p": 5.0})
#: Comm free: nothing to hide, the rewrite only adds work.
#: DHELIX_TEST_FULL=1: the slower multi-rank cases too (over the default suite's 15-minute budget).
_FULL = bool(os.environ.get("DHELIX_TEST_FULL"))
FREE_LINK = TableEstimator(kind_times_s={"compute": 1.0, "collective": 0.0, "p2p": 0.0})


def _sp_in(x, wq, wk, group, gather_dim=1):
    full = funcol.all_gather_single(x, gather_dim, group)
    flat = full.reshape(-1, full.shape[-1])
    return flat @ wq.t(), flat @ wk.t()


def _row_out(h, w, group, scatter_dim=1):
    y = (h.reshape(-1, h.shape[-1]) @ w.t()).reshape(h.shape[0], h.shape[1], -1)
    return funcol.reduce_scatter_single(y, "sum", scatter_dim, group)


def _row_ar(h, w, group):
    """Megatron TP's row-parallel output: matmul -> all-reduce."""
    y = h.reshape(-1, h.shape[-1]) @ w.t()
    return funcol.all_reduce(y.reshape(h.shape[0], h.shape[1], -1), "sum", group)


def _wgrad_in(g, h, w, group):
    """A backward all-gather: the gathered gradient feeds an input gradient and a weight gradient."""
    flat = funcol.all_gather_single(g, 1, group).reshape(-1, g.shape[-1])
    return flat @ w.t(), flat.t() @ h


def _ep_in(send, w1, w3, group, experts=2):
    """Expert parallelism's dispatch: all-to-all, tokens regrouped per local expert, two bmm."""
    world = dist.get_world_size(group)
    rows, dim = send.shape
    slots = rows // (world * experts)
    recv = funcol.all_to_all_single(send, [rows // world] * world, [rows // world] * world, group)
    tokens = recv.view(world, experts, slots, dim).transpose(0, 1).reshape(experts, world * slots, dim)
    return torch.bmm(tokens, w1), torch.bmm(tokens, w3)


def _ep_out(h, w2, group, experts=2, g=None, w3=None):
    """Expert parallelism's combine: each local expert's bmm (plus ``bmm(g, w3)``: the backward's
    sum through w1 and w3), regrouped per destination, all-to-all."""
    world = dist.get_world_size(group)
    rows, dim = h.shape[1], w2.shape[-1]
    y = torch.bmm(h, w2) if g is None else torch.bmm(h, w2) + torch.bmm(g, w3)
    y = y.view(experts, world, rows // world, dim).transpose(0, 1).reshape(-1, dim)
    return funcol.all_to_all_single(y, [y.shape[0] // world] * world, [y.shape[0] // world] * world, group)


def _traced(fn, *shapes, world=2, rank=0):
    with fake_world(world, rank) as group:
        return trace_aten(lambda *a: fn(*a, group), *[torch.randn(s) for s in shapes])


def _run(gm, estimator=SLOW_LINK, world=2, rank=0, **options) -> PassContext:
    """The pass on ``gm`` with ``options``; one piece per transfer unless ``pieces`` says otherwise."""
    options = {"pieces": 1, **options}
    ctx = PassContext("test", "fwd", estimator=estimator, pass_options={"decompose": DecomposeOptions(**options)})
    with fake_world(world, rank):
        decompose_pass(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    annotate_pass(gm, ctx)
    verify_pass(gm, ctx)
    return ctx


def _ops(gm) -> list[str]:
    """Transfers, waits and matmuls in order: ``p2p``, ``ag``, ``rs``, ``ar``, ``wait``, ``mm``."""
    names = {
        P2P_EXCHANGE: "p2p",
        c10d.all_gather_into_tensor.default: "ag",
        c10d.reduce_scatter_tensor.default: "rs",
        c10d.all_reduce.default: "ar",
        c10d.wait_tensor.default: "wait",
        aten.mm.default: "mm",
        aten.addmm.default: "mm",
        aten.bmm.default: "mm",
    }
    return [names[n.target] for n in gm.graph.nodes if n.target in names]


def _p2p_peers(gm) -> list[list[int]]:
    return [[n.args[1], n.args[2]] for n in gm.graph.nodes if n.target == P2P_EXCHANGE]


# ------------------------------------------------------------------------------ traced graphs


def test_all_gather_per_peer_computes_local_shard_first_then_each_peer() -> None:
    gm = _traced(_sp_in, (2, 4, 8), (6, 8), (6, 8), world=4, rank=1)
    ctx = _run(gm, world=4, rank=1, mode="per_peer")
    assert ctx.stats["decompose"]["all_gather_matmul: per_peer"] == 1
    # step s: send own shard to r-s, receive r+s's shard; the next exchange is issued before compute
    assert _ops(gm) == ["p2p", "mm", "mm", "wait", "wait"] * 3 + ["mm", "mm"]
    assert _p2p_peers(gm) == [[0, 2], [3, 3], [2, 0]]
    tags = [n.args[3] for n in gm.graph.nodes if n.target == P2P_EXCHANGE]
    assert len(set(tags)) == 3
    assert not any(n.target == c10d.all_gather_into_tensor.default for n in gm.graph.nodes)


def test_reduce_scatter_per_peer_sends_remote_partials_first_and_local_last() -> None:
    gm = _traced(_row_out, (2, 8, 8), (8, 8), world=4, rank=2)
    ctx = _run(gm, world=4, rank=2, mode="per_peer")
    assert ctx.stats["decompose"]["matmul_reduce_scatter: per_peer"] == 1
    assert _ops(gm) == ["mm", "p2p", "mm", "p2p", "mm", "p2p", "mm"] + ["wait"] * 6
    # partial for r+s goes to r+s; the partial for me comes from r-s
    assert _p2p_peers(gm) == [[3, 1], [0, 0], [1, 3]]


def test_all_gather_in_pieces_computes_each_piece_while_the_next_is_in_flight() -> None:
    gm = _traced(_sp_in, (2, 4, 8), (6, 8), (6, 8), world=4, rank=1)
    ctx = _run(gm, world=4, rank=1, mode="per_peer", pieces=2)
    assert ctx.stats["decompose"]["all_gather_matmul: per_peer_2"] == 1
    piece = ["wait", "wait", "mm", "mm"]
    # step s: both pieces issued together; the local shard in one piece (two matmuls, not four);
    # step s+1 issued after step s's last piece arrived
    step = ["p2p", "p2p", "mm", "mm", *piece]
    assert _ops(gm) == [*step, "wait", "wait", *step, "wait", "wait", *step, *piece]
    assert _p2p_peers(gm) == [[0, 2]] * 2 + [[3, 3]] * 2 + [[2, 0]] * 2
    sends = [n.args[0] for n in gm.graph.nodes if n.target == P2P_EXCHANGE]
    assert [(n.args[1], n.args[2], n.args[3]) for n in sends[:2]] == [(1, 0, 2), (1, 2, 4)]  # halves along dim 1
    tags = [n.args[3] for n in gm.graph.nodes if n.target == P2P_EXCHANGE]
    assert len(set(tags)) == 6


def test_reduce_scatter_in_pieces_sends_each_piece_of_a_remote_partial_when_it_is_ready() -> None:
    gm = _traced(_row_out, (2, 8, 8), (8, 8), world=2, rank=0)
    ctx = _run(gm, mode="per_peer", pieces=2)
    assert ctx.stats["decompose"]["matmul_reduce_scatter: per_peer_2"] == 1
    assert _ops(gm) == ["mm", "p2p", "mm", "p2p", "mm"] + ["wait"] * 4
    assert _p2p_peers(gm) == [[1, 1], [1, 1]]
    # the remote block (rows 4..8 of the scatter dim) in two pieces of 2 rows; the local block whole
    rows = [(n.args[1], n.args[2], n.args[3]) for n in gm.graph.nodes if n.target == aten.slice.Tensor]
    assert rows == [(1, 4, 6), (1, 6, 8), (1, 0, 4)]


def test_pieces_that_do_not_divide_the_shape_leave_the_site_alone_with_a_reason() -> None:
    gm = _traced(_row_out, (1, 6, 8), (8, 8))  # 3 rows per rank: not 2 pieces
    before = str(gm.graph)
    ctx = _run(gm, mode="per_peer", pieces=2)
    assert ctx.stats["decompose"]["matmul_reduce_scatter: per_peer skipped: indivisible"] == 1
    assert ctx.notes["decompose"]["matmul_reduce_scatter: per_peer skipped: indivisible"]  # which site, which sizes
    assert str(gm.graph) == before
    with pytest.raises(ValueError, match="pieces=17"):
        DecomposeOptions(pieces=17).validate()


def test_pieces_are_chosen_by_the_cost_model() -> None:
    # One half-matmul pair takes 1 s; the 256-byte shard takes 2 s on the link. In one piece the
    # peer's matmuls wait for the whole shard (3 s); in 4 pieces only the last piece's (2.25 s).
    device = Device(
        "slow",
        {torch.float32: 2 * 16 * 8 * 64},
        mem_bandwidth_bytes_per_s=1e12,
        launch_overhead_s=0.0,
        source="unit test",
    )
    link = Link("slow_link", bandwidth_bytes_per_s=128.0, latency_s=1e-3, source="unit test")
    gm = _traced(_sp_in, (2, 4, 8), (64, 8), (64, 8))
    ctx = _run(gm, estimator=AnalyticEstimator(device, link), mode="per_peer", pieces=0)
    assert ctx.stats["decompose"]["all_gather_matmul: per_peer_4"] == 1, ctx.stats["decompose"]
    record = ctx.records["decompose"]
    assert (
        record["all_gather_matmul0_per_peer_4_s"]
        < record["all_gather_matmul0_per_peer_2_s"]
        < record["all_gather_matmul0_per_peer_s"]
    )


class _MeasuresByExchanges(TableEstimator):
    """SLOW_LINK's predictions; "measured" times from a segment's exchange count (the original has none)."""

    def __init__(self, seconds_by_exchanges: dict[int, float]) -> None:
        super().__init__(kind_times_s=SLOW_LINK.kind_times_s)
        self.seconds_by_exchanges = seconds_by_exchanges
        self.asked: list[int] = []

    def segment_times(self, segments):
        counts = [sum(n.target == P2P_EXCHANGE for n in nodes) for nodes in segments]
        self.asked.extend(counts)
        return [self.seconds_by_exchanges.get(c) for c in counts]


@pytest.mark.parametrize(
    ("measured", "chosen"),
    [
        ({0: 9.0, 1: 3.0, 2: 1.0, 4: 2.0}, "per_peer_2"),  # the measurements pick, against the prediction
        ({0: 1.0, 1: 3.0, 2: 2.0, 4: 2.5}, None),  # auto keeps the original it measured fastest
        ({0: 9.0, 1: 3.0, 2: None, 4: 2.5}, "per_peer"),  # one candidate not measured: by prediction
        # within min_gain_ratio (2%) of the fastest, the fewest pieces: noise does not flip the plan
        ({0: 9.0, 1: 3.0, 2: 2.03, 4: 2.0}, "per_peer_2"),
        ({0: 9.0, 1: 3.0, 2: 2.1, 4: 2.0}, "per_peer_4"),
    ],
)
def test_measured_candidates_decide_where_every_one_was_measured(measured, chosen) -> None:
    estimator = _MeasuresByExchanges(measured)
    gm = _traced(_sp_in, (2, 4, 8), (64, 8), (64, 8))
    ctx = _run(gm, estimator=estimator, mode="auto", pieces=0)
    assert sorted(estimator.asked) == [0, 1, 2, 4]  # the original and per-peer in 1, 2 and 4 pieces
    stats = ctx.stats["decompose"]
    if chosen is None:
        assert stats == {"all_gather_matmul: kept: no gain": 1}, stats
    else:
        assert stats == {f"all_gather_matmul: {chosen}": 1}, stats
    record = ctx.records["decompose"]
    if all(t is not None for t in measured.values()):
        assert record["all_gather_matmul0_per_peer_2_measured_s"] == measured[2]
        assert record["all_gather_matmul0_original_measured_s"] == measured[0]
    # predicted: each exchange costs the table's 5 s, so the fewest pieces win
    assert record["all_gather_matmul0_per_peer_s"] < record["all_gather_matmul0_per_peer_4_s"]


def test_a_forced_single_variant_is_not_measured() -> None:
    estimator = _MeasuresByExchanges({0: 1.0, 1: 3.0})
    weighed = compile_clock.counts()["variants"]
    ctx = _run(_traced(_sp_in, (2, 4, 8), (64, 8), (64, 8)), estimator=estimator, mode="per_peer", pieces=1)
    assert estimator.asked == [] and ctx.stats["decompose"] == {"all_gather_matmul: per_peer": 1}
    assert compile_clock.counts()["variants"] == weighed, "no choice: no variant weighed"


class _SignatureSpy(EstimatorBase):
    """An estimator that records the signatures ``measure_new`` is asked to measure."""

    def __init__(self, tmp_path: Path) -> None:
        self.profiled = ProfiledEstimator(AnalyticEstimator("cpu", "loopback"), tmp_path, progress=False)
        self.asked: list[list[str | None]] = []

    def node_cost(self, node):
        return self.profiled.node_cost(node)

    def measure_new(self, nodes) -> None:
        self.asked.append([self.profiled.signature(n) for n in nodes if self.profiled.skip_reason(n) is None])


@pytest.mark.parametrize("fn", [_sp_in, _row_out, _row_ar, _wgrad_in])
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_asks_to_measure_the_same_signatures(fn, world, tmp_path: Path) -> None:
    # the profiled cost model measures the variants' new ops only if all ranks agree on them
    shapes = {
        _sp_in: ((2, 4, 8), (6, 8), (6, 8)),
        _row_out: ((2, 8, 8), (8, 8)),
        _row_ar: ((2, 8, 8), (6, 8)),
        _wgrad_in: ((2, 4, 8), (2 * 4 * world, 6), (6, 8)),
    }[fn]
    asked = []
    for rank in range(world):
        spy = _SignatureSpy(tmp_path)
        _run(_traced(fn, *shapes, world=world, rank=rank), estimator=spy, world=world, rank=rank, mode="auto", pieces=0)
        asked.append(spy.asked)
    assert asked[0] and all(a == asked[0] for a in asked)


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_per_peer_computes_the_local_chunk_first_then_each_source(world: int) -> None:
    rank = 1
    gm = _traced(_ep_in, (world * 2 * 3, 8), (2, 8, 5), (2, 8, 5), world=world, rank=rank)
    ctx = _run(gm, world=world, rank=rank, mode="per_peer")
    assert ctx.stats["decompose"]["all_to_all_compute: per_peer"] == 1, ctx.stats["decompose"]
    # every chunk sent up front; the local chunk's bmm under them; each source's bmm as it lands
    assert _ops(gm) == ["p2p"] * (world - 1) + ["mm", "mm"] + ["wait", "wait", "mm", "mm"] * (world - 1)
    assert _p2p_peers(gm) == [[(rank + s) % world, (rank - s) % world] for s in range(1, world)]
    assert not any(n.target == c10d.all_to_all_single.default for n in gm.graph.nodes)


@pytest.mark.parametrize("world", [2, 4])
def test_bmm_all_to_all_per_peer_sends_each_destinations_chunk_when_ready_and_the_local_last(world: int) -> None:
    rank = 1
    gm = _traced(_ep_out, (2, world * 3, 8), (2, 8, 5), world=world, rank=rank)
    ctx = _run(gm, world=world, rank=rank, mode="per_peer")
    assert ctx.stats["decompose"]["bmm_all_to_all: per_peer"] == 1, ctx.stats["decompose"]
    assert _ops(gm) == ["mm", "p2p"] * (world - 1) + ["mm"] + ["wait", "wait"] * (world - 1)
    assert _p2p_peers(gm) == [[(rank + s) % world, (rank - s) % world] for s in range(1, world)]
    slots = [(n.args[1], n.args[2], n.args[3]) for n in gm.graph.nodes if n.target == aten.slice.Tensor]
    assert slots == [(1, 3 * ((rank + s) % world), 3 * ((rank + s) % world + 1)) for s in [*range(1, world), 0]]

    summed = _traced(
        lambda h, w2, g, w3, group: _ep_out(h, w2, group, g=g, w3=w3),
        (2, world * 3, 8),
        (2, 8, 5),
        (2, world * 3, 4),
        (2, 4, 5),
        world=world,
        rank=rank,
    )
    ctx = _run(summed, world=world, rank=rank, mode="per_peer")
    assert ctx.stats["decompose"]["bmm_all_to_all: per_peer"] == 1, ctx.stats["decompose"]
    assert _ops(summed) == ["mm", "mm", "p2p"] * (world - 1) + ["mm", "mm"] + ["wait", "wait"] * (world - 1)


def test_all_to_all_sites_that_are_not_per_source_blocks_are_left_alone_with_reasons() -> None:
    def uneven(send, w, group):
        recv = funcol.all_to_all_single(send, [4, 8], [8, 4], group)
        return torch.bmm(recv.view(2, 6, 1, 8).transpose(0, 1).reshape(6, 2, 8), w)

    def mixed(send, w, group):  # the source dim moves to the last batch position: not a row block
        recv = funcol.all_to_all_single(send, [12, 12], [12, 12], group)
        return torch.bmm(recv.view(2, 3, 4, 8).permute(1, 2, 0, 3).reshape(3, 8, 8), w)

    for fn, shapes, code in (
        (uneven, ((12, 8), (6, 8, 5)), "uneven splits"),
        (mixed, ((24, 8), (3, 8, 5)), "unsupported layout"),  # the source dim permuted, not swapped with the next
    ):
        gm = _traced(fn, *shapes)
        before = str(gm.graph)
        ctx = _run(gm, mode="per_peer")
        assert ctx.stats["decompose"][f"all_to_all_compute: skipped: {code}"] == 1, ctx.stats["decompose"]
        assert ctx.notes["decompose"][f"all_to_all_compute: skipped: {code}"]
        assert str(gm.graph) == before


def test_chunked_variants_keep_k_collectives_in_flight_order() -> None:
    gm = _traced(_sp_in, (2, 4, 8), (6, 8), (6, 8))
    ctx = _run(gm, mode="chunked", max_chunks=2)
    assert ctx.stats["decompose"]["all_gather_matmul: chunked_2"] == 1
    assert _ops(gm) == ["ag", "ag", "wait", "mm", "mm", "wait", "mm", "mm"]
    gm = _traced(_row_out, (2, 8, 8), (8, 8))
    ctx = _run(gm, mode="chunked", max_chunks=2)
    assert ctx.stats["decompose"]["matmul_reduce_scatter: chunked_2"] == 1
    assert _ops(gm) == ["mm", "rs", "mm", "rs", "wait", "wait"]


def test_all_reduce_chunked_keeps_k_row_blocks_in_flight_and_per_peer_scatters_then_gathers() -> None:
    gm = _traced(_row_ar, (2, 8, 8), (6, 8))
    ctx = _run(gm, mode="chunked", max_chunks=2)
    assert ctx.stats["decompose"]["matmul_all_reduce: chunked_2"] == 1
    # block c+1's matmul runs while block c's all-reduce is in flight
    assert _ops(gm) == ["mm", "ar", "mm", "ar", "wait", "wait"]
    blocks = [n for n in gm.graph.nodes if n.target == aten.slice.Tensor]
    assert [(n.args[1], n.args[2], n.args[3]) for n in blocks] == [(0, 0, 8), (0, 8, 16)]

    gm = _traced(_row_ar, (2, 8, 8), (6, 8), world=4, rank=1)
    ctx = _run(gm, world=4, rank=1, mode="per_peer")
    assert ctx.stats["decompose"]["matmul_all_reduce: per_peer"] == 1
    # remote row blocks sent as soon as each is computed, the local block last; then the reduced
    # block goes to every peer while theirs arrive
    assert _ops(gm) == ["mm", "p2p", "mm", "p2p", "mm", "p2p", "mm"] + ["wait"] * 6 + ["p2p"] * 3 + ["wait"] * 6
    assert _p2p_peers(gm) == [[2, 0], [3, 3], [0, 2], [2, 0], [3, 3], [0, 2]]
    assert not any(n.target == c10d.all_reduce.default for n in gm.graph.nodes)


def test_all_reduce_with_rows_that_do_not_split_is_left_alone_with_reasons() -> None:
    gm = _traced(_row_ar, (1, 3, 8), (6, 8))  # 3 rows: neither 2 ranks nor 2 chunks divide them
    before = str(gm.graph)
    ctx = _run(gm, mode="auto", max_chunks=2, auto_chunked=True)
    stats = ctx.stats["decompose"]
    assert stats["matmul_all_reduce: per_peer skipped: indivisible"] == 1
    assert stats["matmul_all_reduce: chunked skipped: indivisible"] == 1
    assert stats["matmul_all_reduce: skipped: no variant applies"] == 1 and str(gm.graph) == before


def test_auto_rewrites_only_with_a_predicted_gain_and_records_predictions() -> None:
    gm = _traced(_sp_in, (2, 4, 8), (6, 8), (6, 8))
    ctx = _run(gm, mode="auto")
    assert sum(v for k, v in ctx.stats["decompose"].items() if k.startswith("all_gather_matmul: ") and _rewrite(k)) == 1
    rec = ctx.records["decompose"]
    assert rec["all_gather_matmul0_chosen_s"] < rec["all_gather_matmul0_original_s"]
    assert rec["predicted_saved_s"] > 0

    gm = _traced(_sp_in, (2, 4, 8), (6, 8), (6, 8))
    before = [n.format_node() for n in gm.graph.nodes]
    ctx = _run(gm, FREE_LINK, mode="auto")
    assert ctx.stats["decompose"]["all_gather_matmul: kept: no gain"] == 1
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_auto_tries_chunked_variants_only_when_asked() -> None:
    gm = _traced(_sp_in, (2, 4, 8), (6, 8), (6, 8))
    ctx = _run(gm, mode="auto")
    assert not any("chunked" in key for key in ctx.records["decompose"])
    gm = _traced(_sp_in, (2, 4, 8), (6, 8), (6, 8))
    weighed = compile_clock.counts()["variants"]
    ctx = _run(gm, mode="auto", auto_chunked=True, max_chunks=2)
    assert "all_gather_matmul0_chunked_2_s" in ctx.records["decompose"]
    assert compile_clock.counts()["variants"] == weighed + 2  # per_peer and chunked_2, weighed


def test_uneven_shapes_and_off_mode_leave_the_graph_alone_with_reasons() -> None:
    gm = _traced(_sp_in, (2, 3, 8), (6, 8), (6, 8))  # a shard of 3 rows does not split in 2 chunks
    before = str(gm.graph)
    ctx = _run(gm, mode="chunked", max_chunks=2)
    stats = ctx.stats["decompose"]
    assert stats["all_gather_matmul: chunked skipped: indivisible"] == 1
    assert ctx.notes["decompose"]["all_gather_matmul: chunked skipped: indivisible"]
    assert stats["all_gather_matmul: skipped: no variant applies"] == 1 and str(gm.graph) == before
    gm = _traced(_sp_in, (2, 4, 8), (6, 8), (6, 8))
    before = str(gm.graph)
    ctx = _run(gm, mode="off")
    assert ctx.stats["decompose"]["off"] == 1 and str(gm.graph) == before


def test_gathered_tensor_saved_for_backward_is_rebuilt_and_reorder_keeps_validity() -> None:
    def fn(x, w, group):
        full = funcol.all_gather_single(x, 1, group)
        return full.reshape(-1, 8) @ w.t(), full  # the gathered tensor is also an output

    gm = _traced(fn, (2, 4, 8), (6, 8))
    ctx = _run(gm, mode="per_peer")
    assert ctx.stats["decompose"]["all_gather_matmul: per_peer"] == 1
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0][1].target == aten.cat.default
    reorder_pass(gm, ctx)
    verify_pass(gm, ctx)


def test_decisions_are_deterministic() -> None:
    def once() -> list[str]:
        gm = _traced(_row_out, (2, 8, 8), (8, 8), world=4, rank=3)
        _run(gm, world=4, rank=3, mode="auto")
        return [n.format_node() for n in gm.graph.nodes]

    assert once() == once()


# ------------------------------------------------------------------------------ gloo ranks


def _decompose_stats(dump_dir: str, rank: int) -> dict[str, int]:
    total: dict[str, int] = {}
    for path in sorted((Path(dump_dir) / f"rank{rank}").glob("*/summary.json")):
        for k, v in json.loads(path.read_text())["stats"].get("decompose", {}).items():
            total[k] = total.get(k, 0) + v
    return total


def _measured_records(dump_dir: str, rank: int) -> dict[str, float]:
    """The decompose pass's measured candidate times, by graph and record name."""
    return {
        f"{path.parent.name}/{k}": v
        for path in sorted((Path(dump_dir) / f"rank{rank}").glob("*/summary.json"))
        for k, v in json.loads(path.read_text())["records"].get("decompose", {}).items()
        if k.endswith("_measured_s")
    }


def _standalone(
    rank: int,
    world_size: int,
    cases: list[tuple],
    mode: str,
    codegen: str,
    pieces: int = 1,
    options: dict | None = None,
    read=_decompose_stats,
) -> dict:
    """Per case: all-gather->2 matmuls, matmul->reduce-scatter and matmul->all-reduce, compiled vs
    eager, fwd + bwd; what ``read`` reads from the dumps (the decompose pass's stats)."""
    import dhelix_compile

    with tempfile.TemporaryDirectory() as dump_dir:
        backend = dhelix_compile.backend(
            codegen=codegen,
            fallback="error",
            dump_dir=dump_dir,
            decompose=mode,
            decompose_max_chunks=2,
            decompose_pieces=pieces,
            **(options or {}),
        )
        for seed, case in enumerate(cases):
            _check_case(rank, world_size, backend, seed, case)
        return read(dump_dir, rank)


def _check_case(rank: int, n: int, backend, seed: int, case: tuple) -> None:
    b, s, k, n_out, dim = case
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(n_out, k, generator=gen), torch.randn(n_out, k, generator=gen)
    xs = [torch.randn(b, s, k, generator=gen) for _ in range(n)]
    rs_shape = (b * n, s, k) if dim == 0 else (b, s * n, k)
    hs = [torch.randn(rs_shape, generator=gen) for _ in range(n)]
    probe_ag = torch.randn(b * s * n, n_out, generator=gen)
    probe_rs = torch.randn(b, s, n_out, generator=gen)
    per_row_bias = torch.randn(rs_shape[0] * rs_shape[1], n_out, generator=gen)

    def ag(x, w1, w2):
        flat = funcol.all_gather_single(x, dim, group).reshape(-1, k)
        return flat @ w1.t(), torch.nn.functional.linear(flat, w2, w2[:, 0])

    def rs(h, w):
        flat = h.reshape(-1, k)
        y = flat @ w.t() if seed % 2 == 0 else torch.addmm(per_row_bias, flat, w.t())  # bias per row
        return funcol.reduce_scatter_single(y.reshape(*h.shape[:-1], n_out), "sum", dim, group)

    def ar(h, w):
        flat = h.reshape(-1, k)
        y = flat @ w.t() if seed % 2 == 0 else torch.addmm(per_row_bias, flat, w.t())  # bias per row
        return funcol.all_reduce(y.reshape(*h.shape[:-1], n_out), "sum", group)

    def loss_ag(o):
        return (o[0] * probe_ag).sum() + (o[1] * probe_ag).sum()

    def loss_rs(o):
        return (o * probe_rs).sum()

    probe_ar = torch.randn(*rs_shape[:-1], n_out, generator=gen)
    cases = (
        (ag, (xs[rank], w1, w2), loss_ag),
        (rs, (hs[rank], w1), loss_rs),
        (ar, (hs[rank], w1), lambda o: (o * probe_ar).sum()),
    )
    for fn, args, loss in cases:
        results = []
        for run in (fn, torch.compile(fn, backend=backend)):
            leaves = [a.clone().requires_grad_() for a in args]
            out = run(*leaves)
            loss(out).backward()
            outs = out if isinstance(out, tuple) else (out,)
            results.append([o.detach() for o in outs] + [a.grad for a in leaves])
        for i, (want, got) in enumerate(zip(*results, strict=True)):
            where = f"{fn.__name__} {case} #{i}"
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, where=where: f"{where}: {m}")
        torch._dynamo.reset()


def _assert_rewrote(stats: dict[str, int], mode: str, cases: int) -> None:
    """Forward and backward sites were rewritten (chunked leaves weight-gradient all-gathers alone)."""

    def done(pattern: str) -> int:
        return sum(v for k, v in stats.items() if k.startswith(f"{pattern}: ") and _rewrite(k) is not None)

    assert done("all_gather_matmul") >= (2 if mode == "per_peer" else 1) * cases, stats
    assert done("matmul_reduce_scatter") >= 2 * cases, stats
    assert done("matmul_all_reduce") >= cases, stats
    assert not any(_per_peer_choice(k) for k in stats) or mode == "per_peer", stats


def _rewrite(code: str) -> str | None:
    """The variant of a rewrite's code ``"<pattern>: <variant>"`` (``per_peer``, ``per_peer_<P>``,
    ``chunked_<k>``); None for every other code (skips, kept, not matched)."""
    parts = code.split(": ")
    return parts[1] if len(parts) == 2 and re.fullmatch(r"per_peer(_\d+)?|chunked_\d+", parts[1]) else None


def _per_peer_choice(code: str) -> bool:
    """``"<pattern>: per_peer"`` or ``"<pattern>: per_peer_<P>"`` (a rewrite, not a skip)."""
    return (_rewrite(code) or "").startswith("per_peer")


def per_peer_sites(stats: dict[str, int], pattern: str) -> int:
    """Sites of ``pattern`` rewritten per peer, in any number of pieces (the backend's default
    lets measurements pick them, so which one is timing's choice)."""
    return sum(v for k, v in stats.items() if k.startswith(f"{pattern}: ") and _per_peer_choice(k))


# Cases (b, s, k, n_out, dim): the batch, the sequence per rank, the contraction dim, the matmul
# outputs, the gather / scatter dim. A list runs in one set of processes, case i with seed i: the
# reduce-scatter and all-reduce matmuls of an odd seed are addmm with a bias per row.


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("mode", "cases"),
    [
        pytest.param(
            "per_peer", [(1, 2, 2, 2, 0)], id="per_peer-batch"
        ),  # the smallest shapes, gathered along the batch
        pytest.param("chunked", [(2, 4, 6, 4, 1)], id="chunked-sequence"),  # k = 2 chunks along the sequence
    ],
)
def test_standalone_decomposed_equals_undecomposed_on_2_ranks(mode, cases) -> None:
    for stats in run_on_ranks(_standalone, 2, cases, mode, "eager", timeout_s=240):
        _assert_rewrote(stats, mode, len(cases))


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "cases", [[(1, 4, 5, 6, 1), (1, 2, 3, 2, 0)]], ids=["sequence-and-batch"]
)  # the batch case with a per-row bias
@pytest.mark.full  # the 2-rank standalone tests above run in the default suite
def test_standalone_per_peer_equals_undecomposed_on_4_ranks(cases) -> None:
    for stats in run_on_ranks(_standalone, 4, cases, "per_peer", "eager", timeout_s=240):
        _assert_rewrote(stats, "per_peer", len(cases))


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world_size", "cases"),
    [  # b and s even: every site splits into 2 pieces per peer
        pytest.param(
            2, [(2, 4, 5, 6, 1), (2, 2, 3, 2, 0)], id="2-sequence-and-batch"
        ),  # the batch case with a per-row bias
        pytest.param(  # one row per piece
            4, [(2, 2, 7, 4, 1)], id="4-sequence", marks=pytest.mark.full
        ),
    ],
)
def test_per_peer_in_pieces_equals_undecomposed(world_size, cases) -> None:
    for stats in run_on_ranks(_standalone, world_size, cases, "per_peer", "eager", 2, timeout_s=240):
        _assert_rewrote(stats, "per_peer", len(cases))
        assert all(k.endswith("per_peer_2") for k in stats if _per_peer_choice(k)), stats


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_profiled_cost_model_measures_the_variants_on_every_rank(tmp_path: Path) -> None:
    # every rank measures the same new ops (agreed), picks the same variants, and stays exact
    options = {"cost_model": "profile", "cache_dir": str(tmp_path)}
    for stats in run_on_ranks(_standalone, 2, [(2, 4, 8, 6, 1)], "per_peer", "eager", 0, options, timeout_s=240):
        _assert_rewrote(stats, "per_peer", 1)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_auto_runs_the_candidates_on_the_live_group_and_the_ranks_agree(tmp_path: Path) -> None:
    # the original and per-peer in 1, 2 and 4 pieces, run with their dataflow on gloo; numerics exact
    options = {"cost_model": "profile", "cache_dir": str(tmp_path)}
    per_rank = run_on_ranks(
        _standalone, 2, [(2, 4, 8, 6, 1)], "auto", "eager", 0, options, _measured_records, timeout_s=240
    )
    measured = per_rank[0]
    sites = {k.rsplit("_original_measured_s", 1)[0] for k in measured if k.endswith("_original_measured_s")}
    assert len(sites) >= 3, measured  # all-gather, reduce-scatter and all-reduce sites, forward and backward
    assert all(v > 0 for v in measured.values()), measured
    assert per_rank[1] == measured  # agreed: every rank chose from the same numbers


def _tp_sp(
    rank: int,
    world_size: int,
    mode: str,
    codegen: str,
    kind: str = "tp_sp",
    tp_mesh: tuple | None = None,
    oracle: str = "reference",
    **options,
) -> dict[str, int]:
    """The ``kind`` model compiled with ``decompose=mode`` against the single-process reference,
    or (``oracle="eager"``) against itself run eagerly on the same mesh; the decompose stats."""
    import dhelix_compile
    from dhelix_compile.testing.checks import CheckConfig, check_against_eager, check_against_reference

    with tempfile.TemporaryDirectory() as dump_dir:
        backend = dhelix_compile.backend(
            codegen=codegen, fallback="error", dump_dir=dump_dir, decompose=mode, decompose_max_chunks=2, **options
        )
        check = check_against_eager if oracle == "eager" else check_against_reference
        check(rank, world_size, kind, backend, CheckConfig(tp_mesh=tp_mesh))
        return _decompose_stats(dump_dir, rank)


#: DHELIX_TEST_FULL=1 adds Inductor codegen (a minute on a 2-core machine).
_TP_SP_CASES = [(2, "eager")] + ([(2, "inductor")] if _FULL else [])  # 4 ranks: the permuted-mesh test below


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world_size", "codegen"), _TP_SP_CASES)
def test_tp_sp_reference_model_with_per_peer_decomposition(world_size: int, codegen: str) -> None:
    for stats in run_on_ranks(_tp_sp, world_size, "per_peer", codegen, timeout_s=540):
        # every block's attention and MLP, forward and backward (2 layers)
        assert per_peer_sites(stats, "all_gather_matmul") >= 8, stats
        assert per_peer_sites(stats, "matmul_reduce_scatter") >= 8, stats


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["per_peer", pytest.param("chunked", marks=pytest.mark.full)])
def test_tp_reference_model_with_decomposed_all_reduces(mode: str) -> None:
    """Megatron TP (no SP): every matmul -> all-reduce site rewritten, results as undecomposed."""
    for stats in run_on_ranks(_tp_sp, 2, mode, "eager", "tp", timeout_s=540):
        done = sum(v for k, v in stats.items() if k.startswith("matmul_all_reduce: ") and _rewrite(k) is not None)
        assert done >= 4, stats  # attention and MLP outputs of both layers, at least


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("world_size", "kind", "tp_mesh"),
    [
        (2, "tp", (1, 0)),
        pytest.param(4, "tp_sp", ((3, 2), (1, 0)), marks=pytest.mark.full),
    ],
)
def test_per_peer_peers_are_group_ranks_on_a_mesh_listed_out_of_order(world_size: int, kind: str, tp_mesh) -> None:
    """A peer is a rank of the collective's process group (``resolve_group_rank``), never a mesh
    coordinate: on ``[1, 0]`` rank 0 is at ``get_coordinate()`` 1 but first in the group, where
    torch's collectives put its tile. The compiled model, every site per peer, equals the same
    model run eagerly on the same mesh (output, loss, local parameters and gradients): torch's
    eager DTensor TP is the oracle there, not the single-process reference, which torch 2.13
    itself does not reproduce on such a mesh (its ``Replicate() -> Shard()`` cuts at
    ``get_coordinate()``). With DHELIX_TEST_FULL=1, TP+SP over the ``tp`` dim of
    ``[[3, 2], [1, 0]]``: groups ``{2, 3}`` and ``{0, 1}``, where rank 3's group rank (1) is
    neither its global rank nor its coordinate (0)."""
    for stats in run_on_ranks(_tp_sp, world_size, "per_peer", "eager", kind, tp_mesh, "eager", timeout_s=540):
        patterns = ("matmul_all_reduce",) if kind == "tp" else ("all_gather_matmul", "matmul_reduce_scatter")
        for pattern in patterns:
            assert per_peer_sites(stats, pattern) >= 4, stats


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("world_size", "codegen"),
    [
        (2, "eager"),
        pytest.param(4, "eager", marks=pytest.mark.full),
        pytest.param(2, "inductor", marks=[pytest.mark.inductor, pytest.mark.full]),
    ],
)
def test_moe_reference_model_with_per_peer_all_to_alls(world_size: int, codegen: str) -> None:
    """Expert parallelism: the all-to-alls feeding the experts' bmm (the forward's dispatch, the
    backward's gradient of the combine) and those sending a bmm's output (the forward's combine,
    the backward's gradient of the dispatch) rewritten per peer, results as the single-process
    reference. A dispatch and its combine may go as one chain instead (``all_to_all_chain``), as
    measured times choose."""
    for stats in run_on_ranks(_tp_sp, world_size, "per_peer", codegen, "moe", timeout_s=540):
        chains = per_peer_sites(stats, "all_to_all_chain")
        assert chains + per_peer_sites(stats, "all_to_all_compute") >= 2, stats
        assert chains + per_peer_sites(stats, "bmm_all_to_all") >= 2, stats


@pytest.mark.multirank
@pytest.mark.inductor
@pytest.mark.timeout(600)
def test_per_peer_through_inductor_codegen() -> None:
    for stats in run_on_ranks(_standalone, 2, [(2, 4, 8, 6, 1)], "per_peer", "inductor", timeout_s=500):
        _assert_rewrote(stats, "per_peer", 1)


def test_backward_sites_with_weight_gradients_and_summed_gradients_are_rewritten() -> None:
    from tests.test_collective_matches import _swiglu_backward_graph

    gm = _swiglu_backward_graph()
    ctx = _run(gm, mode="per_peer")
    assert ctx.stats["decompose"]["all_gather_matmul: per_peer"] == 1
    assert ctx.stats["decompose"]["matmul_reduce_scatter: per_peer"] == 1
    assert not any(
        n.target in (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default) for n in gm.graph.nodes
    )
    reorder_pass(gm, ctx)
    verify_pass(gm, ctx)


def _exchanges(rank: int, world_size: int) -> list[float]:
    """Three exchanges of one ring step; the work registry must be empty after their waits."""
    group = dist.group.WORLD.group_name
    registry = torch._C._distributed_c10d._get_work_registry_size
    seen = []
    for i in range(3):
        done, received = P2P_EXCHANGE(
            torch.full((4096,), float(rank + i)), (rank + 1) % world_size, (rank - 1) % world_size, 7, group
        )
        c10d.wait_tensor(done)
        c10d.wait_tensor(received)
        seen += [float(received[0]), float(registry())]
    return seen


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_exchange_leaves_no_stale_work_registration(world_size: int) -> None:
    """``batch_p2p_ops`` leaves its send input registered, and Inductor's buffer reuse then hangs a
    later ``wait_tensor`` (seen on the TP+SP backward); ``dhelix::exchange`` registers only its outputs.
    On 4 ranks the peer sent to and the peer received from differ (gloo sends it as an all-to-all
    with one non-empty split each way)."""
    for rank, seen in enumerate(run_on_ranks(_exchanges, world_size, timeout_s=60)):
        sender = (rank - 1) % world_size
        assert seen == [float(sender + i) if j == 0 else 0.0 for i in range(3) for j in (0, 1)]


def test_pass_runs_after_annotate_before_reorder_and_the_backend_decides_per_site() -> None:
    from dhelix_compile.config import DHelixConfig
    from dhelix_compile.pass_options import pass_options
    from graph_passes.pass_list import pass_names

    names = pass_names()
    assert names.index("annotate") < names.index("decompose") < names.index("reorder")
    # the backend's default and the options' own: per site, and pieces per site too
    assert pass_options(DHelixConfig())["decompose"] == DecomposeOptions() == DecomposeOptions(mode="auto", pieces=0)
    forced = pass_options(DHelixConfig.from_options({"decompose": "chunked", "decompose_max_chunks": 3}))["decompose"]
    assert forced == DecomposeOptions(mode="chunked", max_chunks=3, pieces=0)
    pieces = pass_options(DHelixConfig.from_options({"decompose": "per_peer", "decompose_pieces": 2}))["decompose"]
    assert pieces == DecomposeOptions(mode="per_peer", pieces=2)
    from dhelix_compile.config import ConfigError
    from graph_passes.decompose import MAX_PIECES

    DHelixConfig.from_options({"decompose_pieces": MAX_PIECES})
    with pytest.raises(ConfigError, match="decompose_pieces"):
        DHelixConfig.from_options({"decompose_pieces": MAX_PIECES + 1})
    with pytest.raises(ValueError, match="decompose mode"):
        DecomposeOptions(mode="sometimes").validate()  # type: ignore[arg-type]  # an unknown mode, on purpose


def test_rewritten_graph_is_annotated_again() -> None:
    gm = _traced(_row_out, (2, 8, 8), (8, 8))
    ctx = PassContext(
        "test", "bwd", estimator=SLOW_LINK, pass_options={"decompose": DecomposeOptions(mode="per_peer", pieces=1)}
    )
    annotate_pass(gm, ctx)
    with fake_world(2):
        decompose_pass(gm, ctx)
    metas = [n.meta.get("dhelix") for n in gm.graph.nodes]
    assert all(m is not None and m["phase"] == "bwd" for m in metas)
    ids = [n.meta["dhelix"]["comm_id"] for n in gm.graph.nodes if n.target == P2P_EXCHANGE]
    assert ids == list(range(len(ids))) and ids
    assert ctx.stats["annotate"]["p2p"] == 0  # the re-annotation counts into a scratch context
