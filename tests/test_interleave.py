"""merge_strands and the interleave pass: the merged graph's contract, the DP, the emitted order."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model import compile_clock
from cost_model.estimator import TableEstimator
from cost_model.simulator import simulate
from cost_model.strand_plan import (
    Segment,
    formula_cost,
    path_peak_bytes,
    path_time,
    plan_pairs,
    plan_timed,
    refine_path,
    usable_pairs,
)
from cost_model.testing import aot_partitions, fake_world, trace_aten
from graph_passes import PassContext
from graph_passes.annotate import annotate_pass
from graph_passes.interleave import InterleaveOptions, emit, interleave_pass, strand_segments
from graph_passes.merge_strands import BWD_STRAND, FWD_STRAND, merge_strands
from graph_passes.verify import verify_pass

aten = torch.ops.aten


def _mlp_loss(w1, w2, x):
    return (torch.relu(x @ w1) @ w2).square().mean()


def test_merged_graph_computes_both_strands_and_shares_parameters() -> None:
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(8, 16, generator=gen, requires_grad=True)
    w2 = torch.randn(16, 4, generator=gen, requires_grad=True)
    x0, x1 = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    fwd, bwd = aot_partitions(_mlp_loss, w1, w2, x0)
    merged = merge_strands(fwd, bwd, shared_fwd_inputs=[0, 1])

    # B's saved weights read F's placeholders; the saved data input (x) does not
    bwd_names = [n.name for n in bwd.graph.nodes if n.op == "placeholder"]
    shared = [name for name, keep in zip(bwd_names, merged.bwd_input_keep) if not keep]
    assert shared and all(name in ("primals_1", "primals_2") for name in shared)
    assert "primals_3" not in shared or "primals_3" not in bwd_names

    # strands and phases are tagged; F's nodes come first
    body = [n for n in merged.gm.graph.nodes if n.op not in ("placeholder", "output")]
    strands = [n.meta["dhelix"]["strand"] for n in body]
    assert strands == sorted(strands) and set(strands) == {FWD_STRAND, BWD_STRAND}
    assert all(
        n.meta["dhelix"]["phase"] == ("fwd" if n.meta["dhelix"]["strand"] == FWD_STRAND else "bwd") for n in body
    )

    # numerics: M(fwd args of micro-batch 1, bwd args of micro-batch 0) == (F(1), B(0))
    with torch.no_grad():
        fwd_args0 = [w1.detach(), w2.detach(), x0]
        fwd_out0 = list(fwd(*fwd_args0))
        n_saved = len(bwd_names) - 1
        bwd_args0 = [*fwd_out0[-n_saved:], torch.tensor(1.0)]
        fwd_args1 = [w1.detach(), w2.detach(), x1]
        got = merged.gm(*merged.merged_args(fwd_args1, bwd_args0))
        want = [*fwd(*fwd_args1), *bwd(*bwd_args0)]
    assert len(got) == len(want) and merged.num_fwd_outputs == len(fwd_out0)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)

    # a position in either strand's argument list maps to where merged_args puts that argument
    fwd_positions, bwd_positions = [2], list(range(len(bwd_names)))
    merged_args = merged.merged_args(fwd_args1, bwd_args0)
    positions = merged.merged_positions(fwd_positions, bwd_positions)
    kept = [j for j in bwd_positions if merged.bwd_input_keep[j]]
    assert len(positions) == 1 + len(kept) and len(kept) < len(bwd_positions)  # the shared weights drop out
    assert merged_args[positions[0]] is fwd_args1[2]
    assert all(merged_args[m] is bwd_args0[j] for m, j in zip(positions[1:], kept, strict=True))


def test_merge_rejects_submodules_with_a_clear_message() -> None:
    traced = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="only call_function"):
        merge_strands(traced, traced)


# ---------------------------------------------------------------------- the DP


def _seg(strand: int, compute_s: float, comm_s: float, live: int = 0, peak: int = 0) -> Segment:
    return Segment(strand, (), compute_s, comm_s, live, peak)


def _path_is_valid(path, a: int, b: int) -> bool:
    fs = [i for i, _ in path if i is not None]
    bs = [j for _, j in path if j is not None]
    return fs == list(range(a)) and bs == list(range(b))


def test_dp_pairs_each_strands_communication_with_the_others_compute() -> None:
    fwd = [_seg(0, 1.0, 1.0) for _ in range(3)]
    bwd = [_seg(1, 1.0, 1.0) for _ in range(3)]
    path, cost = plan_pairs(fwd, bwd)
    assert _path_is_valid(path, 3, 3)
    assert path == [(0, 0), (1, 1), (2, 2)]
    assert cost == pytest.approx(3 * 2.0)  # each pair: max(1 + 1, 1 + 1), instead of 2 + 2 alone


def test_dp_keeps_segments_apart_when_pairing_does_not_pay() -> None:
    # compute-free segments: pairing queues both transfers on the one channel, no gain either way
    fwd = [_seg(0, 0.0, 1.0)]
    bwd = [_seg(1, 5.0, 0.0)]
    path, cost = plan_pairs(fwd, bwd)
    assert cost == pytest.approx(5.0)  # F's transfer hides under B's compute
    assert path == [(0, 0)]


def test_memory_budget_forbids_pairs_that_keep_both_strands_live() -> None:
    fwd = [_seg(0, 1.0, 1.0, live=10, peak=10) for _ in range(2)]
    bwd = [_seg(1, 1.0, 1.0, live=0, peak=20) for _ in range(2)]
    free_path, free_cost = plan_pairs(fwd, bwd, bwd_base_bytes=20)
    assert free_path == [(0, 0), (1, 1)]
    # pairing B_1 with F_1 would hold F_0's 10 bytes during B_1's peak of 20: over a budget of 20
    tight_path, tight_cost = plan_pairs(fwd, bwd, bwd_base_bytes=20, budget_bytes=20)
    assert tight_path == [(None, 0), (0, 1), (1, None)] and tight_cost > free_cost
    # nothing fits: the sequential order (all of B, then all of F)
    none_path, _ = plan_pairs(fwd, bwd, bwd_base_bytes=20, budget_bytes=5)
    assert none_path == [(None, 0), (None, 1), (0, None), (1, None)]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=4),
)
def test_dp_finds_the_cheapest_alignment(f_costs, b_costs) -> None:
    fwd = [_seg(0, float(c), float(x)) for c, x in f_costs]
    bwd = [_seg(1, float(c), float(x)) for c, x in b_costs]
    path, cost = plan_pairs(fwd, bwd)
    assert _path_is_valid(path, len(fwd), len(bwd))
    price = formula_cost(fwd, bwd)
    assert cost == pytest.approx(math.fsum(price(*p) for p in path))
    assert cost <= _brute_force(price, len(fwd), len(bwd)) + 1e-9


def test_usable_pairs_leave_out_moves_over_the_budget_and_the_states_they_strand() -> None:
    """The budget example above (a budget of 20 bytes): F_0 cannot run first, and from state
    (1, 1) no move within the budget reaches the end, so pairs (0, 0), (1, 0) and (1, 1) are
    never read; the sequential fallback's pairs always stay."""
    fwd = [_seg(0, 1.0, 1.0, live=10, peak=10) for _ in range(2)]
    bwd = [_seg(1, 1.0, 1.0, live=0, peak=20) for _ in range(2)]
    assert len(usable_pairs(fwd, bwd, bwd_base_bytes=20)) == 8  # unbounded: every pair
    tight = usable_pairs(fwd, bwd, bwd_base_bytes=20, budget_bytes=20)
    assert tight == [(None, 0), (None, 1), (0, None), (0, 1), (1, None)]
    none_fit = usable_pairs(fwd, bwd, bwd_base_bytes=20, budget_bytes=5)
    assert none_fit == [(None, 0), (None, 1), (0, None), (1, None)]  # the sequential path's, in (i, j) order


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 6), st.integers(0, 9)), min_size=1, max_size=5
    ),
    st.lists(
        st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 6), st.integers(0, 9)), min_size=1, max_size=5
    ),
    st.integers(0, 30),
    st.integers(0, 8),
)
def test_the_dp_reads_nothing_but_usable_pairs(f_specs, b_specs, budget, bwd_base) -> None:
    """Whatever ``P`` says of the pairs ``usable_pairs`` leaves out, ``plan_pairs`` returns the
    same path and time: measuring the usable pairs alone plans what measuring all of them does."""
    fwd = [_seg(0, float(c), float(x), live, live + extra) for c, x, live, extra in f_specs]
    bwd = [_seg(1, float(c), float(x), live, live + extra) for c, x, live, extra in b_specs]
    price = formula_cost(fwd, bwd, 1.3)
    usable = set(usable_pairs(fwd, bwd, budget_bytes=budget, bwd_base_bytes=bwd_base))
    for garbage in (0.0, 1e6):

        def scrambled(i, j, garbage=garbage):
            return price(i, j) if (i, j) in usable else garbage

        assert plan_pairs(fwd, bwd, cost=scrambled, budget_bytes=budget, bwd_base_bytes=bwd_base) == plan_pairs(
            fwd, bwd, cost=price, budget_bytes=budget, bwd_base_bytes=bwd_base
        )


def _brute_force(price, a: int, b: int) -> float:
    """The cheapest of all monotone alignments (moves: F alone, B alone, both)."""
    best = math.inf
    for moves in itertools.product("FBP", repeat=a + b):
        i = j = 0
        total = 0.0
        for m in moves:
            if i == a and j == b:
                break
            if m == "F" and i < a:
                total += price(i, None)
                i += 1
            elif m == "B" and j < b:
                total += price(None, j)
                j += 1
            elif m == "P" and i < a and j < b:
                total += price(i, j)
                i, j = i + 1, j + 1
            else:
                total = math.inf
                break
        if i == a and j == b:
            best = min(best, total)
    return best


def test_refinement_sees_a_transfer_the_additive_pair_costs_leave_at_the_end() -> None:
    # F_1's transfer runs after both strands' compute in the DP's pair (1, 1); the pair costs
    # (max(4 + 4, 4 + 0) = 8) do not see it, the whole-path simulation does
    fwd = [_seg(0, 0.0, 0.0), _seg(0, 4.0, 4.0)]
    bwd = [_seg(1, 0.0, 2.0), _seg(1, 4.0, 0.0)]
    path, _ = plan_pairs(fwd, bwd)
    assert path == [(0, 0), (1, 1)] and path_time(path, fwd, bwd) == pytest.approx(14.0)
    refined, refined_s = refine_path(path, fwd, bwd)
    assert refined == [(0, 0), (1, None), (None, 1)]  # F_1 issues its transfer, then B_1 computes under it
    assert refined_s == pytest.approx(8.0) == path_time(refined, fwd, bwd)


def test_path_time_counts_lead_compute_before_a_wait() -> None:
    fwd = [_seg(0, 1.0, 0.0)]
    waits_first = [_seg(1, 0.0, 3.0), Segment(1, (), 2.0, 0.0, 0, 0, lead_s=0.0, waits=True)]
    lead_first = [_seg(1, 0.0, 3.0), Segment(1, (), 2.0, 0.0, 0, 0, lead_s=2.0, waits=True)]
    no_wait = [_seg(1, 0.0, 3.0), Segment(1, (), 2.0, 0.0, 0, 0, waits=False)]
    path = [(None, 0), (None, 1), (0, None)]
    assert path_time(path, fwd, waits_first) == pytest.approx(3.0 + 2.0 + 1.0)
    assert path_time(path, fwd, lead_first) == pytest.approx(3.0 + 1.0)  # 2 s of it under the transfer
    assert path_time(path, fwd, no_wait) == pytest.approx(3.0)
    # twice as slow under the transfer: its 3 s do 1.5 s of the lead's work, 0.5 s after it, then F's 1 s
    assert path_time(path, fwd, lead_first, contention_factor=2.0) == pytest.approx(3.0 + 0.5 + 1.0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=5),
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=5),
    st.sampled_from([1.0, 1.5]),
    st.sampled_from([math.inf, 6]),
)
def test_refinement_never_worsens_keeps_both_orders_and_the_budget(f_costs, b_costs, factor, budget) -> None:
    fwd = [_seg(0, float(c), float(x), live=m, peak=m + 1) for c, x, m in f_costs]
    bwd = [_seg(1, float(c), float(x), live=m, peak=m + 1) for c, x, m in b_costs]
    path, _ = plan_pairs(fwd, bwd, budget_bytes=budget)
    before = path_time(path, fwd, bwd, factor)
    refined, refined_s = refine_path(path, fwd, bwd, contention_factor=factor, budget_bytes=budget)
    assert _path_is_valid(refined, len(fwd), len(bwd))
    assert refined_s <= before + 1e-9 and refined_s == pytest.approx(path_time(refined, fwd, bwd, factor))
    if path_peak_bytes(path, fwd, bwd) <= budget:
        assert path_peak_bytes(refined, fwd, bwd) <= budget
    compute = sum(s.compute_s for s in fwd + bwd)
    comm = sum(s.comm_s for s in fwd + bwd)
    assert max(compute, comm) - 1e-9 <= refined_s <= compute * factor + comm + 1e-9


def test_the_timed_dp_hides_a_long_last_transfer_under_several_backward_segments() -> None:
    """A forward that ends in a long transfer (HF Llama TP+SP's logits gather) and then computes
    on it: the additive DP pairs that transfer with one short backward segment and leaves most
    of it exposed; the timed DP finishes the forward's compute first and runs the backward
    under the transfer."""
    fwd = [_seg(0, 2.0, 1.0), _seg(0, 2.0, 12.0), _seg(0, 3.0, 0.0)]
    bwd = [_seg(1, 4.0, 0.0) for _ in range(4)]
    additive, _ = plan_pairs(fwd, bwd)
    timed, timed_s = plan_timed(fwd, bwd)
    assert _path_is_valid(timed, len(fwd), len(bwd))
    assert timed_s == pytest.approx(path_time(timed, fwd, bwd))
    assert timed_s < path_time(additive, fwd, bwd) - 1.0
    compute = sum(s.compute_s for s in fwd + bwd)
    assert timed_s == pytest.approx(compute)  # F_0, B_0 under its transfer, F_1, then B_1..B_3 under the gather, F_2


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=4),
    st.sampled_from([1.0, 1.5]),
    st.sampled_from([math.inf, 6]),
)
def test_the_timed_dp_finds_the_path_of_least_path_time(f_costs, b_costs, factor, budget) -> None:
    """Against every path of small instances, within the memory budget."""
    fwd = [_seg(0, float(c), float(x), live=m, peak=m + 1) for c, x, m in f_costs]
    bwd = [_seg(1, float(c), float(x), live=m, peak=m + 1) for c, x, m in b_costs]
    path, path_s = plan_timed(fwd, bwd, contention_factor=factor, budget_bytes=budget, width=64)
    assert _path_is_valid(path, len(fwd), len(bwd))
    assert path_s == pytest.approx(path_time(path, fwd, bwd, factor))
    fitting = [p for p in _all_paths(len(fwd), len(bwd)) if path_peak_bytes(p, fwd, bwd) <= budget]
    if fitting:
        assert path_peak_bytes(path, fwd, bwd) <= budget
        assert path_s <= min(path_time(p, fwd, bwd, factor) for p in fitting) + 1e-9
    narrow, narrow_s = plan_timed(fwd, bwd, contention_factor=factor, budget_bytes=budget)  # the default width
    assert _path_is_valid(narrow, len(fwd), len(bwd)) and narrow_s >= path_s - 1e-9


def _all_paths(a: int, b: int, i: int = 0, j: int = 0) -> list[list[tuple[int | None, int | None]]]:
    if i == a and j == b:
        return [[]]
    out: list[list[tuple[int | None, int | None]]] = []
    if i < a:
        out += [[(i, None), *rest] for rest in _all_paths(a, b, i + 1, j)]
    if j < b:
        out += [[(None, j), *rest] for rest in _all_paths(a, b, i, j + 1)]
    if i < a and j < b:
        out += [[(i, j), *rest] for rest in _all_paths(a, b, i + 1, j + 1)]
    return out


# ---------------------------------------------------------------------- the pass


def _tp_layers(x, w):
    """all_gather -> mm -> reduce_scatter, twice: a strand with two transfers per layer."""
    group = torch.distributed.group.WORLD
    for _ in range(2):
        gathered = funcol.all_gather_tensor(x, 0, group)
        x = funcol.reduce_scatter_tensor(torch.relu(gathered @ w), "sum", 0, group)
    return (x,)


def _traced_tp_layers() -> torch.fx.GraphModule:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with fake_world(2), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return trace_aten(_tp_layers, x, w)


def _merged_tp_graph() -> torch.fx.GraphModule:
    return merge_strands(_traced_tp_layers(), _traced_tp_layers()).gm


def _strand_orders(gm: torch.fx.GraphModule) -> dict[int, list[str]]:
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return {s: [n.name for n in body if n.meta["dhelix"]["strand"] == s] for s in (FWD_STRAND, BWD_STRAND)}


def _ctx(
    estimator,
    memory_budget_ratio: float = 1.15,
    timed_width: int = 0,
    slice_ratio: float = 0.5,
    measure_pairs: bool = False,
) -> PassContext:
    options = {
        "interleave": InterleaveOptions(
            memory_budget_ratio=memory_budget_ratio,
            timed_width=timed_width,
            slice_ratio=slice_ratio,
            measure_pairs=measure_pairs,
        )
    }
    return PassContext(graph_name="merged", phase="fwd", estimator=estimator, pass_options=options)


def _interleaved_tp_graph(estimator, **options: float) -> tuple[torch.fx.GraphModule, PassContext]:
    """The merged TP graph through the interleave pass (toy tensors: the overlap costs relatively
    much memory, so the budget is 2x), verified, each strand still in its own order."""
    gm = _merged_tp_graph()
    before = _strand_orders(gm)
    ctx = _ctx(estimator, memory_budget_ratio=2.0, **options)
    gm = interleave_pass(annotate_pass(gm, ctx), ctx)
    verify_pass(gm, ctx)
    assert _strand_orders(gm) == before
    return gm, ctx


@pytest.mark.parametrize("timed_width", [0, 4])
def test_interleave_pass_interleaves_keeping_each_strands_order(timed_width: int) -> None:
    estimator = TableEstimator(kind_times_s={"compute": 1e-3, "collective": 1e-3})
    gm, ctx = _interleaved_tp_graph(estimator, timed_width=timed_width)
    record = ctx.records["interleave"]
    assert ctx.stats["interleave"]["interleaved"] == 1
    assert record["predicted_makespan_s"] < record["predicted_makespan_sequential_s"]
    assert record["paired_segments"] >= 2
    for candidate in ("sequential", "dp", "list"):
        assert record[f"predicted_makespan_{candidate}_s"] >= record["predicted_makespan_s"]
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert simulate(list(gm.graph.nodes), estimator).makespan_s == pytest.approx(record["predicted_makespan_s"])
    strand_changes = sum(
        1 for a, b in itertools.pairwise(body) if a.meta["dhelix"]["strand"] != b.meta["dhelix"]["strand"]
    )
    assert strand_changes >= 3


class _PairMeasuring(TableEstimator):
    """A table estimator that "measures" segment pairs: a fixed time per key, any key asked for
    (``every``: every key, whatever was asked), each call's keys kept."""

    def __init__(self, every: bool) -> None:
        super().__init__(kind_times_s={"compute": 1e-3, "collective": 1e-3})
        self.every, self.asked = every, []

    def segment_pair_times(self, fwd, bwd, pairs=None):
        keys = [(i, j) for i in (None, *range(len(fwd))) for j in (None, *range(len(bwd))) if (i, j) != (None, None)]
        if pairs is not None and not self.every:
            keys = [k for k in keys if k in set(pairs)]
        self.asked.append(keys)
        return {(i, j): 1e-3 * (1 + (3 * (i or 0) + 5 * (j or 0) + (i is None) + 2 * (j is None)) % 4) for i, j in keys}


@pytest.mark.parametrize("memory_budget_ratio", [1.0, 1.15, 2.0])
def test_interleave_pass_plans_alike_from_the_usable_pairs_alone(memory_budget_ratio: float) -> None:
    """The pass asks for the pairs its DP can use (``strand_plan.usable_pairs``), fewer than all
    under a tight budget, and plans the same order as from every pair measured."""
    orders, records, asked = [], [], []
    for every in (False, True):
        estimator = _PairMeasuring(every)
        ctx = _ctx(estimator, memory_budget_ratio=memory_budget_ratio, measure_pairs=True)
        gm = interleave_pass(annotate_pass(_merged_tp_graph(), ctx), ctx)
        orders.append([n.name for n in gm.graph.nodes])
        records.append(
            {
                k: v
                for k, v in ctx.records["interleave"].items()
                if k not in ("measured_pairs", "plan_time_s", "pair_measure_s")
            }
        )
        asked.append(sum(len(keys) for keys in estimator.asked))
    assert orders[0] == orders[1] and records[0] == records[1]
    assert asked[0] <= asked[1]
    if memory_budget_ratio == 1.0:
        assert asked[0] < asked[1]


def test_interleave_pass_prices_pairs_by_the_formula_unless_asked_to_measure() -> None:
    """``measure_pairs`` off (the default): the pass asks the estimator for no pair."""
    estimator = _PairMeasuring(every=False)
    ctx = _ctx(estimator, memory_budget_ratio=2.0)
    interleave_pass(annotate_pass(_merged_tp_graph(), ctx), ctx)
    assert estimator.asked == [] and "measured_pairs" not in ctx.records["interleave"]
    assert ctx.stats["interleave"]["interleaved"] == 1


def test_interleave_pass_keeps_the_memory_budget() -> None:
    # with room (2x, the test above) the list scheduler's order wins; at 1x the sequential
    # order's peak, its extra live bytes rule it out although it is predicted faster
    gm = _merged_tp_graph()
    ctx = _ctx(TableEstimator(kind_times_s={"compute": 1e-3, "collective": 1e-3}), memory_budget_ratio=1.0)
    gm = interleave_pass(annotate_pass(gm, ctx), ctx)
    record, stats = ctx.records["interleave"], ctx.stats["interleave"]
    prefix = "predicted_peak_bytes_"
    candidates = [key[len(prefix) :] for key in record if key.startswith(prefix)]
    over = {c for c in candidates if record[f"{prefix}{c}"] > record[f"{prefix}sequential"]}
    assert over == {c for c in candidates if stats[f"{c} order over the memory budget"]}
    assert all(ctx.notes["interleave"][f"{c} order over the memory budget"] for c in over)
    assert "list" in over and record["predicted_makespan_list_s"] < record["predicted_makespan_sequential_s"]
    chosen = [c for c in candidates if stats[f"interleaved by {c}"]] or ["sequential"]
    assert len(chosen) == 1 and chosen[0] not in over
    assert record["predicted_makespan_s"] == record[f"predicted_makespan_{chosen[0]}_s"]


def test_interleave_pass_falls_back_to_backward_then_forward() -> None:
    gm = _merged_tp_graph()
    ctx = _ctx(None)
    gm = interleave_pass(annotate_pass(gm, ctx), ctx)
    strands = [n.meta["dhelix"]["strand"] for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert strands == sorted(strands, reverse=True)  # all of B, then all of F
    assert ctx.stats["interleave"]["sequential: no estimator"] == 1


def test_the_strand_plans_search_counts_as_the_plan_phase_not_the_passes() -> None:
    before = compile_clock.totals()
    ctx = _ctx(None)
    with compile_clock.phase("passes"):  # as the pipeline runs it
        interleave_pass(annotate_pass(_merged_tp_graph(), ctx), ctx)
    assert compile_clock.since(before)["plan"] == 0.0, "the sequential order is no search"
    before = compile_clock.totals()
    ctx = _ctx(TableEstimator(kind_times_s={"compute": 1e-3, "collective": 1e-3}), memory_budget_ratio=2.0)
    with compile_clock.phase("passes"):
        interleave_pass(annotate_pass(_merged_tp_graph(), ctx), ctx)
    added = compile_clock.since(before)
    assert added["plan"] >= ctx.records["interleave"]["plan_time_s"] > 0
    assert added["passes"] > 0


def test_interleave_pass_leaves_single_strand_graphs_alone() -> None:
    gm = _traced_tp_layers()
    order = [n.name for n in gm.graph.nodes]
    ctx = _ctx(TableEstimator(default_s=1e-3))
    gm = interleave_pass(annotate_pass(gm, ctx), ctx)
    assert [n.name for n in gm.graph.nodes] == order
    assert ctx.stats["interleave"]["skipped: one strand"] == 1


def test_emit_follows_the_path() -> None:
    fwd = [Segment(0, ("f0",), 0, 0, 0, 0), Segment(0, ("f1",), 0, 0, 0, 0)]  # type: ignore[arg-type]  # names for nodes
    bwd = [Segment(1, ("b0",), 0, 0, 0, 0)]  # type: ignore[arg-type]  # emit only reorders them
    assert emit([(0, 0), (1, None)], fwd, bwd) == ["b0", "f0", "f1"]


def test_the_memory_budget_scales_what_an_order_adds_not_the_parameters() -> None:
    """The budget compares the bytes an order holds above the inputs it never frees: a large
    parameter the graph reads (the MoE layer's experts) must not dilute it. Counting the
    parameters, a 1.25 budget lets an order through that adds 78% to the MoE layer's held bytes."""

    def run(padding_bytes: int) -> tuple[dict[str, float], list[str]]:
        gm = _merged_tp_graph()
        if padding_bytes:
            first = next(iter(gm.graph.nodes))
            with gm.graph.inserting_before(first):
                weight = gm.graph.placeholder("f_big_weight")
            weight.meta["val"] = torch.empty(padding_bytes // 4, device="meta")
        ctx = _ctx(TableEstimator(kind_times_s={"compute": 1e-3, "collective": 1e-3}), memory_budget_ratio=1.05)
        interleave_pass(annotate_pass(gm, ctx), ctx)
        record, stats = ctx.records["interleave"], ctx.stats["interleave"]
        peaks = {k: v for k, v in record.items() if k.startswith("predicted_peak_bytes_")}
        over = sorted(k for k in stats if k.endswith("order over the memory budget"))
        return peaks, over

    peaks, over = run(0)
    assert peaks["predicted_peak_bytes_list"] > 1.05 * peaks["predicted_peak_bytes_sequential"]
    assert "list order over the memory budget" in over
    assert run(1 << 30) == (peaks, over)  # a 1 GiB parameter changes nothing


# ---------------------------------------------------------------------- slices


def test_slices_let_a_forward_go_on_inside_the_backwards_long_stretch() -> None:
    """The MoE layer's merged graph at 539 Mbit/s, in segments (ms): the forward dispatches
    (13.2), runs its experts (11.0), combines (13.2); the backward's one all-to-all (13.2) is
    followed by 19 ms of compute that frees its saved activations. Starting the forward first
    (48.3) holds its experts' activations beside all of the backward's saved ones: over the
    budget. Whole segments can only run the experts after the backward's stretch (58.5). Cut
    into slices, the experts go in once their dispatch lands and enough is freed (52.7)."""

    def seg(strand: int, compute: float, comm: float, live: int, peak: int, waits: bool = True) -> Segment:
        return Segment(strand, (), compute, comm, live, peak, lead_s=0.0 if waits else compute, waits=waits)

    fwd = [seg(0, 1.8, 13.2, 1, 1, waits=False), seg(0, 11.0, 13.2, 3, 3), seg(0, 1.1, 0.0, 3, 3)]
    whole = [seg(1, 1.0, 13.2, 10, 10, waits=False), seg(1, 19.0, 0.0, 0, 10)]
    sliced = [
        seg(1, 1.0, 13.2, 10, 10, waits=False),
        seg(1, 6.3, 0.0, 7, 10),
        seg(1, 6.3, 0.0, 4, 7, waits=False),
        seg(1, 6.4, 0.0, 0, 4, waits=False),
    ]
    budget = {"budget_bytes": 12.5, "bwd_base_bytes": 10}  # 1.25 x the sequential order's 10
    free, free_s = plan_timed(fwd, whole, bwd_base_bytes=10, width=64)
    assert free_s == pytest.approx(48.3) and path_peak_bytes(free, fwd, whole, 0, 10) > 12.5
    _, whole_s = plan_timed(fwd, whole, width=64, **budget)
    path, sliced_s = plan_timed(fwd, sliced, width=64, **budget)
    assert whole_s == pytest.approx(58.5) and sliced_s == pytest.approx(52.7)
    assert path_peak_bytes(path, fwd, sliced, 0, 10) <= 12.5
    assert path == [(0, 0), (None, 1), (1, 2), (2, 3)]  # the experts after the first slice


def test_strand_segments_cut_compute_into_slices() -> None:
    """Slices cut where the compute since the last cut reaches ``slice_s``: the strand's nodes
    in order, the same compute and transfers, a slice without a transfer of its own."""
    gm = _traced_tp_layers()
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    estimator = TableEstimator(kind_times_s={"compute": 1e-3, "collective": 4e-3})
    whole = strand_segments(nodes, estimator)
    sliced = strand_segments(nodes, estimator, slice_s=1e-3)
    assert len(sliced) > len(whole)
    for segments in (whole, sliced):
        assert [n for s in segments for n in s.nodes] == nodes
    assert math.fsum(s.compute_s for s in sliced) == pytest.approx(math.fsum(s.compute_s for s in whole))
    assert math.fsum(s.comm_s for s in sliced) == pytest.approx(math.fsum(s.comm_s for s in whole))
    assert all(s.compute_s <= 1e-3 + 1e-12 for s in sliced if s.comm_s == 0.0)
    assert any(s.comm_s == 0.0 and s is not sliced[-1] for s in sliced)


@pytest.mark.parametrize("slice_ratio", [0.0, 0.5])
def test_the_sliced_plan_is_one_more_candidate_the_simulator_judges(slice_ratio: float) -> None:
    estimator = TableEstimator(kind_times_s={"compute": 1e-3, "collective": 1e-3})
    _, ctx = _interleaved_tp_graph(estimator, slice_ratio=slice_ratio)
    record = ctx.records["interleave"]
    assert ("predicted_makespan_dp_sliced_s" in record) == (slice_ratio > 0)
    assert ("slice_s" in record) == (slice_ratio > 0)
    over = ctx.stats["interleave"]
    fits = [
        value
        for key, value in record.items()
        if key.startswith("predicted_makespan_")
        and key != "predicted_makespan_s"
        and not over.get(f"{key[len('predicted_makespan_') : -len('_s')]} order over the memory budget")
    ]
    assert record["predicted_makespan_s"] == min(fits)  # the fastest order within the budget
