"""The resharding plan (``dhelix_compile.resharding.plan``), a pure function: tiles as torch lays them
out, every destination element covered exactly once, load balancing never worse than naive."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dhelix_compile.mesh_positions import layout_mismatch
from dhelix_compile.resharding.plan import Box, MeshLayout, MeshOrderError, plan_reshard


def test_box_intersection_and_index() -> None:
    a, b = Box((0, 2), (4, 4)), Box((2, 0), (4, 4))
    assert a.intersect(b) == Box((2, 2), (2, 2))
    assert a.intersect(Box((4, 0), (1, 9))) is None
    assert Box((2, 2), (2, 2)).within(a) == (slice(2, 4), slice(0, 2))


def test_shard_to_replicate_is_one_broadcast_per_source_tile() -> None:
    source = MeshLayout((2,), (0, 1), (Shard(0),))
    dest = MeshLayout((2,), (2, 3), (Replicate(),))
    plan = plan_reshard((8, 4), source, dest, itemsize=4)
    assert [(p.box, p.sender, p.receivers) for p in plan.pieces] == [
        (Box((0, 0), (4, 4)), 0, (2, 3)),
        (Box((4, 0), (4, 4)), 1, (2, 3)),
    ]
    assert plan.groups() == ((0, 2, 3), (1, 2, 3))
    assert plan.sender_bytes() == {0: 64, 1: 64}


def test_replicated_source_spreads_the_pieces_over_its_replicas() -> None:
    """2x2 (Replicate, Shard(1)) -> [1, 2, 3] Shard(0): the naive plan sends everything from ranks 0
    and 1; balanced, rank 2 and 3 (replicas of the same tiles) send some, and a rank keeps what it
    holds and needs without a link."""
    source = MeshLayout((2, 2), (0, 1, 2, 3), (Replicate(), Shard(1)))
    dest = MeshLayout((3,), (1, 2, 3), (Shard(0),))
    naive = plan_reshard((6, 8), source, dest, 4, balanced=False)
    balanced = plan_reshard((6, 8), source, dest, 4)
    assert naive.max_sender_bytes() == 96
    assert balanced.max_sender_bytes() == 32
    assert any(p.is_local for p in balanced.pieces)


def test_uneven_and_empty_shards_are_planned() -> None:
    """3 rows over 4 ranks: torch gives ranks 0-2 one row each and rank 3 none."""
    source = MeshLayout((4,), (0, 1, 2, 3), (Shard(0),))
    dest = MeshLayout((2,), (0, 1), (Shard(1),))
    plan = plan_reshard((3, 5), source, dest, 2)
    assert plan.source_tiles[3].numel == 0
    assert all(p.sender != 3 for p in plan.pieces)
    assert sum(p.box.numel for p in plan.pieces) == 15


def test_partial_is_refused_by_the_plan() -> None:
    with pytest.raises(ValueError, match="reduce Partial"):
        plan_reshard((4,), MeshLayout((2,), (0, 1), (Partial(),)), MeshLayout((2,), (2, 3), (Replicate(),)), 4)
    with pytest.raises(ValueError, match="one placement per mesh dimension"):
        MeshLayout((2, 2), (0, 1, 2, 3), (Shard(0),))
    with pytest.raises(ValueError, match="does not fit"):
        MeshLayout((2,), (0, 1), (Shard(2),)).tiles((4, 4))


# ---------------------------------------------------------------------------------- property tests


@st.composite
def layouts(draw: st.DrawFn, ndim: int, world: int) -> MeshLayout:
    mesh_shape = draw(st.sampled_from([(1,), (2,), (3,), (4,), (2, 2), (1, 3), (3, 1)]))
    size = math.prod(mesh_shape)
    ranks = draw(st.permutations(range(world)).map(lambda p: tuple(p[:size])))
    placement = st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard))
    placements: tuple[Placement, ...] = tuple(draw(placement) for _ in mesh_shape)
    return MeshLayout(mesh_shape, ranks, placements)


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple[int, ...], MeshLayout, MeshLayout]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    source, dest = draw(layouts(ndim, 6)), draw(layouts(ndim, 6))
    for layout in (source, dest):  # layouts torch holds as one tensor (the others: test below)
        assume(layout_mismatch(shape, layout.mesh_shape, layout.ranks, layout.placements) is None)
    return shape, source, dest


def test_a_layout_torch_does_not_hold_is_refused_by_the_plan() -> None:
    """Uneven shards on a mesh listing its ranks out of order, and a 2-D mesh whose dim-1 groups
    cut across the sharded dim 0's positions (``mesh_positions``)."""
    even = MeshLayout((2,), (2, 3), (Replicate(),))
    with pytest.raises(MeshOrderError, match="uneven shards"):
        plan_reshard((5,), MeshLayout((4,), (3, 2, 1, 0), (Shard(0),)), even, 4)
    with pytest.raises(MeshOrderError, match="share a dim-1 process group"):
        plan_reshard((4,), MeshLayout((2, 2), (2, 1, 3, 0), (Shard(0), Replicate())), even, 4)
    plan = plan_reshard((4,), MeshLayout((2, 2), (2, 1, 3, 0), (Replicate(), Shard(0))), even, 4)
    assert plan.source_tiles == {
        2: Box((2,), (2,)),
        1: Box((0,), (2,)),
        3: Box((2,), (2,)),
        0: Box((0,), (2,)),
    }  # as torch


def _torch_tiles(shape: tuple[int, ...], layout: MeshLayout) -> dict[int, torch.Tensor]:
    """Every rank's tile of ``arange(numel).view(shape)``, cut the way DTensor cuts it (torch.chunk per
    shard, left to right over the mesh dims): the reference the plan's boxes are checked against."""
    full = torch.arange(math.prod(shape)).view(shape)
    tiles = {}
    for rank, coord in layout.coordinates():
        tile = full
        for mesh_dim, p in enumerate(layout.placements):
            if isinstance(p, Shard):
                chunks = list(torch.chunk(tile, layout.mesh_shape[mesh_dim], dim=p.dim))
                chunks += [tile.narrow(p.dim, 0, 0)] * (layout.mesh_shape[mesh_dim] - len(chunks))
                tile = chunks[coord[mesh_dim]]
        tiles[rank] = tile
    return tiles


@settings(max_examples=200, deadline=None)
@given(case=cases(), balanced=st.booleans())
def test_every_destination_element_is_received_exactly_once(
    case: tuple[tuple[int, ...], MeshLayout, MeshLayout], balanced: bool
) -> None:
    """Run the plan on plain tensors: every destination rank assembles its tile from the pieces it
    receives, each element written once, from a sender that really holds it."""
    shape, source, dest = case
    plan = plan_reshard(shape, source, dest, itemsize=4, balanced=balanced)
    have, want = _torch_tiles(shape, source), _torch_tiles(shape, dest)
    for rank, expected in want.items():
        tile = plan.dest_tiles[rank]
        assert tile.shape == tuple(expected.shape)
        got = torch.full(tile.shape, -1, dtype=torch.long)
        writes = torch.zeros(tile.shape, dtype=torch.long)
        for piece in plan.pieces:
            if rank not in piece.receivers:
                continue
            assert piece.sender in piece.candidates
            assert plan.source_tiles[piece.sender] == piece.source_tile
            got[piece.box.within(tile)] = have[piece.sender][piece.box.within(piece.source_tile)]
            writes[piece.box.within(tile)] += 1
        assert torch.equal(writes, torch.ones_like(writes)), "an element missed or written twice"
        assert torch.equal(got, expected)
    for piece in plan.pieces:  # pieces go to exactly the ranks whose tile it is part of
        assert all(plan.dest_tiles[r] == piece.dest_tile for r in piece.receivers)


@settings(max_examples=200, deadline=None)
@given(case=cases(), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_load_balancing_never_loads_a_sender_more_than_naive(
    case: tuple[tuple[int, ...], MeshLayout, MeshLayout], itemsize: int
) -> None:
    shape, source, dest = case
    naive = plan_reshard(shape, source, dest, itemsize, balanced=False)
    balanced = plan_reshard(shape, source, dest, itemsize)
    assert balanced.max_sender_bytes() <= naive.max_sender_bytes()
    assert sum(p.nbytes for p in balanced.pieces) == sum(p.nbytes for p in naive.pieces)


@settings(max_examples=100, deadline=None)
@given(case=cases())
def test_send_order_starts_every_sender_before_any_sends_twice(
    case: tuple[tuple[int, ...], MeshLayout, MeshLayout],
) -> None:
    shape, source, dest = case
    plan = plan_reshard(shape, source, dest, 4)
    senders = {p.sender for p in plan.pieces}
    first_round = [p.sender for p in plan.pieces[: len(senders)]]
    assert sorted(first_round) == sorted(senders)
