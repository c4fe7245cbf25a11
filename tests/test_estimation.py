"""Which estimator a compile gets: cost_model 'auto', and one profiled estimator per process and link."""

from __future__ import annotations

import torch

from cost_model import AnalyticEstimator, ProfiledEstimator
from dhelix_compile.config import DHelixConfig
from dhelix_compile.estimation import build_estimator, resolve_cost_model


def _graph() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(lambda x: torch.mm(x, x))


def test_auto_is_analytic_without_a_live_multi_rank_group() -> None:
    config = DHelixConfig.from_options({"device": "cpu"}, environ={})
    assert config.cost_model == "auto" and resolve_cost_model(config) == "analytic"
    assert isinstance(build_estimator(config, _graph(), [torch.ones(2, 2)]), AnalyticEstimator)
    assert resolve_cost_model(config.patch(cost_model="profile")) == "profile"


def test_profiled_compiles_share_one_estimator_per_process(tmp_path) -> None:
    """What one graph measured serves the next: a helix merged graph of per-peer strands has no
    collective left to measure, and prices its exchanges by the link scale the strands measured."""
    config = DHelixConfig.from_options(
        {"device": "cpu", "cost_model": "profile", "cache_dir": str(tmp_path)}, environ={}
    )
    first = build_estimator(config, _graph(), [torch.ones(2, 2)])
    second = build_estimator(config, _graph(), [torch.ones(2, 2)])
    assert isinstance(first, ProfiledEstimator) and first is second
    other = build_estimator(config.patch(cache_dir=str(tmp_path / "other")), _graph(), [torch.ones(2, 2)])
    assert other is not first


def _cpu_devices(rank: int, world_size: int) -> list[tuple[float, ...]]:
    from dhelix_compile.estimation import resolve_device

    devices = [resolve_device(DHelixConfig.from_options({"device": d}, environ={}), []) for d in ("cpu", "auto")]
    return [(*d.peak_flops_per_s.values(), d.mem_bandwidth_bytes_per_s, d.launch_overhead_s) for d in devices]


def test_a_measured_cpu_device_is_rank_0s_on_every_rank() -> None:
    """device="cpu", like "auto" on the CPU, plans with rank 0's measurement: each rank's own
    differs a little, and different costs mean a different order of collectives on each rank."""
    from dhelix_compile.testing.multirank import run_on_ranks

    (rank0, rank1) = run_on_ranks(_cpu_devices, 2, timeout_s=120)
    assert rank0 == rank1 and rank0[0] == rank0[1]
