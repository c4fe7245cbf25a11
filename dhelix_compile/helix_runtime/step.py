"""``helix``: run micro-batch i+1's forward and micro-batch i's backward as one merged graph.

    step = dhelix_compile.helix(model, loss_fn=None, **options)   # options as for the backend
    losses = step(microbatches)     # detached scalar losses, one per micro-batch
    optimizer.step()

Contract
    - ``microbatches``: a non-empty list (or tuple); each item is a dict (``model(**mb)``), a
      tuple or list (``model(*mb)``) or a tensor (``model(mb)``).
    - ``loss_fn=None``: the model's output is the loss, a scalar tensor or an object with
      ``.loss`` (Hugging Face style); otherwise ``loss_fn(model, mb)`` returns it.
    - After a step every parameter's ``.grad`` holds what ``for mb in microbatches:
      loss(mb).backward()`` would leave: gradients accumulate onto existing ``.grad``, in
      micro-batch order. A ``data_parallel`` model's replicated gradients are all-reduced once,
      by the last backward (gradient sync is off for the other micro-batches' forwards).
    - Execution: the strand calls F(i) (micro-batch i's forward) and B(i) (its backward) in the
      steps of ``helix_runtime.schedule``, two calls of a step as one merged graph ordered by the
      ``interleave`` pass (``helix_runtime.strand_handoff`` explains the mechanics). The default
      (``helix_schedule="forward_backward"``): F0 | B0+F1 | ... | B(n-1). n = 1 is F then B.
      Forwards of a ``data_parallel`` model's last micro-batch (gradient sync on) are a graph
      of their own: paired with another forward, the two run one after the other.
    - The model is captured whole (``fullgraph=True``, static shapes): a graph break is an
      error. Micro-batches of another shape compile their own graphs; a forward and a
      backward of different shapes run one after the other instead of merged.
    - Refused with :class:`HelixError` (naming the problem): an empty list, an item of another
      type, no parameter requiring grad, a loss that is not a scalar or does not require grad.
    - Random ops (dropout in training mode): every backward uses the mask its forward drew, and
      the step draws the random numbers of the accumulation loop through the same code
      generator (``helix_runtime.random_ops``: two calls that both advance the generator run
      one after the other).
    - Activation checkpointing (non-reentrant: ``torch.utils.checkpoint.checkpoint``, Hugging
      Face's ``gradient_checkpointing_enable``, ``checkpoint_wrapper``, selective checkpointing)
      runs as Inductor runs it: the recompute is in B. The RNG-state wrappers it puts around
      recomputed ops (attention kernels among them) draw only when the wrapped op does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dhelix_compile import _torch_compat as compat
from dhelix_compile.compiler import resolve_config
from dhelix_compile.config import DHelixConfig
from dhelix_compile.data_parallelism import gradient_sync_on_last
from dhelix_compile.helix_runtime.schedule import (
    HelixScheduleKind,
    ScheduleStep,
    StrandCall,
    helix_schedule,
    write_schedule,
)
from dhelix_compile.helix_runtime.strand_handoff import HelixError, Strands, find_helix_error
from dhelix_compile.own_code import with_own_code
from dhelix_compile.step_phases import step_phase

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

__all__ = ["HelixError", "HelixStep", "helix"]


def helix(model: torch.nn.Module, loss_fn: LossFn | None = None, **options: Any) -> HelixStep:
    """A training step over micro-batches with forward/backward strand interleaving.

    ``options`` are the backend's (:class:`~dhelix_compile.config.DHelixConfig` fields),
    validated now.
    """
    if not isinstance(model, torch.nn.Module):
        raise HelixError(f"helix(model, ...) needs a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise HelixError(f"helix loss_fn must be callable as loss_fn(model, micro_batch), got {loss_fn!r}")
    return HelixStep(model, loss_fn, resolve_config(options))


class HelixStep:
    """The callable ``helix`` returns; see the module docstring."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn | None, config: DHelixConfig) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.config = config
        self._strands = Strands(config, self)
        self._recorded: list[ScheduleStep] | None = None  # the schedule last written to dump_dir
        self._compiled = torch.compile(
            with_own_code(self._loss, "helix_loss"), backend=self._strands.backend, fullgraph=True, dynamic=False
        )
        if config.codegen == "inductor":  # its workers, and its CPU check, start while the first call traces
            compat.start_compile_workers()
            compat.start_vec_isa_check(model.parameters())

    @property
    def schedule_kind(self) -> HelixScheduleKind:
        """The ``helix_schedule`` option."""
        return self.config.helix_schedule

    def schedule(self, n: int) -> list[ScheduleStep]:
        """The steps a call over ``n`` micro-batches runs (``helix_runtime.schedule``)."""
        return helix_schedule(n, self.schedule_kind)

    def __call__(self, microbatches: Sequence[Any]) -> list[torch.Tensor]:
        items = self._check(microbatches)
        self._strands.merging = len(items) > 1
        losses: dict[int, torch.Tensor] = {}
        last = len(items) - 1
        with gradient_sync_on_last(self.model) as before_forward:

            def run(call: StrandCall) -> None:
                if call.phase == "fwd":
                    before_forward(call.index == last)  # the partner's forward parks before the next flips it
                    losses[call.index] = self._forward(items[call.index])
                else:
                    losses[call.index].backward()
                    losses[call.index] = losses[call.index].detach()  # let its autograd graph go now

            steps = self.schedule(len(items))
            if self.config.dump_dir and steps != self._recorded:  # once, not every step
                from dhelix_compile.observe.dumps import rank_folder  # observe: only for dumps

                write_schedule(rank_folder(self.config.dump_dir), self.schedule_kind, steps)
                self._recorded = steps
            for step in steps:
                with step_phase("+".join(map(str, step))):
                    if len(step) == 1:
                        run(step[0])
                    else:
                        first, second = step
                        self._strands.run_together(functools.partial(run, first), functools.partial(run, second))
        return [losses[i] for i in range(len(items))]

    # ------------------------------------------------------------------ compile

    def _loss(self, item: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(self.model, item)
        if isinstance(item, Mapping):
            out = self.model(**item)
        elif isinstance(item, (tuple, list)):
            out = self.model(*item)
        else:
            out = self.model(item)
        return out if isinstance(out, torch.Tensor) else out.loss

    # ------------------------------------------------------------------ run

    def _forward(self, item: Any) -> torch.Tensor:
        try:
            with compat.logging_calls_ignored_by_dynamo():  # a model's log line is no graph break (thread-local)
                loss = self._compiled(item)
        except Exception as exc:
            helix_error = find_helix_error(exc)
            if helix_error is not None:
                raise helix_error from None
            raise
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise HelixError(f"helix needs a scalar loss per micro-batch; got {shape} (reduce it, e.g. .mean())")
        if not loss.requires_grad:
            raise HelixError("helix: the loss does not require grad (does it depend on any parameter?)")
        return loss

    def _check(self, microbatches: Sequence[Any]) -> list[Any]:
        if isinstance(microbatches, (torch.Tensor, Mapping)) or not isinstance(microbatches, Sequence):
            raise HelixError(f"a helix step takes a list of micro-batches, got {type(microbatches).__name__}")
        items = list(microbatches)
        if not items:
            raise HelixError("a helix step needs at least one micro-batch; got an empty list")
        for index, item in enumerate(items):
            if not isinstance(item, (torch.Tensor, Mapping, tuple, list)):
                raise HelixError(
                    f"micro-batch {index} is a {type(item).__name__}; expected a dict (model(**mb)), "
                    "a tuple (model(*mb)) or a tensor (model(mb))"
                )
        if not any(p.requires_grad for p in self.model.parameters()):
            raise HelixError("helix: the model has no parameter that requires grad; there is nothing to train")
        return items
