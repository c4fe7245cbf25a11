"""``reshard``: a DTensor from one device mesh to another, as load-balanced broadcasts.

    y = dhelix_compile.reshard(x, device_mesh=mesh_b, placements=[Shard(1)])   # x: a DTensor on mesh_a
    work = dhelix_compile.reshard(x, mesh_b, [Shard(1)], async_op=True); ...; y = work.wait()

torch 2.13's ``DTensor.redistribute`` refuses another mesh ("Cross device mesh comm not supported
yet!"). Called on every rank of the union of the two meshes; the meshes may be disjoint or
overlap, 1-D or 2-D, with any mix of ``Shard(d)`` and ``Replicate()`` on either side, uneven
shards and any dtype. ``Partial()`` on the source is reduced on the way: a reduce-scatter on the
source mesh first (so each replica then sends a different reduced slice), then the move.

On a rank outside ``mesh_b`` the result is torch's own placeholder for a rank outside a DTensor's
mesh: a DTensor on ``mesh_b`` whose local tensor is empty. It takes part in the backward like any
other result: every rank of the union calls ``backward`` through its result (a loss over an
empty local tensor is 0, and its backward still sends this rank's share of the gradient back).

Layers: ``plan`` (pure: tiles, pieces, senders, order; hypothesis-tested), ``groups`` (the
broadcast groups, created once per set of ranks), ``move`` (the broadcasts, differentiable).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dhelix_compile.reshard.move import issue, move
from dhelix_compile.reshard.plan import MeshLayout, ReshardPlan, plan_reshard

__all__ = ["ReshardError", "ReshardWork", "layout_of", "reshard", "reshard_plan"]


class ReshardError(ValueError):
    """A ``reshard`` call that cannot be carried out as asked; the message says why."""


class ReshardWork:
    """The handle of ``reshard(..., async_op=True)``: its broadcasts are in flight; ``wait()``
    returns the resharded DTensor."""

    def __init__(self, finish: Callable[[], DTensor]) -> None:
        self._finish: Callable[[], DTensor] | None = finish
        self._result: DTensor | None = None

    def wait(self) -> DTensor:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        assert self._result is not None
        return self._result


def reshard(
    x: DTensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    async_op: bool = False,
    balanced: bool = True,
) -> DTensor | ReshardWork:
    """``x`` on ``device_mesh`` with ``placements``; see the module docstring.

    ``balanced=False`` sends every piece from the first replica of its source tile (the naive plan,
    kept for comparison). Inside ``torch.compile`` the broadcasts are traced as functional
    collectives (the passes place their waits) and ``async_op`` returns a handle already done.
    """
    placements = tuple(placements)
    _check(x, device_mesh, placements)
    placements = _normalized(placements, x.ndim)
    if x.device_mesh == device_mesh:
        return _done(x.redistribute(device_mesh, placements), async_op)
    x = _reduced(x)
    rank = dist.get_rank()
    plan = reshard_plan(x, device_mesh, placements, balanced=balanced)
    back = _plan(plan.global_shape, plan.dest, plan.source, plan.itemsize, balanced)
    if rank in plan.source_tiles:
        local = x.to_local()
    else:  # no data here, but the backward must run here too (it sends this rank's gradient pieces)
        local = torch.empty(0, dtype=x.dtype, device=x.device_mesh.device_type).requires_grad_(x.requires_grad)
    shape, stride = x.shape, _contiguous_stride(x.shape)

    def finish(issued: object = None) -> DTensor:
        out = move(local, plan, back, rank, issued)  # type: ignore[arg-type]
        return DTensor.from_local(out, device_mesh, placements, run_check=False, shape=shape, stride=stride)

    if async_op and not torch.compiler.is_compiling():
        issued = issue(local.detach(), plan, rank)
        return ReshardWork(lambda: finish(issued))
    return _done(finish(), async_op)


def reshard_plan(
    x: DTensor, device_mesh: DeviceMesh, placements: Sequence[Placement], *, balanced: bool = True
) -> ReshardPlan:
    """The plan ``reshard`` runs for ``x`` (its source reduced, where it holds ``Partial()``)."""
    source = layout_of(x.device_mesh, _normalized(x.placements, x.ndim))
    dest = layout_of(device_mesh, _normalized(placements, x.ndim))
    return _plan(tuple(x.shape), source, dest, x.dtype.itemsize, balanced)


def layout_of(mesh: DeviceMesh, placements: Sequence[Placement]) -> MeshLayout:
    """The plan's view of a mesh and placements: its shape and the global rank at each coordinate."""
    return MeshLayout(tuple(mesh.mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()), tuple(placements))


@functools.lru_cache(maxsize=256)
def _plan(shape: tuple[int, ...], source: MeshLayout, dest: MeshLayout, itemsize: int, balanced: bool) -> ReshardPlan:
    return plan_reshard(shape, source, dest, itemsize, balanced=balanced)


def _check(x: object, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> None:
    if not isinstance(x, DTensor):
        raise ReshardError(f"reshard moves a DTensor between device meshes; got {type(x).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise ReshardError(f"device_mesh must be a DeviceMesh; got {type(mesh).__name__}")
    if x.device_mesh.device_type != mesh.device_type:
        raise ReshardError(
            f"the source mesh is on {x.device_mesh.device_type} and the destination on {mesh.device_type}: "
            "reshard moves tensors between meshes of one device type"
        )
    if len(placements) != mesh.ndim:
        raise ReshardError(
            f"{len(placements)} placements {list(placements)} for a {mesh.ndim}-D destination mesh: "
            "give one placement per mesh dimension"
        )
    for p in placements:
        if isinstance(p, Partial):
            raise ReshardError("reshard cannot produce Partial(): the destination holds values, not partial sums")
        if type(p) not in (Shard, Replicate):
            raise ReshardError(f"placement {p} is not supported on the destination: Shard(d) or Replicate()")
        if isinstance(p, Shard) and not -x.ndim <= p.dim < x.ndim:
            raise ReshardError(f"placement {p} does not fit a {x.ndim}-D tensor of shape {tuple(x.shape)}")
    for p in x.placements:
        if type(p) not in (Shard, Replicate, Partial):
            raise ReshardError(f"source placement {p} is not supported: Shard(d), Replicate() or Partial()")
    rank = dist.get_rank()
    members = {int(r) for r in x.device_mesh.mesh.flatten().tolist()} | {int(r) for r in mesh.mesh.flatten().tolist()}
    if rank not in members:
        raise ReshardError(
            f"rank {rank} is in neither mesh ({x.device_mesh} -> {mesh}): call reshard on the ranks of the two meshes only"
        )


def _reduced(x: DTensor) -> DTensor:
    """``x`` with its ``Partial()`` placements reduced on its own mesh: reduce-scattered along a
    tensor dim no other mesh dim shards (the largest), else all-reduced."""
    if not any(isinstance(p, Partial) for p in x.placements):
        return x
    sharded = {p.dim % x.ndim for p in x.placements if isinstance(p, Shard)}
    free = sorted((d for d in range(x.ndim) if d not in sharded), key=lambda d: -x.shape[d])
    placements: list[Placement] = []
    for p in x.placements:
        if isinstance(p, Partial):
            placements.append(Shard(free.pop(0)) if free else Replicate())
        else:
            placements.append(p)
    return x.redistribute(x.device_mesh, placements)


def _normalized(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)


def _done(y: DTensor, async_op: bool) -> DTensor | ReshardWork:
    return ReshardWork(lambda: y) if async_op else y


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))
