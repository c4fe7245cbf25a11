"""Graph dumps: what each pass did to each compiled graph, as files a person can read.

With ``dump_dir`` set, every compiled partition gets a folder::

    <dump_dir>/[rank<r>/]<graph_name>/
        00_input.txt                  the graph as AOTAutograd handed it to dhelix
        01_collapse_waits.before.txt  the graph before the pipeline's first pass
        01_collapse_waits.after.txt   ... and after it
        01_collapse_waits.opcount.txt op-count diff: which ops the pass added or removed
        02_combine_all_reduces.before.txt   the same for every later pass, numbered in pipeline order
        ...
        graph.dot, graph.svg          the final graph, nodes filled by kind, outlined by strand
                                      (Graphviz's rendering, or a node list without ``dot``)
        timeline.trace.json           predicted timelines of the original order and of the
                                      schedule, Perfetto / Chrome trace (``dhelix_compile.observe.timeline``)
        timeline.svg                  the same as a Gantt chart, exposed communication hatched red
        summary.json                  the graph's phase (``fwd``, ``bwd``, ``inference``, or ``merged``
                                      for helix's merged graphs) and its strands (``strand_roles``),
                                      pass times (s), the per-pass stats counters (reason codes),
                                      the notes behind them (``notes[pass][code]``: prose) and, under
                                      ``"timeline"``, the predicted numbers (``dhelix_compile.observe.report``)
        index.html                    the numbers, the chart and links to every file
    <dump_dir>/[rank<r>/]compile_clock.json
                                      the process's compile clock (``cost_model.compile_clock``):
                                      seconds per phase and the counts, written after each
                                      compile, so it holds the totals up to the last one
      with ``profile_steps=N``, written when the graph's N-th profiled call returns (calls 2 to
      N + 1: the first is a warm-up; ``dhelix_compile.observe.measured``):
        measured.trace.json           the N calls as ``torch.profiler`` recorded them, plus a
                                      ``dhelix`` process whose tracks show each call and its segments
        measured.svg                  Gantt chart of the median measured call (host clock): compute
                                      between communication ops, issues, waits hatched red, and
                                      each transfer from its issue until its wait returned
        predicted_vs_measured.svg     the predicted schedule above that call, on one time axis
        predicted_vs_measured.json    per communication segment and for the whole call: predicted
                                      s, measured s (median of the N calls), measured / predicted;
                                      also under ``"measured"`` in summary.json, and index.html is
                                      written again with the table

``python -m dhelix_compile report DUMP_DIR [--html]`` prints every graph's numbers as a table,
then each measured graph's predicted-vs-measured segments, then each rank's compile time (and
writes ``DUMP_DIR/index.html``, one row per graph linking each graph's page, and the compile
time).

``GraphDumper`` implements ``graph_passes.PassObserver``; the pipeline driver calls it;
``capture.compile_partition`` calls ``write_timelines`` and ``write_graph_picture`` after the
pipeline, and ``write_summary`` last; with ``profile_steps`` it wraps the compiled graph with
``measured.profile_first_steps(..., on_done=dumper.write_measured)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.fx

from cost_model import Estimator, SimResult, compile_clock, simulate
from cost_model.op_kinds import op_name
from dhelix_compile.observe import report
from dhelix_compile.observe.graph_picture import write_graph_picture
from dhelix_compile.observe.measured import MeasuredTimeline
from dhelix_compile.observe.timeline import LabelledTimeline, chrome_trace, gantt_svg
from graph_passes import PassContext


def op_counts(gm: torch.fx.GraphModule) -> Counter[str]:
    """How many ``call_function`` nodes of each target the graph has."""
    return Counter(op_name(n, qualified=True) for n in gm.graph.nodes if n.op == "call_function")


def format_op_count_diff(before: Counter[str], after: Counter[str]) -> str:
    """One line per op whose count changed (``op: before -> after (+d)``), sorted by op."""
    lines = []
    for op in sorted(set(before) | set(after)):
        b, a = before.get(op, 0), after.get(op, 0)
        if a != b:
            lines.append(f"{op}: {b} -> {a} ({a - b:+d})")
    total_b, total_a = sum(before.values()), sum(after.values())
    lines.append(f"total: {total_b} -> {total_a} ({total_a - total_b:+d})")
    if len(lines) == 1:
        lines.insert(0, "no op-count change")
    return "\n".join(lines) + "\n"


def format_graph(gm: torch.fx.GraphModule) -> str:
    """Readable graph text: the generated Python with shapes, then each node's dhelix meta."""
    text = gm.print_readable(print_output=False, include_stride=False, include_device=True)
    tagged = [f"#   {n.name}: {n.meta['dhelix']}" for n in gm.graph.nodes if "dhelix" in n.meta]
    if tagged:
        text += "\n# node.meta['dhelix']:\n" + "\n".join(tagged) + "\n"
    return text


def strand_phases(gm: torch.fx.GraphModule) -> dict[int, str]:
    """Each strand of ``gm`` and its phase, as ``node.meta["dhelix"]`` tags them (``merge_strands``
    tags a merged graph's nodes, ``annotate`` every graph's); empty when no node is tagged."""
    phases: dict[int, str] = {}
    for node in gm.graph.nodes:
        meta = node.meta.get("dhelix")
        if isinstance(meta, dict) and "strand" in meta and "phase" in meta:
            phases.setdefault(int(meta["strand"]), str(meta["phase"]))
    return dict(sorted(phases.items()))


#: A helix schedule's call letters (``helix_runtime.schedule.StrandCall``) and their phases.
_CALL_PHASES = {"F": "fwd", "B": "bwd"}


def recorded_helix_steps(rank_dir: Path) -> list[list[tuple[str, int]]] | None:
    """The steps of the helix schedule recorded in ``rank_dir`` (``helix_runtime.schedule.write_schedule``),
    each a list of ``(phase, micro-batch)`` calls in step order; None when none is recorded."""
    from dhelix_compile.helix_runtime.schedule import SCHEDULE_FILE

    path = rank_dir / SCHEDULE_FILE
    if not path.exists():
        return None
    described = str(json.loads(path.read_text())["steps"])  # "F0 | B0+F1 | B1"
    return [[(_CALL_PHASES[c[0]], int(c[1:])) for c in step.split("+")] for step in described.split(" | ")]


def strand_roles(
    phases: dict[int, str], steps: list[list[tuple[str, int]]] | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Each strand's ``{"strand", "phase", "micro_batch"}`` and the helix steps a graph of these
    strands runs (``"B0+F1"``), from its ``strand_phases`` and the recorded schedule's ``steps``.

    A merged graph (two strands) runs the steps of two calls whose second call (it takes the
    parked first one, ``helix_runtime.strand_handoff``) has strand 0's phase and whose first has
    strand 1's. Strand 1's micro-batch is then ``i`` and strand 0's ``i+d``, when every such step
    is d micro-batches apart; otherwise, and for a graph of one strand, ``micro_batch`` is None.
    """
    roles: list[dict[str, Any]] = [{"strand": s, "phase": p, "micro_batch": None} for s, p in phases.items()]
    if len(phases) != 2 or not steps:
        return roles, []
    p0, p1 = phases.values()
    runs = [step for step in steps if len(step) == 2 and (step[1][0], step[0][0]) == (p0, p1)]
    offsets = {second[1] - first[1] for first, second in runs}
    if len(offsets) == 1:
        (offset,) = offsets
        roles[0]["micro_batch"] = f"i{offset:+d}" if offset else "i"
        roles[1]["micro_batch"] = "i"
    return roles, ["+".join(f"{phase[0].upper()}{index}" for phase, index in step) for step in runs]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "graph"


@dataclasses.dataclass
class _Snapshot:
    text: str
    counts: Counter[str]


#: Folders this process has written, so a graph compiled again under the same name (after
#: ``torch._dynamo.reset()``, which restarts compile ids) gets its own folder.
_folders_used: set[Path] = set()


def _fresh_folder(root: Path, name: str) -> Path:
    folder, n = root / name, 1
    while folder in _folders_used:
        n += 1
        folder = root / f"{name}.{n}"
    _folders_used.add(folder)
    return folder


def rank_folder(dump_dir: str | Path) -> Path:
    """This process's folder under ``dump_dir``: ``rank<r>`` in a process group, else ``dump_dir``."""
    root = Path(dump_dir).resolve()
    if dist.is_available() and dist.is_initialized():
        root = root / f"rank{dist.get_rank()}"
    return root


def write_compile_clock(dump_dir: str | Path) -> Path:
    """This process's compile clock as ``compile_clock.json`` in its :func:`rank_folder`
    (``report.COMPILE_CLOCK_FILE``: ``{"seconds": {phase: s}, "counts": {name: n}}``); its path.
    Written whole under another name, then renamed: helix's two strand threads may both write."""
    folder = rank_folder(dump_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / report.COMPILE_CLOCK_FILE
    clock = {"seconds": compile_clock.totals(), "counts": compile_clock.counts()}
    partial = folder / f".{path.name}.{os.getpid()}.{threading.get_ident()}"
    partial.write_text(json.dumps(clock, indent=2) + "\n")
    os.replace(partial, path)
    return path


class GraphDumper:
    """Writes one compiled graph's dumps under ``root`` (see the module docstring); what it writes
    while the graph compiles counts as ``cost_model.compile_clock``'s ``dumps``."""

    def __init__(self, dump_dir: str | Path, graph_name: str) -> None:
        root = rank_folder(dump_dir)
        self.graph_name = graph_name
        self.folder = _fresh_folder(root, _safe(graph_name))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pass_seconds: dict[str, float] = {}
        self.timeline: dict[str, Any] | None = None
        #: the simulated dhelix schedule (``write_timelines``), what measurements compare with
        self.predicted: SimResult | None = None
        self.summary: dict[str, Any] | None = None
        #: ``strand_phases`` of the graph (the input's, then the scheduled one's)
        self.strand_phases: dict[int, str] = {}
        #: what each strand computes (``report.strand_description``), the timelines' legend
        self.strand_names: dict[int, str] = {}

    @compile_clock.timed("dumps")
    def write_input(self, gm: torch.fx.GraphModule) -> None:
        (self.folder / "00_input.txt").write_text(format_graph(gm))
        self.strand_phases = strand_phases(gm)

    def _roles(self) -> tuple[list[dict[str, Any]], list[str]]:
        return strand_roles(self.strand_phases, recorded_helix_steps(self.folder.parent))

    @compile_clock.timed("dumps")
    def snapshot(self, gm: torch.fx.GraphModule) -> _Snapshot:
        return _Snapshot(format_graph(gm), op_counts(gm))

    @compile_clock.timed("dumps")
    def after_pass(self, index: int, name: str, before: Any, gm: torch.fx.GraphModule, seconds: float) -> None:
        stem = f"{index + 1:02d}_{_safe(name)}"
        (self.folder / f"{stem}.before.txt").write_text(before.text)
        (self.folder / f"{stem}.after.txt").write_text(format_graph(gm))
        (self.folder / f"{stem}.opcount.txt").write_text(format_op_count_diff(before.counts, op_counts(gm)))
        self.pass_seconds[name] = seconds

    @compile_clock.timed("dumps")
    def write_timelines(
        self, original: torch.fx.GraphModule, scheduled: torch.fx.GraphModule, estimator: Estimator
    ) -> None:
        """Simulate both orders; write ``timeline.trace.json`` and ``timeline.svg``."""
        before = simulate(original.graph, estimator)
        after = simulate(scheduled.graph, estimator)
        timelines = [LabelledTimeline("original order", before), LabelledTimeline("dhelix schedule", after)]
        trace = chrome_trace(timelines)
        (self.folder / "timeline.trace.json").write_text(json.dumps(trace, indent=1) + "\n")
        title = f"{self.graph_name}: predicted timeline, original order vs dhelix schedule"
        self.strand_phases = strand_phases(scheduled) or self.strand_phases
        self.strand_names = {r["strand"]: report.strand_description(r) for r in self._roles()[0]}
        (self.folder / "timeline.svg").write_text(gantt_svg(timelines, title, self.strand_names))
        self.timeline = report.timeline_numbers(before, after)
        self.predicted = after

    @compile_clock.timed("dumps")
    def write_graph_picture(self, gm: torch.fx.GraphModule) -> str:
        """``graph.dot`` and ``graph.svg`` of the final graph; returns how the SVG was made."""
        return write_graph_picture(gm, self.folder, "graph", title=f"{self.graph_name} (final graph)")

    @compile_clock.timed("dumps")
    def write_summary(self, ctx: PassContext, **extra: Any) -> None:
        """``summary.json`` and this graph's ``index.html``."""
        self.strand_phases = self.strand_phases or {ctx.strand: ctx.phase}
        strands, steps = self._roles()
        summary = {
            "graph": ctx.graph_name,
            "phase": "merged" if len(strands) > 1 else ctx.phase,
            "strands": strands,
            **({"helix_steps": steps} if steps else {}),
            "pass_seconds": self.pass_seconds,
            "stats": {name: dict(sorted(c.items())) for name, c in sorted(ctx.stats.items())},
            "notes": {name: dict(sorted(codes.items())) for name, codes in sorted(ctx.notes.items())},
            "records": ctx.records,
            "timeline": self.timeline,
            **extra,
        }
        self.summary = summary
        self._write_summary_files()

    def write_measured(self, measured: MeasuredTimeline) -> None:
        """The ``profile_steps`` files; ``summary.json`` and ``index.html`` again, with the numbers."""
        (self.folder / "measured.trace.json").write_text(json.dumps(measured.trace) + "\n")
        numbers = {"graph": self.graph_name, **measured.numbers()}
        (self.folder / "predicted_vs_measured.json").write_text(json.dumps(numbers, indent=2) + "\n")
        call = measured.gantt()
        title = f"{self.graph_name}: measured call ({measured.clock} clock)"
        (self.folder / "measured.svg").write_text(gantt_svg([call], title, self.strand_names))
        if self.predicted is not None:
            ratio = numbers["ratio"]
            title = f"{self.graph_name}: predicted vs measured, one time axis" + (
                f" (measured = {ratio:.2f} x predicted)" if ratio is not None else ""
            )
            timelines = [LabelledTimeline("dhelix schedule, predicted", self.predicted), call]
            (self.folder / "predicted_vs_measured.svg").write_text(gantt_svg(timelines, title, self.strand_names))
        if self.summary is not None:
            self.summary["measured"] = measured.numbers()
            self._write_summary_files()

    def _write_summary_files(self) -> None:
        assert self.summary is not None
        (self.folder / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        (self.folder / "index.html").write_text(report.index_html(self.folder, self.summary))
