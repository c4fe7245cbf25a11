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
