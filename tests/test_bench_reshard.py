"""The resharding microbenchmark's byte accounting (pure; the 4-rank run is ``python -m
dhelix_compile.bench.reshard``, recorded in BENCHMARKS.md)."""

from __future__ import annotations

from torch.distributed.tensor.placement_types import Replicate, Shard

from dhelix_compile.bench.reshard import LAYOUTS, VARIANTS, link_bytes
from dhelix_compile.resharding.plan import MeshLayout, ReshardPlan, plan_reshard

MB = 2**20


def _plans(source: MeshLayout, dest: MeshLayout, rows: int = 256) -> dict[str, ReshardPlan]:
    shape = (rows, 1024)
    naive = plan_reshard(shape, source, dest, 4, balanced=False)
    return {"naive": naive, "per_tile": naive, "dhelix": plan_reshard(shape, source, dest, 4)}


def test_naive_sends_the_whole_tensor_to_every_destination_rank() -> None:
    """1 MiB, [0, 1] Shard(0) -> [2, 3] Shard(1): the root sends 1 MiB to each of 2 ranks; a tile
    moves as pieces of a quarter, every link carries 0.5 MiB."""
    plans = _plans(MeshLayout((2,), (0, 1), (Shard(0),)), MeshLayout((2,), (2, 3), (Shard(1),)))
    assert link_bytes(plans["naive"], "naive") == 2 * MB
    assert link_bytes(plans["per_tile"], "per_tile") == MB // 2
    assert link_bytes(plans["dhelix"], "dhelix") == MB // 2


def test_balancing_spreads_a_replicated_source_over_its_replicas() -> None:
    """2x2 (Replicate, Shard(1)) -> 4 Shard(0): per_tile sends everything from ranks 0 and 1."""
    plans = _plans(
        MeshLayout((2, 2), (0, 1, 2, 3), (Replicate(), Shard(1))), MeshLayout((4,), (0, 1, 2, 3), (Shard(0),))
    )
    per_tile = link_bytes(plans["per_tile"], "per_tile")
    dhelix = link_bytes(plans["dhelix"], "dhelix")
    assert dhelix < per_tile


def test_every_layout_is_accounted_for_every_variant() -> None:
    assert set(VARIANTS) == {"naive", "per_tile", "dhelix"}
    assert len(LAYOUTS) == 3
