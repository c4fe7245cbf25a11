"""The helix runtime: how two strand calls -- a forward and the previous micro-batch's backward,
or two forwards, or two backwards -- become one call.

``helix`` compiles one function, ``loss(micro-batch)``, with a dhelix backend whose partition
compiler (:func:`compile_strand_partition`) keeps, per Dynamo graph, a :class:`StrandPair`: the
scheduled forward F and the scheduled backward B. A merged graph M of two strand calls
(``graph_passes.merge_strands`` + the ``interleave`` pass; ``helix_runtime.merged_candidates``
chooses and compiles it) is compiled the first time a call meets a parked one, and kept by the
taking call's pair per (its phase, the parked pair, the parked phase): F ⊕ B, F ⊕ F or B ⊕ B
of one graph (``helix``: micro-batches of one model), or, when the exchange merges across
graphs (``helix_pipeline``), F of one stage module and B of another.

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

import functools
import logging
import queue
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.fx

from cost_model import compile_clock
from dhelix_compile import _torch_compat as compat
from dhelix_compile.capture import compile_partition, joint_pass, write_compile_clock
from dhelix_compile.config import DHelixConfig
from dhelix_compile.helix_runtime.grad_accumulation import Slots, mark_released, parameter_slots
from dhelix_compile.helix_runtime.merged_candidates import (
    CHOSEN_REWRITES,
    BoxedCallable,
    Merged,
    Strand,
    adding_grads,
    compile_merged,
    without_chosen_rewrites,
)
from dhelix_compile.helix_runtime.random_ops import draws_from_the_stream, random_ops
from graph_passes import PassContext
from graph_passes.context import Phase
from graph_passes.decompose import A2A_CHAIN

log = logging.getLogger("dhelix.helix")

_T = TypeVar("_T")
_A = TypeVar("_A")


class HelixError(RuntimeError):
    """Bad input to ``helix``, or a model it cannot run as two strands (names the problem)."""


class StrandPair:
    """F and B of one Dynamo graph, and the merged graphs its strands were compiled into (see the
    module docstring)."""

    def __init__(self, config: DHelixConfig, exchange: StrandExchange) -> None:
        self.config = config
        self.exchange = exchange
        self.forward: Strand | None = None
        self.backward: Strand | None = None
        #: the Dynamo graph's flat inputs' parameter slots; empty: B returns plain gradients
        self.grad_slots: Slots = ()
        #: per (this pair's phase, parked pair, parked phase): the merged graph of the two calls;
        #: None: run them one after the other
        self._merged: dict[tuple[Phase, StrandPair, Phase], Merged | None] = {}

    def strand(self, phase: Phase) -> Strand | None:
        """F (``"fwd"``) or B (``"bwd"``), once compiled."""
        return self.forward if phase == "fwd" else self.backward

    def merged_with(self, phase: Phase, parked: StrandPair, parked_phase: Phase) -> Merged | None:
        """M = this pair's ``phase`` strand ⊕ ``parked``'s ``parked_phase`` strand, compiled at the
        first call (None: they cannot merge).

        Raises what compiling raised when ``config.fallback == "error"``; otherwise a failure is
        logged, and the two run one after the other from then on.
        """
        key = (phase, parked, parked_phase)
        if key in self._merged:
            return self._merged[key]
        merged: Merged | None = None
        same_graph = parked is self
        # across graphs only a forward and a backward (a pipeline's stages): never two of one phase
        mergeable = same_graph or (self.exchange.merge_across_graphs and phase != parked_phase)
        first, second = self.strand(phase), parked.strand(parked_phase)
        if first is not None and second is not None and first.draws and second.draws:
            # each draws from the default generator as the accumulation loop does, in call order
            log.info(
                "helix: a %s and a %s call that both draw random numbers run one after the other", phase, parked_phase
            )
            mergeable = False
        if mergeable and first is not None and second is not None:
            try:
                merged = compile_merged(
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


def _run_merged(pair: StrandPair, strand: Strand, args: list[Any], pending: _PendingCall) -> Any:
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
    draws = draws_from_the_stream(gm)
    if draws and pair.exchange.merge_across_graphs:
        raise HelixError(
            f"helix_pipeline runs stage modules that draw no random numbers (found {', '.join(sorted(set(random_ops(gm))))}): "
            "set dropout to 0 or call .eval() on the dropout layers (helix runs models with dropout)"
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
        finish=adding_grads(grad_slots),
        **inductor_kwargs,
    )
    rewritten = tuple(
        name
        for name, count in CHOSEN_REWRITES.items()
        if scheduled and scheduled[0][1].records.get(name, {}).get(count, 0) > 0
    )
    decomposed: dict[str, int] = scheduled[0][1].stats.get("decompose", {}) if scheduled else {}
    chained = any(re.fullmatch(rf"{A2A_CHAIN}: per_peer(_\d+)?", code) for code in decomposed)  # rewritten
    compile_id = compat.current_compile_id()
    strand = Strand(
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
        draws,
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
        #: set by the owner before a call: its strands will meet in merged graphs (a helix step of
        #: several micro-batches); graphs captured then leave out the rewrites a graph running alone
        #: would choose, unless ``helix_strand_rewrites`` (:meth:`strand_config`)
        self.merging = False
        weakref.finalize(owner, self.thread.close)

    def strand_config(self) -> DHelixConfig:
        """The config a graph captured now compiles its strands, and plans their merged graphs,
        with: without the passes' chosen rewrites (``merged_candidates.without_chosen_rewrites``)
        when the strands will merge and ``helix_strand_rewrites`` is off. Strands that run alone
        once per step gain little from them, and the merged graph kept the plain strands on every
        workload measured; planning and compiling both costs the first step a third of its time
        on HF Llama TP+SP."""
        if self.merging and not self.config.helix_strand_rewrites:
            return without_chosen_rewrites(self.config)
        return self.config

    def backend(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        config = self.strand_config()
        pair = StrandPair(config, self.exchange)
        if config.helix_grads_in_graph and not self.exchange.merge_across_graphs:
            pair.grad_slots = parameter_slots(example_inputs)
        inner = functools.partial(compile_strand_partition, config=config, pair=pair)
        with compile_clock.phase("capture"):  # the strands' compiles inside count as their own phases
            compiled = compat.compile_with_aot_autograd(gm, example_inputs, inner, joint_pass=joint_pass(config))
        write_compile_clock(config)
        return compiled

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
