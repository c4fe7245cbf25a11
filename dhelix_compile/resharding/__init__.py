"""``reshard``: a DTensor from one device mesh to another, as load-balanced broadcasts.

    y = dhelix_compile.reshard(x, device_mesh=mesh_b, placements=[Shard(1)])   # x: a DTensor on mesh_a

cross_mesh.py      ``reshard`` and its plans: the call checked, planned, agreed across ranks, moved
                   (the contract is its docstring)
plan.py            pure: tiles, pieces, senders, order
groups.py          the broadcast groups, created once per set of ranks
move.py            the broadcasts, differentiable
point_to_point.py  a plan run as sends and receives, its two sides at different times
"""

from __future__ import annotations

from dhelix_compile.resharding.cross_mesh import (
    AGREE_TIMEOUT_S,
    ReshardError,
    ReshardWork,
    layout_of,
    plan_move,
    planned_layouts,
    reshard,
    reshard_plan,
)

__all__ = [
    "AGREE_TIMEOUT_S",
    "ReshardError",
    "ReshardWork",
    "layout_of",
    "plan_move",
    "planned_layouts",
    "reshard",
    "reshard_plan",
]
