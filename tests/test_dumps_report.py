"""Dumps: final-graph picture, predicted timelines (trace JSON + SVG), index.html, the compile
clock, the report command.

Two compiles, each once per module: a single-process MLP (forward + backward graphs, no
collectives) and a function with two all-reduces under PyTorch's fake process group, both
with ``codegen="eager"``. Chromium's headless screenshot of ``index.html`` runs only where
``/usr/bin/chromium`` exists.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed._functional_collectives as fc

import dhelix_compile
from cost_model import compile_clock
from cost_model.testing import fake_world
from dhelix_compile.cli import main
from dhelix_compile.observe import graph_picture
from dhelix_compile.observe.report import (
    collect_compile_clocks,
    collect_summaries,
    format_compile_time,
    format_table,
    report,
)
from dhelix_compile.testing.toy_models import MLP

CHROMIUM = Path("/usr/bin/chromium")
PER_GRAPH_FILES = ("graph.dot", "graph.svg", "timeline.trace.json", "timeline.svg", "summary.json", "index.html")


def _compile(fn: torch.nn.Module | object, dump_dir: Path, **options: object) -> object:
    torch._dynamo.reset()
    backend = dhelix_compile.backend(codegen="eager", fallback="error", dump_dir=str(dump_dir), **options)
    return torch.compile(fn, backend=backend)


def _two_all_reduces(x: torch.Tensor, w: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
    h = x @ w
    r = fc.all_reduce(big * 2, "sum", "0")  # its wait comes right after in the original order
    g = torch.relu(x @ w) @ w
    r2 = fc.all_reduce(h, "sum", "0")
    g = torch.tanh(g @ w) @ w
    return r.sum() + g.sum() + r2.sum()


@pytest.fixture(scope="module")
def mlp_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump_dir = tmp_path_factory.mktemp("mlp_dump")
    torch.manual_seed(0)
    model = MLP()
    _compile(model, dump_dir)(torch.randn(4, 16)).sum().backward()
    return dump_dir


@pytest.fixture(scope="module")
def comm_dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump_dir = tmp_path_factory.mktemp("comm_dump")
    torch.manual_seed(0)
    with fake_world(4):  # a device and a link from the tables: "auto" measures this CPU, and its load
        compiled = _compile(_two_all_reduces, dump_dir, device="a40", link="eth_25g")
        compiled(torch.randn(128, 128), torch.randn(128, 128), torch.randn(1024, 1024))
    return dump_dir


def _graph_folders(dump_dir: Path) -> list[Path]:
    return sorted(p.parent for p in dump_dir.rglob("summary.json"))


def test_every_graph_folder_has_its_pictures_and_page(mlp_dump: Path, comm_dump: Path) -> None:
    mlp_folders = _graph_folders(mlp_dump)
    assert [f.name.split("_")[-1] for f in mlp_folders] == ["bwd", "fwd"]
    comm_folders = _graph_folders(comm_dump)
    assert [f.parent.name for f in comm_folders] == ["rank0"]
    for folder in mlp_folders + comm_folders:
        for name in PER_GRAPH_FILES:
            assert (folder / name).is_file(), folder / name


def test_summary_has_the_predicted_numbers(comm_dump: Path) -> None:
    (folder,) = _graph_folders(comm_dump)
    numbers = json.loads((folder / "summary.json").read_text())["timeline"]
    assert numbers["exposed_comm_before_s"] > 0
    assert numbers["exposed_comm_after_s"] < numbers["exposed_comm_before_s"]
    assert numbers["makespan_after_s"] < numbers["makespan_before_s"]
    assert 0 < numbers["hidden_share"] <= 1
    assert numbers["peak_memory_before_bytes"] > 0 and numbers["peak_memory_after_bytes"] > 0


def test_summary_keeps_the_notes_behind_the_counted_codes(mlp_dump: Path, comm_dump: Path) -> None:
    for folder in _graph_folders(mlp_dump) + _graph_folders(comm_dump):
        summary = json.loads((folder / "summary.json").read_text())
        for pass_name, codes in summary["notes"].items():
            for code, details in codes.items():
                assert summary["stats"][pass_name][code] >= 1 and details, (pass_name, code)


def test_graph_without_collectives_has_no_hideable_share(mlp_dump: Path) -> None:
    for folder in _graph_folders(mlp_dump):
        numbers = json.loads((folder / "summary.json").read_text())["timeline"]
        assert numbers["comm_before_s"] == numbers["comm_after_s"] == 0 and numbers["hidden_share"] is None
        assert numbers["makespan_before_s"] == pytest.approx(numbers["makespan_after_s"])


def test_trace_json_has_what_perfetto_needs(comm_dump: Path) -> None:
    (folder,) = _graph_folders(comm_dump)
    trace = json.loads((folder / "timeline.trace.json").read_text())
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert slices
    for ev in slices:
        assert {"name", "cat", "ph", "pid", "tid", "ts", "dur"} <= ev.keys()
        assert ev["dur"] >= 0 and ev["ts"] >= 0
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert [name.split(" (")[0] for _, name in sorted(processes.items())] == ["original order", "dhelix schedule"]
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(0, "compute stream"), (0, "comm channel 0"), (1, "compute stream")} <= threads
    assert any(e["cat"] == "collective" for e in slices)
    numbers = json.loads((folder / "summary.json").read_text())["timeline"]
    exposed_us = sum(e["dur"] for e in slices if e["cat"] == "exposed_comm" and e["pid"] == 0)
    assert exposed_us == pytest.approx(numbers["exposed_comm_before_s"] * 1e6, rel=1e-6)


def test_svgs_parse_and_the_gantt_marks_exposed_communication(mlp_dump: Path, comm_dump: Path) -> None:
    for folder in _graph_folders(mlp_dump) + _graph_folders(comm_dump):
        for name in ("timeline.svg", "graph.svg"):
            root = ET.parse(folder / name).getroot()
            assert root.tag == "{http://www.w3.org/2000/svg}svg"
    (folder,) = _graph_folders(comm_dump)
    gantt = (folder / "timeline.svg").read_text()
    assert 'fill="url(#exposed)"' in gantt.split("</defs>")[1]
    for text in ("compute stream", "comm channel 0", "time (ms)", "exposed communication"):
        assert text in gantt


def test_graph_picture_falls_back_without_graphviz(
    comm_dump: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cost_model.testing import trace_aten

    gm = trace_aten(lambda a, b: torch.relu(a @ b), torch.randn(4, 4), torch.randn(4, 4))
    monkeypatch.setattr(graph_picture.shutil, "which", lambda name: None)
    assert graph_picture.write_graph_picture(gm, tmp_path) == "node list"
    ET.parse(tmp_path / "graph.svg")
    dot = (tmp_path / "graph.dot").read_text()
    assert dot.startswith("digraph G {") and '"mm" -> "relu"' in dot


def test_report_command_prints_a_row_per_graph(
    mlp_dump: Path, comm_dump: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(comm_dump)]) == 0
    out = capsys.readouterr().out
    assert "makespan before ms" in out and "rank0/" in out
    assert out == report(comm_dump)
    assert out.startswith(format_table(collect_summaries(comm_dump)))
    assert "\nCompile time: " in out and "\nrank0\n" in out  # the fake world's rank folder
    done = subprocess.run(
        [sys.executable, "-m", "dhelix_compile", "report", str(mlp_dump), "--html"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines[: lines.index("")]) == 2 + 2  # header, rule, fwd, bwd; then the compile time
    assert lines[-1].startswith("wrote ")
    page = (mlp_dump / "index.html").read_text()
    for folder in _graph_folders(mlp_dump):
        assert f'href="{folder.name}/index.html"' in page
    assert "<h2>Compile time</h2>" in page and "graphs compiled: " in page


def test_each_rank_folder_holds_its_compile_clock_and_the_report_shows_it(mlp_dump: Path, comm_dump: Path) -> None:
    clocks = collect_compile_clocks(mlp_dump)
    assert [folder for folder, _ in clocks] == [Path(".")]  # no process group: the dump folder itself
    clock = clocks[0][1]
    assert list(clock["seconds"]) == list(compile_clock.PHASES) and list(clock["counts"]) == list(compile_clock.COUNTS)
    assert clock["seconds"]["capture"] > 0 and clock["seconds"]["passes"] > 0 and clock["seconds"]["codegen"] > 0
    assert clock["counts"]["graphs"] >= 2  # the forward and the backward, written after the backward's
    assert [folder for folder, _ in collect_compile_clocks(comm_dump)] == [Path("rank0")]

    text = format_compile_time(clocks)
    assert text.startswith("\nCompile time: wall seconds of this process's dhelix compiles per phase")
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[4:] if line and line[0].isalpha()}
    for phase in compile_clock.PHASES:
        assert rows[phase][0] == f"{clock['seconds'][phase]:.2f}"
    total_s = sum(clock["seconds"].values())
    assert rows["in"] == ["phases", f"{total_s:.2f}", "100.0%"]
    assert rows["capture"][1] == f"{100 * clock['seconds']['capture'] / total_s:.1f}%"
    assert text.splitlines()[-1] == (
        f"graphs compiled: {clock['counts']['graphs']}; candidates weighed: "
        f"{clock['counts']['candidates']} merged graphs, {clock['counts']['variants']} decompose variants"
    )


def test_report_command_on_an_empty_folder_fails(tmp_path: Path) -> None:
    assert main(["report", str(tmp_path)]) == 1


def _non_white_share(png: bytes) -> float:
    """Share of pixels that are not white in an 8-bit RGB / RGBA PNG (no PIL needed)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        header = data if kind == b"IHDR" else header
        idat += data if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6)
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    prev, non_white = bytearray(stride), 0
    for y in range(height):
        filt, row = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = row[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if filt == 1:
                row[i] = (row[i] + a) & 255
            elif filt == 2:
                row[i] = (row[i] + b) & 255
            elif filt == 3:
                row[i] = (row[i] + (a + b) // 2) & 255
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        non_white += sum(1 for x in range(0, stride, bpp) if min(row[x : x + 3]) < 240)
        prev = row
    return non_white / (width * height)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium for a headless screenshot")
def test_index_html_renders_in_a_headless_browser(comm_dump: Path, tmp_path: Path) -> None:
    (folder,) = _graph_folders(comm_dump)
    shot = tmp_path / "index.png"
    subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1000,800",
            f"--screenshot={shot}",
            (folder / "index.html").as_uri(),
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert _non_white_share(shot.read_bytes()) > 0.02
