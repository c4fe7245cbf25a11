"""interleave: order a merged helix graph by DHelix's Strand Interleaving DP.

A merged graph (``merge_strands``) holds two independent strands: the forward of micro-batch
i+1 (strand 0) and the backward of micro-batch i (strand 1). Any interleaving of the two that
keeps each strand's own order is valid; this pass picks the one where each strand's
communication runs under the other strand's compute.

Contract
    Input: an annotated graph and ``ctx.estimator``. A graph with fewer than two strands is
    left alone; a merged graph without an estimator (nothing to hide: no collectives) gets
    the sequential order below. Output: the same nodes, the forward strand in its own
    order, the backward strand in its own order or with its weight gradients deferred
    (``deferral.defer_off_chain``; a valid order), the strands interleaved segment by segment — or, when the simulator predicts no
    gain or the plan would exceed the memory budget, the *sequential* order: the backward
    strand first, then the forward strand (the eager loop's order, which frees the saved
    activations before new ones are made).
    - Deterministic: a function of the graph and the estimator's numbers (every rank, same plan).
    - Records (``ctx.records["interleave"]``): predicted makespan, exposed communication and
      peak bytes of each candidate order (``predicted_peak_bytes``: the chosen one's, held above
      the inputs the graph never frees), segment counts, pairs, ``plan_time_s`` (segmenting
      and the DP) and, with measured pairs, ``pair_measure_s``.
    - Compile time: the search and the judgement count as ``cost_model.compile_clock``'s ``plan``
      phase (the pairs measured on the live group as its ``profiling``), not as ``passes``.

Algorithm::

    segments(strand): cut the strand's node list right after each collective/P2P issue; a
        segment = compute C, then one transfer X (whose wait opens a later segment)
    P(F_i, ∅) = C_F + X_F          P(∅, B_j) = C_B + X_B        (transfer exposed)
    P(F_i, B_j) = max(C_F + C_B + (f-1)·overlap,  X_F + X_B)   (one channel: the transfers
        queue behind each other; f = contention factor: compute under a transfer runs slower)
        with ``measure_pairs`` and an estimator that measures: P measured by co-executing the
        two segments on the live device and group (``cost_model.profile.pairs``; distinct pairs
        only, agreed by ranks), of the pairs the DP below can use (``strand_plan.usable_pairs``:
        a move within the budget on a path that fits from start to end: HF Llama TP+SP's merged
        graph on 2 gloo ranks asked for 270 of the 358 pairs of its two backward orders)
    T[i][j] = min(T[i-1][j] + P(F_i, ∅), T[i][j-1] + P(∅, B_j), T[i-1][j-1] + P(F_i, B_j))
        a move whose live bytes exceed memory_budget_ratio x the sequential order's peak is
        forbidden (live bytes at a cut = forward's live bytes + backward's, each strand's
        profile from ``cost_model.memory`` with the backward's saved inputs freed at last use)
    emit the path: each pair as B_j's nodes then F_i's nodes (B's transfer flies under F's
        compute, F's under the next pair's B compute)
    defer: for each distance d in ``defer_weight_grads`` (default 1), plan again with a
        backward whose off-chain work -- weight gradients, which no later transfer needs --
        moved d segments later, creating compute where communication needs it (DHelix does
        this by hand); candidate ``dp_defer{d}``
    refine: from each DP path, a local search against a whole-path simulation at segment
        granularity (``strand_plan.refine_path``: split, join or swap moves) corrects what
        the additive pair costs cannot see; candidate ``{dp}_refined`` when it moved
    timed: the same DP over that whole-path simulation's clocks instead of additive pair
        costs (``strand_plan.plan_timed``: each cell keeps the partial paths no other
        dominates), so a long transfer runs under as many of the other strand's segments as
        it needs -- HF Llama TP+SP's forward ends in a 34 ms logits gather, which the additive
        DP pairs with one 5 ms backward segment; candidate ``{dp}_timed`` when it differs
        (with ``timed_width`` > 0; off by default, see :class:`InterleaveOptions`)
    sliced: with ``slice_ratio`` > 0, both strands cut again with every stretch of compute
        also cut where it reaches slice_s = slice_ratio x the median transfer (no shorter than
        a strand's compute over MAX_SLICES; off when no segment computes for two slices, and for
        strands of more than MAX_SLICED_SEGMENTS - MAX_SLICES segments), then
        the timed DP and the local search over those slices: a strand whose transfer lands in
        the middle of the other strand's long stretch goes on there instead of after it (the
        MoE layer's experts waited for all of 19 ms of backward compute, although their
        dispatch had landed 13 ms into it); candidate ``{dp}_sliced``
    judge: ``simulate`` the sequential order, the DP's orders and the reorder pass's list
        scheduler run over both strands at node granularity (``list``: collectives issued in
        original order; ``list_critical``: the one with the most work behind it first,
        ``reorder.critical_urgency``), under this pass's memory budget
        and counting live bytes as it does (a second opinion: the DP's additive pair costs do
        not see a wait that a chain of transfers leaves exposed, nor a stretch of one strand's
        compute that the other's work could split); keep the shortest predicted
        makespan whose peak live bytes above the inputs it never frees (the backward's saved
        inputs freed at last use; the parameters not counted, as in the DP's budget) stay
        within memory_budget_ratio x the sequential order's

Reason codes (``ctx.stats["interleave"]``; details in ``ctx.notes["interleave"]``)::

    skipped: one strand                  not a merged graph
    sequential: no estimator             nothing to hide: the sequential order
    sequential: no predicted gain        detail: the best candidate's and the sequential makespans
    interleaved                          an interleaved order is kept, and which one:
    interleaved by <candidate>           dp, dp_defer<d>, dp_refined, dp_defer<d>_refined, dp_timed, dp_defer<d>_timed,
                                         dp_sliced, dp_defer<d>_sliced, list,
                                         list_critical
    <candidate> order over the memory budget   detail: its peak and the budget
    nodes moved                          (counted by how many positions changed)

Picture (two layers of TP: each strand's collective in flight under the other's matmuls)::

    sequential:  B: mm mm [rs]..wait mm mm [rs]..wait   F: mm [ag]..wait mm [ag]..wait
    interleaved: B mm mm [rs] | F mm [ag] | B wait mm mm [rs] | F wait mm [ag] | ...
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence

import torch.fx

from cost_model import compile_clock
from cost_model.estimator import Estimator, MemoizedEstimator
from cost_model.memory import live_bytes_profile
from cost_model.op_kinds import is_comm
from cost_model.simulator import SimResult, simulate
from cost_model.strand_plan import (
    Pair,
    PairCost,
    Segment,
    formula_cost,
    plan_pairs,
    plan_timed,
    refine_path,
    sequential_path,
    usable_pairs,
)
from graph_passes.annotate import strand_of
from graph_passes.context import PassContext
from graph_passes.deferral import defer_off_chain
from graph_passes.merge_strands import BWD_STRAND, FWD_STRAND
from graph_passes.node_order import apply_order
from graph_passes.reorder import ReorderOptions, overlap_schedule


@dataclasses.dataclass(frozen=True)
class InterleaveOptions:
    """Knobs of the interleave pass."""

    memory_budget_ratio: float = 1.25
    """Live bytes of the interleaved order may be at most this times the sequential order's peak."""

    defer_weight_grads: tuple[int, ...] = (1,)
    """For each distance d, the DP also plans a backward whose off-chain work (weight gradients:
    nodes no later transfer depends on) moved d segments later (``deferral.defer_off_chain``)."""

    refine_evals: int = 4000
    """Evaluations of the local search (``strand_plan.refine_path``) from each DP path; 0: off."""

    slice_ratio: float = 0.5
    """Also plan with every stretch of a strand's compute cut into slices of at most this times
    the median transfer (``strand_segments``' ``slice_s``), by the timed DP and the local
    search: a transfer that lands in the middle of the other strand's long segment lets its
    strand go on there (candidate ``{dp}_sliced``). 0: off."""

    measure_pairs: bool = False
    """Price the DP's pairs by running them on the live group (``Estimator.segment_pair_times``)
    instead of by the formula. Off by default: the measurements cost more than Inductor's whole
    compile and no order the pass chose read them -- HF Llama TP+SP (`dhelix bench`, 4
    micro-batches, 2 gloo ranks) measured 380 pairs in 65 s of a 125 s first step, and kept
    the sliced order, which the formula plans, as it did without them."""

    timed_width: int = 0
    """Partial paths each cell of the timed DP (``strand_plan.plan_timed``) keeps; 0: off (the
    default: on HF Llama TP+SP over the 1 Gbit/s link its plan was predicted 8% faster per step
    and measured level with the additive DP's, 1041 against 1034 ms; BENCHMARKS.md)."""


def strand_segments(
    nodes: Sequence[torch.fx.Node],
    estimator: Estimator,
    *,
    freeable_inputs: Sequence[torch.fx.Node] = (),
    slice_s: float = math.inf,
) -> list[Segment]:
    """Cut one strand's nodes (in order) right after each transfer issue, and after the node
    where a segment's compute reaches ``slice_s`` (a slice: no transfer of its own); cost each piece."""
    if not nodes:
        return []
    profile = live_bytes_profile(nodes, lambda n: estimator.node_cost(n).output_bytes, freeable_inputs=freeable_inputs)
    base = profile.held_input_bytes
    segments: list[Segment] = []
    start = 0
    compute_s = 0.0
    for index, node in enumerate(nodes):
        last = index == len(nodes) - 1
        cost = estimator.node_cost(node)
        compute_s += cost.time_s if cost.kind == "compute" else 0.0
        if not (is_comm(cost.kind) or last or compute_s >= slice_s):
            continue
        compute_s = 0.0
        piece = nodes[start : index + 1]
        costs = [estimator.node_cost(n) for n in piece]
        first_wait = next((k for k, c in enumerate(costs) if c.kind == "wait"), None)
        lead = costs if first_wait is None else costs[:first_wait]
        segments.append(
            Segment(
                strand=_strand_of(node),
                nodes=tuple(piece),
                compute_s=math.fsum(c.time_s if c.kind == "compute" else c.issue_s for c in costs),
                comm_s=math.fsum(c.time_s for c in costs if is_comm(c.kind)),
                live_after_bytes=profile.live_after_free_bytes[index] - base,
                peak_bytes=max(profile.live_after_alloc_bytes[start : index + 1]) - base,
                lead_s=math.fsum(c.time_s for c in lead if c.kind == "compute"),
                waits=first_wait is not None,
            )
        )
        start = index + 1
    return segments


def _segs(pair: Pair, fwd: Sequence[Segment], bwd: Sequence[Segment]) -> tuple[Segment | None, Segment | None]:
    return (fwd[pair[0]] if pair[0] is not None else None, bwd[pair[1]] if pair[1] is not None else None)


def emit(path: Sequence[Pair], fwd: Sequence[Segment], bwd: Sequence[Segment]) -> list[torch.fx.Node]:
    """The node order of a plan: each pair as the backward segment's nodes, then the forward's."""
    order: list[torch.fx.Node] = []
    for pair in path:
        f, b = _segs(pair, fwd, bwd)
        if b is not None:
            order.extend(b.nodes)
        if f is not None:
            order.extend(f.nodes)
    return order


def interleave_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Order a merged graph's two strands; see the module docstring."""
    nodes = list(gm.graph.nodes)
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    strands = sorted({_strand_of(n) for n in body})
    if len(strands) < 2:
        ctx.count("interleave", "skipped: one strand")
        return gm
    if strands != [FWD_STRAND, BWD_STRAND]:
        raise ValueError(f"interleave: expected strands {FWD_STRAND} and {BWD_STRAND}, found {strands}")
    fwd_nodes = [n for n in body if _strand_of(n) == FWD_STRAND]
    bwd_nodes = [n for n in body if _strand_of(n) == BWD_STRAND]
    if ctx.estimator is None:  # no communication to hide: the memory-friendly sequential order
        ctx.count("interleave", "sequential: no estimator")
        ctx.count("interleave", "nodes moved", apply_order(gm.graph, bwd_nodes + fwd_nodes))
        return gm
    return _plan_and_order(gm, ctx, nodes, fwd_nodes, bwd_nodes)


@compile_clock.timed("plan")
def _plan_and_order(
    gm: torch.fx.GraphModule,
    ctx: PassContext,
    nodes: list[torch.fx.Node],
    fwd_nodes: list[torch.fx.Node],
    bwd_nodes: list[torch.fx.Node],
) -> torch.fx.GraphModule:
    """The strand plan's search and judgement, and ``gm`` in the order chosen (the module
    docstring's Algorithm), counted as ``compile_clock``'s ``plan`` (the pairs it measures as
    ``profiling``)."""
    assert ctx.estimator is not None
    options = ctx.pass_options.get("interleave", InterleaveOptions())
    assert isinstance(options, InterleaveOptions)
    estimator = MemoizedEstimator(ctx.estimator)
    factor = estimator.contention_factor
    start_s = time.perf_counter()
    bwd_inputs = [n for n in nodes if n.op == "placeholder" and _strand_of(n) == BWD_STRAND]
    bwd_base = sum(estimator.node_cost(n).output_bytes for n in bwd_inputs)
    fwd_segments = strand_segments(fwd_nodes, estimator)
    bwd_orders = _backward_orders(bwd_nodes, estimator, options.defer_weight_grads)
    bwd_segments = {
        name: strand_segments(order, estimator, freeable_inputs=bwd_inputs) for name, order in bwd_orders.items()
    }
    captured = bwd_segments["dp"]  # the backward as captured: the sequential order, the budget's base
    sequential = emit(sequential_path(len(fwd_segments), len(captured)), fwd_segments, captured)
    budget_bytes = options.memory_budget_ratio * _sequential_peak(fwd_segments, captured, bwd_base)
    measure_s = 0.0
    measured_pairs = 0
    plans: dict[str, list[torch.fx.Node]] = {}
    paired: dict[str, int] = {}
    for name, segments in bwd_segments.items():
        cost = formula_cost(fwd_segments, segments, factor)
        measure_start_s = time.perf_counter()
        measured: dict[Pair, float] = {}
        if options.measure_pairs:
            usable = usable_pairs(fwd_segments, segments, budget_bytes=budget_bytes, bwd_base_bytes=bwd_base)
            measured = estimator.segment_pair_times(
                [s.nodes for s in fwd_segments], [s.nodes for s in segments], usable
            )
        measure_s += time.perf_counter() - measure_start_s
        if measured:  # an estimator that measures: measured pairs replace the formula's
            measured_pairs += len(measured)
            cost = _measured_or(measured, cost)
        path, planned_s = plan_pairs(
            fwd_segments, segments, cost=cost, budget_bytes=budget_bytes, bwd_base_bytes=bwd_base
        )
        plans[name] = emit(path, fwd_segments, segments)
        paired[name] = sum(1 for f, b in path if f is not None and b is not None)
        ctx.record("interleave", **{f"{name}_predicted_s": planned_s, f"{name}_paired_segments": paired[name]})
        if options.refine_evals > 0:
            refined, _ = refine_path(
                path,
                fwd_segments,
                segments,
                contention_factor=factor,
                budget_bytes=budget_bytes,
                bwd_base_bytes=bwd_base,
                max_evals=options.refine_evals,
            )
            if refined != path:
                plans[f"{name}_refined"] = emit(refined, fwd_segments, segments)
        if options.timed_width > 0:
            timed, _ = plan_timed(
                fwd_segments,
                segments,
                contention_factor=factor,
                budget_bytes=budget_bytes,
                bwd_base_bytes=bwd_base,
                width=options.timed_width,
            )
            if timed != path:
                plans[f"{name}_timed"] = emit(timed, fwd_segments, segments)
    slice_s = _slice_s(fwd_segments, captured, options.slice_ratio)
    if (
        slice_s < math.inf and max(len(fwd_segments), len(captured)) + MAX_SLICES <= MAX_SLICED_SEGMENTS
    ):  # a long stretch of compute the other strand's transfers could split
        sliced_fwd = strand_segments(fwd_nodes, estimator, slice_s=slice_s)
        for name, order in bwd_orders.items():
            sliced_bwd = strand_segments(order, estimator, freeable_inputs=bwd_inputs, slice_s=slice_s)
            path, _ = plan_timed(
                sliced_fwd,
                sliced_bwd,
                contention_factor=factor,
                budget_bytes=budget_bytes,
                bwd_base_bytes=bwd_base,
                width=max(options.timed_width, SLICED_WIDTH),
            )
            if options.refine_evals > 0:
                path, _ = refine_path(
                    path,
                    sliced_fwd,
                    sliced_bwd,
                    contention_factor=factor,
                    budget_bytes=budget_bytes,
                    bwd_base_bytes=bwd_base,
                    max_evals=options.refine_evals,
                )
            plans[f"{name}_sliced"] = emit(path, sliced_fwd, sliced_bwd)
        ctx.record("interleave", slice_s=slice_s, sliced_fwd_segments=len(sliced_fwd))
    if measured_pairs:
        ctx.record("interleave", measured_pairs=measured_pairs, pair_measure_s=measure_s)
    plan_time_s = time.perf_counter() - start_s - measure_s  # the planning; the measuring is reported apart

    head = [n for n in nodes if n.op == "placeholder"]
    tail = [n for n in nodes if n.op == "output"]
    reorder_options = ctx.pass_options.get("reorder", ReorderOptions())
    candidates = {
        "sequential": sequential,
        **plans,
        # the single-strand list scheduler over both strands: a second opinion the simulator weighs,
        # its collectives issued in original order and by the work behind them
        **{
            name: overlap_schedule(
                sequential,
                estimator,
                dataclasses.replace(reorder_options, memory_budget_ratio=options.memory_budget_ratio),
                freeable_inputs=bwd_inputs,
                critical=critical,
            )
            for name, critical in (("list", False), ("list_critical", True))
        },
    }
    simulated: dict[tuple[torch.fx.Node, ...], SimResult] = {}  # candidates often coincide
    for order in candidates.values():
        if tuple(order) not in simulated:
            simulated[tuple(order)] = simulate(head + order + tail, estimator, freeable_inputs=bwd_inputs)
    results = {name: simulated[tuple(order)] for name, order in candidates.items()}
    peaks = {name: _held_peak(result) for name, result in results.items()}
    fits = [n for n in candidates if n == "sequential" or peaks[n] <= options.memory_budget_ratio * peaks["sequential"]]
    chosen = min(fits, key=lambda n: (results[n].makespan_s, list(candidates).index(n)))
    ctx.record(
        "interleave",
        fwd_segments=len(fwd_segments),
        bwd_segments=len(captured),
        paired_segments=paired["dp"],
        plan_time_s=plan_time_s,
        predicted_makespan_s=results[chosen].makespan_s,
        predicted_peak_bytes=float(peaks[chosen]),
        **{f"predicted_makespan_{n}_s": r.makespan_s for n, r in results.items()},
        **{f"predicted_exposed_comm_{n}_s": r.exposed_comm_s for n, r in results.items()},
        **{f"predicted_peak_bytes_{n}": float(p) for n, p in peaks.items()},
    )
    if chosen == "sequential":
        best = min((n for n in candidates if n != "sequential"), key=lambda n: results[n].makespan_s)
        ctx.explain(
            "interleave",
            "sequential: no predicted gain",
            f"{ctx.graph_name}: sequential {results['sequential'].makespan_s:.4g} s, the fastest other order "
            f"({best}{'' if best in fits else ', over the memory budget'}) {results[best].makespan_s:.4g} s",
        )
    else:
        ctx.count("interleave", "interleaved")
        ctx.count("interleave", f"interleaved by {chosen}")
    for name in candidates:
        if name not in fits:
            ctx.explain(
                "interleave",
                f"{name} order over the memory budget",
                f"{ctx.graph_name}: peak {peaks[name]} B > {options.memory_budget_ratio} x sequential {peaks['sequential']} B",
            )
    ctx.count("interleave", "nodes moved", apply_order(gm.graph, candidates[chosen]))
    return gm


def _backward_orders(
    bwd_nodes: list[torch.fx.Node], estimator: Estimator, distances: Sequence[int]
) -> dict[str, list[torch.fx.Node]]:
    """The backward as captured (``"dp"``) and, per distance, with its weight gradients deferred."""
    orders = {"dp": bwd_nodes}
    for distance in distances:
        deferred = defer_off_chain(bwd_nodes, lambda n: is_comm(estimator.node_cost(n).kind), distance)
        if deferred != bwd_nodes and deferred not in orders.values():
            orders[f"dp_defer{distance}"] = deferred
    return orders


#: Partial paths each cell of the sliced plan's timed DP keeps (at least; ``timed_width`` when larger).
SLICED_WIDTH = 4


#: The most slices a strand's compute is cut into (the timed DP's cells grow with their square).
MAX_SLICES = 48
#: No sliced plan for a strand of more segments than this: the timed DP over two strands of
#: 182 segments took 2.1 s per backward order on this project's CPU machine, and a 32-layer
#: merged graph (134 segments a strand) would have added about 4 s to its 3.5 s interleave pass.
MAX_SLICED_SEGMENTS = 128


def _slice_s(fwd: Sequence[Segment], bwd: Sequence[Segment], ratio: float) -> float:
    """How long a slice of compute may be: ``ratio`` x the median transfer of either strand, but
    no shorter than a strand's compute over ``MAX_SLICES``; infinite (no slicing) when ``ratio``
    is 0, there is no transfer, or no segment computes for longer than two slices."""
    transfers = [s.comm_s for s in (*fwd, *bwd) if s.comm_s > 0.0]
    if ratio <= 0.0 or not transfers:
        return math.inf
    longest_strand_s = max(math.fsum(s.compute_s for s in fwd), math.fsum(s.compute_s for s in bwd))
    slice_s = max(ratio * statistics.median(transfers), longest_strand_s / MAX_SLICES)
    return slice_s if any(s.compute_s > 2 * slice_s for s in (*fwd, *bwd)) else math.inf


def _sequential_peak(fwd: Sequence[Segment], bwd: Sequence[Segment], bwd_base: int) -> int:
    """Peak live bytes of all of the backward, then all of the forward (what the budget scales)."""
    bwd_end = bwd[-1].live_after_bytes if bwd else bwd_base
    return max([bwd_base, *(s.peak_bytes for s in bwd)] + [s.peak_bytes + bwd_end for s in fwd])


def _held_peak(result: SimResult) -> int:
    assert result.held_peak_bytes is not None  # simulated from an order
    return result.held_peak_bytes


def _measured_or(measured: dict[Pair, float], formula: PairCost) -> PairCost:
    """``P`` measured where a measurement exists, else the formula's."""

    def cost(i: int | None, j: int | None) -> float:
        value = measured.get((i, j))
        return value if value is not None else formula(i, j)

    return cost


def _strand_of(node: torch.fx.Node) -> int:
    return strand_of(node) or 0
