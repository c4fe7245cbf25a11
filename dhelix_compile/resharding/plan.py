"""The resharding plan: which slices move from which source rank to which destination ranks.

A pure function of shapes, meshes and placements (no process group is touched), after Zhuang et
al., "On Optimizing the Communication of Model Parallelism" (MLSys 2023, Alpa's cross-mesh
resharding)::

    global tensor, source mesh [0, 1] Shard(0)       destination mesh [2, 3] as (2,) Replicate()
    ┌──────────┐ tile of 0 (rows 0-3)                 ┌──────────┐ tile of 2 = tile of 3 (all)
    │  A       │                                      │  A       │
    ├──────────┤ tile of 1 (rows 4-7)                 │  B       │
    │  B       │                                      └──────────┘
    └──────────┘
    pieces:  A: 0 -> {2, 3} (one broadcast)     B: 1 -> {2, 3} (one broadcast)

1. **Tiles.** Every rank of a mesh holds one box of the global tensor: its offset and shape, as
   ``compute_local_shape_and_global_offset`` gives them (uneven and empty shards included). Ranks
   with the same box are replicas of one tile.
2. **Pieces.** For every distinct destination tile ``D`` and every distinct source tile ``S``, the
   intersection ``S ∩ D`` (when not empty) is a piece: every replica of ``D`` receives it, any
   replica of ``S`` can send it. Distinct tiles of one layout partition the tensor, so the pieces
   of ``D`` cover it exactly once; all of ``D``'s receivers get a piece from one broadcast.
3. **Senders.** Where a source tile has several replicas, its pieces are spread over them:
   largest piece first, each to the replica whose sent bytes would then be least (a replica that
   is the piece's only receiver sends nothing over a link). The naive plan, the first replica for
   everything, is kept as ``balanced=False``: the balanced plan's busiest sender never carries more
   (each replica only serves its own tile's pieces, and a greedy pick never exceeds what the first
   replica alone would have sent so far).
4. **Order.** Round robin over the senders, each one's pieces largest first: the first piece of
   every sender is issued before any sender's second, so every sending link starts at once.

A ``Partial`` source placement is not planned here: the runtime reduces it on the source mesh
first (a reduce-scatter, so every replica then holds a different reduced slice to send).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dhelix_compile.mesh_positions import collective_positions, layout_mismatch

__all__ = ["Box", "MeshLayout", "MeshOrderError", "Piece", "ReshardPlan", "plan_reshard"]


class MeshOrderError(ValueError):
    """A layout torch does not hold as one tensor on its mesh (``mesh_positions.layout_mismatch``)."""


@dataclass(frozen=True)
class Box:
    """A box of the global tensor: where it starts and its size, per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common box, or ``None`` where the two do not overlap (or either is empty)."""
        starts = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        ends = tuple(
            min(a + n, b + m) for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape, strict=True)
        )
        if any(e <= s for s, e in zip(starts, ends, strict=True)):
            return None
        return Box(starts, tuple(e - s for s, e in zip(starts, ends, strict=True)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box in a tensor holding ``outer`` (which contains it)."""
        return tuple(slice(o - p, o - p + n) for o, n, p in zip(self.offset, self.shape, outer.offset, strict=True))


@dataclass(frozen=True)
class MeshLayout:
    """Where one tensor's tiles live: a mesh (its shape, and its global ranks as the mesh lists
    them, row-major) and one placement per mesh dimension. A rank's tile is the one at its *tile
    position*, where torch's collectives put it (``dhelix_compile.mesh_positions``), which is its
    listed coordinate only where every dim lists its ranks in ascending order."""

    mesh_shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        if math.prod(self.mesh_shape) != len(self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"a mesh of shape {self.mesh_shape} needs as many distinct ranks, got {self.ranks}")
        if len(self.placements) != len(self.mesh_shape):
            raise ValueError(
                f"{len(self.placements)} placements {list(self.placements)} for a {len(self.mesh_shape)}-D mesh: "
                "give one placement per mesh dimension"
            )
        for p in self.placements:
            if type(p) not in (Shard, Replicate, Partial):
                raise ValueError(f"placement {p} is not supported: Shard(d), Replicate() or Partial()")

    def coordinates(self) -> Iterator[tuple[int, tuple[int, ...]]]:
        """``(global rank, tile position)`` for every rank of the mesh, in listed order."""
        return iter(collective_positions(self.mesh_shape, self.ranks).items())

    def tiles(self, global_shape: Sequence[int]) -> dict[int, Box]:
        """Every rank's box of a tensor of ``global_shape``; ``MeshOrderError`` where torch would
        not read the layout as one tensor (``mesh_positions.layout_mismatch``). A tensor with no
        elements has empty tiles shaped as torch's DTensor describes them (at each rank's listed
        coordinate): nothing moves, so nothing can land on the wrong rank."""
        from dhelix_compile import _torch_compat as compat

        for p in self.placements:
            if isinstance(p, Shard) and not 0 <= p.dim < len(global_shape):
                raise ValueError(f"placement {p} does not fit a {len(global_shape)}-D tensor")
        mismatch = layout_mismatch(global_shape, self.mesh_shape, self.ranks, self.placements)
        if mismatch is not None:
            raise MeshOrderError(mismatch)
        listed = zip(self.ranks, itertools.product(*(range(n) for n in self.mesh_shape)), strict=True)
        tiles = {}
        for rank, coord in listed if math.prod(global_shape) == 0 else self.coordinates():
            shape, offset = compat.local_shape_and_offset(global_shape, self.mesh_shape, coord, self.placements)
            tiles[rank] = Box(tuple(offset), tuple(shape))
        return tiles

    @property
    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)


@dataclass(frozen=True)
class Piece:
    """One slice to move: from ``sender`` (a source rank holding ``source_tile``) to every
    rank of ``receivers`` (the replicas of ``dest_tile``), as one broadcast."""

    box: Box
    source_tile: Box
    dest_tile: Box
    candidates: tuple[int, ...]  # the source tile's replicas: who could send it
    receivers: tuple[int, ...]
    sender: int
    nbytes: int

    @property
    def group(self) -> tuple[int, ...]:
        """The ranks of its broadcast, sorted."""
        return tuple(sorted({self.sender, *self.receivers}))

    @property
    def is_local(self) -> bool:
        """Its only receiver is its sender: a copy, nothing crosses a link."""
        return self.receivers == (self.sender,)

    def sent_bytes(self, sender: int | None = None) -> int:
        """Bytes ``sender`` (default: the chosen one) puts on its link for this piece."""
        rank = self.sender if sender is None else sender
        return 0 if self.receivers == (rank,) else self.nbytes


@dataclass(frozen=True)
class ReshardPlan:
    """Every piece, in send order, for one tensor shape and pair of layouts."""

    global_shape: tuple[int, ...]
    source: MeshLayout
    dest: MeshLayout
    itemsize: int
    pieces: tuple[Piece, ...]
    dest_tiles: dict[int, Box] = field(compare=False, hash=False)
    source_tiles: dict[int, Box] = field(compare=False, hash=False)

    def sender_bytes(self) -> dict[int, int]:
        """Bytes every source rank sends over its link (0 for a rank that sends nothing)."""
        sent = dict.fromkeys(self.source.ranks, 0)
        for piece in self.pieces:
            sent[piece.sender] += piece.sent_bytes()
        return sent

    def receiver_bytes(self) -> dict[int, int]:
        """Bytes every destination rank receives over its link."""
        received = dict.fromkeys(self.dest.ranks, 0)
        for piece in self.pieces:
            for rank in piece.receivers:
                if rank != piece.sender:
                    received[rank] += piece.nbytes
        return received

    def max_sender_bytes(self) -> int:
        return max(self.sender_bytes().values(), default=0)

    def busiest_link_bytes(self) -> int:
        """The most bytes any one rank's link carries, out and in (a broadcast counted once at its
        sender and once at every other receiver)."""
        sent, received = self.sender_bytes(), self.receiver_bytes()
        return max((sent.get(r, 0) + received.get(r, 0) for r in {*sent, *received}), default=0)

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The broadcast groups the plan needs (two or more ranks), each once, in first-use order."""
        return tuple(dict.fromkeys(p.group for p in self.pieces if not p.is_local))


def plan_reshard(
    global_shape: Sequence[int], source: MeshLayout, dest: MeshLayout, itemsize: int, *, balanced: bool = True
) -> ReshardPlan:
    """The pieces that take a tensor of ``global_shape`` from ``source`` to ``dest``; module docstring."""
    if source.has_partial:
        raise ValueError("plan_reshard takes a reduced source: reduce Partial() placements on the source mesh first")
    if dest.has_partial:
        raise ValueError("reshard cannot produce Partial() placements: the destination holds the values themselves")
    shape = tuple(int(n) for n in global_shape)
    source_tiles, dest_tiles = source.tiles(shape), dest.tiles(shape)
    pieces = [
        (box, src_box, dst_box, replicas, receivers)
        for dst_box, receivers in _replicas(dest_tiles).items()
        for src_box, replicas in _replicas(source_tiles).items()
        if (box := src_box.intersect(dst_box)) is not None
    ]
    senders = _balanced_senders if balanced else _first_senders
    chosen = senders([(box.numel * itemsize, replicas, receivers) for box, _, _, replicas, receivers in pieces])
    planned = [
        Piece(box, src_box, dst_box, replicas, receivers, sender, box.numel * itemsize)
        for (box, src_box, dst_box, replicas, receivers), sender in zip(pieces, chosen, strict=True)
    ]
    return ReshardPlan(shape, source, dest, itemsize, _round_robin(planned), dest_tiles, source_tiles)


def _replicas(tiles: dict[int, Box]) -> dict[Box, tuple[int, ...]]:
    """Non-empty boxes and the ranks holding each, in rank order."""
    held: dict[Box, list[int]] = {}
    for rank, box in sorted(tiles.items()):
        if box.numel > 0:
            held.setdefault(box, []).append(rank)
    return {box: tuple(ranks) for box, ranks in held.items()}


_Choice = tuple[int, tuple[int, ...], tuple[int, ...]]  # (bytes, candidates, receivers)


def _first_senders(pieces: list[_Choice]) -> list[int]:
    return [candidates[0] for _, candidates, _ in pieces]


def _balanced_senders(pieces: list[_Choice]) -> list[int]:
    """Largest piece first, to the candidate whose sent bytes would then be least (ties: the one
    with less already, then the lower rank)."""
    load: dict[int, int] = {}
    chosen = [0] * len(pieces)
    for i in sorted(range(len(pieces)), key=lambda i: -pieces[i][0]):
        nbytes, candidates, receivers = pieces[i]

        def after(rank: int, nbytes: int = nbytes, receivers: tuple[int, ...] = receivers) -> tuple[int, int, int]:
            cost = 0 if receivers == (rank,) else nbytes
            return (load.get(rank, 0) + cost, load.get(rank, 0), rank)

        best = min(candidates, key=after)
        load[best] = after(best)[0]
        chosen[i] = best
    return chosen


def _round_robin(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Every sender's first piece, then every sender's second, ...; each sender's largest first."""
    by_sender: dict[int, list[Piece]] = {}
    for piece in pieces:
        by_sender.setdefault(piece.sender, []).append(piece)
    queues = [sorted(q, key=lambda p: -p.nbytes) for _, q in sorted(by_sender.items())]
    return tuple(p for round_ in itertools.zip_longest(*queues) for p in round_ if p is not None)
