"""``profile_steps=N``: the measured timeline, predicted vs measured per segment, in the dumps.

Layers: the segment arithmetic on hand-made simulator results and profiler events; the
wrapper on a plain boxed function; compiled graphs (single-process MLP, a two-all-reduce
function under PyTorch's fake process group, the TP reference model on two gloo ranks, and
one Inductor case). Timing assertions stop at "positive": the machine is shared.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed._functional_collectives as fc
from torch._functorch.aot_autograd import make_boxed_func

import dhelix_compile
from cost_model import SimEvent, SimResult
from cost_model.testing import fake_world, trace_aten
from dhelix_compile.cli import main
from dhelix_compile.config import ConfigError, DHelixConfig
from dhelix_compile.observe.measured import (
    Boundary,
    MeasuredTimeline,
    MeasurementPlan,
    base_op,
    comm_boundaries,
    measured_sim_result,
    predicted_segments_s,
    profile_first_steps,
    read_step,
)
from dhelix_compile.testing.multirank import run_on_ranks
from dhelix_compile.testing.toy_models import MLP

MEASURED_FILES = ("measured.trace.json", "measured.svg", "predicted_vs_measured.svg", "predicted_vs_measured.json")


def _two_all_reduces(x: torch.Tensor, w: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
    h = x @ w
    r = fc.all_reduce(big * 2, "sum", "0")
    g = torch.relu(x @ w) @ w
    r2 = fc.all_reduce(h, "sum", "0")
    g = torch.tanh(g @ w) @ w
    return r.sum() + g.sum() + r2.sum()


def _backend(dump_dir: Path, steps: int, codegen: str = "eager") -> Any:
    # decompose="off": the segments are cut at the graph's own collectives; under "auto" the
    # measured costs of the moment may send an all-reduce as per-peer steps (more boundaries)
    return dhelix_compile.backend(
        codegen=codegen, fallback="error", dump_dir=str(dump_dir), profile_steps=steps, decompose="off"
    )


def _graph_folders(dump_dir: Path) -> list[Path]:
    return sorted(p.parent for p in dump_dir.rglob("summary.json"))


def _numbers(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "predicted_vs_measured.json").read_text())


def _assert_consistent(numbers: dict[str, Any], steps: int) -> None:
    """Positive times; per call, the segments add up to the whole call."""
    assert numbers["steps"] == steps and len(numbers["measured_steps_s"]) == steps
    assert numbers["measured_step_s"] > 0 and numbers["predicted_step_s"] > 0 and numbers["ratio"] > 0
    segments = numbers["segments"]
    assert segments, numbers.get("segments_note")
    for seg in segments:
        assert seg["measured_s"] > 0 and len(seg["measured_steps_s"]) == steps
        assert seg["predicted_s"] is not None and seg["predicted_s"] >= 0
    for call, total_s in enumerate(numbers["measured_steps_s"]):
        assert math.fsum(s["measured_steps_s"][call] for s in segments) == pytest.approx(total_s, rel=1e-6)
    assert math.fsum(s["predicted_s"] for s in segments) == pytest.approx(numbers["predicted_step_s"], rel=1e-6)


# --------------------------------------------------------------------------- compiled graphs


@pytest.fixture(scope="module")
def mlp_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump_dir = tmp_path_factory.mktemp("mlp_profiled")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.compile(MLP(), backend=_backend(dump_dir, steps=2))
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
    return dump_dir


@pytest.fixture(scope="module")
def comm_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump_dir = tmp_path_factory.mktemp("comm_profiled")
    torch._dynamo.reset()
    torch.manual_seed(0)
    with fake_world(4):
        fn = torch.compile(_two_all_reduces, backend=_backend(dump_dir, steps=3))
        args = (torch.randn(64, 64), torch.randn(64, 64), torch.randn(256, 256))
        for _ in range(4):
            fn(*args)
    return dump_dir


def test_forward_and_backward_get_the_measured_files(mlp_dump: Path) -> None:
    folders = _graph_folders(mlp_dump)
    assert [f.name.split("_")[-1] for f in folders] == ["bwd", "fwd"]
    for folder in folders:
        for name in MEASURED_FILES:
            assert (folder / name).is_file(), folder / name
        numbers = _numbers(folder)
        _assert_consistent(numbers, steps=2)
        assert [s["label"] for s in numbers["segments"]] == ["start \u2192 end"]  # no collectives: one segment
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["profile_steps"] == 2
        assert summary["measured"] == {k: v for k, v in numbers.items() if k != "graph"}
        page = (folder / "index.html").read_text()
        assert "Predicted vs measured" in page and "measured.trace.json" in page
        assert 'src="measured.svg"' in page and 'src="predicted_vs_measured.svg"' in page


def test_measured_trace_has_what_perfetto_needs(mlp_dump: Path, comm_dump: Path) -> None:
    for folder in _graph_folders(mlp_dump) + _graph_folders(comm_dump):
        trace = json.loads((folder / "measured.trace.json").read_text())
        events = trace["traceEvents"]
        slices = [e for e in events if e["ph"] == "X"]
        assert slices
        for ev in slices:
            assert {"name", "ph", "pid", "tid", "ts", "dur"} <= ev.keys(), ev
            assert ev["ts"] >= 0 and ev["dur"] >= 0
        calls = [e for e in slices if e.get("cat") == "dhelix_call"]
        steps = _numbers(folder)["steps"]
        assert [e["name"] for e in calls] == [f"profiled call {i + 1}" for i in range(steps)]
        assert len([e for e in slices if e.get("cat") == "dhelix_segment"]) == steps * len(_numbers(folder)["segments"])
        names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
        assert {"profiled calls", "segments (measured)"} <= names
        assert any(e["name"].startswith("aten::") for e in slices)  # the profiler's own events


def test_collectives_cut_the_call_into_segments(comm_dump: Path) -> None:
    (folder,) = _graph_folders(comm_dump)
    assert folder.parent.name == "rank0"
    numbers = _numbers(folder)
    _assert_consistent(numbers, steps=3)
    summary = json.loads((folder / "summary.json").read_text())
    boundaries = summary["comm_order"]
    assert len(numbers["segments"]) == len(boundaries) + 1 == 5
    labels = [s["label"] for s in numbers["segments"]]
    assert labels[0].startswith("start \u2192 all_reduce") and labels[-1].endswith("\u2192 end")
    gantt = (folder / "predicted_vs_measured.svg").read_text()
    for text in ("dhelix schedule, predicted", "measured, profiled call", "(median)", "comm channel 0", "time (ms)"):
        assert text in gantt
    gantt = (folder / "measured.svg").read_text()
    assert "dhelix schedule" not in gantt and "blocked in waits" in gantt and 'fill="url(#exposed)"' in gantt
    for name in ("measured.svg", "predicted_vs_measured.svg"):
        assert ET.parse(folder / name).getroot().tag == "{http://www.w3.org/2000/svg}svg"


def test_report_prints_measured_columns_and_segments(
    mlp_dump: Path, comm_dump: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(comm_dump)]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "measured ms" in header and "meas/pred" in header
    assert "predicted vs measured per communication segment" in out
    assert "whole call" in out and "start \u2192 all_reduce" in out
    numbers = _numbers(_graph_folders(comm_dump)[0])
    assert f"{numbers['measured_step_s'] * 1e3:.3f}" in out
    assert f"where they differ: {numbers['account']['verdict']}" in out
    assert main(["report", str(mlp_dump)]) == 0
    out = capsys.readouterr().out
    assert "per communication segment" not in out  # one segment each: the columns say it all
    table = out.split("\n\n")[0]  # the graphs' table; the compile time follows
    assert all(line.rstrip().endswith("x") for line in table.splitlines()[2:])


def test_summary_says_measurement_is_pending_before_the_last_profiled_call(tmp_path: Path) -> None:
    torch._dynamo.reset()
    model = torch.compile(MLP(), backend=_backend(tmp_path, steps=2))
    with torch.no_grad():
        model(torch.randn(4, 16))  # the warm-up call
        model(torch.randn(4, 16))  # the first profiled call
    (folder,) = _graph_folders(tmp_path)
    assert not (folder / "predicted_vs_measured.json").exists()
    assert "a warm-up call and 2 profiled calls" in (folder / "index.html").read_text()


# --------------------------------------------------------------------------- the wrapper


def _plan() -> MeasurementPlan:
    return MeasurementPlan("toy", ())


def test_wrapper_warms_up_profiles_then_gets_out_of_the_way() -> None:
    raw = make_boxed_func(lambda x: [x * 2])
    done: list[MeasuredTimeline] = []
    wrapped = profile_first_steps(raw, _plan(), 2, on_done=done.append)  # one warm-up call, two profiled
    assert getattr(wrapped, "_boxed_call", False)
    for i in range(5):
        (out,) = wrapped([torch.full((2,), float(i))])
        assert torch.equal(out, torch.full((2,), 2.0 * i))
        assert len(done) == (1 if i >= 2 else 0)
    assert not wrapped.profiling
    (measured,) = done
    assert len(measured.steps) == 2 and all(s.step_s > 0 for s in measured.steps)
    assert measured.rows()[-1].label == "whole call"


def test_calls_under_the_users_profiler_are_not_counted() -> None:
    done: list[MeasuredTimeline] = []
    wrapped = profile_first_steps(make_boxed_func(lambda x: [x + 1]), _plan(), 1, on_done=done.append, warmup_calls=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        wrapped([torch.ones(2)])
    assert not done
    wrapped([torch.ones(2)])
    assert len(done) == 1


def test_a_failure_while_reading_the_profile_stops_profiling_not_training(caplog: pytest.LogCaptureFixture) -> None:
    def broken(_: MeasuredTimeline) -> None:
        raise OSError("disk full")

    raw = make_boxed_func(lambda x: [x + 1])
    wrapped = profile_first_steps(raw, _plan(), 1, on_done=broken, warmup_calls=0)
    (out,) = wrapped([torch.ones(2)])
    assert torch.equal(out, torch.full((2,), 2.0))
    assert not wrapped.profiling
    assert "profiling stopped: disk full" in caplog.text


# --------------------------------------------------------------------------- segment arithmetic


def test_boundaries_are_the_comm_nodes_in_graph_order() -> None:
    with fake_world(4):
        gm = trace_aten(_two_all_reduces, torch.randn(8, 8), torch.randn(8, 8), torch.randn(4, 4))
    found = comm_boundaries(gm)
    assert [(b.op, b.kind) for b in found] == [
        ("all_reduce", "collective"),
        ("wait_tensor", "wait"),
        ("all_reduce", "collective"),
        ("wait_tensor", "wait"),
    ]
    assert found[1].issue == found[0].node and found[3].issue == found[2].node
    assert {b.namespace for b in found} == {"_c10d_functional"}


def test_inductor_variants_match_their_functional_op() -> None:
    assert base_op("_c10d_functional::all_reduce_") == "all_reduce"
    assert base_op("_c10d_functional::all_gather_into_tensor_out") == "all_gather_into_tensor"
    assert base_op("_c10d_functional::wait_tensor") == "wait_tensor"
    assert base_op("_c10d_functional::reduce_scatter_tensor_coalesced") == "reduce_scatter_tensor_coalesced"


def _boundaries() -> tuple[Boundary, ...]:
    return (
        Boundary("ag", "all_gather_into_tensor", "_c10d_functional", "collective"),
        Boundary("wait", "wait_tensor", "_c10d_functional", "wait", issue="ag"),
    )


def test_predicted_segments_follow_the_compute_stream_clock() -> None:
    # order: mm (0-2 ms), ag issued at 2 ms (transfer 2-5 ms), relu (2-3 ms), wait blocks 3-5 ms, add (5-6 ms)
    events = (
        SimEvent("mm", "compute", "compute", 0.0, 2e-3),
        SimEvent("ag", "collective", "comm0", 2e-3, 5e-3),
        SimEvent("relu", "compute", "compute", 2e-3, 3e-3),
        SimEvent("wait", "wait", "compute", 3e-3, 5e-3),
        SimEvent("add", "compute", "compute", 5e-3, 6e-3),
    )
    result = SimResult(6e-3, 4e-3, 3e-3, 2e-3, 0, events)
    got = predicted_segments_s(["x", "mm", "ag", "relu", "wait", "add", "output"], result, _boundaries())
    assert got == pytest.approx((2e-3, 3e-3, 1e-3))


def _event(name: str, start_us: float, dur_us: float, cat: str = "cpu_op", tid: int = 7) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": start_us, "dur": dur_us, "pid": 1, "tid": tid}


def _profile(issue: str = "_c10d_functional::all_gather_into_tensor_out") -> list[dict[str, Any]]:
    return [
        _event("dhelix::g", 100.0, 100.0, cat="user_annotation"),
        _event("aten::mm", 101.0, 19.0),
        _event(issue, 120.0, 10.0),
        _event("c10d::allgather_", 122.0, 5.0),  # nested, another namespace
        _event("_c10d_functional::wait_tensor", 150.0, 1.0, tid=8),  # another thread
        _event("aten::relu", 130.0, 20.0),
        _event("_c10d_functional::wait_tensor", 150.0, 30.0),
        _event("_c10d_functional::wait_tensor", 151.0, 2.0),  # nested in the outer wait
        _event("aten::add", 180.0, 20.0),
    ]


def test_measured_segments_end_when_each_comm_op_returns() -> None:
    plan = MeasurementPlan("g", _boundaries(), (2e-5, 3e-5, 1e-5), 6e-5)
    step = read_step(plan, _profile())
    assert step.mismatch is None and step.step_s == pytest.approx(100e-6)
    assert step.segments_s() == pytest.approx([30e-6, 50e-6, 20e-6])
    result = measured_sim_result(plan, step)
    assert result.makespan_s == pytest.approx(100e-6) and result.exposed_comm_s == pytest.approx(30e-6)
    (transfer,) = [e for e in result.events if e.resource == "comm0"]
    assert (transfer.node_name, transfer.start_s, transfer.end_s) == ("ag", pytest.approx(20e-6), pytest.approx(80e-6))


def _call(offset_us: float, segments_us: tuple[float, float, float]) -> list[dict[str, Any]]:
    """One profiled call of the all-gather graph whose three segments take ``segments_us``."""
    first, second, third = segments_us
    start = offset_us
    return [
        _event("dhelix::g", start, first + second + third, cat="user_annotation"),
        _event("_c10d_functional::all_gather_into_tensor_out", start + first - 1.0, 1.0),
        _event("_c10d_functional::wait_tensor", start + first, second),
    ]


def test_the_account_splits_the_gap_into_compute_blocked_and_per_call_variation() -> None:
    # predicted: 20 us of compute, then blocked 30 us at the wait, then 10 us of compute
    plan = MeasurementPlan("g", _boundaries(), (2e-5, 3e-5, 1e-5), 6e-5)
    # every call has one segment 40 us long, a different one each call
    calls = [(60.0, 30.0, 10.0), (20.0, 70.0, 10.0), (20.0, 30.0, 50.0)]
    steps = tuple(read_step(plan, _call(1000.0 * i, segs)) for i, segs in enumerate(calls))
    account = MeasuredTimeline(plan, steps, {"traceEvents": []}).account()
    assert account is not None
    assert account.measured_s == pytest.approx(100e-6)  # every call takes 100 us
    assert account.segment_medians_s == pytest.approx(60e-6)  # each segment's median is its short time
    assert account.variation_s == pytest.approx(40e-6)
    assert (account.compute_predicted_s, account.compute_measured_s) == (pytest.approx(30e-6), pytest.approx(30e-6))
    assert (account.blocked_predicted_s, account.blocked_measured_s) == (pytest.approx(30e-6), pytest.approx(30e-6))
    assert [(i, spread) for i, _, spread in account.most_variable] == [
        (0, pytest.approx(40e-6)),
        (1, pytest.approx(40e-6)),
        (2, pytest.approx(40e-6)),
    ]
    verdict = account.verdict()
    assert verdict.index("per-call variation") < verdict.index("compute segments")  # the largest part first
    numbers = MeasuredTimeline(plan, steps, {"traceEvents": []}).numbers()
    assert numbers["account"]["variation_s"] == pytest.approx(40e-6) and numbers["account"]["verdict"] == verdict


def test_the_account_names_a_segment_that_is_slow_in_every_call() -> None:
    plan = MeasurementPlan("g", _boundaries(), (2e-5, 3e-5, 1e-5), 6e-5)
    steps = tuple(read_step(plan, _call(1000.0 * i, (20.0, 80.0 + i, 10.0))) for i in range(3))
    account = MeasuredTimeline(plan, steps, {"traceEvents": []}).account()
    assert account is not None
    assert account.blocked_measured_s - account.blocked_predicted_s == pytest.approx(51e-6)
    assert account.variation_s == pytest.approx(0.0, abs=1e-9)
    assert account.most_variable[0][:2] == (1, "ag \u2192 wait")
    assert account.verdict().split(": ", 1)[1].startswith("blocked segments")


def test_an_in_place_collective_in_the_graph_matches_its_profile() -> None:
    """A graph may hold Inductor's in-place variant (``all_reduce_``: a helix merged graph, built
    from a forward that Inductor compiled), which the profile names the same way."""
    boundaries = (
        Boundary("ar", "all_reduce_", "_c10d_functional", "collective"),
        Boundary("wait", "wait_tensor", "_c10d_functional", "wait", issue="ar"),
    )
    plan = MeasurementPlan("g", boundaries, (2e-5, 3e-5, 1e-5), 6e-5)
    step = read_step(plan, _profile(issue="_c10d_functional::all_reduce_"))
    assert step.mismatch is None and step.segments_s() is not None


def test_other_ops_of_a_boundarys_namespace_are_compute() -> None:
    """A graph with a ``dhelix::exchange`` boundary also runs ``dhelix::grad_total`` (helix adds
    each gradient into ``.grad`` in the graph): those events are compute, not boundaries (a helix
    backward's 41 boundaries met 80 events once, and its calls lost their segments)."""
    boundaries = (
        Boundary("ex", "exchange", "dhelix", "p2p"),
        Boundary("wait", "wait_tensor", "_c10d_functional", "wait", issue="ex"),
    )
    plan = MeasurementPlan("g", boundaries, (2e-5, 3e-5, 1e-5), 6e-5)
    events = [
        _event("dhelix::g", 100.0, 100.0, cat="user_annotation"),
        _event("dhelix::grad_total", 101.0, 5.0),
        _event("dhelix::exchange", 120.0, 10.0),
        _event("dhelix::grad_total", 135.0, 5.0),
        _event("_c10d_functional::wait_tensor", 150.0, 30.0),
    ]
    step = read_step(plan, events)
    assert step.mismatch is None
    assert step.segments_s() == pytest.approx([30e-6, 50e-6, 20e-6])


def test_a_profile_that_does_not_match_the_graph_keeps_only_the_whole_call() -> None:
    plan = MeasurementPlan("g", _boundaries(), (2e-5, 3e-5, 1e-5), 6e-5)
    step = read_step(plan, _profile(issue="_c10d_functional::all_reduce_"))
    assert step.segments_s() is None and "all_gather_into_tensor (ag)" in (step.mismatch or "")
    measured = MeasuredTimeline(plan, (step,), {"traceEvents": []})
    numbers = measured.numbers()
    assert numbers["segments"] == [] and numbers["measured_step_s"] == pytest.approx(100e-6)
    assert "the profile _c10d_functional::all_reduce_" in numbers["segments_note"]
    assert numbers["account"] is None


# --------------------------------------------------------------------------- config


def test_profile_steps_option() -> None:
    assert DHelixConfig().profile_steps == 0
    config = DHelixConfig.from_options(None, environ={"DHELIX_PROFILE_STEPS": "3", "DHELIX_DUMP_DIR": "/tmp/d"})
    assert config.profile_steps == 3
    with pytest.raises(ConfigError, match=r"profile_steps=-1: must be >= 0"):
        DHelixConfig.from_options({"profile_steps": -1, "dump_dir": "/tmp/d"}, environ={})
    with pytest.raises(ConfigError, match=r"profile_steps='many': expected an integer"):
        DHelixConfig.from_options(None, environ={"DHELIX_PROFILE_STEPS": "many"})
    with pytest.raises(ConfigError, match=r"profile_steps=2 needs dump_dir"):
        DHelixConfig.from_options({"profile_steps": 2}, environ={})
    with pytest.raises(ConfigError, match="expected an integer"):
        DHelixConfig.from_options({"profile_steps": 1.5, "dump_dir": "/tmp/d"}, environ={})


# --------------------------------------------------------------------------- two gloo ranks, Inductor


def _tp_profiled(rank: int, world_size: int, dump_dir: str) -> int:
    from dhelix_compile.testing.checks import build_case

    torch._dynamo.reset()
    case = build_case("tp", rank, world_size)
    model = torch.compile(case.parallel, backend=_backend(Path(dump_dir), steps=2))
    for _ in range(3):
        case.local_loss(model(*case.local_inputs)).backward()
    return rank


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_tp_model_on_two_gloo_ranks_gets_per_segment_rows(tmp_path: Path) -> None:
    assert run_on_ranks(_tp_profiled, 2, str(tmp_path), timeout_s=240) == [0, 1]
    for rank in (0, 1):
        folders = _graph_folders(tmp_path / f"rank{rank}")
        assert {f.name.split("_")[-1] for f in folders} == {"fwd", "bwd"}
        for folder in folders:
            numbers = _numbers(folder)
            _assert_consistent(numbers, steps=2)
            assert len(numbers["segments"]) > 1, folder


@pytest.mark.inductor
@pytest.mark.timeout(600)
def test_inductor_code_matches_the_graph_boundaries(tmp_path: Path) -> None:
    torch._dynamo.reset()
    with fake_world(4):
        fn = torch.compile(_two_all_reduces, backend=_backend(tmp_path, steps=2, codegen="inductor"))
        args = (torch.randn(64, 64), torch.randn(64, 64), torch.randn(256, 256))
        for _ in range(3):
            fn(*args)
    (folder,) = _graph_folders(tmp_path)
    numbers = _numbers(folder)
    assert numbers["segments_note"] is None
    _assert_consistent(numbers, steps=2)
    assert len(numbers["segments"]) == 5
    trace = (folder / "measured.trace.json").read_text()
    assert "_c10d_functional::all_reduce_" in trace  # Inductor calls the in-place variant
