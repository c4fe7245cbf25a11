"""The benchmark: its summary table (ratios, each variant's own limit), and a workload end to end on loopback."""

from __future__ import annotations

import json

import pytest

from dhelix_compile.bench.run import ceiling_row, hidden_share, markdown, own_bound
from dhelix_compile.bench.worker import (
    ACCOUNT_PARTS,
    _per_step,
    _predicted_contention_s,
    _predicted_step_s,
    _step_account,
)
from dhelix_compile.helix_runtime.schedule import helix_schedule, write_schedule


def _variant(step_s: float, t_compute_s: float, cpu_s: float | None = None, t_comm_s: float = 0.050) -> dict:
    """A variant's summary row as ``bench.run.summarize`` makes it (its own T_comm 50 ms)."""
    return {
        "step_s_median": step_s,
        "step_s_min": step_s,
        "step_s_max": step_s,
        "t_compute_s": t_compute_s,
        "t_comm_s": t_comm_s,
        **own_bound(step_s, t_compute_s, t_comm_s),
        "wire_bytes_per_step": None,
        "transfers_per_step": None,
        "ceiling": None,
        "step_over_ceiling": None,
        "predicted_step_s": None,
        "cpu_s_median": cpu_s,
        "idle_s": None if cpu_s is None else step_s - cpu_s,
    }


def _summary(variants: dict, **extra: object) -> dict:
    """A summary as ``bench.run.summarize`` makes it: T_compute 100 ms, T_comm 50 ms."""
    return {
        "link": "veth",
        "model": "m",
        "parallel": "tp_sp",
        "world_size": 2,
        "repeats": 3,
        "t_compute_s": 0.100,
        "t_comm_s": 0.050,
        "limit_s": 0.100,
        "variants": variants,
        **extra,
    }


def test_hidden_share_is_zero_when_sequential_and_one_at_the_limit() -> None:
    assert hidden_share(0.150, 0.100, 0.050) == pytest.approx(0.0)
    assert hidden_share(0.100, 0.100, 0.050) == pytest.approx(1.0)


def test_the_table_sets_each_variant_beside_its_own_limit_and_a_pipelines_shared_ceiling() -> None:
    summary = _summary(
        {
            "inductor": _variant(0.150, 0.100),
            "dhelix_decompose": {**_variant(0.120, 0.110, 0.1155, t_comm_s=0.040), "gloo_cpu_s_median": 0.0123},
        },
        ceiling={  # one for every variant: the step's transfers under the top-level T_compute
            "step_s_median": 0.105,
            "step_s_measured": 0.107,
            "in_flight": 2,
            "step_s_by_in_flight": {1: 0.112, 2: 0.105},
            "t_compute_s": 0.095,
            "cpu_s_median": 0.104,
            "idle_s": 0.001,
            "hidden_share": hidden_share(0.105, 0.095, 0.050),
        },
    )
    table = markdown(summary).splitlines()
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
        for line in table
        if line.startswith("| ")
    }
    cells = rows["dhelix_decompose"]
    assert cells[3] == "1.25x"  # vs Inductor
    assert cells[4:10] == ["110.0", "40.0", "110.0", "1.09", "75%", "1.14"]  # own: (150-120)/40; 120/105
    assert cells[10:12] == ["-", "-"]  # no bytes recorded: shown as such
    assert cells[12:14] == ["115.5 (12.3)", "4.5"]  # CPU per step (gloo's threads'), idle = step - CPU
    assert cells[14:] == ["-", "-"]  # no compile times recorded: shown as such
    assert rows["inductor"][12:14] == ["-", "-"]  # no CPU time measured: shown as such, not as zero
    assert rows["*ceiling*"][3:10] == ["1.43x", "95.0", "50.0", "100.0", "1.05", "80%", "1.00"]
    assert any("(here 2: 1 in flight 112.0 ms, 2 in flight 105.0 ms)" in line for line in table)


def test_the_table_splits_each_first_step_into_its_compile_phases() -> None:
    helix = {
        **_variant(0.120, 0.110),
        "first_step_s": 14.0,
        "compile_phases_s": {
            "capture": 1.0,
            "profiling": 2.0,
            "passes": 0.5,
            "plan": 0.3,
            "agreement": 0.1,
            "codegen": 9.0,
        },
    }
    recorded = {  # a run whose clock had fewer phases: the missing ones shown as such, not as zero
        **_variant(0.130, 0.110),
        "first_step_s": 13.0,
        "compile_phases_s": {"profiling": 2.0, "passes": 0.8, "agreement": 0.1, "codegen": 9.0},
    }
    table = markdown(_summary({"helix": helix, "recorded": recorded})).splitlines()
    assert any(
        line.endswith("| first step (s) | capture / profiling / passes / plan / codegen (s) |") for line in table
    )
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
        for line in table
        if line.startswith("| ")
    }
    assert rows["helix"][14:] == ["14.0", "1.0 / 2.0 / 0.5 / 0.3 / 9.0"]
    assert rows["recorded"][14:] == ["13.0", "- / 2.0 / 0.8 / - / 9.0"]
    assert any("capture / profiling / passes / plan / codegen: of it" in line for line in table)


def test_the_prediction_table_shows_the_cpu_beside_gloos_threads_alone_and_on_the_link() -> None:
    helix = {
        **_variant(0.200, 0.150, 0.190),
        "gloo_cpu_s_median": 0.012,
        "predicted_step_s": 0.160,
        "cpu_s_alone_median": 0.152,
        "predicted_contention_s": 0.0105,
    }
    table = markdown(_summary({"helix": helix, "dhelix": {**_variant(0.25, 0.15), "predicted_step_s": 0.2}}))
    assert "| helix | 160.0 | 200.0 | 0.80 | 152.0 -> 178.0 | 10.5 |" in table.splitlines()
    assert "| dhelix | 200.0 | 250.0 | 0.80 | - -> - | - |" in table.splitlines()  # not recorded: shown so


def _write_summary(folder, kind: str, account: dict | None) -> None:
    graph = folder / "rank0" / f"1_0_{kind}"
    graph.mkdir(parents=True)
    (graph / "summary.json").write_text(json.dumps({"measured": {"account": account}}))


def test_a_step_account_adds_each_graph_per_call_over_the_step_and_the_table_shows_it(tmp_path) -> None:
    parts = {"fwd": 1.0, "merged": 10.0, "bwd": 100.0}
    for kind, scale in parts.items():
        _write_summary(tmp_path, kind, {part: scale * (i + 1) for i, part in enumerate(ACCOUNT_PARTS)})
    # helix, 4 micro-batches: forward + 3 merged + backward
    write_schedule(tmp_path / "rank0", "forward_backward", helix_schedule(4, "forward_backward"))
    assert _step_account(tmp_path, 0, 4) == pytest.approx(
        {part: 131.0 * (i + 1) for i, part in enumerate(ACCOUNT_PARTS)}
    )
    _write_summary(tmp_path / "unprofiled", "fwd", None)
    _write_summary(tmp_path / "unprofiled", "bwd", None)
    assert _step_account(tmp_path / "unprofiled", 0, 4) is None  # no profiled calls: no account
    assert _per_step({"fwd": 1.0, "bwd": 2.0}, 4) == 12.0  # one strand: n x (forward + backward)
    # helix's "same_phase" schedule: F0+F1 | B0+B1 | F2+F3 | B2+B3, and with 5: ... | B2+F4 | B3+B4
    pairs = {"fwd": 1.0, "bwd": 2.0, "fwdpair": 10.0, "bwdpair": 100.0}
    assert _per_step(pairs, 4, "same_phase") == 220.0
    assert _per_step({**pairs, "merged": 1000.0}, 5, "same_phase") == 1220.0
    assert _per_step(pairs, 5, "same_phase") is None  # a graph the schedule runs has no number
    assert _per_step({**pairs, "merged": 1000.0}, 4, "paired_ends") == 2110.0  # F0+F1 | B0+F2 | B1+F3 | B2+B3
    # F and B alone never run in that schedule: their graphs have no account, the step has one
    for kind in ("fwdpair", "bwdpair"):
        _write_summary(tmp_path / "paired", kind, {part: 1.0 for part in ACCOUNT_PARTS})
    for kind in ("fwd", "bwd"):
        _write_summary(tmp_path / "paired", kind, None)
    write_schedule(tmp_path / "paired" / "rank0", "same_phase", helix_schedule(4, "same_phase"))
    assert _step_account(tmp_path / "paired", 0, 4) == {part: 4.0 for part in ACCOUNT_PARTS}

    variant = _variant(0.150, 0.100) | {
        "measured_account": dict(zip(ACCOUNT_PARTS, (0.08, 0.09, 0.03, 0.04, 0.025), strict=True))
    }
    summary = _summary({"helix": variant})
    assert "| helix | 80.0 -> 90.0 | 30.0 -> 40.0 | 25.0 |" in markdown(summary).splitlines()


def test_the_ceiling_is_the_faster_of_one_and_two_collectives_in_flight() -> None:
    measured = {  # as the worker sends it: depths as JSON keys, per-repeat samples
        "compute_s": [0.090, 0.095, 0.100],
        "in_flight": {
            "1": {"step_s": [0.130, 0.120, 0.125], "cpu_s": [0.1, 0.1, 0.1]},
            "2": {"step_s": [0.110, 0.140, 0.105], "cpu_s": [0.09, 0.1, 0.11]},
        },
    }
    ceiling = ceiling_row(measured, t_comm=0.050)
    assert ceiling is not None
    assert (ceiling["in_flight"], ceiling["step_s_median"]) == (2, 0.110)
    assert ceiling["step_s_by_in_flight"] == {1: 0.125, 2: 0.110}
    assert ceiling["cpu_s_median"] == 0.1 and ceiling["t_compute_s"] == 0.095
    assert ceiling["hidden_share"] == pytest.approx(hidden_share(0.110, 0.095, 0.050))
    assert ceiling_row(None, 0.050) is None


def test_the_ceiling_is_corrected_by_its_matmuls_distance_from_t_compute_repeat_by_repeat() -> None:
    measured = {
        "compute_s": [0.110, 0.100, 0.120],  # the matmuls ran 10-30 ms long against a 90 ms T_compute
        "in_flight": {
            "1": {"step_s": [0.140, 0.125, 0.160], "cpu_s": [0.1, 0.1, 0.1]},
            "2": {"step_s": [0.150, 0.150, 0.150], "cpu_s": [0.1, 0.1, 0.1]},
        },
    }
    ceiling = ceiling_row(measured, t_comm=0.050, t_compute=0.090)
    assert ceiling is not None
    # one in flight: 140 - 20, 125 - 10, 160 - 30 -> median 120; two: 130, 140, 120 -> 130
    assert ceiling["step_s_by_in_flight"] == pytest.approx({1: 0.120, 2: 0.130})
    assert (ceiling["in_flight"], ceiling["step_s_measured"]) == (1, 0.140)
    assert ceiling["hidden_share"] == pytest.approx(hidden_share(0.120, 0.090, 0.050))
    # a correction that would put the ceiling under the physical limit stops at it
    floored = ceiling_row(measured, t_comm=0.200, t_compute=0.090)
    assert floored is not None and floored["step_s_median"] == 0.200


def _bench_end_to_end(tmp_path, argv: list[str], variants: list[str]) -> dict:
    """``dhelix bench`` on loopback with ``variants`` (3 repeats): its summary, checked for what
    every run measures."""
    import json

    from dhelix_compile.bench.run import main

    out = tmp_path / "bench.json"
    argv = [*argv, "--rate", "none", "--variants", ",".join(variants), "--repeats", "3", "--warmup", "1"]
    assert main([*argv, "--time-limit-s", "30", "--timeout-s", "240", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert set(summary["variants"]) == set(variants) and not summary["errors"]
    assert summary["t_comm_s"] > 0 and summary["t_compute_s"] > 0 and summary["t_comm_cpu_s"] > 0
    # gloo's threads moved the bytes; their CPU is read around the barrier before each replay too,
    # which they run (a millisecond, more than a short replay's whole CPU time can be)
    assert 0 < summary["t_comm_gloo_cpu_s"] <= summary["t_comm_cpu_s"] + 0.001
    for v in summary["variants"].values():  # a step's CPU time is measured beside its wall time
        assert v["cpu_s_median"] > 0 and v["idle_s"] == pytest.approx(max(v["step_s_median"] - v["cpu_s_median"], 0.0))
        assert v["first_step_s"] > 0  # the compiling first step, timed apart
        # its own collectives, recorded at the process group, alone and under its own T_compute
        assert v["t_comm_s"] > 0 and v["wire_bytes_per_step"] > 0 and v["transfers_per_step"] > 0
        assert v["limit_s"] == max(v["t_compute_s"], v["t_comm_s"])
        ceiling = v["ceiling"]
        assert ceiling["step_s_median"] > 0 and ceiling["t_compute_s"] > 0 and ceiling["cpu_s_median"] > 0
        assert ceiling["step_s_median"] == min(ceiling["step_s_by_in_flight"].values())  # 1 or 2 in flight
    return summary


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.full
def test_the_moe_workload_runs_end_to_end_on_loopback(tmp_path) -> None:
    summary = _bench_end_to_end(tmp_path, ["--model", "moe_small"], ["eager", "dhelix_eager[decompose=off]"])
    dhelix = summary["variants"]["dhelix_eager[decompose=off]"]
    phases = dhelix["compile_phases_s"]  # on a live 2-rank group the default profiles
    assert phases["passes"] > 0 and phases["profiling"] > 0 and phases["codegen"] > 0
    assert not any(summary["variants"]["eager"]["compile_phases_s"].values())  # no dhelix graph: no passes


def test_the_demo_prints_losses_and_speed_beside_each_variants_own_limit_and_ceiling(capsys, tmp_path) -> None:
    from dhelix_compile.bench.demo import _print_results

    summary = {
        "link": "veth 300mbit",
        "model": "tiny",
        "microbatches": 4,
        "t_compute_s": 0.100,
        "t_comm_s": 0.090,
        "variants": {
            "eager": _variant(0.300, 0.150),
            "inductor": _variant(0.200, 0.100),
            "helix": {**_variant(0.130, 0.1), "ceiling": {"step_s_median": 0.125}},
        },
    }
    _print_results({"eager": [2.5, 2.4], "helix": [2.5, 2.4000001]}, summary, tmp_path)
    out = capsys.readouterr().out
    assert "| 2 | 2.400000 | 2.400000 | 1.0e-07 |" in out
    assert "| helix | 130.0 | 1.54x | 100.0 | 1.30 | 1.04 |" in out
    assert "| inductor | 200.0 | 1.00x | 100.0 | 2.00 | - |" in out  # no ceiling recorded: shown as such


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.full
def test_the_data_parallel_workload_runs_end_to_end_on_loopback(tmp_path) -> None:
    """``--data-parallel``: PyTorch's DDP beside ``data_parallel`` on the unparallelized model,
    gradients reduced once per step; T_comm is the step's all-reduces replayed."""
    argv = ["--model", "tiny", "--data-parallel", "replicate", "--microbatches", "2"]
    summary = _bench_end_to_end(tmp_path, argv, ["torch_eager", "eager"])
    assert summary["data_parallel"] == "replicate"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "mlp_small", "--data-parallel", "shard"], "runs a model as written"),
        (["--data-parallel", "shard", "--variants", "dhelix_decompose"], "unknown benchmark variant"),
        (["--data-parallel", "shard", "--pipeline", "1f1b"], "separate benchmarks"),
    ],
)
def test_bad_data_parallel_runs_are_named(argv: list[str], message: str, capsys) -> None:
    from dhelix_compile.bench.run import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_predicted_step_adds_each_planned_graphs_final_makespan(tmp_path) -> None:
    """A planned graph's prediction is its final graph's (the dumps' timeline, helix's in-graph
    gradient adds included), else its pass's; a graph no pass planned leaves the step unpredicted."""

    def write(folder, kind: str, summary: dict) -> None:
        graph = folder / "rank0" / f"1_0_{kind}"
        graph.mkdir(parents=True)
        (graph / "summary.json").write_text(json.dumps(summary))

    write(tmp_path, "fwd", {"records": {"reorder": {"predicted_makespan_s": 1.0}}})  # no timeline dumped
    write(
        tmp_path,
        "merged",
        {"records": {"interleave": {"predicted_makespan_s": 10.0}}, "timeline": {"makespan_after_s": 12.0}},
    )
    write(
        tmp_path,
        "bwd",
        {"records": {"reorder": {"predicted_makespan_s": 100.0}}, "timeline": {"makespan_after_s": 104.0}},
    )
    write_schedule(tmp_path / "rank0", "forward_backward", helix_schedule(4, "forward_backward"))
    assert _predicted_step_s(tmp_path, 0, 4) == pytest.approx(1.0 + 3 * 12.0 + 104.0)
    assert _predicted_contention_s(tmp_path, 0, 4) is None  # the forward's dump does not say
    for kind, contention in (("fwd", 0.5), ("merged", 2.0), ("bwd", 3.0)):
        summary_path = tmp_path / "rank0" / f"1_0_{kind}" / "summary.json"
        summary = json.loads(summary_path.read_text())
        summary.setdefault("timeline", {})["contention_after_s"] = contention
        summary_path.write_text(json.dumps(summary))
    assert _predicted_contention_s(tmp_path, 0, 4) == pytest.approx(0.5 + 3 * 2.0 + 3.0)
    write(tmp_path / "unplanned", "fwd", {"records": {}, "timeline": {"makespan_after_s": 1.0}})
    write(tmp_path / "unplanned", "bwd", {"records": {"reorder": {"predicted_makespan_s": 2.0}}})
    assert _predicted_step_s(tmp_path / "unplanned", 0, 4) is None
