"""``reshard``: a DTensor from one device mesh to another, as load-balanced broadcasts.

    y = dhelix_compile.reshard(x, device_mesh=mesh_b, placements=[Shard(1)])   # x: a DTensor on mesh_a
    work = dhelix_compile.reshard(x, mesh_b, [Shard(1)], async_op=True); ...; y = work.wait()

torch 2.13's ``DTensor.redistribute`` refuses another mesh ("Cross device mesh comm not supported
yet!"). Called on every rank of the union of the two meshes; the meshes may be disjoint or
overlap, 1-D or 2-D, with any mix of ``Shard(d)`` and ``Replicate()`` on either side, uneven
shards and any dtype. ``Partial()`` on the source is reduced on the way: a reduce-scatter on the
source mesh first (so each replica then sends a different reduced slice), then the move.

Meshes may list their ranks in any order: each rank gets the tile torch's collectives put there
(``dhelix_compile.mesh_positions``), and a layout torch itself does not hold as one tensor there
(uneven shards on a dim listed out of order; a 2-D mesh whose groups cut across a sharded dim's
positions) is refused with a ``ReshardError`` before anything is sent. Within one mesh, torch's
own ``redistribute`` runs the move only where the mesh lists its ranks in its groups' order
(elsewhere it keeps the chunk at ``get_coordinate()``); otherwise the move is planned as between
two meshes.

On a rank outside ``mesh_b`` the result is torch's own placeholder for a rank outside a DTensor's
mesh: a DTensor on ``mesh_b`` whose local tensor is empty. It takes part in the backward like any
other result: every rank of the union calls ``backward`` through its result (a loss over an
empty local tensor is 0, and its backward still sends this rank's share of the gradient back).

This module checks the call, plans it (once per layout pair), has the ranks agree on the plan and
runs the move; the layers below it: ``plan`` (pure: tiles, pieces, senders, order;
hypothesis-tested), ``groups`` (the broadcast groups, created once per set of ranks), ``move``
(the broadcasts, differentiable).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dhelix_compile import _torch_compat as compat
from dhelix_compile.group_timeouts import peer_wait_s
from dhelix_compile.mesh_positions import group_order_mismatch, in_listed_order, layout_mismatch, mesh_ranks
from dhelix_compile.resharding.groups import broadcast_groups, forget_old_world, world_cache
from dhelix_compile.resharding.move import Issued, RankSteps, move, rank_steps
from dhelix_compile.resharding.plan import MeshLayout, MeshOrderError, ReshardPlan, plan_reshard

__all__ = ["ReshardError", "ReshardWork", "layout_of", "plan_move", "planned_layouts", "reshard", "reshard_plan"]


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
    kept for comparison). Inside ``torch.compile`` the plan is made while tracing (a constant of
    the graph), the broadcasts are traced as functional collectives (the passes place their
    waits), and ``async_op`` returns a handle already done.
    """
    if not isinstance(x, DTensor):
        raise ReshardError(f"reshard moves a DTensor between device meshes; got {type(x).__name__}")
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise ReshardError(
            f"placements must be a list with one Placement per dim of the destination mesh; got {placements!r}"
            + (f" (pass [{placements!r}])" if isinstance(placements, Placement) else "")
        )
    prepared = _prepare(
        tuple(x.shape), x.dtype, x.device_mesh, tuple(x.placements), device_mesh, tuple(placements), balanced
    )
    if prepared.steps is None:  # one mesh: torch's own redistribute
        return _done(x.redistribute(device_mesh, prepared.placements), async_op)
    steps, back = prepared.steps, prepared.back
    assert steps is not None and back is not None, "planned with its reverse"
    if prepared.reduced != tuple(x.placements):
        x = x.redistribute(x.device_mesh, prepared.reduced)
    if prepared.in_source:
        local = x.to_local()
    else:  # no data here, but the backward must run here too (it sends this rank's gradient pieces)
        local = _ANCHORS[(x.dtype, x.device_mesh.device_type, x.requires_grad)]
    shape, stride = x.shape, _contiguous_stride(x.shape)

    def finish(issued: Issued | None = None) -> DTensor:
        out = move(local, steps, back, issued)
        return DTensor.from_local(out, device_mesh, prepared.placements, run_check=False, shape=shape, stride=stride)

    if async_op and not torch.compiler.is_compiling():
        issued = Issued(local.detach(), steps)
        return ReshardWork(lambda: finish(issued))
    return _done(finish(), async_op)


@dataclass(frozen=True)
class _Prepared:
    """Everything about a call that is not tensor data: checked, planned, its groups made."""

    placements: tuple[Placement, ...]  # the destination's, shard dims made non-negative
    steps: RankSteps | None = None  # this rank's part of the plan; None: the two meshes are one
    back: RankSteps | None = None  # its part of the reverse plan (the backward)
    reduced: tuple[Placement, ...] = ()  # the source's, Partial() reduced
    in_source: bool = False


#: What a rank outside the source mesh passes to the move: an empty leaf (requiring grad when the
#: source does, so the backward runs there and sends its pieces). Made by ``_prepare``, outside any
#: traced code, and read from here: a global, so Dynamo takes it as a graph input.
_ANCHORS: dict[tuple[torch.dtype, str, bool], torch.Tensor] = {}


@compat.constant_while_tracing
def _prepare(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    source_mesh: DeviceMesh,
    source_placements: tuple[Placement, ...],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    balanced: bool,
) -> _Prepared:
    if not isinstance(mesh, DeviceMesh):
        raise ReshardError(f"device_mesh must be a DeviceMesh; got {type(mesh).__name__}")
    forget_old_world()
    key = (shape, dtype, source_mesh, source_placements, mesh, placements, balanced)
    if key not in _PREPARED:  # checked, planned and agreed once; later calls only look it up
        _PREPARED[key] = _prepare_new(shape, dtype, source_mesh, source_placements, mesh, placements, balanced)
    return _PREPARED[key]


_PREPARED: dict[tuple[object, ...], _Prepared] = world_cache({})


def _prepare_new(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    source_mesh: DeviceMesh,
    source_placements: tuple[Placement, ...],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    balanced: bool,
) -> _Prepared:
    _check(shape, source_mesh, source_placements, mesh, placements)
    for layout in (layout_of(source_mesh, source_placements), layout_of(mesh, placements)):
        mismatch = layout_mismatch(shape, layout.mesh_shape, layout.ranks, _normalized(layout.placements, len(shape)))
        if mismatch is not None:  # torch does not hold it as one tensor: refused before anything is sent
            raise ReshardError(f"reshard cannot move {_describe(layout)}: {mismatch}")
    if source_mesh == mesh and in_listed_order(tuple(mesh.mesh.shape), mesh_ranks(mesh)):
        return _Prepared(_normalized(placements, len(shape)))  # torch's own redistribute (module docstring)
    source, dest = _layouts(shape, source_mesh, source_placements, mesh, placements)
    plan = _plan(shape, source, dest, dtype.itemsize, balanced)
    back = _plan(shape, dest, source, dtype.itemsize, balanced)
    rank = dist.get_rank()
    _agree(plan, balanced, rank, [group_order_mismatch(m) for m in (source_mesh, mesh)])
    differentiable = dtype.is_floating_point or dtype.is_complex
    for requires_grad in (False, True) if differentiable else (False,):
        key = (dtype, mesh.device_type, requires_grad)
        _ANCHORS.setdefault(key, torch.empty(0, dtype=dtype, device=mesh.device_type, requires_grad=requires_grad))
    groups = {**broadcast_groups(plan, rank), **broadcast_groups(back, rank)}
    steps, back_steps = rank_steps(plan, rank, groups), rank_steps(back, rank, groups)
    return _Prepared(dest.placements, steps, back_steps, source.placements, rank in plan.source_tiles)


#: How long a rank waits for the other ranks of the two meshes to describe the same call, at most:
#: the default group's timeout where shorter (``group_timeouts.peer_wait_s``; its groups have it).
AGREE_TIMEOUT_S = 300.0
_AGREED: set[tuple[object, ...]] = world_cache(set())
_CALLS_PER_UNION: dict[tuple[int, ...], int] = world_cache({})


def _agree(plan: ReshardPlan, balanced: bool, rank: int, mismatches: Sequence[str | None] = ()) -> None:
    """The first time a plan is made, every rank of the two meshes checks that the others asked
    for the same move (through the c10d store): ranks that disagree would create different
    groups and wait in each other's rendezvous until the process group's timeout. A rank whose
    mesh groups hold their ranks in another order than the plan assumes (``mismatches``, from
    ``mesh_positions.group_order_mismatch``) describes that instead, so every rank fails at once."""
    problem = "; ".join(m for m in mismatches if m is not None)
    key = (plan.global_shape, plan.source, plan.dest, plan.itemsize, balanced)
    if key in _AGREED or not compat.real_process_group_initialized():
        if problem:
            raise ReshardError(f"reshard cannot place tiles as torch does: {problem}")
        return
    union = tuple(sorted({*plan.source.ranks, *plan.dest.ranks}))
    count = _CALLS_PER_UNION.get(union, 0)
    _CALLS_PER_UNION[union] = count + 1
    mine = (
        f"{_describe(plan.source)} -> {_describe(plan.dest)}, shape {list(plan.global_shape)}, itemsize {plan.itemsize}"
    )
    prefix = f"dhelix/reshard/{'_'.join(map(str, union))}/{count}"
    store = compat.default_store()
    store.set(f"{prefix}/{rank}", f"{mine}; {problem}" if problem else mine)
    if problem:
        raise ReshardError(f"reshard cannot place tiles as torch does: {problem}")
    wait_s = peer_wait_s(AGREE_TIMEOUT_S)
    for other in union:
        if other == rank:
            continue
        try:
            store.wait([f"{prefix}/{other}"], timedelta(seconds=wait_s))
        except Exception as exc:  # the store raises on timeout (DistStoreError / RuntimeError)
            raise ReshardError(
                f"rank {other} of the two meshes did not call reshard within {wait_s:g} s "
                f"(this rank: {mine}); every rank of both meshes must make the same call (a rank that "
                "died or is stuck does not)"
            ) from exc
        theirs = store.get(f"{prefix}/{other}").decode()
        if theirs != mine:
            raise ReshardError(f"ranks disagree on a reshard: rank {rank}: {mine}; rank {other}: {theirs}")
    _AGREED.add(key)


def _describe(layout: MeshLayout) -> str:
    return f"mesh {list(layout.ranks)} shaped {list(layout.mesh_shape)} {list(layout.placements)}"


def reshard_plan(
    x: DTensor, device_mesh: DeviceMesh, placements: Sequence[Placement], *, balanced: bool = True
) -> ReshardPlan:
    """The plan ``reshard`` runs for ``x`` (its source reduced, where it holds ``Partial()``)."""
    shape = tuple(x.shape)
    source, dest = _layouts(shape, x.device_mesh, tuple(x.placements), device_mesh, tuple(placements))
    return _plan(shape, source, dest, x.dtype.itemsize, balanced)


def _layouts(
    shape: tuple[int, ...],
    source_mesh: DeviceMesh,
    source_placements: tuple[Placement, ...],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
) -> tuple[MeshLayout, MeshLayout]:
    """The two layouts a move plans with (:func:`planned_layouts`), from meshes."""
    return planned_layouts(shape, layout_of(source_mesh, source_placements), layout_of(mesh, placements))


def planned_layouts(shape: tuple[int, ...], source: MeshLayout, dest: MeshLayout) -> tuple[MeshLayout, MeshLayout]:
    """The two layouts a move plans with: the source's ``Partial()`` reduced, shard dims non-negative."""
    ndim = len(shape)
    reduced = _reduced_placements(shape, source.mesh_shape, source.ranks, _normalized(source.placements, ndim))
    return (
        MeshLayout(source.mesh_shape, source.ranks, reduced),
        MeshLayout(dest.mesh_shape, dest.ranks, _normalized(dest.placements, ndim)),
    )


def plan_move(
    shape: tuple[int, ...], itemsize: int, source: MeshLayout, dest: MeshLayout, *, balanced: bool = True
) -> ReshardPlan:
    """The plan for a tensor of ``shape`` from ``source`` to ``dest``, given as plain layouts (no
    mesh objects: a rank outside a mesh plans with it too); its source is the reduced one where
    ``source`` holds ``Partial()`` (the caller reduces first, to ``plan.source.placements``)."""
    reduced, normalized = planned_layouts(shape, source, dest)
    return _plan(shape, reduced, normalized, itemsize, balanced)


def layout_of(mesh: DeviceMesh, placements: Sequence[Placement]) -> MeshLayout:
    """The plan's view of a mesh and placements: its shape and its ranks as it lists them."""
    return MeshLayout(tuple(mesh.mesh.shape), mesh_ranks(mesh), tuple(placements))


@functools.lru_cache(maxsize=256)
def _plan(shape: tuple[int, ...], source: MeshLayout, dest: MeshLayout, itemsize: int, balanced: bool) -> ReshardPlan:
    try:
        return plan_reshard(shape, source, dest, itemsize, balanced=balanced)
    except MeshOrderError as e:  # a mesh torch itself cannot hold this tensor on: refused before any send
        raise ReshardError(f"reshard cannot move {_describe(source)} -> {_describe(dest)}: {e}") from None


def _check(
    shape: tuple[int, ...],
    source_mesh: DeviceMesh,
    source_placements: tuple[Placement, ...],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
) -> None:
    if source_mesh.device_type != mesh.device_type:
        raise ReshardError(
            f"the source mesh is on {source_mesh.device_type} and the destination on {mesh.device_type}: "
            "reshard moves tensors between meshes of one device type"
        )
    if len(placements) != mesh.ndim:
        raise ReshardError(
            f"{len(placements)} placements {list(placements)} for a {mesh.ndim}-D destination mesh: "
            "give one placement per mesh dimension"
        )
    ndim = len(shape)
    for p in placements:
        if isinstance(p, Partial):
            raise ReshardError("reshard cannot produce Partial(): the destination holds values, not partial sums")
        if not isinstance(p, (Shard, Replicate)) or _is_strided(p):
            raise ReshardError(f"placement {p} is not supported on the destination: Shard(d) or Replicate()")
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            raise ReshardError(f"placement {p} does not fit a {ndim}-D tensor of shape {shape}")
    for p in source_placements:
        if not isinstance(p, (Shard, Replicate, Partial)) or _is_strided(p):
            raise ReshardError(f"source placement {p} is not supported: Shard(d), Replicate() or Partial()")
    rank = dist.get_rank()
    members = set(mesh_ranks(source_mesh)) | set(mesh_ranks(mesh))
    if rank not in members:
        raise ReshardError(
            f"rank {rank} is in neither mesh ({source_mesh} -> {mesh}): call reshard on the ranks of the two meshes only"
        )


def _is_strided(p: Placement) -> bool:
    return type(p).__name__ == "_StridedShard"


def _reduced_placements(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], ranks: tuple[int, ...], placements: tuple[Placement, ...]
) -> tuple[Placement, ...]:
    """``placements`` with every ``Partial()`` reduced on the source mesh: reduce-scattered along a
    tensor dim no other mesh dim shards (the largest whose shards torch places consistently on the
    mesh, ``mesh_positions.layout_mismatch``), else all-reduced."""
    sharded = {p.dim for p in placements if isinstance(p, Shard)}
    free = sorted((d for d in range(len(shape)) if d not in sharded), key=lambda d: -shape[d])
    reduced = list(placements)
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            fits = [
                d
                for d in free
                if layout_mismatch(shape, mesh_shape, ranks, (*reduced[:i], Shard(d), *reduced[i + 1 :])) is None
            ]
            reduced[i] = Shard(fits[0]) if fits else Replicate()
            if fits:
                free.remove(fits[0])
    return tuple(reduced)


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
