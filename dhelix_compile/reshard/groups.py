"""The process groups a plan's broadcasts run on: created once per set of ranks, then reused.

Only a group's members create it (``new_group(..., use_local_synchronization=True)``: ranks
outside both meshes never call ``reshard``), in the plan's order, which every rank computes the
same, under a name made of its ranks (``compat.new_member_group`` says why torch's own name hangs). A cached group is found by its ranks, so two plans that need the same ranks share a group,
and calling ``reshard`` again creates nothing.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from dhelix_compile import _torch_compat as compat
from dhelix_compile.reshard.plan import ReshardPlan

__all__ = ["GROUP_PREFIX", "broadcast_groups", "created_group_count"]

#: The name of every group ``reshard`` creates starts so (then its ranks): graphs that hold one are known by it.
GROUP_PREFIX = "dhelix_reshard_"

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_WORLD: list[object] = [None]  # the default group the cached groups belong to
_LOCK = threading.Lock()


def broadcast_groups(plan: ReshardPlan, rank: int) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The process group of every broadcast group of ``plan`` that ``rank`` is in, creating the missing ones."""
    groups = {}
    with _LOCK:
        if _WORLD[0] is not dist.group.WORLD:  # a new default group: the cached ones are gone with the old
            _GROUPS.clear()
            _WORLD[0] = dist.group.WORLD
        for ranks in plan.groups():
            if rank not in ranks:
                continue
            if ranks not in _GROUPS:
                group = compat.new_member_group(ranks, GROUP_PREFIX + "_".join(map(str, ranks)))
                assert group is not None and group != dist.GroupMember.NON_GROUP_MEMBER
                _GROUPS[ranks] = group
            groups[ranks] = _GROUPS[ranks]
    return groups


def created_group_count() -> int:
    """How many groups ``reshard`` has created in this process (tests check that a second call adds none)."""
    return len(_GROUPS)
