"""Merged candidates: which merged graph two strand calls run as, chosen and compiled.

Contract
    :func:`compile_merged` takes two scheduled strands (:class:`Strand`: F and B of one Dynamo
    graph, two of one phase, or, in a pipeline, F of one stage and B of another), merges them
    (``graph_passes.merge_strands``), and returns the compiled merged graph M (:class:`Merged`).
    When a pass rewrote either strand by its own choice (``CHOSEN_REWRITES``: decompose,
    bucket_collectives) or holds an all-to-all chain, M is also planned from rival strands (those
    passes off; the chains undone); :func:`leanest_of_the_fastest` picks which candidate to
    compile, and ``ctx.records[MERGE_RECORDS]`` says what each was predicted (and measured) to
    take. A helix step of several micro-batches captures its strands without those passes'
    own choices unless ``helix_strand_rewrites`` (``strand_handoff.Strands.strand_config``,
    :func:`without_chosen_rewrites`): M then has one candidate, or two where a forced decompose
    mode made an all-to-all chain. Backward strands add their parameters' gradients into
    ``.grad`` in the graph (:func:`adding_grads`, ``helix_runtime.grad_accumulation``). A
    backward strand that recomputes (activation checkpointing, :func:`recomputes`) tightens M's
    memory budget (:func:`merged_config`).

Pseudo-code::

    config = merged_config(config, F, B)  # budget 1.0 when B recomputes and the option is not set
    candidates = [merge(F, B) as scheduled]
    if a pass chose to rewrite F or B:   candidates += [merge(F, B) as captured, those passes off]
    if F or B holds an all-to-all chain: candidates += [merge(F, B) planned without chains]
    plans = [the passes on each candidate]     # interleave predicts makespan and peak; counted
                                               # as compile_clock's "candidates" when there are several
    times = measured on the live group if the estimator measures, else predicted
    compile candidates[leanest_of_the_fastest(times, peaks)]

``helix_runtime.strand_handoff`` runs the calls that meet in M.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from cost_model import compile_clock
from dhelix_compile import _torch_compat as compat
from dhelix_compile.capture import compile_partition, plan_partition
from dhelix_compile.config import DHelixConfig
from dhelix_compile.helix_runtime.grad_accumulation import Slots, add_grads_in_graph, graph_outputs
from dhelix_compile.helix_runtime.schedule import merged_graph_kind
from dhelix_compile.pass_options import pass_options
from graph_passes import PassContext, PassError
from graph_passes.context import Phase
from graph_passes.joint.regather import REGATHER_AC_GRAPH_ID
from graph_passes.merge_strands import MergedStrands, merge_strands

log = logging.getLogger("dhelix.helix")

BoxedCallable = Callable[[list[Any]], Any]


#: ``ctx.records`` group of a merged graph whose strands were rewritten by a pass's own choice
#: (decomposed, or bucketed): the predicted makespans of M from the strands as scheduled
#: (``rewritten_strands_s``), from the strands without those passes (``plain_strands_s``) and
#: from the strands without all-to-all chains (``unchained_strands_s``), those that were
#: candidates; where every candidate was run on the live group, their measured times
#: (``<label>_strands_measured_s``); their predicted peaks as planned and in the sequential
#: order (``<label>_strands_peak_bytes``, ``<label>_strands_sequential_peak_bytes``).
#: ``leanest_of_the_fastest`` says which was compiled.
MERGE_RECORDS = "merge"

#: Passes that rewrite a strand by their own choice for the strand running alone, weighed again
#: in the merged graph: pass name -> the field of its ``ctx.records[pass]`` that counts rewrites.
CHOSEN_REWRITES: dict[str, str] = {"decompose": "sites_rewritten", "bucket_collectives": "collectives_removed"}


@dataclasses.dataclass
class Strand:
    name: str  # the partition's graph name (Dynamo's compile id), for the merged graphs' names
    phase: Phase  # "fwd": F, "bwd": B
    gm: torch.fx.GraphModule  # as scheduled for running alone
    raw: torch.fx.GraphModule  # the partition as AOTAutograd gave it
    rewritten: tuple[str, ...]  # the passes of ``CHOSEN_REWRITES`` that rewrote ``gm``
    example_inputs: Sequence[Any]
    inductor_kwargs: dict[str, Any]
    compiled: BoxedCallable
    chained: bool = False  # the decompose pass rewrote an all-to-all chain of ``gm``
    grad_slots: Slots = ()  # B: its outputs' parameters (grad_accumulation); empty: .grad added after it
    donated: tuple[int, ...] = ()  # B: its inputs AOTAutograd donates (saved activations it frees first)
    draws: bool = False  # it advances the default generator (random_ops.draws_from_the_stream)


@dataclasses.dataclass(frozen=True)
class Merged:
    """A compiled merged graph and how to call it."""

    strands: MergedStrands
    compiled: BoxedCallable


#: ``interleave_memory_budget_ratio`` of a merged graph whose backward strand recomputes, when
#: the option is not set: M's order may not raise its predicted peak above the
#: backward-then-forward order's. Checkpointing asks for memory, and the peak model misses part
#: of what an interleaved order holds there: on the reference transformer ``medium`` with every
#: block checkpointed (functional TP+SP, 2 ranks) M at budget 1.0 was predicted to hold what its
#: sequential order holds (31.5 MiB) and the step peaked at 1.12-1.15x the eager checkpointed
#: loop's, against 0.95x for the sequential order and 1.19-1.26x at 1.25 (docs/helix.md).
RECOMPUTE_MEMORY_BUDGET_RATIO = 1.0

_RECOMPUTE_POLICIES = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def recomputes(gm: torch.fx.GraphModule) -> bool:
    """Whether a backward partition recomputes forward ops under activation checkpointing.

    Checkpointing tags the ops of a checkpointed region ``meta["recompute"]`` on the joint graph
    (every op under full checkpointing, the ones its policy does not save under selective
    checkpointing), and AOTAutograd's partitioner copies the ops it recomputes, tags included,
    into the backward. ``data_parallel``'s parameter gathers done again in the backward
    (``graph_passes.joint.regather``, their own ``ac_graph_id``) do not count."""
    return any(
        node.op == "call_function"
        and node.meta.get("recompute") in _RECOMPUTE_POLICIES
        and node.meta.get("ac_graph_id") != REGATHER_AC_GRAPH_ID
        for node in gm.graph.nodes
    )


def merged_config(config: DHelixConfig, first: Strand, second: Strand) -> DHelixConfig:
    """The config a merged graph of ``first`` and ``second`` is planned and compiled with:
    ``config``, with ``interleave_memory_budget_ratio`` at :data:`RECOMPUTE_MEMORY_BUDGET_RATIO`
    when the option is not set (None) and a backward strand recomputes (:func:`recomputes`).
    A value set applies as given."""
    if config.interleave_memory_budget_ratio is not None:
        return config
    if not any(s.phase == "bwd" and recomputes(s.raw) for s in (first, second)):
        return config
    return config.patch(interleave_memory_budget_ratio=RECOMPUTE_MEMORY_BUDGET_RATIO)


def compile_merged(
    first: Strand, second: Strand, config: DHelixConfig, *, same_graph: bool, shared_names: Collection[str]
) -> Merged:
    """Merge two scheduled strands (the taking call's ``first``, the parked call's ``second``:
    F and B, or two of one phase), run the passes on M, compile it.

    ``same_graph``: the strands come from one Dynamo graph (it names M).
    ``shared_names``: placeholders of ``first`` that are the same tensors in both calls (the one
    model's parameters and buffers; ``second``'s placeholder of that name reads it), which M
    then reads once. Empty in a pipeline: Dynamo lifts a module's parameters to graph inputs,
    so one graph serves every stage module of the same structure (DualPipeV's middle chunks),
    and F of one stage may meet B of another through the same graph.

    Decomposition and bucketing were decided for each strand running alone. When either
    rewrote one of them (``CHOSEN_REWRITES``), M is also planned from the plain strands (those
    passes off); when either holds an all-to-all chain, also from the strands planned again
    without chains (their all-to-alls decomposed on their own). The fastest merged graph is
    compiled: measured, every candidate run on the live group, where the estimator measures
    (``cost_model="profile"``), else by the lowest predicted makespan; of candidates within the
    rewrites' minimum gain of it, the one that holds the least memory, and none over the
    merged graph's memory budget (``leanest_of_the_fastest``; :func:`merged_config`). On the MoE layer the
    chain makes the forward alone 15% faster, but the merged graph with it measured 88 ms
    against 78 without (its forward's sends wait behind the backward's compute). In a merged
    graph the other strand's compute may hide a whole collective, and per-peer steps then only
    add their overheads (HF Llama with PyTorch's TP plan measured 999 ms decomposed against
    922 ms undecomposed), and one bucket of all the next forward's parameter gathers holds that
    forward back until the last weight arrives (data_parallel's small model: 1293 ms bucketed
    against 1127 ms per parameter).
    """
    config = merged_config(config, first, second)
    kind = merged_graph_kind(first.phase, second.phase)
    name = f"{first.name}_{kind}" if same_graph else f"{first.name}_with_{second.name}_{kind}"
    placeholders = [n.name for n in first.raw.graph.nodes if n.op == "placeholder"]
    shared = [i for i, placeholder in enumerate(placeholders) if placeholder in shared_names]

    def merge(one: torch.fx.GraphModule, two: torch.fx.GraphModule) -> tuple[MergedStrands, list[Any]]:
        """M of ``one`` and ``two``, and its example inputs."""
        with compile_clock.phase("passes"):  # merge_strands is a graph pass, run outside the pipeline
            merged = merge_strands(one, two, shared_fwd_inputs=shared, phases=(first.phase, second.phase))
        inputs = merged.merged_args(list(first.example_inputs), list(second.example_inputs))
        # strands of two Dynamo compiles hold values of two fake modes: one for the passes and Inductor
        return merged, inputs if same_graph else compat.into_one_fake_mode(merged.gm, inputs)

    candidates = [_Candidate("rewritten", *merge(first.gm, second.gm), config)]
    rival_off = _rival_disables(config, first, second)
    if rival_off:
        rival_config = config.patch(disable_passes=(*config.disable_passes, *rival_off))
        candidates.append(_Candidate("plain", *merge(first.raw, second.raw), rival_config))
    if first.chained or second.chained:  # chain or single sites: the pass's choice in every mode
        unchained = config.patch(decompose_all_to_all_chains=False)
        strands = [_unchained(first, unchained), _unchained(second, unchained)]
        if strands[0] is not None and strands[1] is not None:
            candidates.append(_Candidate("unchained", *merge(strands[0], strands[1]), unchained))
    records: dict[str, dict[str, float]] = {}
    chosen, planned = candidates[0], None
    if len(candidates) > 1:
        compile_clock.count("candidates", len(candidates))
        plans = [_plan(c.merged.gm, c.inputs, c.config, name) for c in candidates]
        records[MERGE_RECORDS] = {f"{c.label}_strands_s": s for c, (_, s) in zip(candidates, plans, strict=True)}
        times = [s for _, s in plans]
        measured = _measured_s(*(p for p, _ in plans))
        if measured is not None:  # run on the live group: the measurements decide
            times = list(measured)
            records[MERGE_RECORDS].update(
                {f"{c.label}_strands_measured_s": t for c, t in zip(candidates, measured, strict=True)}
            )
        peaks = [_held_peaks(p) for p, _ in plans]
        for c, (peak, sequential_peak) in zip(candidates, peaks, strict=True):
            records[MERGE_RECORDS][f"{c.label}_strands_peak_bytes"] = peak
            records[MERGE_RECORDS][f"{c.label}_strands_sequential_peak_bytes"] = sequential_peak
        best = leanest_of_the_fastest(times, peaks, config)
        chosen, planned = candidates[best], plans[best][0]
        if best:
            log.info(
                "%s: compiling the merged graph of the %s strands (%s %.4g s, peak %.4g MB; the rewritten "
                "strands' %.4g s, %.4g MB)",
                name,
                chosen.label,
                "measured" if measured is not None else "predicted",
                times[best],
                peaks[best][0] / 1e6,
                times[0],
                peaks[0][0] / 1e6,
            )
    merged, inputs, config = chosen.merged, chosen.inputs, chosen.config
    compiled = compile_partition(
        merged.gm,
        inputs,
        config=config,
        graph_name=name,
        records=records,
        planned=planned,
        finish=adding_grads(first.grad_slots, second.grad_slots, merged.num_fwd_outputs),
        # a backward's saved activations are M's to free (_run_merged hands them over): Inductor
        # writes M's buffers over them, as it does in B alone (the MLP block's silu gradient
        # took a new 3 MiB buffer in M at its peak, and B's saved pre-activation in B alone)
        donated=merged.merged_positions(first.donated, second.donated),
        **first.inductor_kwargs,
    )
    return Merged(merged, compiled)


def adding_grads(
    first: Slots, second: Slots | None = None, split: int = 0
) -> Callable[[torch.fx.GraphModule], object] | None:
    """``compile_partition``'s ``finish`` for a graph that returns a strand's outputs (then, merged,
    another's from index ``split``), given each strand's ``grad_slots`` (empty for a forward):
    each backward's parameter gradients added into ``.grad`` in the graph (``grad_accumulation``).
    None when neither has slots."""
    if not first and not second:
        return None

    def finish(gm: torch.fx.GraphModule) -> object:
        total = len(graph_outputs(gm)[1])
        spans = [(first, 0, split if second is not None else total), (second or (), split, total - split)]
        return add_grads_in_graph(gm, [(start, n, slots) for slots, start, n in spans if slots])

    return finish


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """A merged graph to plan, and the config it is planned and compiled with."""

    label: str
    merged: MergedStrands
    inputs: list[Any]
    config: DHelixConfig


def _unchained(strand: Strand, config: DHelixConfig) -> torch.fx.GraphModule | None:
    """``strand`` without all-to-all chains: as scheduled when it has none, else as AOTAutograd
    gave it through the passes with ``config`` (None: they failed)."""
    if not strand.chained:
        return strand.gm
    try:
        return plan_partition(
            strand.raw, strand.example_inputs, config=config, graph_name=strand.name, phase=strand.phase
        )[0]
    except PassError as exc:
        log.warning("%s: planning a strand again failed (%s)", strand.name, exc)
        return None


def chosen_rewrite_passes(config: DHelixConfig) -> tuple[str, ...]:
    """The passes of ``CHOSEN_REWRITES`` that ``config`` runs and that rewrite by their own choice
    (``decompose`` only in ``auto`` mode: a forced mode is the user's choice)."""
    auto = pass_options(config)["decompose"].mode == "auto"
    return tuple(
        name for name in CHOSEN_REWRITES if name not in config.disable_passes and (auto or name != "decompose")
    )


def without_chosen_rewrites(config: DHelixConfig) -> DHelixConfig:
    """``config`` with :func:`chosen_rewrite_passes` off (itself when there are none)."""
    off = chosen_rewrite_passes(config)
    return config.patch(disable_passes=(*config.disable_passes, *off)) if off else config


def _rival_disables(config: DHelixConfig, first: Strand, second: Strand) -> tuple[str, ...]:
    """The passes the plain rival of a merged graph turns off: those that rewrote either strand by
    their own choice (:func:`chosen_rewrite_passes`)."""
    rewritten = {*first.rewritten, *second.rewritten}
    return tuple(name for name in chosen_rewrite_passes(config) if name in rewritten)


def _measured_s(*candidates: tuple[torch.fx.GraphModule, PassContext] | None) -> tuple[float, ...] | None:
    """Each planned candidate's whole graph run on the live group (``Estimator.segment_times``:
    agreed across ranks), or None unless every one was measured (no candidate failed to plan, the
    estimator measures, every run succeeded)."""
    if any(c is None for c in candidates):
        return None
    planned = [c for c in candidates if c is not None]
    estimator = planned[0][1].estimator
    if estimator is None:
        return None
    graphs = [[n for n in gm.graph.nodes if n.op == "call_function"] for gm, _ in planned]
    times = estimator.segment_times(graphs)
    if any(t is None for t in times):
        return None
    return tuple(t for t in times if t is not None)


def _held_peaks(planned: tuple[torch.fx.GraphModule, PassContext] | None) -> tuple[float, float]:
    """A planned merged graph's predicted peaks above the inputs it never frees: in the order
    compiled, and in the sequential order (NaN: not planned)."""
    record = planned[1].records.get("interleave", {}) if planned is not None else {}
    return record.get("predicted_peak_bytes", math.nan), record.get("predicted_peak_bytes_sequential", math.nan)


def leanest_of_the_fastest(times: Sequence[float], peaks: Sequence[tuple[float, float]], config: DHelixConfig) -> int:
    """Which merged candidate to compile (``peaks``: each one's ``_held_peaks``): of those whose
    peak is within ``interleave_memory_budget_ratio`` x the leanest sequential order's, and whose
    time is within ``decompose_min_gain_ratio`` of the fastest of them, the leanest (the first
    of equals). Peaks not predicted (NaN) count against no candidate.

    The interleave pass budgets each candidate against its own strands' sequential order; the
    strands' rewrites (per-peer steps) add memory of their own. And times this close are noise
    on a shared machine, the peaks are not: on the MLP block the decomposed strands' merged
    graph measured 118.9 ms against the plain strands' 119.0, held 34% more, and the step
    peaked at 1.89x the eager accumulation loop's against 1.07x (BENCHMARKS.md).
    """
    base = min((s for _, s in peaks if not math.isnan(s)), default=math.nan)
    budget = config.interleave_budget_ratio * base
    fits = [i for i, (p, _) in enumerate(peaks) if math.isnan(p) or math.isnan(base) or p <= budget]
    fits = fits or list(range(len(times)))
    fastest = min(times[i] for i in fits)
    close = [i for i in fits if times[i] <= fastest * (1.0 + config.decompose_min_gain_ratio)]
    return min(close, key=lambda i: (0.0 if math.isnan(peaks[i][0]) else peaks[i][0], i))


def _plan(
    gm: torch.fx.GraphModule, example_inputs: list[Any], config: DHelixConfig, name: str
) -> tuple[tuple[torch.fx.GraphModule, PassContext] | None, float]:
    """``gm`` through the passes, and the interleave pass's predicted makespan (infinite when it
    predicted none, or the passes failed: compiling then plans again, and fails or falls back as
    configured)."""
    try:
        planned = plan_partition(gm, example_inputs, config=config, graph_name=name, phase="fwd")
    except PassError as exc:
        log.warning("%s: planning a merged candidate failed (%s)", name, exc)
        return None, math.inf
    return planned, planned[1].records.get("interleave", {}).get("predicted_makespan_s", math.inf)
