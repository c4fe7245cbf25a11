"""``helix_pipeline``: torch's pipeline schedules with each rank's forward and backward merged.

    stages = [PipelineStage(chunk_a, r, 2 * pp, device, group=pp_group),
              PipelineStage(chunk_b, 2 * pp - 1 - r, 2 * pp, device, group=pp_group)]
    schedule = ScheduleDualPipeV(stages, n_microbatches=8, loss_fn=loss_fn)
    schedule = dhelix_compile.helix_pipeline(schedule, **options)   # options as for the backend
    schedule.step(x, target=y)                                       # unchanged
    optimizer.step()

What runs
    Every stage module is compiled by dhelix (``module.compile(...)``: the module object stays
    the one the stage holds, and later calls to it run compiled too). A stage module whose
    forward is torch's own (an ``nn.Sequential`` of blocks, a bare ``nn.Linear``) also gets an
    instance attribute ``forward`` that calls that forward from a frame of dhelix's: Dynamo
    skips the frames of torch's files, and would compile none under it (``own_code``). The
    schedule's compute steps run on torch's own runtime (``_PipelineScheduleRuntime``: its
    sends, receives, gradient scaling and loss bookkeeping), with three steps replaced:

    ==============  ===========================================================================
    forward         the stage's compiled forward F
    full backward   the stage's compiled backward B (input and weight gradients in one graph)
    overlap         F of one stage and micro-batch and B of another as one merged graph,
                    ordered by the interleave pass (``helix_runtime.strand_handoff``): one strand's
                    collectives (TP, SP, EP inside the stage) run under the other's compute
    ==============  ===========================================================================

Which schedules pair what (``pairing`` has the rules)
    ``ScheduleDualPipeV``         its own ``OVERLAP_F_B`` steps (F of one chunk with B of the
                                  other: the folded pipeline, both ranks merge in the steady state)
    ``Schedule1F1B``              nothing in torch's order: every steady-state F and the B after it
                                  would lengthen the step (``makespan``), so each runs on its own;
                                  with ``order="eager_1f1b"``, each steady-state F and the B after
                                  it on every stage but the last (whose F and B are of one
                                  micro-batch)
    ``ScheduleInterleaved1F1B``   each F followed by a B of another micro-batch on the rank,
                                  when the pipeline still completes with the two merged
    A schedule's split backwards (``I`` then ``W``: zero-bubble steps of DualPipeV) run as one
    full backward at the ``I`` step: a compiled stage computes both gradients in one graph.

Data parallelism: stage modules wrapped by ``data_parallel`` over the DP dim of a ``(pp, dp)``
mesh carry their all-gathers and gradient reductions inside their graphs, so a merged step hides
one strand's DP collectives under the other's compute. Replicated gradients are all-reduced
once per step, by each stage's last backward (gradient sync off for the other micro-batches'
forwards, as ``helix`` does; the user's setting is restored after the step).

Stage boundaries: a DTensor whose two sides are declared in the stages' static metadata
(``input_args`` / ``output_args`` / ``input_grads`` / ``output_grads``) moves by a resharding
plan, in any layout on either side, its gradient back by the reverse plan (``boundaries``).

Refused with :class:`~dhelix_compile.helix_runtime.strand_handoff.HelixError`: another schedule type
(the message names the supported ones), a stage module already compiled, a stage module with
dropout in training mode (random ops found only when compiling fail the first step the same
way), a step whose batch does not split into equal micro-batches (a count torch rejects at
construction, below the number of stages, never reaches here), and ``cost_model="profile"``:
profiling agrees its measurements across all ranks, and the ranks of a pipeline compile
different stage graphs at different times; ``"auto"`` means the analytic model here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch

from dhelix_compile import _torch_compat as compat
from dhelix_compile.compiler import resolve_config
from dhelix_compile.config import DHelixConfig
from dhelix_compile.data_parallelism import gradient_sync_on_last
from dhelix_compile.group_timeouts import bound_group_timeouts, p2p_timeout_s
from dhelix_compile.helix_runtime.strand_handoff import HelixError, Strands, find_helix_error
from dhelix_compile.own_code import in_own_frame
from dhelix_compile.pipeline_runtime.boundaries import install_boundaries
from dhelix_compile.pipeline_runtime.pairing import (
    Compute,
    Order,
    Overlap,
    Step,
    as_full_backwards,
    one_f_one_b,
    pair_forwards_with_backwards,
)
from dhelix_compile.pipeline_runtime.steps import PipelineSteps
from dhelix_compile.step_phases import step_phase

__all__ = ["SUPPORTED_SCHEDULES", "helix_pipeline"]

#: ``order=``: the schedule's own compute order, or Alpa's eager 1F1B (``Schedule1F1B`` only).
PipelineOrder = Literal["schedule", "eager_1f1b"]

#: The torch schedules helix_pipeline runs, by class name.
SUPPORTED_SCHEDULES = ("ScheduleDualPipeV", "Schedule1F1B", "ScheduleInterleaved1F1B")


def helix_pipeline(schedule: Any, *, order: PipelineOrder = "schedule", **options: Any) -> Any:
    """``schedule`` with its compute steps run by dhelix; see the module docstring.

    ``order="eager_1f1b"`` (``Schedule1F1B`` only) runs Alpa's eager 1F1B instead of torch's order:
    more warm-up forwards, so each stage's sends start under compute (``pairing.one_f_one_b``).
    Returns the schedule itself when it is one of torch's runtime schedules (DualPipeV,
    Interleaved1F1B), and a drop-in runtime schedule over the same stage for ``Schedule1F1B``.
    """
    kind = type(schedule).__name__
    if kind not in SUPPORTED_SCHEDULES or type(schedule).__module__ != "torch.distributed.pipelining.schedules":
        raise HelixError(
            f"helix_pipeline runs {', '.join(SUPPORTED_SCHEDULES)} from torch.distributed.pipelining; got {kind}"
        )
    if order not in ("schedule", "eager_1f1b"):
        raise HelixError(f"helix_pipeline: order={order!r}; choose 'schedule' (the schedule's own) or 'eager_1f1b'")
    if order == "eager_1f1b" and kind != "Schedule1F1B":
        raise HelixError(f"helix_pipeline: order='eager_1f1b' reorders a Schedule1F1B; got {kind}")
    config = _pipeline_config(resolve_config(options))
    stages = compat.schedule_stages(schedule)
    for stage in stages:
        _check_stage_module(stage.submod, stage.stage_index)
    bound_group_timeouts(map(compat.stage_group, stages), config.group_timeout_s)  # its sends and receives
    install_boundaries(stages)
    runtime = schedule if compat.is_runtime_schedule(schedule) else compat.single_stage_runtime(schedule)
    steps = helix_order(schedule, eager_1f1b=order == "eager_1f1b")
    compat.set_pipeline_compute_order(runtime, _to_torch(steps))
    _HelixStages(runtime, stages, config, _last_backwards(steps))
    return runtime


def helix_order(schedule: Any, *, eager_1f1b: bool = False) -> Order:
    """The compute order helix_pipeline runs for ``schedule`` (every rank): torch's order with
    full backwards (or eager 1F1B's, for a ``Schedule1F1B``), and its forwards paired with
    backwards (module docstring)."""
    num_stages = compat.schedule_num_stages(schedule)
    if compat.is_runtime_schedule(schedule):
        order = {
            rank: [_from_torch(a) for a in actions] for rank, actions in compat.pipeline_compute_order(schedule).items()
        }
    else:
        order = one_f_one_b(num_stages, compat.schedule_microbatches(schedule), eager=eager_1f1b)
    order = as_full_backwards(order)
    if any(isinstance(step, Overlap) for steps in order.values() for step in steps):
        return order  # the schedule chose its overlaps (DualPipeV)
    return pair_forwards_with_backwards(order, num_stages)


def _pipeline_config(config: DHelixConfig) -> DHelixConfig:
    if config.cost_model == "profile":
        raise HelixError(
            "helix_pipeline plans with the analytic cost model: cost_model='profile' agrees its measurements "
            "across all ranks, and the ranks of a pipeline compile different stage graphs at different times"
        )
    return config.patch(cost_model="analytic") if config.cost_model == "auto" else config


def _check_stage_module(module: torch.nn.Module, stage_index: int) -> None:
    for name, sub in module.named_modules():
        if compat.compiled_module(sub):
            raise HelixError(
                f"stage {stage_index}'s module {name or '(root)'} is already compiled (torch.compile); "
                "helix_pipeline compiles the stage modules itself: pass the uncompiled modules"
            )
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.training and sub.p > 0:
            raise HelixError(
                f"stage {stage_index}'s module {name} is dropout with p={sub.p} in training mode: helix_pipeline "
                "runs one micro-batch's forward together with another's backward and does not reproduce eager's "
                "RNG stream. Set p=0 or call .eval() on the dropout layers."
            )


def _compile_stage_module(module: torch.nn.Module, backend: Callable[..., Any]) -> None:
    """``module.compile`` with dhelix's backend. A forward written in torch (``nn.Sequential``,
    ``nn.Linear``, a subclass that keeps theirs) is in Dynamo's skipfiles, and ``Module.compile``
    would find no frame to compile under it (``own_code``): the module gets an instance
    attribute ``forward`` that calls its own from a frame of dhelix's (``in_own_frame``)."""
    forward = module.forward
    if _written_in_torch(forward):
        module.forward = in_own_frame(forward, f"{type(module).__name__}_forward")
    module.compile(backend=backend, fullgraph=True, dynamic=False)


def _written_in_torch(fn: Callable[..., Any]) -> bool:
    package = (getattr(fn, "__module__", None) or "").partition(".")[0]
    return package == "torch"


class _HelixStages:
    """The stage modules compiled with one set of strands, and the schedule's compute steps."""

    def __init__(self, runtime: Any, stages: list[Any], config: DHelixConfig, last_backwards: dict[int, int]) -> None:
        self.strands = Strands(config, runtime, merge_across_graphs=True)
        self.steps = PipelineSteps(runtime, p2p_timeout_s(map(compat.stage_group, stages)))
        for stage in stages:
            _compile_stage_module(stage.submod, self.strands.backend)
        self.steps.install(self.forward, self.backward, self.overlap)
        self.last_backwards = last_backwards
        self.modules = {stage.stage_index: stage.submod for stage in stages}
        self.before_forward: dict[int, Callable[[bool], None]] = {}
        splits = compat.schedule_microbatches(runtime) if compat.splits_batch_on_dim0(runtime) else 1
        runtime.step = self._syncing_once(_raising_helix_errors(runtime.step, splits))

    def _syncing_once(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step`` with each ``data_parallel`` stage module's replicated gradients reduced by its
        last backward only (``gradient_sync_on_last``, as ``helix`` does; torch's own schedules do
        the same for DDP and FSDP2 modules): the forward of the micro-batch whose backward comes
        last turns sync on, the others off, and the user's setting is back after the step."""

        @functools.wraps(step)
        def run(*args: Any, **kwargs: Any) -> Any:
            with contextlib.ExitStack() as stack:
                self.before_forward = {
                    index: stack.enter_context(gradient_sync_on_last(module)) for index, module in self.modules.items()
                }
                for sync_if_last in self.before_forward.values():
                    # off from the start: torch's metadata inference (a real forward and backward on
                    # the first step, input gradients only) then runs the graphs of the early
                    # micro-batches, not a third variant per stage that Dynamo would compile
                    sync_if_last(False)
                try:
                    return step(*args, **kwargs)
                finally:
                    self.before_forward = {}

        return run

    def forward(self, action: Any, ctx: Any) -> None:
        with step_phase(_part_name(action)):
            self._forward(action, ctx)

    def _forward(self, action: Any, ctx: Any) -> None:
        _, stage, microbatch, _ = compat.pipeline_action_fields(action)
        if stage in self.before_forward:
            self.before_forward[stage](microbatch == self.last_backwards[stage])
        with compat.logging_calls_ignored_by_dynamo():  # a model's log line is no graph break
            self.steps.forward(action, ctx)

    def backward(self, action: Any, ctx: Any) -> None:
        with step_phase(_part_name(action)):
            self.steps.backward(action)()

    def overlap(self, action: Any, ctx: Any) -> None:
        _, _, _, subs = compat.pipeline_action_fields(action)
        assert subs is not None, "an overlap holds a forward and a backward"
        forward, backward = subs
        with step_phase(f"{_part_name(backward)}+{_part_name(forward)}"):
            run_backward = self.steps.backward(backward)  # its output gradient is here before F starts
            with self.steps.hand_overs_after():  # in one order on every rank, not the two threads'
                self.strands.run_together(run_backward, lambda: self._forward(forward, ctx))


def _part_name(action: Any) -> str:
    """``F2s3``: the forward of micro-batch 2 on stage 3 (``B2s3`` its backward), as
    ``dhelix_compile.step_phases`` names a part of the step."""
    kind, stage, microbatch, _ = compat.pipeline_action_fields(action)
    return f"{kind}{microbatch}s{stage}"


def _raising_helix_errors(step: Callable[..., Any], n_microbatches: int) -> Callable[..., Any]:
    """``step`` refusing a batch the schedule cannot split, and raising the HelixError a stage's
    compile raised, not Dynamo's wrapping of it."""

    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        _check_batch(args, kwargs, n_microbatches)
        try:
            return step(*args, **kwargs)
        except Exception as exc:
            helix_error = find_helix_error(exc)
            if helix_error is not None and helix_error is not exc:
                raise helix_error from None
            raise

    return run


def _check_batch(args: tuple[Any, ...], kwargs: dict[str, Any], n_microbatches: int) -> None:
    """A batch (inputs or target) that does not split into equal micro-batches on dim 0 (torch's
    default; a schedule given its own chunk specs is not checked here): torch fails deep in
    its splitting on fewer rows than micro-batches, and splits unevenly otherwise (10 rows in 4:
    3, 3, 2, 2), where every stage, compiled for one micro-batch shape, would recompile per shape."""
    for name, value in [*((f"input {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] % n_microbatches:
            raise HelixError(
                f"helix_pipeline: {name} has {value.shape[0]} rows (dim 0) and the schedule splits every step into "
                f"{n_microbatches} micro-batches: pass a multiple of {n_microbatches} rows (the stages are compiled "
                "for one micro-batch shape), or build the schedule with another micro-batch count"
            )


def _last_backwards(order: Order) -> dict[int, int]:
    """Each stage's micro-batch whose backward runs last (in an ``Overlap`` too)."""
    last: dict[int, int] = {}
    for steps in order.values():
        for step in steps:
            backward = step.backward if isinstance(step, Overlap) else step
            if backward.kind in ("B", "I"):
                last[backward.stage] = backward.microbatch
    return last


def _from_torch(action: Any) -> Step:
    kind, stage, microbatch, subs = compat.pipeline_action_fields(action)
    if subs is not None:
        forward, backward = (_from_torch(a) for a in subs)
        assert isinstance(forward, Compute) and isinstance(backward, Compute)
        return Overlap(forward, backward)
    if kind not in ("F", "B", "I", "W") or stage is None or microbatch is None:
        raise HelixError(f"helix_pipeline: unexpected step {action} in the schedule's compute order")
    return Compute(kind, stage, microbatch)  # type: ignore[arg-type]  # kind checked above


def _to_torch(order: Order) -> dict[int, list[Any]]:
    def action(step: Compute) -> Any:
        return compat.pipeline_action(step.kind, step.stage, step.microbatch)

    return {
        rank: [
            compat.pipeline_overlap_action(action(s.forward), action(s.backward))
            if isinstance(s, Overlap)
            else action(s)
            for s in steps
        ]
        for rank, steps in order.items()
    }
