"""``dhelix_compile.reshard`` on 4 gloo ranks: every placement pair of three mesh pairs (disjoint,
2x2 -> 4, overlapping), forward and backward, equal to the full tensor cut for the destination;
dtypes; bad calls. The plan itself is tested in ``test_reshard_plan.py``."""

from __future__ import annotations

import pytest

from dhelix_compile.testing.multirank import run_on_ranks
from dhelix_compile.testing.reshard_checks import (
    LAYOUT_PAIRS,
    PERMUTED_LAYOUT_PAIRS,
    check_compiled,
    check_dtypes_and_errors,
    check_every_layout_pair,
    placement_pairs,
)


def _mesh_ndim(ranks: list[object]) -> int:
    return 2 if isinstance(ranks[0], list) else 1


def test_every_placement_pair_equals_the_full_tensor_cut_for_the_destination() -> None:
    results = run_on_ranks(check_every_layout_pair, 4, timeout_s=300)
    for pair in LAYOUT_PAIRS:
        src, dst = LAYOUT_PAIRS[pair]
        expected = len(placement_pairs(_mesh_ndim(src), _mesh_ndim(dst)))
        for rank, by_pair in enumerate(results):
            result = by_pair[pair]
            assert result["cases"] == expected
            assert result["failures"] == [], f"{pair}, rank {rank}"
            assert result["new_groups_on_repeat"] == 0, "a repeated reshard created process groups"


def test_meshes_listing_their_ranks_out_of_order_get_the_tiles_torch_places() -> None:
    """A mesh whose ranks along a dim are not ascending: torch's collectives place tiles by each
    dim group's sorted ranks, not by ``get_coordinate()``; every tile equals ``distribute_tensor``'s
    on the destination and every gradient its on the source (reversed, 4 -> a reversed 2x2,
    disjoint and overlapping permuted meshes; every placement pair of each)."""
    results = run_on_ranks(check_every_layout_pair, 4, tuple(PERMUTED_LAYOUT_PAIRS), timeout_s=400)
    for pair, (src, dst) in PERMUTED_LAYOUT_PAIRS.items():
        for rank, by_pair in enumerate(results):
            result = by_pair[pair]
            assert result["cases"] == len(placement_pairs(_mesh_ndim(src), _mesh_ndim(dst)))
            assert result["failures"] == [], f"{pair}, rank {rank}"


def test_dtypes_move_and_bad_calls_get_clear_errors() -> None:
    results = run_on_ranks(check_dtypes_and_errors, 4, timeout_s=180)
    for rank, (dtype_failures, errors) in enumerate(results):
        assert dtype_failures == []
        assert "got Tensor" in errors["not_dtensor"]
        assert "one placement per mesh dimension" in errors["placement_count"]
        assert "does not fit a 2-D tensor" in errors["shard_dim"]
        assert "cannot produce Partial" in errors["partial_dest"]
        assert "ranks disagree on a reshard" in errors["disagree"]  # every rank, none left waiting
        assert (
            "one Placement per dim" in errors["placement_not_list"]
            and "pass [Shard(dim=0)]" in errors["placement_not_list"]
        )
        assert "distribute_tensor and full_tensor() disagree there" in errors["inconsistent_mesh"]
        assert "[[0, 3], [2, 1]]" in errors["inconsistent_mesh"]
        assert "places uneven shards inconsistently" in errors["uneven_on_permuted_mesh"]
        if "device_type" in errors:
            assert "one device type" in errors["device_type"]
        if rank == 0:
            assert "rank 0 is in neither mesh" in errors["neither_mesh"]


@pytest.mark.parametrize("source_ndim,dest_ndim,count", [(1, 1, 12), (2, 1, 45)])
def test_placement_pairs_cover_every_combination(source_ndim: int, dest_ndim: int, count: int) -> None:
    assert len(placement_pairs(source_ndim, dest_ndim)) == count


@pytest.mark.inductor
@pytest.mark.parametrize(
    "codegen",
    [
        "eager",
        pytest.param(
            "inductor",
            marks=pytest.mark.full,
        ),
    ],
)
def test_reshard_traces_into_one_compiled_graph_equal_to_eager(codegen: str) -> None:
    """``fullgraph=True`` through dhelix and through AOTAutograd: values and gradients equal eager
    on the three mesh pairs, and the broadcasts are functional collectives in the forward and
    backward graphs (so the passes can move them). dhelix with eager codegen, and with Inductor's
    under DHELIX_TEST_FULL=1 (the suite's time budget)."""
    results = run_on_ranks(check_compiled, 4, codegen, timeout_s=400)
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}"
        assert result["aot_graphs"] == 6  # forward and backward of three functions
        assert result["broadcasts"] > 0
