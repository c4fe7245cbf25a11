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
    - Execution: F(1), M(2,1), M(3,2), ..., M(n,n-1), B(n), where M is the merged graph
      ordered by the ``interleave`` pass (``dhelix_compile.helix_runtime.strands`` explains the mechanics).
      n = 1 is F then B.
    - The model is captured whole (``fullgraph=True``, static shapes): a graph break is an
      error. Micro-batches of another shape compile their own graphs; a forward and a
      backward of different shapes run one after the other instead of merged.
    - Refused with :class:`HelixError` (naming the problem): an empty list, an item of another
      type, no parameter requiring grad, a loss that is not a scalar or does not require grad,
      and models that draw random numbers (dropout with p > 0 in training mode): helix does
      not reproduce eager's per-micro-batch RNG stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dhelix_compile import _torch_compat as compat
from dhelix_compile.compiler import resolve_config
from dhelix_compile.config import DHelixConfig
from dhelix_compile.data_parallelism import gradient_sync_on_last
from dhelix_compile.helix_runtime.strands import HelixError, Strands, find_helix_error
from dhelix_compile.own_code import with_own_code

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
        self._compiled = torch.compile(
            with_own_code(self._loss, "helix_loss"), backend=self._strands.backend, fullgraph=True, dynamic=False
        )

    def __call__(self, microbatches: Sequence[Any]) -> list[torch.Tensor]:
        items = self._check(microbatches)
        losses: list[torch.Tensor] = []
        last = len(items) - 1
        with gradient_sync_on_last(self.model) as before_forward:
            before_forward(last == 0)
            loss = self._forward(items[0])
            for index, item in enumerate(items[1:], start=1):
                before_forward(index == last)
                next_loss = self._forward_beside_backward(item, loss)
                losses.append(loss.detach())
                loss = next_loss
            loss.backward()
        losses.append(loss.detach())
        return losses

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
            with compat.logging_calls_ignored_by_dynamo():  # a model's log line is no graph break
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

    def _forward_beside_backward(self, item: Any, previous: torch.Tensor) -> torch.Tensor:
        """Run ``previous.backward()`` merged with the forward of ``item`` (see ``strands``)."""
        return self._strands.run_beside(previous.backward, lambda: self._forward(item))

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
