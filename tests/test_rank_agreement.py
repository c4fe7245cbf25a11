"""Ranks agree on measured numbers over real gloo groups, with tensors only (numpy blocked)."""

from __future__ import annotations

import math
import sys

import pytest

from cost_model.rank_agreement import (
    FAILED_S,
    agree_max,
    agree_max_s,
    all_agree,
    check_same_signatures,
    gather_floats,
    gather_texts,
)
from dhelix_compile.testing.multirank import MultiRankError, run_on_ranks

pytestmark = pytest.mark.multirank


def _agree_on(rank: int, world_size: int) -> dict[str, object]:
    import torch.distributed as dist

    sys.modules["numpy"] = None  # type: ignore[assignment]  # None blocks imports: any numpy import now fails
    group = dist.group.WORLD
    return {
        "max": agree_max([float(rank), -float(rank), 0.5], group),
        "all_true": all_agree(True, group),
        "one_false": all_agree(rank != world_size - 1, group),
        "gathered": gather_floats([float(rank), None if rank == 0 else 2.0 * rank], group),
        # seconds: failed on rank 0 only, and failed everywhere
        "times": agree_max_s([math.nan if rank == 0 else 0.25, math.nan], group),
        "texts": gather_texts("é" * rank, group),  # rank 0's is empty
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_agree_with_tensors_only(world_size: int) -> None:
    results = run_on_ranks(_agree_on, world_size, timeout_s=120.0)
    top = float(world_size - 1)
    expected_rows = [[0.0, None]] + [[float(r), 2.0 * r] for r in range(1, world_size)]
    for result in results:
        assert result == {
            "max": [top, 0.0, 0.5],
            "all_true": True,
            "one_false": False,
            "gathered": expected_rows,
            "times": [0.25, FAILED_S],  # the ranks that measured set the time
            "texts": ["é" * r for r in range(world_size)],
        }


def _different_signatures(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    check_same_signatures(["a", "b"] if rank == 0 else ["a", "c"], dist.group.WORLD)


def test_different_signatures_raise_on_every_rank() -> None:
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_different_signatures, 2, timeout_s=120.0)
    assert all("ranks are calibrating different graphs" in f.detail for f in info.value.failures)
    assert {f.rank for f in info.value.failures} == {0, 1}


def test_without_a_group_each_rank_keeps_its_own() -> None:
    assert agree_max([1.0, 2.0], None) == [1.0, 2.0]
    assert agree_max_s([1.0, math.nan], None) == [1.0, FAILED_S]
    assert all_agree(False, None) is False
    assert gather_floats([1.0, None], None) == [[1.0, None]]
    assert gather_texts("x", None) == ["x"]
    check_same_signatures(["x"], None)
