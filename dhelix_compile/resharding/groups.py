"""The process groups a plan's broadcasts run on: created once per set of ranks, then reused.

Only a group's members create it (``new_group(..., use_local_synchronization=True)``: ranks
outside both meshes never call ``reshard``), in the plan's order, which every rank computes the
same, under a name made of its ranks (``compat.new_member_group`` says why torch's own name
hangs). A cached group is found by its ranks, so two plans that need the same ranks share a
group, and calling ``reshard`` again creates nothing.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import torch.distributed as dist

from dhelix_compile import _torch_compat as compat
from dhelix_compile.resharding.plan import ReshardPlan

__all__ = ["GROUP_PREFIX", "broadcast_groups", "created_group_count", "forget_old_world", "member_group", "world_cache"]

#: The name of every group ``reshard`` creates starts so (then its ranks): graphs that hold one are known by it.
GROUP_PREFIX = "dhelix_reshard_"

_C = TypeVar("_C", bound="dict[Any, Any] | set[Any]")
_WORLD_CACHES: list[dict[Any, Any] | set[Any]] = []
_WORLD: list[object] = [None]  # the default group the caches belong to
_LOCK = threading.Lock()


def world_cache(cache: _C) -> _C:
    """``cache``, emptied by :func:`forget_old_world` once a new default process group is up: what
    it holds (groups, what the ranks agreed, plans cut to this rank) belongs to the old one."""
    _WORLD_CACHES.append(cache)
    return cache


def forget_old_world() -> None:
    """Empty every :func:`world_cache` if the default process group is not the one they were filled under."""
    if _WORLD[0] is not dist.group.WORLD:
        for cache in _WORLD_CACHES:
            cache.clear()
        _WORLD[0] = dist.group.WORLD


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = world_cache({})


def broadcast_groups(plan: ReshardPlan, rank: int) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The process group of every broadcast group of ``plan`` that ``rank`` is in, creating the missing ones."""
    return {ranks: member_group(ranks) for ranks in plan.groups() if rank in ranks}


def member_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group of ``ranks`` (sorted), created by its members the first time they ask."""
    with _LOCK:
        forget_old_world()
        if ranks not in _GROUPS:
            group = compat.new_member_group(ranks, GROUP_PREFIX + "_".join(map(str, ranks)))
            assert group is not None and group != dist.GroupMember.NON_GROUP_MEMBER
            _GROUPS[ranks] = group
        return _GROUPS[ranks]


def created_group_count() -> int:
    """How many groups ``reshard`` has created in this process (tests check that a second call adds none)."""
    return len(_GROUPS)
