"""``python -m dhelix_compile.bench.memory``: the command line (the ranks' measurements are benchmarks, not tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dhelix_compile.bench import memory


def test_variants_with_several_bracketed_options_reach_the_ranks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Commas inside brackets separate options, not variants (they were split as variants once)."""
    calls: list[tuple[Any, ...]] = []

    def fake_run(fn: Any, ranks: int, *args: Any, **kwargs: Any) -> list[dict[str, int]]:
        calls.append(args)
        return [{name: 2**20 * (i + 1) for i, name in enumerate(args[-1])}] * ranks

    monkeypatch.setattr("dhelix_compile.testing.multirank.run_on_ranks", fake_run)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # main sets it for its ranks; undone after the test
    variant = "helix[memory_budget_ratio=1.0,interleave_memory_budget_ratio=1.0]"
    assert memory.main(["--model", "mlp_medium", "--variants", f"eager,{variant}"]) == 0
    assert calls[0][-1] == ["eager", variant]
    assert f"| {variant} | 2.0 | 2.00x |" in capsys.readouterr().out


def test_a_rate_puts_the_ranks_on_that_link(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rate``: the profiled plans follow the link, so the peaks are measured on the one asked for."""
    links: list[Any] = []

    def fake_run(fn: Any, ranks: int, *args: Any, **kwargs: Any) -> list[dict[str, int]]:
        links.append(kwargs["link"])
        return [{name: 2**20 for name in args[-1]}] * ranks

    monkeypatch.setattr("dhelix_compile.testing.multirank.run_on_ranks", fake_run)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert memory.main(["--model", "moe_medium", "--variants", "eager,helix", "--rate", "613mbit"]) == 0
    assert memory.main(["--model", "moe_medium", "--variants", "eager,helix"]) == 0
    assert [link.rate for link in links] == ["613mbit", None]
    out = capsys.readouterr().out
    assert "a 613mbit link" in out and "loopback" in out


def test_checkpoint_reaches_the_ranks_and_names_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_run(fn: Any, ranks: int, *args: Any, **kwargs: Any) -> list[dict[str, int]]:
        calls.append(args)
        return [{name: 2**20 for name in args[-1]}] * ranks

    monkeypatch.setattr("dhelix_compile.testing.multirank.run_on_ranks", fake_run)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    argv = ["--model", "tiny", "--parallel", "functional_sp", "--checkpoint", "selective", "--variants", "eager,helix"]
    assert memory.main(argv) == 0
    assert calls[0] == ("tiny", "functional_sp", 4, "selective", ["eager", "helix"])
    assert "functional TP+SP, blocks under selective" in capsys.readouterr().out


def _functional_sp_peaks(rank: int, world_size: int) -> dict[str, int]:
    return memory._rank_peaks(rank, world_size, "tiny", "functional_sp", 2, "checkpoint", ["eager"])


@pytest.mark.multirank
def test_the_checkpointed_functional_sp_workload_runs_on_two_ranks() -> None:
    """The eager checkpointed loop of the ``functional_sp`` workload runs, and its micro-batches
    are each rank's sequence shard of one batch (the ranks' losses sum to its mean)."""
    from dhelix_compile.testing.multirank import run_on_ranks

    peaks = run_on_ranks(_functional_sp_peaks, 2, timeout_s=240)
    assert all(rank["eager"] > 0 for rank in peaks)


def test_functional_sp_is_refused_for_a_model_other_than_the_reference_transformer() -> None:
    """Hugging Face Llama would otherwise be built with PyTorch's TP plan under the name functional_sp."""
    from dhelix_compile.bench.workloads import build_workload

    with pytest.raises(ValueError, match="functional_sp is the reference transformer's"):
        build_workload("hf_llama_tiny", "functional_sp", None, 2, 1, torch.Generator())
