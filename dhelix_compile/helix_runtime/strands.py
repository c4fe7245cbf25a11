"""The helix runtime: how a forward and the previous micro-batch's backward become one call.

``helix`` compiles one function, ``loss(micro-batch)``, with a dhelix backend whose partition
compiler (:func:`compile_strand_partition`) keeps, per Dynamo graph, a :class:`StrandPair`: the
scheduled forward F and the scheduled backward B. The merged graph M = F ⊕ B
(``graph_passes.merge_strands`` + the ``interleave`` pass) is compiled the first time a forward
meets a parked backward, and kept by the forward's pair per backward pair: F and B of one graph
(``helix``: micro-batch i+1 and i of one model), or, when the exchange merges across graphs
(``helix_pipeline``), F of one stage module and B of another.

AOTAutograd calls F from the forward of each micro-batch and B from ``loss.backward()``. The
runner (``dhelix_compile.helix_runtime.step``) makes the two meet::

    main thread                                  backward thread
    loss_1 = f(mb_1)          -> F alone
    exchange.expect_forward()
    submit ──────────────────────────────────►   loss_1.backward()
                                                  B wrapper: post (pair, args); wait
    wait until posted
    loss_2 = f(mb_2)          -> F wrapper takes the posted backward:
                                 M(fwd args + bwd args) -> (fwd outs, grads)
                                 hands the grads over ──► B wrapper returns them; autograd
                                                          accumulates .grad as backward would
    wait ◄────────────────────────────────────── done
    ...
    loss_n.backward()         -> B alone (no forward follows)

Nothing is left waiting: a parked backward that no forward takes (a recompile to another
graph, an error, a merged graph that failed to compile) runs B alone in the main thread while the backward thread stays parked, so
the strands never run concurrently; an error in M reaches both threads. The
backward of micro-batch i always runs before the forward of i+1 returns, so gradients
accumulate in micro-batch order, exactly as in the eager loop.
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
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.fx

from cost_model.op_kinds import op_name
from dhelix_compile import _torch_compat as compat
from dhelix_compile.capture import compile_partition, joint_pass, plan_partition
from dhelix_compile.config import DHelixConfig
from dhelix_compile.pass_options import pass_options
from graph_passes import PassContext, PassError
from graph_passes.context import Phase
from graph_passes.decompose import A2A_CHAIN
from graph_passes.merge_strands import MergedStrands, merge_strands

log = logging.getLogger("dhelix.helix")

BoxedCallable = Callable[[list[Any]], Any]
_T = TypeVar("_T")


#: ``ctx.records`` group of a merged graph whose strands were rewritten by a pass's own choice
#: (decomposed, or bucketed): the predicted makespans of M from the strands as scheduled
#: (``rewritten_strands_s``), from the strands without those passes (``plain_strands_s``) and
#: from the strands without all-to-all chains (``unchained_strands_s``), those that were
#: candidates; where every candidate was run on the live group, their measured times
#: (``<label>_strands_measured_s``). The lowest (measured where measured) was compiled.
MERGE_RECORDS = "merge"

#: Passes that rewrite a strand by their own choice for the strand running alone, weighed again
#: in the merged graph: pass name -> the field of its ``ctx.records[pass]`` that counts rewrites.
_CHOSEN_REWRITES: dict[str, str] = {"decompose": "sites_rewritten", "bucket_collectives": "collectives_removed"}


class HelixError(RuntimeError):
    """Bad input to ``helix``, or a model it cannot run as two strands (names the problem)."""


#: Ops that draw random numbers. A helix step runs micro-batch i+1's forward inside the same
#: graph as micro-batch i's backward; rather than reason about RNG streams, helix refuses them.
_RANDOM_OP_NAMES = (
    "native_dropout",
    "dropout",
    "bernoulli",
    "rand",
    "randn",
    "randint",
    "rand_like",
    "randn_like",
    "randint_like",
    "randperm",
    "normal",
    "uniform",
    "exponential",
    "multinomial",
    "inductor_random",
    "inductor_seeds",
    "philox_rand",
    "run_and_save_rng_state",
)


def random_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the random-number ops in ``gm`` (empty if none)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if op_name(node) in _RANDOM_OP_NAMES:
            found.append(op_name(node, qualified=True))
    return found


@dataclasses.dataclass
class _Strand:
    name: str  # the partition's graph name (Dynamo's compile id), for the merged graphs' names
    gm: torch.fx.GraphModule  # as scheduled for running alone
    raw: torch.fx.GraphModule  # the partition as AOTAutograd gave it
    rewritten: tuple[str, ...]  # the passes of ``_CHOSEN_REWRITES`` that rewrote ``gm``
    example_inputs: Sequence[Any]
    inductor_kwargs: dict[str, Any]
    compiled: BoxedCallable
    chained: bool = False  # the decompose pass rewrote an all-to-all chain of ``gm``


@dataclasses.dataclass(frozen=True)
class _Merged:
    """A compiled merged graph and how to call it."""

    strands: MergedStrands
    compiled: BoxedCallable


class StrandPair:
    """F and B of one Dynamo graph, and the merged graphs its F was compiled into (see the module
    docstring)."""

    def __init__(self, config: DHelixConfig, exchange: StrandExchange) -> None:
        self.config = config
        self.exchange = exchange
        self.forward: _Strand | None = None
        self.backward: _Strand | None = None
        #: per backward pair: the merged graph of this F and its B; None: run them one after the other
        self._merged: dict[StrandPair, _Merged | None] = {}

    def merged_with(self, backward: StrandPair) -> _Merged | None:
        """M = this pair's F ⊕ ``backward``'s B, compiled at the first call (None: they cannot merge).

        Raises what compiling raised when ``config.fallback == "error"``; otherwise a failure is
        logged, and the two run one after the other from then on.
        """
        if backward in self._merged:
            return self._merged[backward]
        merged: _Merged | None = None
        mergeable = backward is self or self.exchange.merge_across_graphs
        if mergeable and self.forward is not None and backward.backward is not None:
            try:
                merged = _compile_merged(
                    self.forward,
                    backward.backward,
                    self.config,
                    same_graph=backward is self,
                    share_parameters=backward is self and not self.exchange.merge_across_graphs,
                )
            except Exception as exc:
                if self.config.fallback == "error":
                    raise
                log.warning("helix: merging a forward and a backward failed (%s); they run one after the other", exc)
        self._merged[backward] = merged
        return merged


def _compile_merged(
    forward: _Strand, backward: _Strand, config: DHelixConfig, *, same_graph: bool, share_parameters: bool
) -> _Merged:
    """Merge the scheduled F and B, run the passes on M, compile it.

    ``same_graph``: F and B are the two halves of one Dynamo graph (it names M).
    ``share_parameters``: they also run on the same parameters and buffers, which M then reads
    once (``helix``: one model). Not in a pipeline: Dynamo lifts a module's parameters to
    graph inputs, so one graph serves every stage module of the same structure (DualPipeV's
    middle chunks), and F of one stage may meet B of another through the same graph.

    Decomposition and bucketing were decided for F and B each running alone. When either
    rewrote one of them (``_CHOSEN_REWRITES``), M is also planned from the plain strands (those
    passes off); when either holds an all-to-all chain, also from the strands planned again
    without chains (their all-to-alls decomposed on their own). The fastest merged graph is
    compiled: measured, every candidate run on the live group, where the estimator measures
    (``cost_model="profile"``), else by the lowest predicted makespan. On the MoE layer the
    chain makes the forward alone 15% faster, but the merged graph with it measured 88 ms
    against 78 without (its forward's sends wait behind the backward's compute). In a merged
    graph the other strand's compute may hide a whole collective, and per-peer steps then only
    add their overheads (HF Llama with PyTorch's TP plan measured 999 ms decomposed against
    922 ms undecomposed), and one bucket of all the next forward's parameter gathers holds that
    forward back until the last weight arrives (data_parallel's small model: 1293 ms bucketed
    against 1127 ms per parameter).
    """
    name = f"{forward.name}_merged" if same_graph else f"{forward.name}_with_{backward.name}_merged"
    shared = (forward.inductor_kwargs.get("static_input_idxs") or ()) if share_parameters else ()

    def merge(fwd: torch.fx.GraphModule, bwd: torch.fx.GraphModule) -> tuple[MergedStrands, list[Any]]:
        """M of ``fwd`` and ``bwd``, and its example inputs."""
        merged = merge_strands(fwd, bwd, shared_fwd_inputs=shared)
        inputs = merged.merged_args(list(forward.example_inputs), list(backward.example_inputs))
        # F and B of two Dynamo compiles hold values of two fake modes: one for the passes and Inductor
        return merged, inputs if same_graph else compat.into_one_fake_mode(merged.gm, inputs)

    candidates = [_Candidate("rewritten", *merge(forward.gm, backward.gm), config)]
    rival_off = _rival_disables(config, forward, backward)
    if rival_off:
        rival_config = config.patch(disable_passes=(*config.disable_passes, *rival_off))
        candidates.append(_Candidate("plain", *merge(forward.raw, backward.raw), rival_config))
    if forward.chained or backward.chained:  # chain or single sites: the pass's choice in every mode
        unchained = config.patch(decompose_all_to_all_chains=False)
        strands = [_unchained(forward, unchained, "fwd"), _unchained(backward, unchained, "bwd")]
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
        best = min(range(len(candidates)), key=times.__getitem__)  # the first of equals
        chosen, planned = candidates[best], plans[best][0]
        if best:
            log.info(
                "%s: the %s strands make a shorter merged graph (%s %.4g s < %.4g s); compiling that one",
                name,
                chosen.label,
                "measured" if measured is not None else "predicted",
                times[best],
                times[0],
            )
    merged, inputs, config = chosen.merged, chosen.inputs, chosen.config
    compiled = compile_partition(
        merged.gm,
        inputs,
        config=config,
        graph_name=name,
        records=records,
        planned=planned,
        **forward.inductor_kwargs,
    )
    return _Merged(merged, compiled)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """A merged graph to plan, and the config it is planned and compiled with."""

    label: str
    merged: MergedStrands
    inputs: list[Any]
    config: DHelixConfig


def _unchained(strand: _Strand, config: DHelixConfig, phase: Phase) -> torch.fx.GraphModule | None:
    """``strand`` without all-to-all chains: as scheduled when it has none, else as AOTAutograd
    gave it through the passes with ``config`` (None: they failed)."""
    if not strand.chained:
        return strand.gm
    try:
        return plan_partition(strand.raw, strand.example_inputs, config=config, graph_name=strand.name, phase=phase)[0]
    except PassError as exc:
        log.warning("%s: planning a strand again failed (%s)", strand.name, exc)
        return None


def _rival_disables(config: DHelixConfig, forward: _Strand, backward: _Strand) -> tuple[str, ...]:
    """The passes the plain rival of a merged graph turns off: those that rewrote F or B by their
    own choice (``decompose`` only in ``auto`` mode: a forced mode is the user's choice)."""
    rewritten = {*forward.rewritten, *backward.rewritten} - set(config.disable_passes)
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


class _PendingBackward:
    """A backward call parked by the backward thread until a forward takes it."""

    def __init__(self, pair: StrandPair, args: list[Any]) -> None:
        self.pair = pair
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()

    def run_here(self) -> None:
        """Run B alone in the calling thread on the parked arguments, and hand over the result.

        The backward thread stays parked meanwhile, so the two strands never run concurrently
        (concurrent collectives could be ordered differently on different ranks).
        """
        assert self.pair.backward is not None
        args, self.args = self.args, []
        try:
            self.finish(result=self.pair.backward.compiled(args))
        except BaseException as exc:
            self.finish(error=exc)
            raise


class StrandExchange:
    """Where the backward thread parks its call and the next forward picks it up.

    ``merge_across_graphs``: a forward merges with a parked backward of another Dynamo graph
    (another stage module of a pipeline); otherwise only with its own graph's, and a backward
    of another graph (micro-batches of another shape) runs before the forward instead.
    """

    def __init__(self, *, merge_across_graphs: bool = False) -> None:
        self.merge_across_graphs = merge_across_graphs
        self._lock = threading.Condition()
        self._expecting = False
        self._pending: _PendingBackward | None = None

    # -- runner side
    def expect_forward(self) -> None:
        """The next backward call should wait for the forward that follows it."""
        with self._lock:
            self._expecting = True
            self._pending = None

    def wait_posted(self, job: BackwardJob, poll_s: float = 0.05) -> None:
        """Block until the backward call parked, or the job ended (an error, or nothing to park)."""
        with self._lock:
            while self._pending is None and not job.done.is_set():
                self._lock.wait(poll_s)

    def release(self) -> None:
        """No forward took the parked call: let the backward thread run B alone."""
        with self._lock:
            self._expecting = False
            pending, self._pending = self._pending, None
        if pending is not None and not pending.done.is_set():
            pending.run_here()

    # -- strand side
    def park(self, pair: StrandPair, args: list[Any]) -> _PendingBackward | None:
        """Called by B's wrapper: park the call if a forward is expected, else return None."""
        with self._lock:
            if not self._expecting:
                return None
            self._expecting = False
            self._pending = _PendingBackward(pair, args)
            self._lock.notify_all()
            return self._pending

    def take(self) -> _PendingBackward | None:
        """Called by F's wrapper: the parked backward call, if any."""
        with self._lock:
            pending, self._pending = self._pending, None
            return pending


class BackwardJob:
    """One backward (``loss.backward()``, a pipeline stage's backward) submitted to a :class:`BackwardThread`."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run: Callable[[], None] | None = run
        self.done = threading.Event()
        self.error: BaseException | None = None


class BackwardThread:
    """The one long-lived thread that runs a helix step's backward calls.

    A fresh thread per micro-batch measured about 10 ms slower per call on the TP+SP model:
    thread-local state (DTensor's sharding-propagation caches among it) starts cold in every
    new thread. The thread is a daemon and stops when :meth:`close` is called.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[BackwardJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, run: Callable[[], None]) -> BackwardJob:
        """Start ``run()`` on the thread; the job's ``done`` is set when it returns."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._serve, args=(self._jobs,), name="dhelix-helix-backward", daemon=True
            )
            self._thread.start()
        job = BackwardJob(run)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        """Let the thread end (after the jobs already submitted)."""
        self._jobs.put(None)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[BackwardJob | None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                assert job.run is not None
                job.run()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the submitting thread
                job.error = exc
            finally:
                job.run = None  # drop what the backward holds (a loss and its graph) now
                job.done.set()


def strand_forward(pair: StrandPair) -> BoxedCallable:
    """F's boxed callable: runs M when a backward is parked, F alone otherwise."""

    def forward(args: list[Any]) -> Any:
        assert pair.forward is not None
        pending = pair.exchange.take()
        if pending is None:
            return pair.forward.compiled(args)
        try:
            found = pair.merged_with(pending.pair)
        except BaseException as exc:
            pending.finish(error=exc)
            raise
        if found is None:
            pending.run_here()  # one after the other
            return pair.forward.compiled(args)
        merged = found.strands
        merged_args = merged.merged_args(args, pending.args)
        # Hand over ownership: AOTAutograd's frames still hold these two lists; emptying them
        # leaves M's argument list the only reference, so the generated code frees each saved
        # activation of micro-batch i at its last use.
        args.clear()
        pending.args.clear()
        try:
            outputs = found.compiled(merged_args)
        except BaseException as exc:
            pending.finish(error=exc)
            raise
        outputs = list(outputs)
        pending.finish(result=outputs[merged.num_fwd_outputs :])
        return outputs[: merged.num_fwd_outputs]

    return compat.mark_boxed(forward)


def strand_backward(pair: StrandPair) -> BoxedCallable:
    """B's boxed callable: parks the call for the next forward when one is expected."""

    def backward(args: list[Any]) -> Any:
        assert pair.backward is not None
        pending = pair.exchange.park(pair, args)
        if pending is None:
            return pair.backward.compiled(args)
        pending.done.wait()
        if pending.error is not None:
            raise HelixError(f"the merged forward/backward graph failed: {pending.error}") from pending.error
        return pending.result

    return compat.mark_boxed(backward)


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
    compiled = compile_partition(
        gm, example_inputs, config=config, on_scheduled=lambda g, ctx: scheduled.append((g, ctx)), **inductor_kwargs
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
        scheduled[0][0] if scheduled else gm,
        gm,
        rewritten,
        example_inputs,
        dict(inductor_kwargs),
        compiled,
        chained,
    )
    if not inductor_kwargs.get("is_backward"):
        pair.forward = strand
        return strand_forward(pair)
    pair.backward = strand
    return strand_backward(pair)


class Strands:
    """What a helix step or a helix pipeline runs its two strands with: one :class:`StrandExchange`,
    one :class:`BackwardThread` (closed when ``owner`` is collected) and the ``torch.compile``
    backend whose graphs meet through the exchange (a :class:`StrandPair` per graph)."""

    def __init__(self, config: DHelixConfig, owner: object, *, merge_across_graphs: bool = False) -> None:
        self.config = config
        self.exchange = StrandExchange(merge_across_graphs=merge_across_graphs)
        self.thread = BackwardThread()
        weakref.finalize(owner, self.thread.close)

    def backend(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        pair = StrandPair(self.config, self.exchange)
        inner = functools.partial(compile_strand_partition, config=self.config, pair=pair)
        return compat.compile_with_aot_autograd(gm, example_inputs, inner, joint_pass=joint_pass(self.config))

    def run_beside(self, backward: Callable[[], None], forward: Callable[[], _T]) -> _T:
        """``backward()`` on the thread and ``forward()`` here, met in a merged graph (module docstring).

        Returns ``forward()``'s result once both have returned; an error of either is raised here.
        """
        exchange = self.exchange
        exchange.expect_forward()
        job = self.thread.submit(backward)
        try:
            exchange.wait_posted(job)
            result = forward()
        finally:
            exchange.release()
            job.done.wait()
        if job.error is not None:
            raise job.error
        return result


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
