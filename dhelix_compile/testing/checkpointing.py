"""Activation checkpointing on a model's blocks, applied the ways users apply it.

``checkpoint_blocks(model.layers, kind)`` replaces each block of a ``ModuleList`` in place by
the block under non-reentrant checkpointing (the only kind ``torch.compile`` captures whole):

* ``"checkpoint"``: ``torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)``
  around every call, as Hugging Face's ``gradient_checkpointing_enable`` does;
* ``"checkpoint_wrapper"``: torch's ``checkpoint_wrapper`` module
  (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, ``NO_REENTRANT``), as
  FSDP users and torchtitan's "full" mode wrap their blocks;
* ``"selective"``: ``checkpoint`` with ``create_selective_checkpoint_contexts`` and
  :func:`save_matmuls`: matmul outputs saved, everything else recomputed -- torchtitan's "op"
  mode saves matmuls, attention and a few collectives; attention is left to the recompute here,
  so its kernel is recomputed in the backward under AOTAutograd's RNG-state wrappers.

Parameter names gain the wrapper's prefix (``block.`` / ``_checkpoint_wrapped_module.``); their
order is unchanged, so gradients compare with an unwrapped copy's in ``parameters()`` order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten

CheckpointKind = Literal["checkpoint", "checkpoint_wrapper", "selective"]
CHECKPOINT_KINDS: tuple[CheckpointKind, ...] = ("checkpoint", "checkpoint_wrapper", "selective")

#: The matmuls :func:`save_matmuls` saves.
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


class Checkpointed(nn.Module):
    """``block`` called under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, with
    ``context_fn`` when given (Dynamo traces checkpoint's default ``noop_context_fn`` only when it
    is not passed)."""

    def __init__(self, block: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.context_fn is None:
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)


def save_matmuls(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective-checkpointing policy: matmul outputs saved, every other op recomputed."""
    return CheckpointPolicy.MUST_SAVE if func in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(block: nn.Module, kind: CheckpointKind) -> nn.Module:
    """``block`` under checkpointing of ``kind`` (see the module docstring)."""
    if kind == "checkpoint":
        return Checkpointed(block)
    if kind == "selective":
        return Checkpointed(block, functools.partial(create_selective_checkpoint_contexts, save_matmuls))
    if kind == "checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    raise ValueError(f"unknown checkpointing kind {kind!r}; expected one of {CHECKPOINT_KINDS}")


def checkpoint_blocks(blocks: nn.ModuleList, kind: CheckpointKind) -> nn.ModuleList:
    """Every block of ``blocks`` replaced, in place, by :func:`checkpointed`; returns ``blocks``."""
    for i, block in enumerate(blocks):
        blocks[i] = checkpointed(block, kind)
    return blocks
