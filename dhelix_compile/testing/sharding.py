"""Map a parallel model's local parameters and gradients to slices of the reference model's.

Contract
--------
A parallel model here keeps the reference model's parameter names; each local parameter is
either

* a shard: ``full.chunk(world_size, dim)[rank]`` of the reference parameter (even split), or
* a replica: the whole reference parameter.

``shard_dims(model)`` says which, as ``{name: dim or None}``: from DTensor placements for
``parallelize_module`` models, from ``model.shard_dims()`` for the hand-written ones.

Gradients follow the convention "the ranks' losses sum to the reference loss" (for DTensor
models the loss is replicated and counted once, DTensor's own convention). So a sharded
parameter's local gradient must equal the slice of the reference gradient, and a replicated
parameter's gradient must equal the whole reference gradient once partial gradients are summed
over ranks: ``sync_replicated_grads`` does that for plain replicated parameters of hand-written
models (norm weights under sequence parallelism, a router, a replicated embedding), and
``local_grad`` does it for DTensor gradients (a ``Partial`` gradient of a ``Replicate``
parameter, a ``Replicate`` gradient of a ``Shard(0)`` embedding) by redistributing to the
parameter's placements. Both are collectives: call them on every rank in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = [
    "assert_matches_reference",
    "copy_shards_from",
    "local_grad",
    "local_value",
    "reference_slice",
    "shard_dims",
    "sync_replicated_grads",
]


def reference_slice(full: torch.Tensor, dim: int | None, rank: int, world_size: int) -> torch.Tensor:
    """The part of ``full`` that ``rank`` holds: ``full.chunk(world_size, dim)[rank]`` or all."""
    if dim is None:
        return full
    if full.shape[dim] % world_size:
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} not divisible by {world_size}")
    return full.chunk(world_size, dim)[rank]


@runtime_checkable
class DeclaresShardDims(Protocol):
    """A hand-written parallel model: ``shard_dims()`` says which of its parameters are shards."""

    def shard_dims(self) -> Mapping[str, int | None]: ...


@torch.no_grad()
def copy_shards_from(model: nn.Module, reference: nn.Module, rank: int, world_size: int) -> None:
    """Fill ``model``'s parameters with ``rank``'s slices of ``reference``'s (``model.shard_dims()``)."""
    reference_params = dict(reference.named_parameters())
    assert isinstance(model, DeclaresShardDims), f"{type(model).__name__} declares no shard_dims()"
    dims = model.shard_dims()
    for name, param in model.named_parameters():
        param.copy_(reference_slice(reference_params[name].detach(), dims[name], rank, world_size))


def _dtensor_dim(param: DTensor) -> int | None:
    if param.device_mesh.ndim != 1:
        raise ValueError(f"only 1-D meshes are supported, got {param.device_mesh}")
    placement = param.placements[0]
    if isinstance(placement, Shard):
        return placement.dim % param.ndim
    if isinstance(placement, Replicate):
        return None
    raise ValueError(f"unexpected parameter placement {placement}")


def shard_dims(model: nn.Module) -> dict[str, int | None]:
    """``{parameter name: sharded dim or None (replicated)}`` in ``named_parameters`` order."""
    declared: Mapping[str, int | None] = model.shard_dims() if isinstance(model, DeclaresShardDims) else {}
    dims: dict[str, int | None] = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            dims[name] = _dtensor_dim(param)
        else:
            dims[name] = declared.get(name)
    return dims


def local_value(param: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a (possibly DTensor) parameter."""
    return param.to_local() if isinstance(param, DTensor) else param.detach()


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The rank-local gradient laid out like the parameter (collective for DTensor params).

    DTensor gradients need not share the parameter's placements: in torch 2.13 the gradient of a
    ``Replicate`` norm weight under ``SequenceParallel`` is ``Partial(sum)`` and the gradient of a
    vocab-sharded (``Shard(0)``) embedding is ``Replicate``; both are redistributed here.
    """
    grad = param.grad
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        assert isinstance(param, DTensor)
        if tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad.to_local()
    return grad


@torch.no_grad()
def sync_replicated_grads(model: nn.Module, names: Iterable[str], group: dist.ProcessGroup | None = None) -> None:
    """Sum the gradients of the named plain (non-DTensor) parameters over ``group``, in place."""
    params = dict(model.named_parameters())
    for name in names:
        grad = params[name].grad
        if grad is not None:
            dist.all_reduce(grad, group=group)


def assert_matches_reference(
    model: nn.Module,
    reference: nn.Module,
    rank: int,
    world_size: int,
    *,
    grads: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """Assert every local parameter (and gradient) equals its slice of the reference's.

    Replicated plain parameters' gradients must already be summed (``sync_replicated_grads``).
    Raises ``AssertionError`` naming every mismatching parameter and the largest difference.
    """
    ref_params = dict(reference.named_parameters())
    dims = shard_dims(model)
    problems: list[str] = []
    for name, param in model.named_parameters():
        if name not in ref_params:
            problems.append(f"{name}: not in the reference model")
            continue
        pairs = [("value", local_value(param), ref_params[name].detach())]
        if grads:
            grad = local_grad(param)
            ref_grad = ref_params[name].grad
            if grad is None or ref_grad is None:
                problems.append(
                    f"{name}: missing gradient (local: {grad is not None}, reference: {ref_grad is not None})"
                )
                continue
            pairs.append(("grad", grad, ref_grad))
        for what, got, full in pairs:
            want = reference_slice(full, dims[name], rank, world_size)
            if got.shape != want.shape:
                problems.append(f"{name}.{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            elif not torch.allclose(got, want.to(got.dtype), atol=atol, rtol=rtol):
                diff = (got - want.to(got.dtype)).abs().max().item()
                problems.append(f"{name}.{what}: max abs diff {diff:.3g} (dim={dims[name]})")
    if problems:
        raise AssertionError(f"rank {rank}/{world_size}: " + "; ".join(problems))
