"""Profiled calibration: single process, disk cache, progress bar, and two gloo ranks."""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cost_model import AnalyticEstimator, Device, Link, ProfiledEstimator, simulate
from cost_model.profile.cache import CACHE_SAMPLES, CACHE_VERSION
from cost_model.profile.estimator import MAX_CPU_SHARE
from cost_model.progress import progress_bar
from cost_model.testing import fake_world, trace_aten
from dhelix_compile.testing.multirank import run_on_ranks

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Fixed entries so no test pays for measure_cpu_device().
DEVICE = Device("unit_cpu", {torch.float32: 1e10}, 1e10, 1e-6, "unit test")
LINK = Link("unit_lo", 1e9, 1e-5, "unit test")


def _mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w).sum(0)


def test_calibrate_measures_then_hits_the_cache(tmp_path: pathlib.Path) -> None:
    gm = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    base = AnalyticEstimator(DEVICE, LINK)
    est = ProfiledEstimator(base, tmp_path, warmup=1, repeats=3, progress=False)
    report = est.calibrate(gm)
    assert (report.measured, report.cached) == (3, 0)
    mm = next(n for n in gm.graph.nodes if n.target == aten.mm.default)
    cost = est.node_cost(mm)
    assert cost.time_s == est.measurements[est.signature(mm) or ""] > 0
    assert cost.flops == base.node_cost(mm).flops  # only the time is replaced

    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["version"] == CACHE_VERSION and len(data["entries"]) == 3
    assert any(k.startswith("aten.mm.default|T([32, 16]") for k in data["entries"])

    # one measurement is not enough for the cache to answer alone: a second calibration
    # measures again and keeps the lower of the two
    again = ProfiledEstimator(base, tmp_path, warmup=1, repeats=3, progress=False)
    report2 = again.calibrate(gm)
    assert (report2.measured, report2.cached) == (3, 0)
    entries = json.loads(files[0].read_text())["entries"]
    assert all(len(samples) == CACHE_SAMPLES and samples == sorted(samples) for samples in entries.values())
    assert again.node_cost(mm).time_s == min(entries[again.signature(mm) or ""]) <= cost.time_s

    third = ProfiledEstimator(base, tmp_path, progress=False)
    report3 = third.calibrate(gm)
    assert (report3.measured, report3.cached) == (0, 3)  # its speed probes are not counted
    assert report3.speed is not None and report3.speed > 0
    # each cached time at the machine's speed now, or the probe's own time where that is lower
    assert all(0 < third.measurements[sig] <= min(samples) * report3.speed for sig, samples in entries.items())
    assert simulate(gm.graph, third).compute_s == pytest.approx(sum(third.measurements.values()))


def test_cached_times_are_put_at_the_machines_speed_now(tmp_path: pathlib.Path, monkeypatch: Any) -> None:
    """The cache holds each op's lowest time. On a machine that runs 2x slower now, the speed
    probes (the slowest cached ops, measured again) say so, and every cached time is doubled,
    the ops the probes did not measure too; an op measured now keeps the lower of its own time
    and its cached one at that speed. The probes' times join the cache, where the lowest stand."""
    gm = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    base = AnalyticEstimator(DEVICE, LINK)
    est = ProfiledEstimator(base, tmp_path, progress=False, device_name="unit", measure_contention=False)
    sigs = {n.target: est.signature(n) or "" for n in gm.graph.nodes if n.op == "call_function"}
    cached = {sigs[aten.mm.default]: 4e-3, sigs[aten.relu.default]: 3e-3, sigs[aten.sum.dim_IntList]: 1e-3}
    entries = {sig: [t] * CACHE_SAMPLES for sig, t in cached.items()}
    est.disk_cache.path("unit").write_text(json.dumps({"version": CACHE_VERSION, "device": "unit", "entries": entries}))
    probed: list[str] = []

    def twice_as_slow(item: Any) -> float:
        probed.append(item.sig)
        return 2 * cached[item.sig]

    monkeypatch.setattr(est, "_measure", twice_as_slow)
    monkeypatch.setattr("cost_model.profile.estimator.SPEED_PROBES", 2)
    report = est.calibrate(gm)
    assert (report.measured, report.cached, report.speed) == (0, 3, 2.0)
    assert probed == [sigs[aten.mm.default], sigs[aten.relu.default]]  # the slowest two
    assert est.measurements == pytest.approx({sig: 2 * t for sig, t in cached.items()})
    assert est.disk_cache.load("unit") == entries  # slower samples do not displace the lowest

    # an earlier stall: a 10x time in the cache (one sample, so measured again) is this
    # call's measurement, not 10x at the speed the probes measured
    stale = {**entries, sigs[aten.sum.dim_IntList]: [10 * cached[sigs[aten.sum.dim_IntList]]]}
    est.disk_cache.path("unit").write_text(json.dumps({"version": CACHE_VERSION, "device": "unit", "entries": stale}))
    later = ProfiledEstimator(base, tmp_path, progress=False, device_name="unit", measure_contention=False)
    monkeypatch.setattr(later, "_measure", twice_as_slow)
    report = later.calibrate(gm)
    assert (report.measured, report.speed) == (1, 2.0)
    assert later.measurements[sigs[aten.sum.dim_IntList]] == pytest.approx(2 * cached[sigs[aten.sum.dim_IntList]])


def _measure_at(monkeypatch: Any, est: ProfiledEstimator, ratio: float) -> list[str]:
    """``est`` measures without a clock: every op takes ``ratio`` times its base estimate (how
    slow the machine is at that calibration). The ops it measured, in order, are returned."""
    measured: list[str] = []

    def measure(item: Any) -> float:
        measured.append(str(item.node.target))
        return ratio * est.base.node_cost(item.node).time_s

    monkeypatch.setattr(est, "_measure", measure)
    return measured


MM, RELU, SUM = "aten.mm.default", "aten.relu.default", "aten.sum.dim_IntList"

#: A settled time is measured again by a calibration that uses it, in one of two ways, and which
#: one depends on how fast the machine ran when it was cached against how fast it runs now:
#: "probe": about as fast (1.5x slower now): it is a speed probe, and the time is the cached one
#:          at the probes' speed (module docstring of cost_model.profile.estimator: ``speed``);
#: "stall": far faster now (20x: the cores were busy when it was cached): it is a stall against
#:          this calibration's other ops, and the lower of the two times stands (``stalls``).
#: (branch, measured / base time when it was cached, measured / base time now)
_SETTLED_MEASURED_AGAIN = [("probe", 100.0, 150.0), ("stall", 1000.0, 50.0)]


@pytest.mark.parametrize(("branch", "cached_ratio", "now_ratio"), _SETTLED_MEASURED_AGAIN)
def test_a_slow_cached_measurement_does_not_stay(
    tmp_path: pathlib.Path, monkeypatch: Any, branch: str, cached_ratio: float, now_ratio: float
) -> None:
    """A time measured while the cores were busy (1 s for a 32x16 matmul, in a version-2 file of
    single numbers) is measured again by the next calibration, and the lower time wins. Once
    settled, the next calibration measures it again too (``_SETTLED_MEASURED_AGAIN``)."""
    gm = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    base = AnalyticEstimator(DEVICE, LINK)
    est = ProfiledEstimator(base, tmp_path, progress=False, device_name="unit")
    mm = next(n for n in gm.graph.nodes if n.target == aten.mm.default)
    sig = est.signature(mm) or ""
    est.disk_cache.path("unit").write_text(json.dumps({"version": 2, "device": "unit", "entries": {sig: 1.0}}))
    assert est.disk_cache.load("unit") == {sig: [1.0]}
    first = _measure_at(monkeypatch, est, cached_ratio)
    report = est.calibrate(gm)
    assert report.measured == 3 and first == [MM, RELU, SUM]
    cached_s = cached_ratio * base.node_cost(mm).time_s
    assert est.measurements[sig] == cached_s < 1.0
    assert est.disk_cache.load("unit")[sig] == [cached_s, 1.0]

    later = ProfiledEstimator(base, tmp_path, progress=False, device_name="unit")
    again = _measure_at(monkeypatch, later, now_ratio)
    report = later.calibrate(gm)
    assert (report.measured, report.cached) == (2, 1)  # relu and sum had their first measurement
    assert again == [RELU, SUM, MM]  # then the settled matmul, as a probe or as a stall
    now_s = now_ratio * base.node_cost(mm).time_s
    if branch == "probe":
        assert (report.measured_again, report.speed) == (0, pytest.approx(now_ratio / cached_ratio))
        assert later.measurements[sig] == pytest.approx(cached_s * report.speed)
    else:
        assert (report.measured_again, report.speed) == (1, None)
        assert later.measurements[sig] == now_s
    assert later.disk_cache.load("unit")[sig] == sorted([cached_s, now_s])  # the 1 s sample is gone


@pytest.mark.parametrize(("branch", "cached_ratio", "now_ratio"), _SETTLED_MEASURED_AGAIN)
def test_a_stalled_compute_time_is_measured_again_even_when_settled(
    tmp_path: pathlib.Path, monkeypatch: Any, branch: str, cached_ratio: float, now_ratio: float
) -> None:
    """A compute op's time far above what its graph's typical measured / base ratio gives it (a
    stall while it was measured: 1 s for a 32x8 relu, settled in the cache by two calibrations)
    is measured again by the next calibration; the lower time stands and joins the cache entry.
    The others are measured once. The next calibration measures the relu's new settled time
    again too (``_SETTLED_MEASURED_AGAIN``)."""
    gm = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    base = AnalyticEstimator(DEVICE, LINK)
    est = ProfiledEstimator(base, tmp_path, progress=False, device_name="unit")
    relu = next(n for n in gm.graph.nodes if n.target == aten.relu.default)
    sig = est.signature(relu) or ""
    stalled = [1.0] * CACHE_SAMPLES
    entries = {"version": CACHE_VERSION, "device": "unit", "entries": {sig: stalled}}
    est.disk_cache.path("unit").write_text(json.dumps(entries))
    first = _measure_at(monkeypatch, est, cached_ratio)
    report = est.calibrate(gm)
    assert (report.measured, report.cached, report.measured_again) == (2, 1, 1)
    assert first == [MM, SUM, RELU]
    cached_s = cached_ratio * base.node_cost(relu).time_s
    assert est.measurements[sig] == cached_s < 0.01
    assert est.disk_cache.load("unit")[sig] == [cached_s, 1.0]
    assert est.node_cost(relu).time_s == est.measurements[sig]

    later = ProfiledEstimator(base, tmp_path, progress=False, device_name="unit")
    again = _measure_at(monkeypatch, later, now_ratio)
    report = later.calibrate(gm)
    assert (report.measured, report.cached) == (2, 1)  # mm and sum had their first measurement
    assert again == [MM, SUM, RELU]  # then the settled relu, as a probe or as a stall
    now_s = now_ratio * base.node_cost(relu).time_s
    if branch == "probe":
        assert (report.measured_again, report.speed) == (0, pytest.approx(now_ratio / cached_ratio))
        assert later.measurements[sig] == pytest.approx(cached_s * report.speed)
    else:
        assert (report.measured_again, report.speed) == (1, None)
        assert later.measurements[sig] == now_s
    assert later.disk_cache.load("unit")[sig] == sorted([cached_s, now_s])  # the 1 s sample is gone


def test_an_op_that_stays_above_the_stall_line_is_measured_again_once_per_process(
    tmp_path: pathlib.Path, monkeypatch: Any
) -> None:
    """An op the base model misprices is above the stall line in every graph that holds it: the
    first calibration measures it again, later graphs of the process take its time as it stands."""
    base = AnalyticEstimator(DEVICE, LINK)
    est = ProfiledEstimator(base, tmp_path, progress=False, device_name="unit", measure_contention=False)
    measured: list[str] = []

    def measure(item: Any) -> float:  # the relu always 100x its base estimate, the rest 1x
        measured.append(str(item.node.target))
        return (100.0 if item.node.target == aten.relu.default else 1.0) * base.node_cost(item.node).time_s

    monkeypatch.setattr(est, "_measure", measure)
    x, w = torch.randn(32, 16), torch.randn(16, 8)
    first = est.calibrate(trace_aten(_mlp, x, w))
    assert first.measured_again == 1 and measured.count(RELU) == 2
    second = est.calibrate(trace_aten(lambda a, b: (torch.relu(a @ b) * 2).sum(), x, w))
    assert second.measured_again == 0 and measured.count(RELU) == 2


def test_a_compute_op_measured_again_keeps_the_lower_time(tmp_path: pathlib.Path, monkeypatch: Any) -> None:
    """A stall in this calibration's own measurement: the second measurement replaces it, in the
    times and in what goes to the cache; a slower second measurement of a time from elsewhere
    (the cache) leaves the time and joins the cache entry as a sample (the lowest stand)."""
    from cost_model.profile.estimator import STALL_OVERHEAD_S, _Item

    gm = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    node = next(n for n in gm.graph.nodes if n.target == aten.relu.default)
    est = ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), tmp_path, progress=False)
    base_s = est.base.node_cost(node).time_s
    again = {"stalled": 2 * base_s, "unlucky": 100 * STALL_OVERHEAD_S}
    monkeypatch.setattr(est, "_measure", lambda item: again[item.sig])
    items = [_Item(name, node, False, False) for name in ("a", "b", "c", "stalled", "unlucky")]
    items.append(_Item("collective", node, True, False))
    stall_s = 50 * STALL_OVERHEAD_S
    times = [base_s, base_s, base_s, stall_s, stall_s, stall_s]
    fresh = {"stalled": stall_s}
    assert est._measure_stalls_again(items, times, [base_s] * len(items), fresh) == 2
    assert times == [base_s, base_s, base_s, 2 * base_s, stall_s, stall_s]
    assert fresh == {"stalled": 2 * base_s, "unlucky": 100 * STALL_OVERHEAD_S}


def test_a_transfer_measured_again_keeps_the_lower_median(tmp_path: pathlib.Path, monkeypatch: Any) -> None:
    """Every collective and exchange measured by a calibration is measured once more after the
    others (a link's slow epochs last a measurement's length); compute ops are not."""
    from cost_model.profile.estimator import _Item

    gm = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    node = next(n for n in gm.graph.nodes if n.target == aten.mm.default)
    est = ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), tmp_path, progress=False)
    again = {"slow": 1e-3, "fast": 9e-3, "failed": 2e-3, "p2p": 5e-3}

    def measure(item: Any) -> float:  # as _measure does: an exchange's issue time is written too
        est.issue_measurements[item.sig] = 7e-4
        return again[item.sig]

    monkeypatch.setattr(est, "_measure", measure)
    est.issue_measurements.update({"fast": 1e-4, "p2p": 2e-4})
    items = [
        _Item("slow", node, True, False),  # 8 ms, then 1 ms: the second stands
        _Item("fast", node, True, False),  # 1 ms, then 9 ms: the first stands, with its issue time
        _Item("failed", node, True, False),  # NaN, then 2 ms
        _Item("cached", node, True, False),  # not measured by this calibration
        _Item("compute", node, False, False),
        _Item("p2p", node, True, True),
    ]
    times = [8e-3, 1e-3, math.nan, 3e-3, 4e-3, 6e-3]
    est._measure_transfers_again(items, [1.0, 1.0, 1.0, 0.0, 1.0, 1.0], times)
    assert times == [1e-3, 1e-3, 2e-3, 3e-3, 4e-3, 5e-3]
    assert (est.issue_measurements["fast"], est.issue_measurements["p2p"]) == (1e-4, 7e-4)


def test_unmeasured_compute_costs_the_base_estimate_times_its_ops_measured_ratio(tmp_path: pathlib.Path) -> None:
    measured = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    halves = trace_aten(
        lambda x, w: torch.relu(x @ w).sum(0) + torch.sigmoid(x).sum(), torch.randn(16, 16), torch.randn(16, 8)
    )
    base = AnalyticEstimator(DEVICE, LINK)
    est = ProfiledEstimator(base, tmp_path, warmup=1, repeats=3, progress=False)
    assert est.node_cost(next(n for n in halves.graph.nodes if n.target == aten.mm.default)) == base.node_cost(
        next(n for n in halves.graph.nodes if n.target == aten.mm.default)
    )  # nothing measured yet
    est.calibrate(measured)
    ratio = {
        str(n.target): est.node_cost(n).time_s / base.node_cost(n).time_s
        for n in measured.graph.nodes
        if n.op == "call_function"
    }
    mm = next(n for n in halves.graph.nodes if n.target == aten.mm.default)
    assert est.node_cost(mm).time_s == pytest.approx(base.node_cost(mm).time_s * ratio[str(aten.mm.default)])
    assert est.compute_scale(mm) == pytest.approx(ratio[str(aten.mm.default)])
    sigmoid = next(n for n in halves.graph.nodes if n.target == aten.sigmoid.default)  # no sigmoid was measured
    assert est.compute_scale(sigmoid) == pytest.approx(sorted(ratio.values())[1])  # the median of all three
    assert est.node_cost(sigmoid).time_s == pytest.approx(base.node_cost(sigmoid).time_s * est.compute_scale(sigmoid))


def test_a_kinds_contention_factor_is_the_median_of_the_processs_measurements(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each graph measures its own factor (its slowest op, its largest transfer); one measurement
    is noisy, so a kind's factor pools every one this process made."""
    measured = iter([1.1, 2.0, 1.4, 1.0, 1.3, 1.0])  # reduce, move, reduce, move, ...
    keys = iter(range(100))

    def fake_measure(
        compute: Any, comms: Any, group: Any, cache: dict[str, float], repeats: int, transfer: str, shares: Any
    ) -> float:
        factor = next(measured)
        cache[f"contention|{next(keys)}|{transfer}"] = factor  # keys end with the kind, as measure_contention's
        return factor

    monkeypatch.setattr("cost_model.profile.estimator.measure_contention", fake_measure)
    est = ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), tmp_path, warmup=0, repeats=1, progress=False)
    graphs = [trace_aten(_mlp, torch.randn(8 * k, 16), torch.randn(16, 8)) for k in (1, 2, 3)]
    factors = [est.calibrate(gm).contention_factor for gm in graphs[:2]]
    assert est.measured_contention == {"reduce": pytest.approx(1.25), "move": pytest.approx(1.5)}
    assert factors == [2.0, pytest.approx(1.5)]
    est.calibrate(graphs[2])
    assert est.measured_contention == {"reduce": pytest.approx(1.3), "move": pytest.approx(1.0)}


def test_a_kind_with_max_factors_measured_is_not_measured_again() -> None:
    """Once a process holds ``MAX_FACTORS`` factors of a kind, later graphs pool those: nothing
    is sent (the group is not even asked), and the other kind is still measured."""
    from cost_model.profile.contention import MAX_FACTORS, measure_contention

    class Untouchable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the group was used ({name})")

    cache = {f"contention|op{k}|bytes=1|reduce": 1.0 + k / 10 for k in range(MAX_FACTORS)}
    gm = trace_aten(_mlp, torch.randn(8, 16), torch.randn(16, 8))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    args = ([(1e-3, "sig", node)], [(1e-3, node)], Untouchable(), cache, 1)
    assert measure_contention(*args, "reduce") is None
    with pytest.raises(AssertionError, match="the group was used"):
        measure_contention(*args, "move")


def test_symbolic_graph_shares_signatures_and_scales_expression(tmp_path: pathlib.Path) -> None:
    args = (torch.randn(32, 16), torch.randn(16, 8))
    static = trace_aten(_mlp, *args)
    dynamic = trace_aten(_mlp, *args, dynamic=True)
    base = AnalyticEstimator(DEVICE, LINK)
    for _ in range(CACHE_SAMPLES):  # until the static graph's entries are settled
        ProfiledEstimator(base, tmp_path, repeats=1, warmup=0, progress=False).calibrate(static)
    est = ProfiledEstimator(base, tmp_path, progress=False)
    assert est.calibrate(dynamic).measured == 0
    mm = next(n for n in dynamic.graph.nodes if n.target == aten.mm.default)
    cost = est.node_cost(mm)
    assert cost.time_expr.free_symbols  # still a function of the sizes
    from cost_model import evaluate, size_hints

    assert evaluate(cost.time_expr, size_hints(dynamic.graph)) == pytest.approx(cost.time_s)


def test_progress_bar_and_fake_group_collectives_skipped(tmp_path: pathlib.Path) -> None:
    stream = io.StringIO()
    with progress_bar(4, "calibrate", enabled=True, stream=stream) as bar:
        for i in range(4):
            bar.set_postfix_str(f"op{i}")
            bar.update()
    assert "[" + "#" * 30 + "] 4/4" in stream.getvalue()

    with fake_world(4):
        gm = trace_aten(lambda x: funcol.all_reduce(x @ x, "sum", dist.group.WORLD), torch.randn(8, 8))
        est = ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), tmp_path, repeats=1, progress=False)
        report = est.calibrate(gm)
    assert report.measured == 1
    assert report.skipped == {"fake process group": 1}


def test_the_progress_bar_shows_where_it_did(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Silent without work or when disabled; calibrate's bar: rank 0 only, ``progress`` when set,
    else only on a terminal and from 8 measurements on."""
    quiet = io.StringIO()
    with progress_bar(0, "none", enabled=True, stream=quiet):
        pass
    with progress_bar(3, "off", enabled=False, stream=quiet) as bar:
        bar.update(3)
    assert quiet.getvalue() == ""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    class RankOne:
        def rank(self) -> int:
            return 1

    base = AnalyticEstimator(DEVICE, LINK)
    auto = ProfiledEstimator(base, tmp_path)
    assert not auto._show_progress(100, None)  # stderr is no terminal under pytest
    monkeypatch.setattr("sys.stderr", Terminal())
    assert auto._show_progress(8, None) and not auto._show_progress(7, None)
    assert not auto._show_progress(100, RankOne())
    monkeypatch.undo()
    assert ProfiledEstimator(base, tmp_path, progress=True)._show_progress(1, None)
    assert not ProfiledEstimator(base, tmp_path, progress=True)._show_progress(100, RankOne())
    assert not ProfiledEstimator(base, tmp_path, progress=False)._show_progress(100, None)

    capsys.readouterr()
    gm = trace_aten(_mlp, torch.randn(32, 16), torch.randn(16, 8))
    ProfiledEstimator(base, tmp_path / "shown", warmup=0, repeats=1, progress=True).calibrate(gm)
    shown = capsys.readouterr().err
    assert "dhelix calibrate" in shown and "] 3/3" in shown and shown.endswith("\n")


class _RankSkewedEstimator(ProfiledEstimator):
    """Pretends rank r measured (r + 1) ms for every compute op, to test agreement."""

    def _measure(self, item: Any) -> float:
        if item.is_collective:
            return super()._measure(item)
        return (dist.get_rank() + 1) * 1e-3


def _gloo_calibrate(rank: int, world_size: int, cache_root: str) -> dict[str, Any]:
    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x @ w, "sum", dist.group.WORLD).relu()

    gm = trace_aten(step, torch.randn(64, 64), torch.randn(64, 64))
    base = AnalyticEstimator(DEVICE, LINK, comm_backend="gloo")
    # Separate cache dirs: rank 1 starts with a warm cache for mm, rank 0 cold; since rank 0
    # misses it, both ranks measure it (the same collectives run on every rank).
    cache = pathlib.Path(cache_root, f"rank{rank}")
    real = ProfiledEstimator(base, cache, warmup=1, repeats=3, progress=False, device_name="unit")
    if rank == 1:
        mm = next(n for n in gm.graph.nodes if n.target == aten.mm.default)
        cache.mkdir(parents=True)
        real.disk_cache.path("unit").write_text(
            json.dumps({"version": CACHE_VERSION, "device": "unit", "entries": {real.signature(mm): [1.0, 1.0]}})
        )
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "broadcast")}
    sent = dict.fromkeys(originals, 0)  # what the contention stand-ins send (the graph only all-reduces)

    def counting(name: str) -> Any:
        def send(*args: Any, **kwargs: Any) -> Any:
            sent[name] += 1
            return originals[name](*args, **kwargs)

        return send

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        report = real.calibrate(gm)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    skewed = _RankSkewedEstimator(
        base, pathlib.Path(cache_root, f"skew{rank}"), warmup=0, repeats=1, progress=False, measure_contention=False
    )
    skewed.calibrate(gm)
    issue = next(n for n in gm.graph.nodes if n.target == c10d.all_reduce.default)
    takes_cpu = real.transfers_take_compute_cpu
    factors = {}
    for together in (False, True):  # the all-reduce's factor, its threads apart from the compute or not
        real.transfers_take_compute_cpu = together
        factors[together] = real.node_cost(issue).contention_factor
    real.transfers_take_compute_cpu = takes_cpu
    from dhelix_compile.ops.exchange import P2P_EXCHANGE

    exchange = trace_aten(
        lambda x: P2P_EXCHANGE(x, 1 - rank, 1 - rank, 3, dist.group.WORLD.group_name), torch.randn(64, 64)
    )
    p2p = next(n for n in exchange.graph.nodes if n.target == P2P_EXCHANGE)
    unmeasured_p2p_s = real.node_cost(p2p).time_s
    p2p_report = real.measure_new([p2p])  # as the decompose pass does with its variants' new nodes
    p2p_cost = real.node_cost(p2p)
    return {
        "link_scale": real.link_scale,
        "p2p_s": unmeasured_p2p_s,
        "p2p_measured": p2p_report.measured,
        "p2p_cost": (p2p_cost.issue_s, p2p_cost.time_s),
        "p2p_total": real.measurements[real.signature(p2p)],
        "p2p_issues": real.issue_measurements,
        "link_scale_after_p2p": real.link_scale,
        "p2p_base_s": base.node_cost(p2p).time_s,
        "allreduce_base_s": base.node_cost(issue).time_s,
        "measured": report.measured,
        "contention": report.contention_factor,
        "contention_by_kind": dict(real.measured_contention),
        "stand_ins_sent": sent,
        "issue_cpu_share": real.transfer_cpu_shares[real.signature(issue) or ""],
        "standin_cpu_shares": dict(real.standin_cpu_shares),
        "p2p_cpu_share": real.transfer_cpu_shares[real.signature(p2p) or ""],
        "takes_cpu": takes_cpu,
        "factor_apart": factors[False],
        "factor_together": factors[True],
        "issue_factor": real.node_cost(issue).contention_factor,
        "p2p_factor": real.node_cost(p2p).contention_factor,
        "real": real.measurements,
        "skewed": {k: v for k, v in skewed.measurements.items() if "c10d" not in k},
        "allreduce_s": real.node_cost(issue).time_s,
        "on_disk": sorted(json.loads(real.disk_cache.path("unit").read_text())["entries"]),
    }


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_two_gloo_ranks_agree(tmp_path: pathlib.Path) -> None:
    results = run_on_ranks(_gloo_calibrate, 2, str(tmp_path), timeout_s=80)
    r0, r1 = results
    assert r0["measured"] == r1["measured"] == 3  # mm, all_reduce, relu
    assert r0["real"] == r1["real"]  # agreed: identical numbers on every rank
    assert max(r0["real"].values()) < 1.0  # rank 1's stale 1 s entry was re-measured
    assert any("_c10d_functional.all_reduce" in k and "group_size=2" in k and "backend=gloo" in k for k in r0["real"])
    assert r0["allreduce_s"] > 0
    assert r0["contention"] == r1["contention"] and r0["contention"] >= 1.0
    # one factor per kind of transfer, agreed; each transfer is priced with its own kind's
    by_kind = r0["contention_by_kind"]
    assert by_kind == r1["contention_by_kind"] and set(by_kind) == {"reduce", "move"}
    assert min(by_kind.values()) >= 1.0 and r0["contention"] == max(by_kind.values())
    # ... and, where its threads run on the compute's cores (2 ranks x 1 thread filling the
    # cores), what it takes of them against what the stand-in's took: each measured, agreed
    share, standin = r0["issue_cpu_share"], r0["standin_cpu_shares"]
    assert share == r1["issue_cpu_share"] and share > 0
    assert standin == r1["standin_cpu_shares"] and set(standin) == {"reduce", "move"}
    assert r0["takes_cpu"] == r1["takes_cpu"] == (len(os.sched_getaffinity(0)) <= 2)

    def taking(kind: str, share: float) -> float:  # a transfer's factor where its threads take the compute's CPU
        return max(1.0, by_kind[kind] * (1 - min(standin[kind], MAX_CPU_SHARE)) / (1 - min(share, MAX_CPU_SHARE)))

    assert r0["factor_apart"] == by_kind["reduce"]
    assert r0["factor_together"] == pytest.approx(taking("reduce", share))
    assert r0["issue_factor"] == r0["factor_together" if r0["takes_cpu"] else "factor_apart"]
    p2p_expected = taking("move", r0["p2p_cpu_share"]) if r0["takes_cpu"] else by_kind["move"]
    assert r0["p2p_factor"] == pytest.approx(p2p_expected)
    # a "move" is timed beside all-to-alls, what a graph on gloo sends for every move: each rank
    # sends and receives at once (broadcasts carried one direction at a time, and slowed less)
    assert r0["stand_ins_sent"]["all_to_all_single"] > 0 and r0["stand_ins_sent"]["broadcast"] == 0
    # the disk cache holds compute ops only: collectives and contention depend on the link
    assert r0["on_disk"] and not any(k.startswith("contention|") or "c10d" in k for k in r0["on_disk"])
    # the max over ranks wins: rank 1 "measured" 2 ms
    assert r0["skewed"] == r1["skewed"] and set(r0["skewed"].values()) == {2e-3}
    assert not math.isnan(r0["allreduce_s"])
    # P2P (not measured) is priced on the link as the measured all-reduce found it
    assert r0["link_scale"] == r1["link_scale"] == pytest.approx(r0["allreduce_s"] / r0["allreduce_base_s"])
    assert r0["p2p_s"] == pytest.approx(r0["p2p_base_s"] * r0["link_scale"]) and r0["p2p_s"] > 0
    # measured (measure_new): the issue on the calling thread, agreed, and the rest of the transfer
    assert r0["p2p_measured"] == r1["p2p_measured"] == 1
    assert r0["p2p_issues"] == r1["p2p_issues"] and len(r0["p2p_issues"]) == 1
    issue_s, rest_s = r0["p2p_cost"]
    assert r0["p2p_cost"] == r1["p2p_cost"] and issue_s > 0 and rest_s >= 0
    assert issue_s + rest_s == pytest.approx(r0["p2p_total"])
    assert r0["link_scale_after_p2p"] == r0["link_scale"]  # only collectives set the link's scale


def test_rank_dependent_scalars_do_not_change_signatures(tmp_path: pathlib.Path) -> None:
    """A vocab-sharded embedding masks tokens with ``lt(tokens, rank * n)``: the offset differs by
    rank, the cost does not; ranks must agree on what to measure."""
    est = ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), tmp_path, progress=False)
    gm = trace_aten(lambda t: (t < 0, t < 32, t.sum(0), t.sum(1)), torch.zeros(4, 6, dtype=torch.int64))
    lt0, lt32, sum0, sum1 = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert est.signature(lt0) == est.signature(lt32)
    assert est.signature(sum0) != est.signature(sum1)  # the dim changes the output's shape


def test_a_cat_of_the_same_parts_in_another_order_has_the_same_signature(tmp_path: pathlib.Path) -> None:
    """A per-peer all-gather cats its local output (one piece) and the received pieces in gathered
    order, which depends on the rank; ranks must agree on what to measure."""
    est = ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), tmp_path, progress=False)
    gm = trace_aten(
        lambda a, b: (torch.cat([a, b, b], 1), torch.cat([b, b, a], 1), torch.cat([a, a, b], 1)),
        torch.zeros(2, 4),
        torch.zeros(2, 2),
    )
    first, last, other_parts = [n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert est.signature(first) == est.signature(last)
    assert est.signature(first) != est.signature(other_parts)


def test_an_exchange_signature_names_its_group_by_size_and_backend_not_by_name() -> None:
    """On a DP x TP mesh, ranks exchange within different TP groups (different names, same size):
    they must agree on what to measure (a 4-rank helix run raised "ranks are calibrating different
    graphs" when the group's name was in the signature)."""
    from cost_model.profile.signatures import p2p_signature
    from dhelix_compile.ops.exchange import P2P_EXCHANGE

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    sends = [
        graph.call_function(P2P_EXCHANGE, (x, peer, peer, tag, name)) for peer, tag, name in ((1, 0, "3"), (0, 5, "4"))
    ]
    wider = graph.placeholder("wider")
    wider.meta["val"] = torch.empty(8, 8)
    other = graph.call_function(P2P_EXCHANGE, (wider, 1, 1, 0, "3"))
    with fake_world(2) as group:
        first, second, third = (p2p_signature(n, group) for n in (*sends, other))
    assert first == second and first != third
    assert "group_size=2" in first


_SIDE_EFFECT_CALLS: list[int] = []


@torch.library.custom_op("dhelix_test::counts_its_calls", mutates_args=())
def _counts_its_calls(x: torch.Tensor) -> torch.Tensor:
    _SIDE_EFFECT_CALLS.append(1)
    return x.clone()


@_counts_its_calls.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_ops_outside_torch_are_never_run_by_the_profiler(tmp_path: pathlib.Path) -> None:
    """A custom op may have side effects (``dhelix::with_accumulated_grad`` clears a parameter's
    ``.grad``): calibration prices it from the base estimate and never calls it."""
    gm = trace_aten(lambda x, w: _counts_its_calls(x @ w), torch.randn(8, 8), torch.randn(8, 8))
    est = ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), tmp_path, warmup=1, repeats=2, progress=False)
    report = est.calibrate(gm)
    assert _SIDE_EFFECT_CALLS == []
    assert report.measured == 1 and report.skipped == {"not a torch op: may have side effects": 1}


def _gather_through_run_node(rank: int, world_size: int) -> bool:
    from cost_model.profile.running import run_node, transfer_tensors

    def gather(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_gather_tensor(x, 0, dist.group.WORLD)

    gm = trace_aten(gather, torch.randn(3, 4))
    issue = next(n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default)
    wait = next(n for n in gm.graph.nodes if n.target == c10d.wait_tensor.default)
    shard = torch.full((3, 4), float(rank))
    sent = run_node(issue, (shard, world_size, dist.group.WORLD.group_name), {})
    (in_flight,) = transfer_tensors(sent)  # one all-to-all
    gathered = run_node(wait, (in_flight,), {})
    expected = torch.cat([torch.full((3, 4), float(r)) for r in range(world_size)])
    return bool(torch.equal(gathered, expected))


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_the_profiler_runs_a_gloo_all_gather_as_an_all_to_all_with_the_same_values() -> None:
    """Segments and pairs run their nodes for real beside compute: a gloo all-gather goes as
    an all-to-all there too (torch's gloo all-gather corrupts the heap; a CI run lost a rank to it
    while helix measured segment pairs), and its wait gives the gathered tensor."""
    assert run_on_ranks(_gather_through_run_node, 2, timeout_s=80) == [True, True]


class _FakeClock:
    """``time.perf_counter`` for :func:`median_runs_interleaved_s`: every timed function takes
    1 s, or 5 s while the "machine" is in a slow spell (calls ``slow`` by their global index)."""

    def __init__(self, slow: range) -> None:
        self.now, self.calls, self.slow = 0.0, [], slow

    def perf_counter(self) -> float:
        return self.now

    def fn(self, name: str) -> Any:
        def run() -> None:
            self.now += 5.0 if len(self.calls) in self.slow else 1.0
            self.calls.append(name)

        return run


def test_candidates_are_timed_in_rotating_rounds_so_a_slow_spell_falls_on_every_one(monkeypatch: Any) -> None:
    """Two candidates that take the same time, and a slow spell of three calls (the emulated
    link's epochs): timed one after the other, the first measures 5x the second. Interleaved,
    in rounds that start one further along, both see the spell alike."""
    from cost_model.profile import running

    clock = _FakeClock(slow=range(2, 5))  # the first three timed calls, after 2 warmups
    monkeypatch.setattr(running.time, "perf_counter", clock.perf_counter)
    times = running.median_runs_interleaved_s([clock.fn("a"), clock.fn("b")], 1, 5, torch.device("cpu"))
    assert clock.calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert times == [1.0, 1.0]

    sequential = _FakeClock(slow=range(2, 5))  # a's 2nd-4th timed calls
    monkeypatch.setattr(running.time, "perf_counter", sequential.perf_counter)
    one_by_one = [running.median_run_s(sequential.fn(name), 1, 5, torch.device("cpu")) for name in "ab"]
    assert one_by_one == [5.0, 1.0]  # what the candidates' times were before


def test_a_candidate_that_raises_is_nan_and_the_others_are_still_timed(monkeypatch: Any) -> None:
    from cost_model.profile import running

    clock = _FakeClock(slow=range(0))
    monkeypatch.setattr(running.time, "perf_counter", clock.perf_counter)

    def fails() -> None:
        clock.calls.append("x")
        raise RuntimeError("no inputs of that shape")

    times = running.median_runs_interleaved_s([clock.fn("a"), fails, clock.fn("b")], 0, 3, torch.device("cpu"))
    assert math.isnan(times[1]) and times[0] == times[2] == 1.0
    assert clock.calls.count("x") == 1 and clock.calls.count("a") == clock.calls.count("b") == 3
    assert running.median_runs_interleaved_s([], 1, 3, torch.device("cpu")) == []


def test_a_long_compute_op_is_timed_with_one_warmup_and_three_calls(monkeypatch: Any) -> None:
    """An op whose first call reaches LONG_OP_S: that call warms it up, three are timed (2 + 5
    calls otherwise); one that raises is NaN after that one call."""
    from cost_model.profile import running

    calls: list[str] = []

    def op() -> None:
        calls.append("op")

    cpu = torch.device("cpu")
    monkeypatch.setattr(running, "LONG_OP_S", 0.0)  # every call is long
    assert running.median_op_run_or_nan_s(op, 2, 5, cpu) >= 0.0 and len(calls) == 4
    calls.clear()
    assert running.median_op_run_or_nan_s(op, 2, 2, cpu) >= 0.0 and len(calls) == 3  # repeats below three stand
    calls.clear()
    monkeypatch.setattr(running, "LONG_OP_S", math.inf)  # none is
    assert running.median_op_run_or_nan_s(op, 2, 5, cpu) >= 0.0 and len(calls) == 7
    calls.clear()
    assert running.median_op_run_or_nan_s(op, 0, 5, cpu) >= 0.0 and len(calls) == 5  # no warm-up asked: none

    def fails() -> None:
        calls.append("x")
        raise RuntimeError("no inputs of that shape")

    calls.clear()
    assert math.isnan(running.median_op_run_or_nan_s(fails, 2, 5, cpu)) and calls == ["x"]


def _segments_on_ranks(rank: int, world_size: int, cache_root: str) -> list[float | None]:
    from cost_model.profile.segments import segment_times

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x @ w, "sum", dist.group.WORLD).relu()

    gm = trace_aten(step, torch.randn(64, 64), torch.randn(64, 64))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    unmakeable = trace_aten(lambda x: x.relu(), torch.randn(4, 4))
    relu = next(n for n in unmakeable.graph.nodes if n.op == "call_function")
    relu.args[0].meta["val"] = "not a tensor"  # an input the profiler cannot make
    profiled = ProfiledEstimator(
        AnalyticEstimator(DEVICE, LINK, comm_backend="gloo"),
        pathlib.Path(cache_root, f"rank{rank}"),
        warmup=1,
        repeats=3,
        progress=False,
        measure_contention=False,
    )
    # the whole step, its matmul alone, and a segment that cannot run: measured together
    return segment_times(profiled, [nodes, nodes[:1], [relu]])


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_segments_measured_together_on_two_gloo_ranks(tmp_path: pathlib.Path) -> None:
    r0, r1 = run_on_ranks(_segments_on_ranks, 2, str(tmp_path), timeout_s=80)
    assert r0 == r1  # agreed
    whole, matmul, unmakeable = r0
    assert whole is not None and matmul is not None and 0 < matmul < whole
    assert unmakeable is None


def test_a_gradient_added_in_graph_is_priced_as_its_measured_add(tmp_path: pathlib.Path) -> None:
    """Helix's ``dhelix::grad_total`` (added after planning, not runnable alone: it writes
    ``.grad``) names an ``aten.add`` of its gradient as its stand-in (``STAND_IN_KEY``); once
    measured (``measure_new``) the final graph's prediction (``PlannedCosts``) prices it so."""
    from cost_model import PlannedCosts
    from cost_model.estimator import STAND_IN_KEY
    from dhelix_compile.helix_runtime.grad_accumulation import add_grads_in_graph
    from dhelix_compile.ops.accumulated_grad import GRAD_TOTAL

    def backward_like(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.t() @ (x @ w), w * 2

    gm = trace_aten(backward_like, torch.randn(64, 256), torch.randn(256, 256))
    est = ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), tmp_path, warmup=1, repeats=3, progress=False)
    est.calibrate(gm)
    assert add_grads_in_graph(gm, [(0, 2, (7, None))]) == 1  # the first output is slot 7's gradient
    (total,) = [n for n in gm.graph.nodes if n.target is GRAD_TOTAL]
    stand_in = total.meta[STAND_IN_KEY]
    assert stand_in.target is aten.add.Tensor
    assert [a.meta["val"].shape for a in stand_in.args] == [torch.Size([256, 256])] * 2
    est.measure_new([stand_in])
    measured = est.measurements[est.signature(stand_in) or ""]
    assert PlannedCosts(est).node_cost(total).time_s == measured > 0
    assert est.node_cost(total).time_s != measured  # alone, the estimator cannot time the op itself


def test_the_contention_stand_in_is_as_large_as_an_exchanges_payload() -> None:
    """A P2P exchange (``dhelix::exchange``) counts its payload's bytes (``describe_comm``), so the
    transfer timed beside the compute is that large (else 1 MiB)."""
    from cost_model.profile.contention import _comm_nbytes
    from dhelix_compile.ops.exchange import P2P_EXCHANGE

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(256, 512)
    exchange = graph.call_function(P2P_EXCHANGE, (x, 1, 1, 0, "group"))
    assert _comm_nbytes(exchange) == 256 * 512 * 4


def test_an_expanded_input_is_made_real_with_its_shared_elements() -> None:
    """An expanded value (0 strides: elements shared) cannot be filled in place; it is filled as
    the storage its strides reach, then viewed (the rotary tables of a Hugging Face Llama are)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cost_model.profile.running import materialize

    with FakeTensorMode():
        val = torch.empty(1, 16).expand(4, 16)
    real = materialize(val, {})
    assert (real.shape, real.stride()) == ((4, 16), (0, 1))
    assert torch.equal(real[0], real[3]) and real.abs().sum() > 0


def test_dhelix_copy_ops_are_measured_as_torchs_own(tmp_path: pathlib.Path) -> None:
    """The copies around a gloo collective sent as an all-to-all (``dhelix::tile_rows``,
    ``dhelix::sum_row_blocks``, pure functions) are timed as torch's ops are."""
    import dhelix_compile.ops  # noqa: F401 - registers the dhelix ops

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dhelix.sum_row_blocks(torch.ops.dhelix.tile_rows(torch.relu(x), 2), 2)

    gm = trace_aten(f, torch.randn(64, 16))
    est = ProfiledEstimator(AnalyticEstimator(DEVICE, LINK), tmp_path, warmup=1, repeats=3, progress=False)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in ops] == [
        "aten.relu.default",
        "dhelix.tile_rows.default",
        "dhelix.sum_row_blocks.default",
    ]
    assert [est.skip_reason(n) for n in ops] == [None, None, None]
    report = est.calibrate(gm)
    assert report.measured == 3 and all(est.node_cost(n).time_s > 0 for n in ops)
    assert est.measurements[est.signature(ops[1]) or ""] > 0
