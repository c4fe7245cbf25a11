"""The pipeline benchmark workload (``bench.pipeline_parallel``): its transfers follow the schedule's stage
layout, and on two gloo ranks every variant trains the same gradients and the P2P replay completes."""

from __future__ import annotations

import os

import pytest
import torch

from dhelix_compile.bench.pipeline_parallel import P2PReplay, Transfer, build_pipeline, run_pipeline_variants
from dhelix_compile.testing.multirank import run_on_ranks


@pytest.mark.parametrize(
    ("kind", "crossings"),
    [
        ("dualpipev", [(0, 1), (1, 0), (1, 0), (0, 1)]),  # stage 0 -> 1 and back, 2 -> 3 and back
        ("1f1b", [(0, 1), (1, 0)]),
        ("interleaved_1f1b", [(0, 1), (1, 0), (1, 0), (0, 1), (0, 1), (1, 0)]),
    ],
)
def test_transfers_are_the_activations_and_gradients_that_cross_ranks(kind: str, crossings: list) -> None:
    """DualPipeV folds stages 1 and 2 onto rank 1 (no transfer between them); interleaved 1F1B
    loops 0, 2 on rank 0 and 1, 3 on rank 1 (every stage boundary crosses)."""
    pipeline = build_pipeline(kind, "tiny", 0, 2, microbatches=3, gen=torch.Generator().manual_seed(0))
    per_microbatch = len(pipeline.transfers) // 3
    assert [(t.src, t.dst) for t in pipeline.transfers[:per_microbatch]] == crossings
    assert pipeline.transfers == pipeline.transfers[:per_microbatch] * 3
    assert all(t.shape == (2, 32, 64) for t in pipeline.transfers)  # tiny: batch 2, seq 32, dim 64


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("kind", ["1f1b", "interleaved_1f1b", "dualpipev"])
def test_transfers_pair_the_ranks_torchs_schedule_runs_the_stages_on(kind: str, pp: int) -> None:
    """The replay's ranks are the pipeline group's ranks that torch's schedule maps each stage to
    (``stage_index_to_group_rank``, read from the schedule itself on each rank of a fake world);
    the bench's group is the default one, where a group rank is the global rank that
    ``dist.isend`` takes."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from cost_model.testing import fake_world
    from dhelix_compile.testing.pipeline_checks import build_schedule, stage_layout

    owners = []
    for rank in range(pp):
        with fake_world(pp, rank):
            stages = [
                PipelineStage(
                    nn.Linear(2, 2),
                    i,
                    pp * len(stage_layout(kind, pp, rank)),
                    torch.device("cpu"),
                    input_args=torch.zeros(1, 2),
                    output_args=torch.zeros(1, 2),
                )
                for i in stage_layout(kind, pp, rank)
            ]
            build_schedule(kind, stages, 2 * pp, lambda y, _: y.sum())
            owners.append(dict(stages[0].stage_index_to_group_rank))
    assert owners == [owners[0]] * pp
    owner = owners[0]
    crossing = [
        pair
        for stage in range(len(owner) - 1)
        if owner[stage] != owner[stage + 1]
        for pair in ((owner[stage], owner[stage + 1]), (owner[stage + 1], owner[stage]))
    ]
    pipeline = build_pipeline(kind, "tiny", 0, pp, microbatches=1, gen=torch.Generator().manual_seed(0))
    assert [(t.src, t.dst) for t in pipeline.transfers] == crossing


def test_replay_keeps_only_this_ranks_transfers() -> None:
    transfers = [Transfer(0, 1, (2,)), Transfer(2, 3, (2,)), Transfer(3, 0, (4,))]
    replay = P2PReplay(transfers, rank=0)
    assert len(replay) == 2 and [b.shape for b in replay.buffers] == [(2,), (4,)]


def test_unknown_schedule_and_variant_are_named() -> None:
    with pytest.raises(ValueError, match="gpipe"):
        build_pipeline("gpipe", "tiny", 0, 2, 2, torch.Generator())
    pipeline = build_pipeline("1f1b", "tiny", 0, 2, 2, torch.Generator())
    with pytest.raises(ValueError, match="helix_pipeline"):
        pipeline.step_function("helix", {})


@pytest.mark.multirank
@pytest.mark.skipif(
    not os.environ.get("DHELIX_TEST_FULL"), reason="DHELIX_TEST_FULL=1: the default suite's time budget"
)
def test_every_variant_trains_the_same_gradients_on_two_ranks() -> None:
    """Inductor-compiled stages under the looped schedule (torch runs DualPipeV's split backward on
    them with other gradients: BENCHMARKS.md), helix_pipeline under the folded one."""
    runs = {
        "interleaved_1f1b": ["pipeline_eager", "pipeline_inductor"],
        "dualpipev": ["pipeline_eager", "helix_pipeline"],
    }
    for kind, variants in runs.items():
        sums = run_on_ranks(
            run_pipeline_variants, 2, kind, "tiny", 4, variants, timeout_s=300, options={"codegen": "eager"}
        )
        for rank, per_variant in enumerate(sums):
            eager = per_variant["pipeline_eager"]
            for name, value in per_variant.items():
                assert value == pytest.approx(eager, rel=1e-4, abs=1e-5), f"{kind} rank {rank}: {name}"
