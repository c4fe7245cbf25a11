"""``dhelix::with_accumulated_grad`` and ``dhelix::grad_total``: a backward's gradient plus what its
parameter accumulated so far.

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

``grad_total(g, slot)`` is the same sum computed into ``param.grad``'s own buffer: ``helix``'s
backward graphs return it in place of ``g`` (``helix_runtime.grad_accumulation``), so each
micro-batch's gradient is freed as soon as it is added instead of being held as a graph output
until the graph ends (in a merged graph, while the next micro-batch's forward runs). Autograd
then stores the returned total in the cleared ``param.grad``, as it stores a first gradient:
``.grad`` ends as eager's, added in the same order. Where adding in place would differ from
autograd's accumulation, it returns a copy of ``g`` and leaves ``.grad`` alone: nothing
accumulated yet, hooks on the parameter (a tensor hook must see ``g`` alone), a local gradient
of another dtype, shape or stride, or one that is a view into a larger buffer (DDP's
``gradient_as_bucket_view``, a flat gradient buffer: autograd adds into it in place, and the
buffer stays ``.grad``'s storage). Otherwise ``.grad`` afterwards may be another tensor object
with the same values (autograd stores or copies the returned sum).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.distributed.tensor import DTensor

from dhelix_compile import _torch_compat as compat

_slots = itertools.count()
_PARAMETERS: dict[int, weakref.ref[torch.Tensor]] = {}


def accumulator_slot(param: torch.Tensor) -> int:
    """A new slot naming ``param`` for :func:`with_accumulated_grad` and :func:`grad_total` (held weakly)."""
    slot = next(_slots)
    _PARAMETERS[slot] = weakref.ref(param, lambda _: _PARAMETERS.pop(slot, None))
    return slot


def _parameter(slot: int) -> torch.Tensor | None:
    ref = _PARAMETERS.get(slot)
    return ref() if ref is not None else None


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


@torch.library.custom_op("dhelix::with_accumulated_grad", mutates_args=())
def with_accumulated_grad(grad: torch.Tensor, slot: int) -> torch.Tensor:
    """``grad`` plus the gradient accumulated in the slot's parameter, whose ``.grad`` it clears."""
    param = _parameter(slot)
    accumulated = param.grad if param is not None else None
    if accumulated is None:
        return grad.clone()
    assert param is not None
    param.grad = None
    return grad + _local(accumulated).to(grad.dtype)


@with_accumulated_grad.register_fake
def _with_accumulated_grad_fake(grad: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty_like(grad)


@torch.library.custom_op("dhelix::grad_total", mutates_args=())
def grad_total(grad: torch.Tensor, slot: int) -> torch.Tensor:
    """``grad`` added into the slot's ``param.grad`` buffer, which is returned (``.grad`` cleared);
    a copy of ``grad`` where that would differ from autograd's accumulation (module docstring)."""
    param = _parameter(slot)
    accumulated = param.grad if param is not None else None
    if accumulated is None or param is None or compat.has_tensor_hooks(param):
        return grad.clone()
    local = _local(accumulated)
    if (local.dtype, local.shape, local.stride()) != (grad.dtype, grad.shape, grad.stride()) or local.requires_grad:
        return grad.clone()
    if local.storage_offset() or local.untyped_storage().nbytes() != local.numel() * local.element_size():
        return grad.clone()  # a view into a buffer (DDP's gradient_as_bucket_view): autograd adds into it
    param.grad = None
    return local.add_(grad)


@grad_total.register_fake
def _grad_total_fake(grad: torch.Tensor, slot: int) -> torch.Tensor:
    return torch.empty_like(grad)


#: The ops as graphs call them (``torch.ops.dhelix.with_accumulated_grad.default``, ...).
WITH_ACCUMULATED_GRAD = torch.ops.dhelix.with_accumulated_grad.default
GRAD_TOTAL = torch.ops.dhelix.grad_total.default
