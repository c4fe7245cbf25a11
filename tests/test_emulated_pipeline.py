"""The pipeline bench on an emulated cluster: one process as a rank of a PP x TP job.

Timing-free: which rank and TP degree a run takes, the options it refuses, and that
``dhelix bench --pipeline 1f1b --link emulated:...,ranks=4`` reports pipeline_inductor and
helix_pipeline each beside its own limit with the bytes it sent. Numerics of helix_pipeline on
PP=2 x TP=2 are checked on real gloo ranks (``tests/test_helix_pipeline.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from dhelix_compile.bench import run as bench_run
from dhelix_compile.bench.emulated import parse_emulated_link, pipeline_rank, pipeline_tp


def test_two_pipeline_ranks_and_tp_over_the_rest_unless_told() -> None:
    assert pipeline_tp(4) == 2 and pipeline_tp(8) == 4 and pipeline_tp(2) == 1 and pipeline_tp(3) == 1
    assert pipeline_tp(8, tp=2) == 2 and pipeline_tp(4, tp=1) == 1
    with pytest.raises(ValueError, match="does not divide"):
        pipeline_tp(4, tp=3)


def test_the_emulated_rank_holds_the_last_stage() -> None:
    assert pipeline_rank("1f1b", pp=2, tp=2) == 2  # stage 1 on pipeline rank 1: global rank 2
    assert pipeline_rank("interleaved_1f1b", pp=2, tp=2) == 2  # stages 1 and 3 on pipeline rank 1
    assert pipeline_rank("dualpipev", pp=2, tp=2) == 0  # the folded V: stages 0 and 3 on pipeline rank 0
    assert pipeline_rank("1f1b", pp=4, tp=1) == 3


def test_the_link_spec_names_a_rank() -> None:
    spec = parse_emulated_link("emulated:ib400,ranks=4,rank=1")
    assert spec is not None and (spec.ranks, spec.rank) == (4, 1)
    assert parse_emulated_link("emulated:ib400") == parse_emulated_link("emulated:ib400,ranks=8")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        parse_emulated_link("emulated:ib400,ranks=4,rank=4")
    with pytest.raises(ValueError, match="integer"):
        parse_emulated_link("emulated:ib400,rank=last")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--tp", "2"], "--tp sets the TP ranks"),
        (["--pipeline", "1f1b", "--link", "emulated:ib400,ranks=4", "--device", "cuda"], "float32 on CPU"),
        (["--pipeline", "1f1b", "--link", "emulated:ib400,ranks=4", "--tp", "3"], "does not divide"),
    ],
)
def test_the_bench_refuses_what_it_cannot_run(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_run.main(["--model", "tiny", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.full
def test_pp2_x_tp2_puts_each_pipeline_variant_beside_its_own_limit(tmp_path: Path) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    out = tmp_path / "bench.json"
    argv = ["--pipeline", "1f1b", "--link", "emulated:ib100,ranks=4", "--model", "tiny", "--microbatches", "2"]
    argv += ["--variants", "pipeline_inductor,helix_pipeline", "--repeats", "1", "--warmup", "0", "--out", str(out)]
    assert bench_run.main(argv) == 0
    assert not dist.is_initialized(), "the bench leaves no process group behind"
    summary = json.loads(out.read_text())
    assert summary["parallel"] == "pipeline 1f1b, PP=2 x TP=2" and summary["rank"] == 2
    assert list(summary["variants"]) == ["pipeline_inductor", "helix_pipeline"]
    for row in summary["variants"].values():
        # the last stage sends gradients to the first and runs its blocks' and head's TP collectives
        assert row["t_compute_s"] > 0 and row["t_comm_s"] > 0 and row["wire_bytes_per_step"] > 0
        assert row["limit_s"] == max(row["t_compute_s"], row["t_comm_s"])
        assert len(row["step_s_all"]) == 1
        assert {"send", "recv", "all_reduce"} <= set(row["operations_per_step"])
