"""The numbers and words the dump pictures and pages show, checked on hand-made data: the time
axis, bar labels, legends, panel headers against the summary rows, the hidden share, merged
graphs' titles and strands, the node-list picture's width. ``tests/test_observe_browser.py``
renders them."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
import torch.fx

from cost_model import SimEvent, SimResult
from dhelix_compile.helix_runtime.schedule import helix_schedule, write_schedule
from dhelix_compile.observe import graph_picture, report, svg
from dhelix_compile.observe.dumps import GraphDumper, recorded_helix_steps, strand_roles
from dhelix_compile.observe.timeline import LabelledTimeline, axis_end_s, bar_label, gantt_svg, panel_header
from graph_passes import PassContext


def _result(events: list[SimEvent], *, contention_s: float = 0.0, exposed_s: float = 0.0) -> SimResult:
    compute = [e for e in events if e.resource == "compute" and e.kind != "wait"]
    return SimResult(
        makespan_s=max(e.end_s for e in events),
        compute_s=sum(e.end_s - e.start_s for e in compute) - contention_s,
        comm_s=sum(e.end_s - e.start_s for e in events if e.resource != "compute"),
        exposed_comm_s=exposed_s,
        peak_memory_bytes=1 << 20,
        events=tuple(events),
        contention_s=contention_s,
    )


BEFORE = _result(
    [
        SimEvent("f_mm", "compute", "compute", 0.0, 0.040, 0),
        SimEvent("f_all_gather_into_tensor", "collective", "comm0", 0.040, 0.0687, 0),
        SimEvent("b_mm_default_3", "compute", "compute", 0.0687, 0.2001, 1),
    ],
    exposed_s=0.0287,
)
AFTER = _result(
    [
        SimEvent("f_mm", "compute", "compute", 0.0, 0.041, 0),
        SimEvent("f_all_gather_into_tensor", "collective", "comm0", 0.0, 0.0287, 0),
        SimEvent("b_mm_default_3", "compute", "compute", 0.041, 0.172, 1),
    ],
    contention_s=0.001,
)


def test_the_axis_ends_at_the_first_round_tick_above_the_data() -> None:
    assert axis_end_s(0.200142) == pytest.approx((0.220, 0.020))  # not 250 ms in steps of 50
    assert axis_end_s(0.200) == pytest.approx((0.200, 0.020))
    assert axis_end_s(0.000495) == pytest.approx((0.0005, 0.00005))
    rng = random.Random(0)
    for _ in range(500):
        end_s = 10 ** rng.uniform(-6, 1)
        axis_s, step_s = axis_end_s(end_s)
        intervals = round(axis_s / step_s)
        assert end_s <= axis_s * (1 + 1e-9) and 4 <= intervals <= 12
        assert axis_s - end_s < step_s * (1 + 1e-9)  # the first tick at or above the data
        assert axis_s <= end_s * 1.34, end_s  # never a whole coarse step of empty axis


def test_a_bar_shows_its_whole_name_or_none() -> None:
    name = "f_all_gather_into_tensor"
    needed = svg.text_width_px(name, 10) + 6
    assert bar_label(name, needed) == name
    assert bar_label(name, needed - 1) is None
    assert svg.text_width_px("mm", 10) > svg.text_width_px("ii", 10)
    assert svg.text_width_px("abc", 10, weight="bold") > svg.text_width_px("abc", 10)


def test_the_gantt_names_strands_and_cuts_no_label() -> None:
    names = {0: "forward of micro-batch i+1", 1: "backward of micro-batch i"}
    timelines = [LabelledTimeline("original order", BEFORE), LabelledTimeline("dhelix schedule", AFTER)]
    picture = gantt_svg(timelines, "0_0_merged: predicted timeline", names)
    texts = re.findall(r"<text [^>]*>([^<]*)</text>", picture)
    for entry in (
        "compute, forward of micro-batch i+1",
        "communication, forward of micro-batch i+1",
        "compute, backward of micro-batch i",
    ):
        assert entry in texts
    assert not any("…" in t or "strand 0" in t for t in texts)
    assert {"f_mm", "b_mm_default_3"} <= set(texts)  # wide enough for their names
    assert "f_all_gather_into_tensor" not in texts  # 129 px of bar: too narrow for its name, not cut
    assert "f_all_gather_into_tensor (collective, forward of micro-batch i+1)" in picture  # tooltip
    ticks = [t for t in texts if re.fullmatch(r"[0-9.]+", t)]
    assert ticks[-1] == "220"  # data to 200.1 ms
    width = float(re.search(r'viewBox="0 0 ([0-9.]+)', picture).group(1))
    assert width >= max(svg.text_width_px(panel_header(t), 13, weight="bold") for t in timelines)
    assert "compute, strand 0" in gantt_svg(timelines)  # a strand nobody named keeps its number


def test_panel_headers_and_summary_rows_give_the_same_totals() -> None:
    numbers = report.timeline_numbers(BEFORE, AFTER)
    rows = dict(report.summary_rows({"timeline": numbers}))
    for order, res in (("original order", BEFORE), ("dhelix schedule", AFTER)):
        compute, comm = rows[f"compute / communication, {order} (ms, as its timeline panel)"].split(" / ")
        header = panel_header(LabelledTimeline(order, res))
        assert f"compute {compute} ms" in header and f"communication {comm} ms" in header
        bars_s = sum(e.end_s - e.start_s for e in res.events if e.resource == "compute")
        assert float(compute) == pytest.approx(bars_s * 1e3, abs=1e-3)  # what the compute bars add up to
    assert "slowed by transfers" in panel_header(LabelledTimeline("dhelix schedule", AFTER))


@pytest.mark.parametrize(
    ("before_ms", "after_ms", "share"),
    [(28.7, 0.0, 1.0), (57.5, 27.9, (57.5 - 27.9) / 57.5), (10.0, 12.0, -0.2), (0.0, 0.0, None)],
)
def test_the_hidden_share_is_the_exposed_communication_hidden(
    before_ms: float, after_ms: float, share: float | None
) -> None:
    got = report.hidden_share(before_ms / 1e3, after_ms / 1e3)
    assert got == pytest.approx(share) if share is not None else got is None


def test_the_page_prints_the_hidden_share_with_its_formula() -> None:
    numbers = report.timeline_numbers(BEFORE, AFTER)
    rows = dict(report.summary_rows({"timeline": numbers}))
    assert rows["hideable communication = exposed, original order (ms)"] == "28.700"
    assert rows["share hidden = (exposed before - exposed after) / hideable"] == "100.0% = (28.700 - 0.000) / 28.700"
    assert "hidden = (exposed before - exposed after) / hideable" in report.format_table(
        [(Path("g"), {"timeline": numbers})]
    )


def _steps(tmp_path: Path, kind: str, n: int) -> list[list[tuple[str, int]]] | None:
    write_schedule(tmp_path, kind, helix_schedule(n, kind))  # type: ignore[arg-type]
    return recorded_helix_steps(tmp_path)


def test_strand_roles_read_the_micro_batches_off_the_recorded_schedule(tmp_path: Path) -> None:
    fwd_bwd = {0: "fwd", 1: "bwd"}
    roles, steps = strand_roles(fwd_bwd, _steps(tmp_path, "forward_backward", 4))
    assert [(r["phase"], r["micro_batch"]) for r in roles] == [("fwd", "i+1"), ("bwd", "i")]
    assert steps == ["B0+F1", "B1+F2", "B2+F3"]
    roles, steps = strand_roles(fwd_bwd, _steps(tmp_path, "paired_ends", 4))
    assert [r["micro_batch"] for r in roles] == ["i+2", "i"] and steps == ["B0+F2", "B1+F3"]
    roles, steps = strand_roles({0: "fwd", 1: "fwd"}, _steps(tmp_path, "same_phase", 4))
    assert [r["micro_batch"] for r in roles] == ["i+1", "i"] and steps == ["F0+F1", "F2+F3"]
    roles, steps = strand_roles(fwd_bwd, None)  # no helix schedule recorded (a pipeline's graphs)
    assert [r["micro_batch"] for r in roles] == [None, None] and steps == []
    assert strand_roles({0: "bwd"}, _steps(tmp_path, "forward_backward", 4)) == (
        [{"strand": 0, "phase": "bwd", "micro_batch": None}],
        [],
    )


def test_graph_kind_words() -> None:
    assert report.graph_kind({"phase": "fwd"}) == "forward"
    assert report.graph_kind({"phase": "inference"}) == "inference"
    merged = {
        "phase": "merged",
        "strands": [
            {"strand": 0, "phase": "fwd", "micro_batch": "i+1"},
            {"strand": 1, "phase": "bwd", "micro_batch": None},
        ],
    }
    assert report.graph_kind(merged) == "merged: forward of micro-batch i+1 (strand 0) ⊕ backward (strand 1)"


def _merged_graph() -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x, g = graph.placeholder("f_x"), graph.placeholder("b_g")
    y, dx = graph.call_function(torch.relu, (x,)), graph.call_function(torch.neg, (g,))
    graph.output((y, dx))
    for node in (x, y):
        node.meta["dhelix"] = {"strand": 0, "phase": "fwd"}
    for node in (g, dx):
        node.meta["dhelix"] = {"strand": 1, "phase": "bwd"}
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_merged_graphs_summary_and_page_say_merged(tmp_path: Path) -> None:
    write_schedule(tmp_path, "forward_backward", helix_schedule(3, "forward_backward"))
    dumper = GraphDumper(tmp_path, "0_0_merged")
    dumper.write_input(_merged_graph())
    dumper.write_summary(PassContext("0_0_merged", "fwd"))  # helix compiles it as a forward
    summary = json.loads((dumper.folder / "summary.json").read_text())
    assert summary["phase"] == "merged"
    assert [(s["strand"], s["phase"], s["micro_batch"]) for s in summary["strands"]] == [
        (0, "fwd", "i+1"),
        (1, "bwd", "i"),
    ]
    assert summary["helix_steps"] == ["B0+F1", "B1+F2"]
    page = (dumper.folder / "index.html").read_text()
    title = "dhelix: 0_0_merged (merged: forward of micro-batch i+1 (strand 0) ⊕ backward of micro-batch i (strand 1); helix steps B0+F1, B1+F2)"
    assert f"<title>{title}</title>" in page and f"<h1>{title}</h1>" in page


def test_a_plain_graphs_summary_keeps_its_phase(tmp_path: Path) -> None:
    dumper = GraphDumper(tmp_path, "0_0_bwd")
    dumper.write_input(torch.fx.symbolic_trace(torch.nn.ReLU()))
    dumper.write_summary(PassContext("0_0_bwd", "bwd"))
    summary = json.loads((dumper.folder / "summary.json").read_text())
    assert summary["phase"] == "bwd" and summary["strands"] == [{"strand": 0, "phase": "bwd", "micro_batch": None}]
    assert "<title>dhelix: 0_0_bwd (backward)</title>" in (dumper.folder / "index.html").read_text()


def test_the_node_list_picture_is_as_wide_as_its_longest_row() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    name = "a_node_whose_name_is_long_enough_to_run_off_a_thousand_pixels_" * 3
    node = graph.call_function(torch.relu, (x,))
    node.name = name
    graph.output(node)
    picture = graph_picture.node_list_svg(torch.fx.GraphModule(torch.nn.Module(), graph), "g")
    width = float(re.search(r'viewBox="0 0 ([0-9.]+)', picture).group(1))
    row = next(t for t in re.findall(r"<text [^>]*>([^<]*)</text>", picture) if name in t)
    assert row.endswith("[compute, strand 0]")  # the whole row, not its first 150 characters
    assert width >= 20 + svg.text_width_px(row, 11, mono=True)
