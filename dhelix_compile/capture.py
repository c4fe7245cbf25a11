"""Capture: AOTAutograd's joint forward-backward graph, partitioned, each partition through our passes.

Data flow for one Dynamo graph::

    Dynamo FX graph ──► AOTAutograd (Inductor's decompositions, joint graph + graph_passes.joint, min-cut partition)
                          ├─► forward graph   ─► compile_partition(phase="fwd")
                          ├─► backward graph  ─► compile_partition(phase="bwd")   (at first backward)
                          └─► inference graph ─► compile_partition(phase="inference")  (no grad)

    compile_partition:  its groups' timeouts bounded, gloo's threads ahead of the compute (graphs
                        with collectives; group_timeouts, comm_threads)
                        ─► estimator (graphs with collectives) ─► copy ─► graph_passes.run_pipeline
                        ─► rank-consistency check ─► dumps (with dump_dir) ─► codegen.generate
                        ─► with dump_dir: the process's compile clock into its rank's folder
                        ─► with profile_steps: the first N calls profiled (dhelix_compile.observe.measured)
                        a pass raised?  fallback="inductor": warn, plain Inductor on the untouched graph
                                        fallback="error":    raise the PassError

The capture itself is Inductor's (``compile_fx``): dhelix graphs differ from plain Inductor's
only by what our passes do, which keeps "dhelix vs Inductor" comparisons honest.

``cost_model.compile_clock`` times the phases: ``capture`` around AOTAutograd, and inside it
each partition's ``profiling``, ``passes``, ``agreement``, ``codegen`` and ``dumps`` as their
own (the backward's at the first backward, outside ``capture``); each graph generated counts as
one of ``graphs``.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from cost_model import Estimator, PlannedCosts, compile_clock
from cost_model.estimator import STAND_IN_KEY
from cost_model.op_kinds import op_name
from cost_model.profile import ProfiledEstimator
from dhelix_compile import _torch_compat as compat
from dhelix_compile import ops as _ops  # noqa: F401 - registers the dhelix ops the passes emit
from dhelix_compile.codegen import generate, has_communication
from dhelix_compile.comm_threads import ThreadPriority, local_ranks, prioritize_gloo_threads
from dhelix_compile.config import DHelixConfig
from dhelix_compile.consistency import check_rank_consistency
from dhelix_compile.estimation import build_estimator, resolve_cost_model
from dhelix_compile.group_timeouts import bound_graph_timeouts, graph_wait_s
from dhelix_compile.pass_options import pass_options
from graph_passes import PassContext, PassError, Phase, run_pipeline
from graph_passes.gloo_collectives import PASS_NAME as GLOO_COLLECTIVES
from graph_passes.gloo_collectives import GlooCollectiveOptions
from graph_passes.joint import JointPasses, joint_passes

if TYPE_CHECKING:  # observe/ is imported only when a dump or a profile is asked for
    from dhelix_compile.observe.dumps import GraphDumper
    from dhelix_compile.observe.measured import MeasurementPlan

log = logging.getLogger("dhelix")

_anonymous_graph_ids = itertools.count()


def capture(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: DHelixConfig,
    *,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Compile a Dynamo graph with dhelix; returns what ``torch.compile`` expects of a backend."""
    if config.codegen == "inductor":  # its workers, and its CPU check, start while AOTAutograd traces
        compat.start_compile_workers()
        compat.start_vec_isa_check(example_inputs)
    inner = functools.partial(compile_partition, config=config)
    with compile_clock.phase("capture"):  # the partitions' compiles inside count as their own phases
        compiled = compat.compile_with_aot_autograd(
            gm,
            example_inputs,
            inner,
            inductor_config_patches=compat.inductor_mode_options(mode),
            joint_pass=joint_pass(config),
        )
    write_compile_clock(config)
    return compiled


def joint_pass(config: DHelixConfig) -> JointPasses:
    """What runs on AOTAutograd's joint graph before it is partitioned: ``graph_passes.joint``'s
    list, ``vocab_parallel_loss`` only with the option of that name (``graph_passes`` README)."""
    return joint_passes(disabled=() if config.vocab_parallel_loss else ("vocab_parallel_loss",))


def compile_partition(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    config: DHelixConfig,
    graph_name: str | None = None,
    on_scheduled: Callable[[torch.fx.GraphModule, PassContext], None] | None = None,
    records: dict[str, dict[str, float]] | None = None,
    planned: tuple[torch.fx.GraphModule, PassContext] | None = None,
    finish: Callable[[torch.fx.GraphModule], object] | None = None,
    donated: Sequence[int] = (),
    **inductor_kwargs: Any,
) -> Callable[..., Any]:
    """Run the pass pipeline on one partition and generate its code (see the module docstring).

    ``graph_name`` overrides the name derived from Dynamo's compile id and the phase (helix's
    merged graphs); ``on_scheduled`` is called with the scheduled graph and the passes' context
    before codegen (not when the pipeline fell back to plain Inductor), and may keep it: codegen
    compiles a copy. ``records`` are numbers the caller decided by (``ctx.records``, in the
    summary beside the passes'). ``planned`` is
    :func:`plan_partition`'s result for ``gm`` under ``config``: it is compiled as is unless
    dumps are asked for (they record every pass, so the pipeline runs again). ``finish``: a last
    rewrite of a copy of the scheduled graph, after ``on_scheduled`` has seen it, before the
    dumps and codegen (helix's gradients added into ``.grad`` in the graph). ``donated``: the
    positions of inputs the caller hands over, whose buffers the generated code may reuse
    (``_torch_compat.mark_donated``).
    """
    phase = _phase_of(inductor_kwargs)
    name = graph_name or _graph_name(phase)
    dumper = _dumper(config, name)
    ctx = planned[1] if planned is not None and dumper is None else None
    if ctx is None:
        ctx = _pass_context(gm, example_inputs, config, name, phase, dumper)
    for group, values in (records or {}).items():
        ctx.record(group, **values)
    if dumper is not None:
        dumper.write_input(gm)
    try:
        if planned is not None and ctx is planned[1]:
            scheduled = planned[0]
        else:
            with compile_clock.phase("passes"):
                scheduled = run_pipeline(copy_graph_module(gm), ctx, disabled=config.disable_passes)
    except PassError as exc:
        if config.fallback == "error":
            raise
        log.warning("%s; falling back to plain Inductor on the untouched graph", exc)
        # if a pass failed on some ranks only, their orders differ: fail clearly, never hang
        with compile_clock.phase("agreement"):
            check_rank_consistency(gm, name, graph_wait_s(gm, config.consistency_timeout_s))
        if dumper is not None:
            dumper.write_summary(ctx, fallback=str(exc), profile_steps=config.profile_steps)
        plan = _measurement_plan(gm, name, dumper, config)  # before codegen: Inductor rewrites its graph
        with compile_clock.phase("codegen"):
            compiled = compat.inductor_compile_partition(gm, example_inputs, **inductor_kwargs)
        compile_clock.count("graphs")
        write_compile_clock(config)
        return _profiled(compiled, plan, dumper, config)
    if on_scheduled is not None:
        on_scheduled(scheduled, ctx)
    if finish is not None or donated or on_scheduled is not None:
        # Inductor rewrites the graph it compiles (reinplacing, on an FX-graph-cache miss only): the
        # graph the caller keeps must not depend on whether the cache hit
        scheduled = copy_graph_module(scheduled)
    if finish is not None:
        finish(scheduled)
    if donated:
        compat.mark_donated(scheduled, donated)
    with compile_clock.phase("agreement"):
        check_rank_consistency(scheduled, name, graph_wait_s(scheduled, config.consistency_timeout_s))
    if dumper is not None:
        with compile_clock.phase("dumps"):
            stand_ins = [n.meta[STAND_IN_KEY] for n in scheduled.graph.nodes if STAND_IN_KEY in n.meta]
            if ctx.estimator is not None and stand_ins:  # the final timeline prices them (PlannedCosts)
                ctx.estimator.measure_new(stand_ins)
            write_final_dumps(dumper, gm, scheduled, ctx.estimator or _dump_estimator(config, gm, example_inputs))
            dumper.write_summary(
                ctx, codegen=config.codegen, comm_order=comm_order(scheduled), profile_steps=config.profile_steps
            )
    log.debug("%s: stats %s", name, {k: dict(v) for k, v in ctx.stats.items()})
    plan = _measurement_plan(scheduled, name, dumper, config)  # before codegen: Inductor rewrites its graph
    with compile_clock.phase("codegen"):
        compiled = generate(
            scheduled, example_inputs, config.codegen, inductor_kwargs, strand_kernels=config.helix_strand_kernels
        )
    compile_clock.count("graphs")
    write_compile_clock(config)
    return _profiled(compiled, plan, dumper, config)


def plan_partition(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    config: DHelixConfig,
    graph_name: str,
    phase: Phase,
) -> tuple[torch.fx.GraphModule, PassContext]:
    """The pass pipeline on a copy of ``gm`` without codegen or dumps: the scheduled graph and
    what the passes predicted, for a caller that weighs candidate graphs before compiling one.
    Raises :class:`PassError` when a pass fails."""
    ctx = _pass_context(gm, example_inputs, config, graph_name, phase, None)
    with compile_clock.phase("passes"):
        scheduled = run_pipeline(copy_graph_module(gm), ctx, disabled=config.disable_passes)
    return scheduled, ctx


def _pass_context(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: DHelixConfig,
    name: str,
    phase: Phase,
    dumper: GraphDumper | None,
) -> PassContext:
    """What the passes get for ``gm``: its estimator (measured first, when profiled) and options."""
    communicates = has_communication(gm)
    if communicates:  # before anything is measured on them
        bound_graph_timeouts(gm, config.group_timeout_s)
    threads = _gloo_threads_ahead() if config.gloo_thread_priority == "realtime" and communicates else None
    start = time.perf_counter()  # after the threads moved: the profile measures what the steps will run
    estimator = _estimator(config, gm, example_inputs, name)
    ctx = PassContext(
        graph_name=name,
        phase=phase,
        example_inputs=example_inputs,
        estimator=estimator,
        pass_options={**pass_options(config), GLOO_COLLECTIVES: GlooCollectiveOptions(gloo_groups(gm))},
        observer=dumper,
    )
    if threads is not None and (threads.moved or threads.already):
        ctx.record("gloo_threads", moved=threads.moved, already_realtime=threads.already)
    if estimator is not None:  # building a profiled estimator measures the graph's ops and collectives
        ctx.record(
            "cost_model",
            calibration_s=time.perf_counter() - start,
            contention_factor=float(estimator.contention_factor),
            **{
                f"contention_factor_{transfer}": factor
                for transfer, factor in (
                    estimator.measured_contention.items() if isinstance(estimator, ProfiledEstimator) else ()
                )
            },
        )
        if isinstance(estimator, ProfiledEstimator) and estimator.speed is not None:
            ctx.record("cost_model", machine_speed=estimator.speed)
    return ctx


_THREAD_REASONS: set[str] = set()


def _gloo_threads_ahead() -> ThreadPriority:
    """Gloo's threads ahead of the compute (``comm_threads``); why not, logged as a warning the
    first time in a process and at INFO for each new reason after it."""
    result = prioritize_gloo_threads(local_ranks(), torch.get_num_threads())
    if result.moved:
        refused = f"; the kernel refused {result.refused_share:.1%}" if result.refused_share else ""
        log.info(
            "%d gloo threads moved to real-time priority (SCHED_DEADLINE, %.1f%% of each ms%s; "
            "gloo_thread_priority='realtime')",
            result.moved,
            result.share * 100,
            refused,
        )
    if result.reason is not None and result.reason not in _THREAD_REASONS:
        level = logging.INFO if _THREAD_REASONS else logging.WARNING
        _THREAD_REASONS.add(result.reason)
        log.log(
            level,
            "gloo's threads stay at normal priority: %s. A transfer in flight then waits for the "
            "scheduler while this rank computes, and hides less under it (slower steps, the same "
            "results); later compiles try again; gloo_thread_priority='normal' silences this",
            result.reason,
        )
    return result


def gloo_groups(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The live gloo groups ``gm`` all-gathers or reduce-scatters on: the ``gloo_collectives``
    pass sends those collectives as all-to-alls (its module docstring says why)."""
    c10d = torch.ops._c10d_functional
    names = {
        str(node.args[2] if node.target is c10d.all_gather_into_tensor.default else node.args[3])
        for node in gm.graph.nodes
        if node.target in (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
    }
    return frozenset(name for name in names if compat.group_backend(name) == "gloo")


def _estimator(
    config: DHelixConfig, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str
) -> Estimator | None:
    """The passes' estimator (none for a graph without communication).

    Profiling measures the graph's collectives on the live group, so ranks that traced
    different graphs would wait on each other's measurements: check their collective
    sequences first, for the error that names the first difference.
    """
    if not has_communication(gm):
        return None
    if resolve_cost_model(config, gm) == "profile":
        with compile_clock.phase("agreement"):
            check_rank_consistency(gm, name, graph_wait_s(gm, config.consistency_timeout_s))
    return build_estimator(config, gm, example_inputs)


def _dumper(config: DHelixConfig, name: str) -> GraphDumper | None:
    """The graph's dump writer with ``dump_dir`` (loaded here, not at import: ``observe`` is only for dumps)."""
    if not config.dump_dir:
        return None
    from dhelix_compile.observe.dumps import GraphDumper

    return GraphDumper(config.dump_dir, name)


def write_compile_clock(config: DHelixConfig) -> None:
    """With ``dump_dir``: this process's compile clock (seconds per phase, counts) into its rank's
    folder, written after each compile, so the file holds the totals up to the last one."""
    if not config.dump_dir:
        return
    from dhelix_compile.observe.dumps import write_compile_clock as write

    write(config.dump_dir)


def _measurement_plan(
    gm: torch.fx.GraphModule, name: str, dumper: GraphDumper | None, config: DHelixConfig
) -> MeasurementPlan | None:
    """What ``profile_steps`` measures of ``gm`` (``None`` when not asked); call it before codegen."""
    if dumper is None or config.profile_steps == 0:
        return None
    from dhelix_compile.observe.measured import MeasurementPlan

    return MeasurementPlan.of(gm, name, dumper.predicted)


def _profiled(
    compiled: Callable[..., Any], plan: MeasurementPlan | None, dumper: GraphDumper | None, config: DHelixConfig
) -> Callable[..., Any]:
    """``compiled``; with a plan, ``config.profile_steps`` calls after a warm-up call are profiled into the dump folder."""
    if plan is None or dumper is None:
        return compiled
    from dhelix_compile.observe.measured import profile_first_steps

    return profile_first_steps(compiled, plan, config.profile_steps, on_done=dumper.write_measured)


def write_final_dumps(
    dumper: GraphDumper, original: torch.fx.GraphModule, scheduled: torch.fx.GraphModule, estimator: Estimator
) -> None:
    """Timelines and graph picture of a compiled graph; a failure only warns (dumps are a diagnosis aid)."""
    try:
        dumper.write_timelines(original, scheduled, PlannedCosts(estimator))
        dumper.write_graph_picture(scheduled)
    except Exception as exc:  # noqa: BLE001 - a picture must not fail a compile
        log.warning("%s: writing the timeline / graph picture failed: %s", dumper.graph_name, exc)


def _dump_estimator(config: DHelixConfig, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Estimator:
    """For the dump of a graph without collectives (its passes get no estimator): analytic, no calibration."""
    return build_estimator(config.patch(cost_model="analytic"), gm, example_inputs)


def comm_order(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's collective issues and waits in order, e.g. ``["all_gather_into_tensor", "wait_tensor"]``."""
    return [op_name(n) for n in gm.graph.nodes if n.meta.get("dhelix", {}).get("kind") in ("collective", "p2p", "wait")]


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose graph passes may rewrite freely; node meta is copied shallowly."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)


def _phase_of(inductor_kwargs: dict[str, Any]) -> Phase:
    if inductor_kwargs.get("is_backward"):
        return "bwd"
    if inductor_kwargs.get("is_inference"):
        return "inference"
    return "fwd"


def _graph_name(phase: Phase) -> str:
    compile_id = compat.current_compile_id()
    prefix = compile_id.replace("/", "_") if compile_id else f"g{next(_anonymous_graph_ids)}"
    return f"{prefix}_{phase}"
