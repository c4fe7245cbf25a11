"""The two data-parallel moves of a parameter, as differentiable functional collectives.

    gather_shards(shard, dim, group)        forward: all-gather the DP ranks' shards along ``dim``
                                            backward: reduce-scatter the gradient (mean over ranks)
    replicate_with_reduced_grad(x, group)   forward: ``x`` itself (cast to the compute dtype)
                                            backward: all-reduce the gradient (mean over ranks), or
                                            leave it local to accumulate (gradient sync off), or
                                            all-reduce it plus the locally accumulated one

Both are ``torch.autograd.Function`` s over ``torch.distributed._functional_collectives``, so
Dynamo traces them: the all-gather lands in the forward graph and the reduction in the backward
graph, where the passes (and ``helix``'s second strand) can schedule them. Shards are equal (the
caller picks a dim that splits evenly), so every rank traces the same graph.

Dtypes (mixed precision as FSDP2's ``MixedPrecisionPolicy``): the shard is cast to
``compute_dtype`` before the all-gather (the gather moves bf16 when asked); the gradient is cast
to ``reduce_dtype`` before the reduction, divided by the number of ranks first (DDP's order:
no overflow in low precision; for a power-of-two rank count the division is exact either way),
and the result cast back to the stored parameter's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed._functional_collectives as funcol

from dhelix_compile.ops.accumulated_grad import with_accumulated_grad

if TYPE_CHECKING:
    from dhelix_compile._torch_compat import GroupName

__all__ = ["gather_shards", "replicate_with_reduced_grad"]


def _waited(result: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, complete: eager code gets an ``AsyncCollectiveTensor``
    (waited here), traced code its ``wait_tensor`` already (one wait in the graph, not two)."""
    return result.wait() if isinstance(result, funcol.AsyncCollectiveTensor) else result


class _GatherShards(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        shard: torch.Tensor,
        dim: int,
        group: GroupName,
        ranks: int,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.meta = (dim, group, ranks, shard.dtype, reduce_dtype)
        return _waited(funcol.all_gather_single(shard.to(compute_dtype), dim, group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dim, group, ranks, shard_dtype, reduce_dtype = ctx.meta
        reduced = funcol.reduce_scatter_single(grad.to(reduce_dtype) / ranks, "sum", dim, group)
        return _waited(reduced).to(shard_dtype), None, None, None, None, None


class _ReplicateWithReducedGrad(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: GroupName,
        ranks: int,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        reduce_now: bool,
        accumulated_slot: int | None,
    ) -> torch.Tensor:
        ctx.meta = (group, ranks, x.dtype, reduce_dtype, reduce_now, accumulated_slot)
        return x.to(compute_dtype) if compute_dtype != x.dtype else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        group, ranks, dtype, reduce_dtype, reduce_now, accumulated_slot = ctx.meta
        none = (None,) * 6
        if not reduce_now:  # accumulates locally in param.grad until a backward reduces it
            return grad.to(dtype), *none
        total = grad.to(reduce_dtype)
        if accumulated_slot is not None:
            total = with_accumulated_grad(total, accumulated_slot)
        reduced = _waited(funcol.all_reduce(total / ranks, "sum", group))
        return reduced.to(dtype), *none


def gather_shards(
    shard: torch.Tensor, dim: int, group: GroupName, ranks: int, compute_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> torch.Tensor:
    """The tensor whose equal ``dim`` shards the ``ranks`` ranks of ``group`` hold; see the module doc."""
    out: torch.Tensor = _GatherShards.apply(shard, dim, group, ranks, compute_dtype, reduce_dtype)
    return out


def replicate_with_reduced_grad(
    x: torch.Tensor,
    group: GroupName,
    ranks: int,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    *,
    reduce_now: bool = True,
    accumulated_slot: int | None = None,
) -> torch.Tensor:
    """``x`` (in ``compute_dtype``), whose gradient is averaged over the ranks of ``group``.

    ``reduce_now=False``: the gradient is returned unreduced (it accumulates locally in
    ``param.grad``). ``accumulated_slot``: the parameter's ``accumulator_slot``; the reduction
    then includes what ``param.grad`` accumulated (``dhelix::with_accumulated_grad``).
    """
    out: torch.Tensor = _ReplicateWithReducedGrad.apply(
        x, group, ranks, compute_dtype, reduce_dtype, reduce_now, accumulated_slot
    )
    return out
