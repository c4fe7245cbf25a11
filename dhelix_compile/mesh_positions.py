"""Where torch's collectives put each rank of a ``DeviceMesh``: the position a DTensor's tile is at.

A mesh lists its ranks in any order (``DeviceMesh("cpu", [[3, 2], [1, 0]])``), and
``mesh.get_coordinate()`` reports a rank's place in that list. torch's collectives do not use it:
each mesh dim's process group holds its ranks in *its own* order (torch 2.13 sorts them; a dim as
large as the world is the default group, ranks 0..N-1), and a scatter or all-gather over that group
(``distribute_tensor``, ``full_tensor()``, ``redistribute``) puts tile ``i`` on the group's
``i``-th rank, which ``mesh.get_local_rank(dim)`` reports. So on ``[[3, 2], [1, 0]]`` rank 3 is at
``get_coordinate() == (0, 0)`` but holds tile ``(1, 1)`` of a ``[Shard(0), Shard(1)]`` DTensor.
Everything of dhelix that maps a rank to a tile asks this module, never ``get_coordinate()``::

    mesh ranks (as listed)      dim 0's groups      dim 1's groups      tile positions
    ┌───┬───┐                   {3, 1} -> [1, 3]    {3, 2} -> [2, 3]    ┌───┬───┐
    │ 3 │ 2 │                   {2, 0} -> [0, 2]    {1, 0} -> [0, 1]    │ 0 │ 1 │
    ├───┼───┤                                                           ├───┼───┤
    │ 1 │ 0 │                   rank 3: 2nd of [1, 3], 2nd of [2, 3]    │ 2 │ 3 │
    └───┴───┘                   -> tile (1, 1)                          └───┴───┘

Two layouts torch does not hold as one tensor (``layout_mismatch`` names them; ``reshard``
refuses them before anything is sent):

* **Groups across a sharded dim's positions.** ``distribute_tensor`` applies the placements mesh
  dim by mesh dim, each from its groups' first ranks: the ranks of one dim-e group must sit at one
  position of every *sharded* dim d before e (of every other sharded dim, where e is ``Partial()``:
  its reduction adds the group's tiles). On ``[[2, 1], [3, 0]]`` ranks 2 and 1 share a dim-1 group
  but are first and second in their dim-0 groups, so with ``[Shard(0), Replicate()]`` rank 2
  receives rank 1's rows and ``full_tensor()`` returns ``[2, 3, 0, 1]`` for ``[0, 1, 2, 3]`` on
  ranks 2 and 3 (torch 2.13). With ``[Replicate(), Shard(0)]`` the same mesh is fine.
* **Uneven shards on a dim listed out of order.** A DTensor's local shape comes from
  ``get_coordinate()`` (``compute_local_shape_and_global_offset``), its data from the collectives.
  On ``[3, 2, 1, 0]``, 5 rows ``Shard(0)``: ``distribute_tensor`` gives rank 0 no rows
  (coordinate 3's share) of the scatter's first chunk, and ``full_tensor()`` returns
  ``[0, 0, 2, 0, 4]`` for ``[0, 1, 2, 3, 4]`` (torch 2.13).

A tensor with no elements has nothing to misplace: no mismatch.

torch's ``redistribute`` within one such mesh is a third: ``Replicate()`` to ``Shard(d)`` keeps the
chunk at ``get_coordinate()``, not the one its collectives put there, so on ``[[1, 0, 2]]`` a
``[Shard(1), Replicate()]`` tensor of 7 x 1 redistributed to ``[Shard(1), Shard(0)]`` holds other
rows than ``distribute_tensor`` gives the same layout (torch 2.13). ``in_listed_order`` tells
where torch's redistribute can be trusted.

Contract
--------
``collective_positions(mesh_shape, ranks) -> {rank: position}``: pure; ``ranks`` as the mesh lists
them (row-major); a 1-D mesh's positions are its ranks' places in sorted order.
``layout_mismatch(global_shape, mesh_shape, ranks, placements) -> str | None``: pure; why torch
does not hold that tensor in that layout as one tensor, or ``None``. ``Partial()`` reads as
``Replicate()``.
``in_listed_order(mesh_shape, ranks) -> bool``: every rank's position is its listed coordinate.
``group_order_mismatch(mesh) -> str | None``: why this rank's own dim groups hold their ranks in
another order than ``compat.dim_group_order`` assumes, or ``None``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dhelix_compile import _torch_compat as compat

__all__ = ["collective_positions", "group_order_mismatch", "in_listed_order", "layout_mismatch", "mesh_ranks"]


def mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The mesh's ranks as listed (row-major), the order ``get_coordinate()`` uses."""
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def collective_positions(mesh_shape: Sequence[int], ranks: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """Every rank's tile position on a mesh of ``mesh_shape`` listing ``ranks`` (row-major): along
    each dim, its index in its dim group's order."""
    shape = tuple(int(n) for n in mesh_shape)
    listed = _listed(shape, ranks)
    return {
        rank: tuple(compat.dim_group_order(_line(listed, coord, d, n)).index(rank) for d, n in enumerate(shape))
        for coord, rank in listed.items()
    }


def in_listed_order(mesh_shape: Sequence[int], ranks: Sequence[int]) -> bool:
    """Whether every rank's tile position is its listed coordinate (``get_coordinate()``)."""
    shape = tuple(int(n) for n in mesh_shape)
    position = collective_positions(shape, ranks)
    return all(position[rank] == coord for coord, rank in _listed(shape, ranks).items())


def layout_mismatch(
    global_shape: Sequence[int], mesh_shape: Sequence[int], ranks: Sequence[int], placements: Sequence[Placement]
) -> str | None:
    """Why a tensor of ``global_shape`` in ``placements`` on the mesh listing ``ranks`` is not one
    DTensor as torch handles it (module docstring), or ``None``."""
    if math.prod(global_shape) == 0:
        return None
    shape = tuple(int(n) for n in mesh_shape)
    listed = _listed(shape, ranks)
    position = collective_positions(shape, ranks)
    sharded = [d for d, p in enumerate(placements) if isinstance(p, Shard)]
    for coord, rank in listed.items():
        for e, n in enumerate(shape):
            partial = isinstance(placements[e], Partial)
            for other in _line(listed, coord, e, n):
                off = [
                    d for d in sharded if (d < e or (partial and d != e)) and position[other][d] != position[rank][d]
                ]
                if off:
                    d = off[0]
                    return (
                        f"on the mesh {_nested(shape, ranks)}, ranks {rank} and {other} share a dim-{e} process "
                        f"group ({placements[e]}) but are at positions {position[rank][d]} and {position[other][d]} "
                        f"of their dim-{d} groups ({placements[d]}): each mesh dim's group holds its ranks in "
                        f"ascending order, not in the mesh's, so torch's own distribute_tensor and full_tensor() "
                        f"disagree there. List the mesh's ranks ascending along every dim, e.g. "
                        f"{_nested(shape, sorted(int(r) for r in ranks))}"
                    )
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    for listed_at, rank in listed.items():
        if position[rank] == listed_at:
            continue
        placed = compat.local_shape_and_offset(global_shape, shape, position[rank], plain)[0]
        described = compat.local_shape_and_offset(global_shape, shape, listed_at, plain)[0]
        if placed != described:
            return (
                f"on the mesh {_nested(shape, ranks)}, {list(placements)} of shape {list(global_shape)} gives rank "
                f"{rank} a tile of shape {list(placed)} from torch's collectives (tile position {position[rank]}) "
                f"but a DTensor local shape of {list(described)} (its get_coordinate() {listed_at}): torch places "
                f"uneven shards inconsistently on a mesh that lists a dim's ranks out of ascending order (its "
                f"own distribute_tensor and full_tensor() lose data there). Shard evenly, or list every dim's "
                f"ranks in ascending order, e.g. {_nested(shape, sorted(int(r) for r in ranks))}"
            )
    return None


def group_order_mismatch(mesh: DeviceMesh) -> str | None:
    """Why this rank's own dim groups of ``mesh`` do not hold their ranks in the order
    ``collective_positions`` assumes (a torch whose groups are ordered otherwise), or ``None``:
    they do, or this rank is not in the mesh (it has no groups to look at)."""
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    shape = tuple(mesh.mesh.shape)
    listed = _listed(shape, mesh_ranks(mesh))
    for d, n in enumerate(shape):
        expected = compat.dim_group_order(_line(listed, tuple(coord), d, n))
        actual = tuple(int(r) for r in dist.get_process_group_ranks(mesh.get_group(d)))
        if actual != expected:
            return (
                f"the process group of dim {d} of the mesh {mesh.mesh.tolist()} holds ranks {list(actual)}; "
                f"dhelix expects {list(expected)} (this torch, {torch.__version__}, orders a mesh dim's group otherwise)"
            )
    return None


def _listed(shape: tuple[int, ...], ranks: Sequence[int]) -> dict[tuple[int, ...], int]:
    """Every listed coordinate's rank."""
    coords = list(itertools.product(*(range(n) for n in shape)))
    if len(coords) != len(ranks):
        raise ValueError(f"a mesh of shape {list(shape)} has {len(coords)} ranks; got {len(ranks)}")
    return dict(zip(coords, (int(r) for r in ranks), strict=True))


def _line(listed: dict[tuple[int, ...], int], coord: tuple[int, ...], dim: int, size: int) -> list[int]:
    """The ranks along mesh dim ``dim`` through ``coord``, as the mesh lists them."""
    keys = [(*coord[:dim], i, *coord[dim + 1 :]) for i in range(size)]
    return [listed[key] for key in keys]


def _nested(shape: tuple[int, ...], ranks: Sequence[int]) -> list[object]:
    """``ranks`` (row-major) as nested lists of ``shape``."""
    flat: list[object] = [int(r) for r in ranks]
    for n in reversed(shape[1:]):
        flat = [flat[i : i + n] for i in range(0, len(flat), n)]
    return flat
