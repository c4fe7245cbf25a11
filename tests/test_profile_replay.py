"""The measurement log (cost_model.profile.replay): a second process of the same program replays
what the first measured, call by call, and plans from the same numbers."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cost_model import AnalyticEstimator, Device, Link, ProfiledEstimator
from cost_model.profile.replay import state_delta
from cost_model.testing import trace_aten
from dhelix_compile.testing.multirank import run_on_ranks

DEVICE = Device("unit_cpu", {torch.float32: 1e10}, 1e10, 1e-6, "unit test")
LINK = Link("unit_lo", 1e9, 1e-5, "unit test")


def _mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w).sum(0)


def _estimator(cache: pathlib.Path, **kwargs: Any) -> ProfiledEstimator:
    return ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), cache, warmup=0, repeats=1, progress=False, **kwargs)


def test_state_delta_holds_what_a_call_set() -> None:
    before = {
        "measurements": {"a": 1.0, "b": float("nan")},
        "_speed_ratios": [1.0],
        "transfers_take_compute_cpu": False,
    }
    after = {
        "measurements": {"a": 1.0, "b": float("nan"), "c": 2.0},
        "_speed_ratios": [1.0, 1.5],
        "transfers_take_compute_cpu": True,
    }
    assert state_delta(before, after) == {
        "measurements": {"c": 2.0},
        "_speed_ratios": [1.5],
        "transfers_take_compute_cpu": True,
    }
    assert state_delta(after, after) == {}


def test_a_second_process_replays_the_first_ones_calibration(tmp_path: pathlib.Path) -> None:
    gm = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    waits: list[int] = []
    first = _estimator(tmp_path, replay_link="unit", before_measuring=lambda: waits.append(1))
    assert first.calibrate(gm).measured == 3
    assert waits == [1]
    assert len(list((tmp_path / "replay" / "unit").glob("*.json"))) == 1

    second = _estimator(tmp_path, replay_link="unit", before_measuring=lambda: waits.append(2))
    report = second.calibrate(gm)
    assert (report.measured, report.cached) == (0, 3)
    assert second.state() == first.state()  # the same numbers: the same plans
    assert waits == [1]  # nothing measured: Inductor's compile workers are not waited for

    # another program (another first graph) keeps its own log; without a link key, no log at all
    other = _estimator(tmp_path, replay_link="unit")
    assert other.calibrate(trace_aten(_mlp, torch.randn(8, 16), torch.randn(16, 8))).measured == 3
    assert len(list((tmp_path / "replay" / "unit").glob("*.json"))) == 2
    assert _estimator(tmp_path / "none").calibrate(gm).measured == 3
    assert not (tmp_path / "none" / "replay").exists()


def test_a_call_that_differs_ends_the_replay(tmp_path: pathlib.Path) -> None:
    one = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    two = trace_aten(lambda x: (x * 2).neg(), torch.randn(64, 64))
    three = trace_aten(lambda x: x.exp(), torch.randn(64, 64))
    first = _estimator(tmp_path, replay_link="unit")
    first.calibrate(one)
    first.calibrate(two)
    second = _estimator(tmp_path, replay_link="unit")
    assert second.calibrate(one).measured == 0
    assert second.calibrate(three).measured == 1  # not the logged second call: measured
    assert second.calibrate(two).measured == 2  # ... and nothing replays after it
    log = json.loads(next((tmp_path / "replay" / "unit").glob("*.json")).read_text())
    assert len(log["calls"]) == 3  # the replayed call, then this process's own


def test_the_log_is_read_and_agreed_through_the_runner(tmp_path: pathlib.Path) -> None:
    """Replaying a segment call agrees with the other ranks by collectives: it runs through the
    estimator's runner (the compiler's fake-tensor mode left), as measuring does."""
    gm = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    segments = [[n for n in gm.graph.nodes if n.op == "call_function"]]
    ran: list[str] = []

    def runner(fn: Any) -> Any:
        ran.append(getattr(fn, "__qualname__", "fn"))
        return fn()

    first = _estimator(tmp_path, replay_link="unit", runner=runner)
    first.segment_times(segments)
    second = _estimator(tmp_path, replay_link="unit", runner=runner)
    ran.clear()
    assert second.segment_times(segments) == first.segment_times(segments)
    assert any("_replayed" in name for name in ran), ran  # the log's agreement, through the runner


def _replay_on_gloo(rank: int, world_size: int, cache_root: str) -> list[tuple[int, int]]:
    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x @ w, "sum", dist.group.WORLD).relu()

    from cost_model.profile import replay

    # a small loopback all-reduce measured twice can differ by more than the 3x the product allows
    # on a busy machine: the test's tolerance is wider and its false log further off
    replay.LINK_TOLERANCE = 10.0
    gm = trace_aten(step, torch.randn(256, 256), torch.randn(256, 256))
    base = AnalyticEstimator(DEVICE, LINK, comm_backend="gloo")
    cache = pathlib.Path(cache_root, f"rank{rank}")  # each rank its own folder, as on two hosts

    def calibrate() -> tuple[int, int]:
        est = ProfiledEstimator(base, cache, warmup=1, repeats=3, progress=False, replay_link="unit")
        report = est.calibrate(gm)
        return report.measured, len(est.measurements)

    counts = [calibrate(), calibrate()]
    path = next((cache / "replay" / "unit").glob("*.json"))
    log = json.loads(path.read_text())
    measurements = log["calls"][0]["delta"]["measurements"]
    for sig in measurements:  # the link logged as far slower than it runs
        if "c10d" in sig:
            measurements[sig] *= 10 * replay.LINK_TOLERANCE
    path.write_text(json.dumps(log))
    counts.append(calibrate())
    return counts


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_gloo_ranks_replay_a_link_as_logged_and_measure_one_that_is_not(tmp_path: pathlib.Path) -> None:
    r0, r1 = run_on_ranks(_replay_on_gloo, 2, str(tmp_path), timeout_s=100)
    assert r0 == r1
    assert r0[0] == (3, 3)  # mm, all_reduce, relu measured
    assert r0[1] == (0, 3)  # replayed
    assert r0[2] == (3, 3)  # the all-reduce measured outside the tolerance: measured again


def test_the_scheduled_graph_a_caller_keeps_is_not_the_one_inductor_compiled() -> None:
    """``compile_partition`` hands ``on_scheduled``'s caller (helix, which merges the strands it
    keeps) a graph Inductor never sees: Inductor rewrites the graph it compiles on an FX-graph-cache
    miss only (``index_put`` becomes ``index_put_``), so a kept graph that was compiled would differ
    between a cold process and a warm one, and so would the merged graph's measurement calls: the
    warm process would stop replaying the cold one's log there and measure afresh."""
    import functools

    from dhelix_compile import _torch_compat as compat
    from dhelix_compile.capture import compile_partition
    from dhelix_compile.compiler import resolve_config

    kept: list[tuple[torch.fx.GraphModule, list[str]]] = []

    def keep(graph: torch.fx.GraphModule, ctx: object) -> None:
        kept.append((graph, [str(n.target) for n in graph.graph.nodes]))

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        config = resolve_config({"cost_model": "analytic"})
        inner = functools.partial(compile_partition, config=config, on_scheduled=keep)
        return compat.compile_with_aot_autograd(gm, example_inputs, inner)

    def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y[mask] = 0.0
        return y + 1

    x, mask = torch.randn(8, 8), torch.rand(8, 8) > 0.5
    with torch._inductor.config.patch(fx_graph_cache=False):  # a miss: Inductor rewrites what it compiles
        out = torch.compile(masked, backend=backend)(x, mask)
    torch.testing.assert_close(out, masked(x, mask))
    assert kept and any("index_put" in target for _, targets in kept for target in targets)
    for graph, targets in kept:
        assert [str(n.target) for n in graph.graph.nodes] == targets
