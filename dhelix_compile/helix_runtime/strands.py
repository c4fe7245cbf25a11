"""The helix runtime: how two strand calls -- a forward and the previous micro-batch's backward,
or two forwards, or two backwards -- become one call.

``helix`` compiles one function, ``loss(micro-batch)``, with a dhelix backend whose partition
compiler (:func:`compile_strand_partition`) keeps, per Dynamo graph, a :class:`StrandPair`: the
scheduled forward F and the scheduled backward B. A merged graph M of two strand calls
(``graph_passes.merge_strands`` + the ``interleave`` pass) is compiled the first time a call
meets a parked one, and kept by the taking call's pair per (its phase, the parked pair, the
parked phase): F ⊕ B, F ⊕ F or B ⊕ B of one graph (``helix``: micro-batches of one model), or,
when the exchange merges across graphs (``helix_pipeline``), F of one stage module and B of
another.

AOTAutograd calls F from the forward of each micro-batch and B from ``loss.backward()``. The
runner (``helix_runtime.step``, in the steps of ``helix_runtime.schedule``) makes two meet:
the first call of a step runs on the partner thread and parks, the second runs here and takes
it. For the step B1+F2::

    main thread                                  partner thread
    exchange.expect_partner()
    submit ──────────────────────────────────►   loss_1.backward()
                                                  B wrapper: park (pair, "bwd", args); wait
    wait until parked
    loss_2 = f(mb_2)          -> F wrapper takes the parked call:
                                 M(fwd args + bwd args) -> (fwd outs, grads)
                                 hands the grads over ──► B wrapper returns them; autograd
                                                          stores .grad as backward would
    wait ◄────────────────────────────────────── done

F0+F1 runs ``f(mb_0)`` on the partner thread (its F call parks; the loss comes back as the
job's result). In B0+B1 the taking B1 returns its gradients only after the partner's
``loss_0.backward()`` has returned, so gradients accumulate in micro-batch order, exactly as
in the eager loop. With ``helix_grads_in_graph`` (the default) a backward graph adds each
parameter's gradient into ``.grad`` where it is computed and returns the sum, which autograd
stores (``helix_runtime.grad_accumulation``): M does not hold micro-batch i's gradients while
micro-batch i+1's forward runs.

Nothing is left waiting: a parked call that no call takes (a recompile to another graph, an
error, a merged graph that failed to compile, two calls of different graphs) runs alone in the
main thread while the partner thread stays parked, so the strands never run concurrently; an
error in M reaches both threads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import queue
import re
import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import torch
import torch.fx

from dhelix_compile import _torch_compat as compat
from dhelix_compile.capture import compile_partition, joint_pass, plan_partition
from dhelix_compile.config import DHelixConfig
from dhelix_compile.helix_runtime.grad_accumulation import (
    Slots,
    add_grads_in_graph,
    graph_outputs,
    mark_released,
    parameter_slots,
)
from dhelix_compile.helix_runtime.random_ops import random_ops
from dhelix_compile.helix_runtime.schedule import merged_graph_kind
from dhelix_compile.pass_options import pass_options
from graph_passes import PassContext, PassError
from graph_passes.context import Phase
from graph_passes.decompose import A2A_CHAIN
from graph_passes.merge_strands import MergedStrands, merge_strands

log = logging.getLogger("dhelix.helix")

BoxedCallable = Callable[[list[Any]], Any]
_T = TypeVar("_T")
_A = TypeVar("_A")


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
_CHOSEN_REWRITES: dict[str, str] = {"decompose": "sites_rewritten", "bucket_collectives": "collectives_removed"}


class HelixError(RuntimeError):
    """Bad input to ``helix``, or a model it cannot run as two strands (names the problem)."""


@dataclasses.dataclass
class _Strand:
    name: str  # the partition's graph name (Dynamo's compile id), for the merged graphs' names
    phase: Phase  # "fwd": F, "bwd": B
    gm: torch.fx.GraphModule  # as scheduled for running alone
    raw: torch.fx.GraphModule  # the partition as AOTAutograd gave it
    rewritten: tuple[str, ...]  # the passes of ``_CHOSEN_REWRITES`` that rewrote ``gm``
    example_inputs: Sequence[Any]
    inductor_kwargs: dict[str, Any]
    compiled: BoxedCallable
    chained: bool = False  # the decompose pass rewrote an all-to-all chain of ``gm``
    grad_slots: Slots = ()  # B: its outputs' parameters (grad_accumulation); empty: .grad added after it
    donated: tuple[int, ...] = ()  # B: its inputs AOTAutograd donates (saved activations it frees first)


@dataclasses.dataclass(frozen=True)
class _Merged:
    """A compiled merged graph and how to call it."""

    strands: MergedStrands
    compiled: BoxedCallable


class StrandPair:
    """F and B of one Dynamo graph, and the merged graphs its strands were compiled into (see the
    module docstring)."""

    def __init__(self, config: DHelixConfig, exchange: StrandExchange) -> None:
        self.config = config
        self.exchange = exchange
        self.forward: _Strand | None = None
        self.backward: _Strand | None = None
        #: the Dynamo graph's flat inputs' parameter slots; empty: B returns plain gradients
        self.grad_slots: Slots = ()
        #: per (this pair's phase, parked pair, parked phase): the merged graph of the two calls;
        #: None: run them one after the other
        self._merged: dict[tuple[Phase, StrandPair, Phase], _Merged | None] = {}

    def strand(self, phase: Phase) -> _Strand | None:
        """F (``"fwd"``) or B (``"bwd"``), once compiled."""
        return self.forward if phase == "fwd" else self.backward

    def merged_with(self, phase: Phase, parked: StrandPair, parked_phase: Phase) -> _Merged | None:
        """M = this pair's ``phase`` strand ⊕ ``parked``'s ``parked_phase`` strand, compiled at the
        first call (None: they cannot merge).

        Raises what compiling raised when ``config.fallback == "error"``; otherwise a failure is
        logged, and the two run one after the other from then on.
        """
        key = (phase, parked, parked_phase)
        if key in self._merged:
            return self._merged[key]
        merged: _Merged | None = None
        same_graph = parked is self
        # across graphs only a forward and a backward (a pipeline's stages): never two of one phase
        mergeable = same_graph or (self.exchange.merge_across_graphs and phase != parked_phase)
        first, second = self.strand(phase), parked.strand(parked_phase)
        if mergeable and first is not None and second is not None:
            try:
                merged = _compile_merged(
                    first,
                    second,
                    self.config,
                    same_graph=same_graph,
                    shared_names=self._parameter_names()
                    if same_graph and not self.exchange.merge_across_graphs
                    else (),
                )
            except Exception as exc:
                if self.config.fallback == "error":
                    raise
                log.warning(
                    "helix: merging a %s and a %s call failed (%s); they run one after the other",
                    phase,
                    parked_phase,
                    exc,
                )
        self._merged[key] = merged
        return merged

    def _parameter_names(self) -> frozenset[str]:
        """F's placeholders that are the model's parameters and buffers (AOTAutograd's static
        inputs): the same tensors in every call of this graph, and named alike in B when saved."""
        if self.forward is None:
            return frozenset()
        placeholders = [n.name for n in self.forward.raw.graph.nodes if n.op == "placeholder"]
        static = self.forward.inductor_kwargs.get("static_input_idxs") or ()
        return frozenset(placeholders[i] for i in static if i < len(placeholders))


def _compile_merged(
    first: _Strand, second: _Strand, config: DHelixConfig, *, same_graph: bool, shared_names: Collection[str]
) -> _Merged:
    """Merge two scheduled strands (the taking call's ``first``, the parked call's ``second``:
    F and B, or two of one phase), run the passes on M, compile it.

    ``same_graph``: the strands come from one Dynamo graph (it names M).
    ``shared_names``: placeholders of ``first`` that are the same tensors in both calls (the one
    model's parameters and buffers; ``second``'s placeholder of that name reads it), which M
    then reads once. Empty in a pipeline: Dynamo lifts a module's parameters to graph inputs,
    so one graph serves every stage module of the same structure (DualPipeV's middle chunks),
    and F of one stage may meet B of another through the same graph.

    Decomposition and bucketing were decided for each strand running alone. When either
    rewrote one of them (``_CHOSEN_REWRITES``), M is also planned from the plain strands (those
    passes off); when either holds an all-to-all chain, also from the strands planned again
    without chains (their all-to-alls decomposed on their own). The fastest merged graph is
    compiled: measured, every candidate run on the live group, where the estimator measures
    (``cost_model="profile"``), else by the lowest predicted makespan; of candidates within the
    rewrites' minimum gain of it, the one that holds the least memory, and none over the
    merged graph's memory budget (``leanest_of_the_fastest``). On the MoE layer the
    chain makes the forward alone 15% faster, but the merged graph with it measured 88 ms
    against 78 without (its forward's sends wait behind the backward's compute). In a merged
    graph the other strand's compute may hide a whole collective, and per-peer steps then only
    add their overheads (HF Llama with PyTorch's TP plan measured 999 ms decomposed against
    922 ms undecomposed), and one bucket of all the next forward's parameter gathers holds that
    forward back until the last weight arrives (data_parallel's small model: 1293 ms bucketed
    against 1127 ms per parameter).
    """
    kind = merged_graph_kind(first.phase, second.phase)
    name = f"{first.name}_{kind}" if same_graph else f"{first.name}_with_{second.name}_{kind}"
    placeholders = [n.name for n in first.raw.graph.nodes if n.op == "placeholder"]
    shared = [i for i, placeholder in enumerate(placeholders) if placeholder in shared_names]

    def merge(one: torch.fx.GraphModule, two: torch.fx.GraphModule) -> tuple[MergedStrands, list[Any]]:
        """M of ``one`` and ``two``, and its example inputs."""
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
        finish=_adding_grads(first.grad_slots, second.grad_slots, merged.num_fwd_outputs),
        # a backward's saved activations are M's to free (_run_merged hands them over): Inductor
        # writes M's buffers over them, as it does in B alone (the MLP block's silu gradient
        # took a new 3 MiB buffer in M at its peak, and B's saved pre-activation in B alone)
        donated=merged.merged_positions(first.donated, second.donated),
        **first.inductor_kwargs,
    )
    return _Merged(merged, compiled)


def _adding_grads(
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


def _unchained(strand: _Strand, config: DHelixConfig) -> torch.fx.GraphModule | None:
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


def _rival_disables(config: DHelixConfig, first: _Strand, second: _Strand) -> tuple[str, ...]:
    """The passes the plain rival of a merged graph turns off: those that rewrote either strand by
    their own choice (``decompose`` only in ``auto`` mode: a forced mode is the user's choice)."""
    rewritten = {*first.rewritten, *second.rewritten} - set(config.disable_passes)
    if pass_options(config)["decompose"].mode != "auto":
        rewritten.discard("decompose")
    return tuple(name for name in _CHOSEN_REWRITES if name in rewritten)


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
    budget = config.interleave_memory_budget_ratio * base
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


class _PendingCall:
    """A strand call parked by the partner thread until the next strand call takes it."""

    def __init__(self, pair: StrandPair, phase: Phase, args: list[Any]) -> None:
        self.pair = pair
        self.phase = phase
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.job: PartnerJob | None = None  # the partner thread's job that made the call

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()

    def run_here(self) -> None:
        """Run the parked call's strand alone in the calling thread, and hand over the result.

        The partner thread stays parked meanwhile, so the two strands never run concurrently
        (concurrent collectives could be ordered differently on different ranks).
        """
        strand = self.pair.strand(self.phase)
        assert strand is not None
        args, self.args = self.args, []
        try:
            self.finish(result=strand.compiled(args))
        except BaseException as exc:
            self.finish(error=exc)
            raise


class StrandExchange:
    """Where the partner thread parks its strand call and the next call picks it up.

    ``merge_across_graphs``: a forward merges with a parked backward of another Dynamo graph
    (another stage module of a pipeline); otherwise a call merges only with its own graph's,
    and a parked call of another graph (micro-batches of another shape) runs first instead.
    """

    def __init__(self, *, merge_across_graphs: bool = False) -> None:
        self.merge_across_graphs = merge_across_graphs
        self._lock = threading.Condition()
        self._expecting = False
        self._pending: _PendingCall | None = None

    # -- runner side
    def expect_partner(self) -> None:
        """The next strand call (the partner thread's) should wait for the call that follows it."""
        with self._lock:
            self._expecting = True
            self._pending = None

    def wait_posted(self, job: PartnerJob, poll_s: float = 0.05) -> None:
        """Block until the job's strand call parked, or the job ended (an error, or nothing to
        park: the next call then runs alone)."""
        with self._lock:
            while self._pending is None and not job.done.is_set():
                self._lock.wait(poll_s)
            if self._pending is not None:
                self._pending.job = job
            else:
                self._expecting = False

    def release(self) -> None:
        """No call took the parked one: let the partner thread's call run alone."""
        with self._lock:
            self._expecting = False
            pending, self._pending = self._pending, None
        if pending is not None and not pending.done.is_set():
            pending.run_here()

    # -- strand side
    def park(self, pair: StrandPair, phase: Phase, args: list[Any]) -> _PendingCall | None:
        """Called by a strand's wrapper: park the call if a partner is expected, else return None."""
        with self._lock:
            if not self._expecting:
                return None
            self._expecting = False
            self._pending = _PendingCall(pair, phase, args)
            self._lock.notify_all()
            return self._pending

    def take(self) -> _PendingCall | None:
        """Called by a strand's wrapper: the parked call, if any."""
        with self._lock:
            pending, self._pending = self._pending, None
            return pending


class PartnerJob:
    """One call (a forward, ``loss.backward()``, a pipeline stage's backward) submitted to a
    :class:`PartnerThread`."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.run: Callable[[], Any] | None = run
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class PartnerThread:
    """The one long-lived thread that runs the parking call of each merged step of a helix step.

    A fresh thread per micro-batch measured about 10 ms slower per call on the TP+SP model:
    thread-local state (DTensor's sharding-propagation caches among it) starts cold in every
    new thread. The thread is a daemon and stops when :meth:`close` is called.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[PartnerJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, run: Callable[[], Any]) -> PartnerJob:
        """Start ``run()`` on the thread; the job's ``done`` is set when it returns."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._serve, args=(self._jobs,), name="dhelix-helix-partner", daemon=True
            )
            self._thread.start()
        job = PartnerJob(run)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        """Let the thread end (after the jobs already submitted)."""
        self._jobs.put(None)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[PartnerJob | None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                assert job.run is not None
                job.result = job.run()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the submitting thread
                job.error = exc
            finally:
                job.run = None  # drop what the call holds (a loss and its graph) now
                job.done.set()


def strand_call(pair: StrandPair, phase: Phase) -> BoxedCallable:
    """The boxed callable of F (``phase="fwd"``) or B: parks the call when a partner is expected,
    runs the merged graph when a call is parked, else runs the strand alone."""

    def call(args: list[Any]) -> Any:
        strand = pair.strand(phase)
        assert strand is not None
        exchange = pair.exchange
        parked = exchange.park(pair, phase, args)
        if parked is not None:  # the next call runs it
            parked.done.wait()
            if parked.error is not None:
                raise HelixError(f"the merged graph failed: {parked.error}") from parked.error
            return parked.result
        pending = exchange.take()
        if pending is None:
            return strand.compiled(args)
        try:
            outputs = _run_merged(pair, strand, args, pending)
        finally:
            if phase == "bwd" and pending.phase == "bwd" and pending.job is not None:
                # gradients accumulate in micro-batch order: the parked (earlier) backward first
                pending.job.done.wait()
        return outputs

    return compat.mark_boxed(call)


def _run_merged(pair: StrandPair, strand: _Strand, args: list[Any], pending: _PendingCall) -> Any:
    """Run this call (of ``pair``'s ``strand``) merged with the parked one (or, when they cannot
    merge, one after the other: the parked call first); hand the parked call its outputs, return
    this call's."""
    try:
        found = pair.merged_with(strand.phase, pending.pair, pending.phase)
    except BaseException as exc:
        pending.finish(error=exc)
        raise
    if found is None:
        pending.run_here()  # one after the other
        return strand.compiled(args)
    merged = found.strands
    merged_args = merged.merged_args(args, pending.args)
    # Hand over ownership: AOTAutograd's frames still hold these two lists; emptying them
    # leaves M's argument list the only reference, so the generated code frees each saved
    # activation of micro-batch i at its last use.
    args.clear()
    pending.args.clear()
    try:
        outputs = list(found.compiled(merged_args))
    except BaseException as exc:
        pending.finish(error=exc)
        raise
    pending.finish(result=outputs[merged.num_fwd_outputs :])
    return outputs[: merged.num_fwd_outputs]


def compile_strand_partition(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    config: DHelixConfig,
    pair: StrandPair,
    **inductor_kwargs: Any,
) -> BoxedCallable:
    """The partition compiler of a helix graph: F and B as usual, wrapped to meet (the merged
    graphs are compiled when they first meet)."""
    if inductor_kwargs.get("is_inference"):
        raise HelixError(
            "helix needs a loss that requires grad: no parameter of the model requires grad, or the "
            "loss does not depend on one (the graph was captured as inference)"
        )
    if not inductor_kwargs.get("is_backward"):
        found = random_ops(gm)
        if found:
            raise HelixError(
                "helix does not run models that draw random numbers (found "
                f"{', '.join(sorted(set(found)))}): micro-batch i+1's forward runs together with "
                "micro-batch i's backward, and helix does not reproduce eager's RNG stream. Set dropout "
                "to 0 (or use model.eval() for the dropout layers)."
            )
    scheduled: list[tuple[torch.fx.GraphModule, PassContext]] = []
    grad_slots = pair.grad_slots if inductor_kwargs.get("is_backward") else ()
    if grad_slots:
        mark_released(gm, grad_slots)
    compiled = compile_partition(
        gm,
        example_inputs,
        config=config,
        on_scheduled=lambda g, ctx: scheduled.append((g, ctx)),
        finish=_adding_grads(grad_slots),
        **inductor_kwargs,
    )
    rewritten = tuple(
        name
        for name, count in _CHOSEN_REWRITES.items()
        if scheduled and scheduled[0][1].records.get(name, {}).get(count, 0) > 0
    )
    decomposed: dict[str, int] = scheduled[0][1].stats.get("decompose", {}) if scheduled else {}
    chained = any(re.fullmatch(rf"{A2A_CHAIN}: per_peer(_\d+)?", code) for code in decomposed)  # rewritten
    compile_id = compat.current_compile_id()
    strand = _Strand(
        compile_id.replace("/", "_") if compile_id else f"graph{id(pair):x}",
        "bwd" if inductor_kwargs.get("is_backward") else "fwd",
        scheduled[0][0] if scheduled else gm,
        gm,
        rewritten,
        example_inputs,
        dict(inductor_kwargs),
        compiled,
        chained,
        grad_slots,
        compat.donated_input_indices() if inductor_kwargs.get("is_backward") else (),
    )
    if strand.phase == "fwd":
        pair.forward = strand
    else:
        pair.backward = strand
    return strand_call(pair, strand.phase)


class Strands:
    """What a helix step or a helix pipeline runs its two strands with: one :class:`StrandExchange`,
    one :class:`PartnerThread` (closed when ``owner`` is collected) and the ``torch.compile``
    backend whose graphs meet through the exchange (a :class:`StrandPair` per graph)."""

    def __init__(self, config: DHelixConfig, owner: object, *, merge_across_graphs: bool = False) -> None:
        self.config = config
        self.exchange = StrandExchange(merge_across_graphs=merge_across_graphs)
        self.thread = PartnerThread()
        weakref.finalize(owner, self.thread.close)

    def backend(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        pair = StrandPair(self.config, self.exchange)
        if self.config.helix_grads_in_graph and not self.exchange.merge_across_graphs:
            pair.grad_slots = parameter_slots(example_inputs)
        inner = functools.partial(compile_strand_partition, config=self.config, pair=pair)
        return compat.compile_with_aot_autograd(gm, example_inputs, inner, joint_pass=joint_pass(self.config))

    def run_together(self, first: Callable[[], _A], second: Callable[[], _T]) -> tuple[_A, _T]:
        """``first()`` on the partner thread and ``second()`` here, their strand calls met in a
        merged graph (module docstring): ``first``'s call parks, ``second``'s takes it.

        Returns both results once both have returned; an error of either is raised here.
        """
        exchange = self.exchange
        exchange.expect_partner()
        job = self.thread.submit(first)
        try:
            exchange.wait_posted(job)
            if job.error is not None:  # ended before its strand call
                raise job.error
            result = second()
        finally:
            exchange.release()
            job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result, result


def find_helix_error(exc: BaseException) -> HelixError | None:
    """The HelixError a compile raised, looking through Dynamo's wrapping of backend errors."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, HelixError):
            return current
        seen.add(id(current))
        current = getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
    return None
