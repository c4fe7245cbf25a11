"""``dhelix::with_accumulated_grad``: a backward's gradient plus what its parameter accumulated so far.

Gradient accumulation with one reduction per step (DDP's ``no_sync``): the micro-batches before
the last leave their local gradients in ``param.grad``; the last backward must all-reduce
``param.grad + g``, not ``g``. A compiled backward graph cannot read ``param.grad`` (it is no
input of the graph, and under ``helix`` the previous micro-batch's backward is still running when
the last forward starts), so the graph calls this op where it needs the sum::

    total = with_accumulated_grad(g, slot)     # g + param.grad (in g's dtype); param.grad = None
    reduced = all_reduce(total / ranks)         # autograd then stores ``reduced`` in param.grad

``slot`` names the parameter (:func:`accumulator_slot`). The op reads ``param.grad`` when it runs,
then clears it, so autograd's accumulation afterwards stores the reduced sum instead of adding it
to the local one. ``param.grad`` may be a DTensor (its local tensor is added). With nothing
accumulated it returns a copy of ``g`` (a custom op's output may not alias its input).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.distributed.tensor import DTensor

_slots = itertools.count()
_PARAMETERS: dict[int, weakref.ref[torch.Tensor]] = {}


def accumulator_slot(param: torch.Tensor) -> int:
    """A new slot naming ``param`` for :func:`with_accumulated_grad` (held weakly)."""
    slot = next(_slots)
    _PARAMETERS[slot] = weakref.ref(param, lambda _: _PARAMETERS.pop(slot, None))
    return slot


@torch.library.custom_op("dhelix::with_accumulated_grad", mutates_args=())
def with_accumulated_grad(grad: torch.Tensor, slot: int) -> torch.Tensor:
    """``grad`` plus the gradient accumulated in the slot's parameter, whose ``.grad`` it clears."""
    ref = _PARAMETERS.get(slot)
    param = ref() if ref is not None else None
    accumulated = param.grad if param is not None else None
    if accumulated is None:
        return grad.clone()
    assert param is not None
    param.grad = None
    local = accumulated.to_local() if isinstance(accumulated, DTensor) else accumulated
    return grad + local.to(grad.dtype)


@with_accumulated_grad.register_fake
def _with_accumulated_grad_fake(grad: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty_like(grad)


#: The op as graphs call it (``torch.ops.dhelix.with_accumulated_grad.default``).
WITH_ACCUMULATED_GRAD = torch.ops.dhelix.with_accumulated_grad.default
