"""Summaries of a dump: the numbers, a per-graph ``index.html`` and a terminal table.

Contract
--------
* :func:`timeline_numbers` -- from the simulated original order and dhelix's schedule of
  one graph, the summary numbers (all predicted, seconds and bytes)::

      makespan_before_s / makespan_after_s         SimResult.makespan_s
      exposed_comm_before_s / exposed_comm_after_s SimResult.exposed_comm_s
      compute_before_s / compute_after_s           the compute stream's busy time in that order:
                                                   compute_s + contention_s, what its bars add up to
      comm_before_s / comm_after_s                 SimResult.comm_s (the schedule's graph may
                                                   communicate otherwise: decomposed, bucketed)
      hideable_comm_s  exposed_comm_before_s: the communication the compute stream waits for in
                       the original order, which a schedule can hide
      hidden_share     (exposed_comm_before_s - exposed_comm_after_s) / hideable_comm_s
                       (:data:`HIDDEN_SHARE_FORMULA`; None when nothing is exposed to begin
                       with; negative when the schedule exposes more)
      peak_memory_before_bytes / peak_memory_after_bytes
      contention_before_s / contention_after_s   SimResult.contention_s: the compute time the
                           order adds by running compute beside transfers (their contention factors)

  Each panel of ``timeline.svg`` prints the same makespan, compute, communication and exposed
  numbers for its order (``timeline.panel_header``).
  ``GraphDumper`` stores them under ``"timeline"`` in each graph's ``summary.json``.
  With ``profile_steps``, ``summary.json`` also gets ``"measured"``
  (``MeasuredTimeline.numbers()``: the measured call, median of the profiled calls, and per
  communication segment predicted s, measured s, ratio = measured / predicted; and
  ``"account"``, where the difference went: ``MeasuredTimeline.account``).
* :func:`graph_kind` -- what the graph holds, for its page's title: ``forward``,
  ``backward``, ``inference``, or for a merged graph (``"phase": "merged"``) each strand's
  phase and micro-batch and the helix steps that run it (``summary["strands"]``,
  ``summary["helix_steps"]``, written by ``GraphDumper``).
* :func:`index_html` -- one graph folder's page: the numbers, pass times, the Gantt chart
  inline, the predicted-vs-measured table and chart when measured, and links to every file.
* :func:`collect_summaries` / :func:`format_table` -- every ``summary.json`` under a dump
  directory (``rank*/`` folders included), as rows of a plain-text table, followed by one
  predicted-vs-measured segment table per measured graph that has communication; what
  ``python -m dhelix_compile report DUMP_DIR`` prints. :func:`dump_index_html` is the same
  table as a page linking each graph's ``index.html`` (``report --html`` writes it).
* :func:`collect_compile_clocks` / :func:`format_compile_time` -- each rank folder's
  ``compile_clock.json`` (``dumps.write_compile_clock``: the process's
  ``cost_model.compile_clock`` after its last compile), as a "Compile time" section per rank:
  seconds per phase, each phase's share of the seconds in phases, graphs compiled and
  candidates weighed. The report prints it after the tables, and the dump's page shows it.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cost_model import SimResult
from cost_model.units import format_ms, format_pct

#: How ``hidden_share`` is computed, as the page and the report print it.
HIDDEN_SHARE_FORMULA = "(exposed before - exposed after) / hideable"


def hidden_share(exposed_before_s: float, exposed_after_s: float) -> float | None:
    """The share of the original order's exposed communication that the schedule hides
    (:data:`HIDDEN_SHARE_FORMULA`); None when the original order exposes none."""
    if exposed_before_s <= 0:
        return None
    return (exposed_before_s - exposed_after_s) / exposed_before_s


def timeline_numbers(before: SimResult, after: SimResult) -> dict[str, Any]:
    """The predicted summary numbers of one graph (see the module docstring)."""
    return {
        "makespan_before_s": before.makespan_s,
        "makespan_after_s": after.makespan_s,
        "exposed_comm_before_s": before.exposed_comm_s,
        "exposed_comm_after_s": after.exposed_comm_s,
        "compute_before_s": before.compute_s + before.contention_s,
        "compute_after_s": after.compute_s + after.contention_s,
        "comm_before_s": before.comm_s,
        "comm_after_s": after.comm_s,
        "hideable_comm_s": before.exposed_comm_s,
        "hidden_share": hidden_share(before.exposed_comm_s, after.exposed_comm_s),
        "peak_memory_before_bytes": before.peak_memory_bytes,
        "peak_memory_after_bytes": after.peak_memory_bytes,
        "contention_before_s": before.contention_s,
        "contention_after_s": after.contention_s,
    }


_PHASE_WORDS = {"fwd": "forward", "bwd": "backward", "inference": "inference"}


def strand_description(strand: dict[str, Any]) -> str:
    """``{"phase": "fwd", "micro_batch": "i+1"}`` -> ``"forward of micro-batch i+1"``."""
    words = _PHASE_WORDS.get(str(strand.get("phase")), str(strand.get("phase")))
    return f"{words} of micro-batch {strand['micro_batch']}" if strand.get("micro_batch") else words


def graph_kind(summary: dict[str, Any]) -> str:
    """What the graph of ``summary`` holds (see the module docstring): ``"forward"``, or
    ``"merged: forward of micro-batch i+1 ⊕ backward of micro-batch i; helix steps B0+F1, B1+F2"``."""
    phase = str(summary.get("phase", ""))
    if phase != "merged":
        return _PHASE_WORDS.get(phase, phase)
    strands = summary.get("strands") or []
    held = " ⊕ ".join(f"{strand_description(s)} (strand {s['strand']})" for s in strands)
    steps = summary.get("helix_steps")
    return f"merged: {held}" + (f"; helix steps {', '.join(steps)}" if steps else "")


# --------------------------------------------------------------------------- formatting


def _mib(value_bytes: Any) -> str:
    return "-" if value_bytes is None else f"{value_bytes / 2**20:.2f}"


def _ratio(ratio: Any) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _measured_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    m = summary.get("measured")
    if m:
        calls = f"median of {m['steps']} profiled call{'s' if m['steps'] != 1 else ''}"
        rows = [
            (f"measured call, {calls}, {m['clock']} clock (ms)", format_ms(m.get("measured_step_s"), 3)),
            ("measured / predicted (dhelix schedule)", _ratio(m.get("ratio"))),
        ]
        account = m.get("account")
        if account:
            rows += [
                ("measured segments' medians, added up (ms)", format_ms(account.get("segment_medians_s"), 3)),
                ("per-call variation: median call - that sum (ms)", format_ms(account.get("variation_s"), 3)),
                ("where measured and predicted differ", str(account.get("verdict", "-"))),
            ]
        return rows
    if summary.get("profile_steps"):
        return [
            (
                "measured call (ms)",
                f"pending: written after a warm-up call and {summary['profile_steps']} profiled calls",
            )
        ]
    return []


def _hidden_share_value(t: dict[str, Any]) -> str:
    """``"100.0% = (28.700 - 0.000) / 28.700"``: the share and the numbers it divides."""
    share = t.get("hidden_share")
    if share is None:
        return "- (nothing exposed in the original order)" if t.get("hideable_comm_s") is not None else "-"
    before, after = format_ms(t["exposed_comm_before_s"], 3), format_ms(t["exposed_comm_after_s"], 3)
    return f"{format_pct(share)} = ({before} - {after}) / {format_ms(t['hideable_comm_s'], 3)}"


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``(label, value)`` pairs of one graph's summary, as the page and the table show them."""
    t = summary.get("timeline") or {}
    rows = [
        ("predicted makespan, original order (ms)", format_ms(t.get("makespan_before_s"), 3)),
        ("predicted makespan, dhelix schedule (ms)", format_ms(t.get("makespan_after_s"), 3)),
        ("exposed communication, original order (ms)", format_ms(t.get("exposed_comm_before_s"), 3)),
        ("exposed communication, dhelix schedule (ms)", format_ms(t.get("exposed_comm_after_s"), 3)),
        (
            "compute / communication, original order (ms, as its timeline panel)",
            f"{format_ms(t.get('compute_before_s'), 3)} / {format_ms(t.get('comm_before_s'), 3)}",
        ),
        (
            "compute / communication, dhelix schedule (ms, as its timeline panel)",
            f"{format_ms(t.get('compute_after_s'), 3)} / {format_ms(t.get('comm_after_s'), 3)}",
        ),
        ("hideable communication = exposed, original order (ms)", format_ms(t.get("hideable_comm_s"), 3)),
        (f"share hidden = {HIDDEN_SHARE_FORMULA}", _hidden_share_value(t)),
        ("peak memory, original order (MiB)", _mib(t.get("peak_memory_before_bytes"))),
        ("peak memory, dhelix schedule (MiB)", _mib(t.get("peak_memory_after_bytes"))),
    ]
    rows.extend(_measured_rows(summary))
    for name, seconds in (summary.get("pass_seconds") or {}).items():
        rows.append((f"pass {name} (ms)", format_ms(seconds, 3)))
    if summary.get("fallback"):
        rows.append(("fell back to plain Inductor", str(summary["fallback"])))
    return rows


def index_html(folder: Path, summary: dict[str, Any]) -> str:
    """The page of one graph folder (see the module docstring)."""
    heading = html.escape(f"{summary.get('graph', folder.name)} ({graph_kind(summary)})")
    table = "\n".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>" for label, value in summary_rows(summary)
    )
    gantt = folder / "timeline.svg"
    picture = (
        '<h2>Predicted timeline</h2>\n<p><a href="timeline.svg"><img src="timeline.svg" '
        'alt="predicted timeline" style="max-width:100%"></a></p>\n'
        '<p>Open <a href="timeline.trace.json">timeline.trace.json</a> in '
        '<a href="https://ui.perfetto.dev">ui.perfetto.dev</a> or chrome://tracing.</p>'
        if gantt.exists()
        else "<p>No timeline (no estimator for this graph).</p>"
    )
    measured = _measured_html(folder, summary)
    links = "\n".join(
        f'<li><a href="{html.escape(p.name)}">{html.escape(p.name)}</a></li>'
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != "index.html"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dhelix: {heading}</title>
<style>
body {{ font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; }}
th {{ background: #f4f4f4; font-weight: normal; }}
td {{ font-family: monospace; }}
td.num {{ text-align: right; }}
tr.total td {{ font-weight: bold; }}
</style></head>
<body>
<h1>dhelix: {heading}</h1>
<h2>Summary (predicted by the cost model, unless marked measured)</h2>
<table>
{table}
</table>
{picture}
{measured}
<h2>Final graph</h2>
<p><a href="graph.svg">graph.svg</a> (<a href="graph.dot">graph.dot</a>): nodes filled by kind, outlined by strand.</p>
<h2>Files</h2>
<ul>
{links}
</ul>
</body></html>
"""


SEGMENT_COLUMNS = ("#", "segment", "predicted ms", "measured ms", "measured / predicted")


def segment_table_rows(measured: dict[str, Any]) -> list[tuple[str, ...]]:
    """Rows of the predicted-vs-measured table: one per segment, then the whole call."""
    rows: list[tuple[str, ...]] = [
        (
            str(seg["segment"]),
            seg["label"],
            format_ms(seg["predicted_s"], 3),
            format_ms(seg["measured_s"], 3),
            _ratio(seg["ratio"]),
        )
        for seg in measured.get("segments") or []
    ]
    rows.append(
        (
            "",
            "whole call",
            format_ms(measured.get("predicted_step_s"), 3),
            format_ms(measured.get("measured_step_s"), 3),
            _ratio(measured.get("ratio")),
        )
    )
    return rows


def _measured_html(folder: Path, summary: dict[str, Any]) -> str:
    m = summary.get("measured")
    if not m:
        if summary.get("profile_steps"):
            return (
                f"<h2>Predicted vs measured</h2>\n<p>profile_steps={summary['profile_steps']}: written "
                f"after a warm-up call and {summary['profile_steps']} profiled calls of this graph; "
                "reload the page then.</p>"
            )
        return ""
    rows = segment_table_rows(m)
    if len(m.get("segments") or []) < 2:  # no communication: the one segment is the whole call
        rows = rows[-1:]
    lines = []
    for i, (index, label, *numbers) in enumerate(rows):
        total = ' class="total"' if i == len(rows) - 1 else ""
        cells = "".join(f'<td class="num">{html.escape(c)}</td>' for c in numbers)
        lines.append(f'<tr{total}><td class="num">{html.escape(index)}</td><td>{html.escape(label)}</td>{cells}</tr>')
    body = "\n".join(lines)
    header = "".join(f"<th>{html.escape(c)}</th>" for c in SEGMENT_COLUMNS)
    note = (
        "Segments cut the graph at its collective issues and waits: segment <i>i</i> runs from the "
        "moment communication op <i>i</i>&minus;1 returned to the moment op <i>i</i> returned, so it "
        "holds the compute before op <i>i</i> and, for a wait, the time the caller was blocked. "
        if len(rows) > 1
        else "This graph has no communication: one segment, the whole call. "
    ) + (
        f"Measured: median of {m['steps']} profiled calls after a warm-up call "
        f"({html.escape(str(m['clock']))} clock, under torch.profiler). "
        "Predicted: the cost model's simulation of the dhelix schedule."
    )
    if m.get("segments_note"):
        note += f" <b>No segment times:</b> {html.escape(str(m['segments_note']))}."
    if (m.get("account") or {}).get("verdict"):
        note += f" <b>Where they differ:</b> {html.escape(str(m['account']['verdict']))}."
    pictures = "\n".join(
        f'<p><a href="{name}"><img src="{name}" alt="{alt}" style="max-width:100%"></a></p>'
        for name, alt in (
            ("predicted_vs_measured.svg", "predicted schedule above the measured call"),
            ("measured.svg", "the measured call"),
        )
        if (folder / name).exists()
    )
    return f"""<h2>Predicted vs measured</h2>
<p>{note}</p>
<table><tr>{header}</tr>
{body}
</table>
{pictures}
<p>Open <a href="measured.trace.json">measured.trace.json</a> in <a href="https://ui.perfetto.dev">ui.perfetto.dev</a>:
every op of the profiled calls, and a <code>dhelix</code> process whose tracks mark each call and its segments;
<a href="predicted_vs_measured.json">predicted_vs_measured.json</a> has the numbers.</p>"""


def collect_summaries(dump_dir: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every ``summary.json`` under ``dump_dir`` (any depth), sorted by path."""
    root = Path(dump_dir)
    found = []
    for path in sorted(root.rglob("summary.json")):
        found.append((path.parent.relative_to(root), json.loads(path.read_text())))
    return found


COLUMNS = (
    "graph",
    "makespan before ms",
    "after ms",
    "exposed before ms",
    "after ms",
    "hidden",
    "peak mem before MiB",
    "after MiB",
    "passes ms",
    "measured ms",
    "meas/pred",
)


def table_row(folder: Path, summary: dict[str, Any]) -> tuple[str, ...]:
    """One table row of a graph's summary."""
    t = summary.get("timeline") or {}
    m = summary.get("measured") or {}
    pass_total_s = sum((summary.get("pass_seconds") or {}).values())
    return (
        str(folder),
        format_ms(t.get("makespan_before_s"), 3),
        format_ms(t.get("makespan_after_s"), 3),
        format_ms(t.get("exposed_comm_before_s"), 3),
        format_ms(t.get("exposed_comm_after_s"), 3),
        format_pct(t.get("hidden_share")),
        _mib(t.get("peak_memory_before_bytes")),
        _mib(t.get("peak_memory_after_bytes")),
        format_ms(pass_total_s, 3),
        format_ms(m.get("measured_step_s"), 3),
        _ratio(m.get("ratio")),
    )


def format_table(found: Sequence[tuple[Path, dict[str, Any]]]) -> str:
    """A plain-text table, one row per graph, then a segment table per measured graph with communication.

    ``hidden`` is :data:`HIDDEN_SHARE_FORMULA` (printed under the table when a graph has one);
    ``measured ms`` is the median profiled call (``profile_steps``), ``meas/pred`` its ratio to
    the predicted makespan of the dhelix schedule (``makespan after ms``).
    """
    text = _aligned(COLUMNS, [table_row(folder, summary) for folder, summary in found], left=(0,))
    if any((summary.get("timeline") or {}).get("hidden_share") is not None for _, summary in found):
        text += f"hidden = {HIDDEN_SHARE_FORMULA}, hideable = exposed before\n"
    for folder, summary in found:
        m = summary.get("measured")
        if not m or len(m.get("segments") or []) < 2:
            continue
        calls = f"median of {m['steps']} profiled call{'s' if m['steps'] != 1 else ''}"
        text += f"\n{folder}: predicted vs measured per communication segment ({m['clock']} clock, {calls})\n"
        if m.get("segments_note"):
            text += f"no segment times: {m['segments_note']}\n"
        text += _aligned(SEGMENT_COLUMNS, segment_table_rows(m), left=(1,))
        if (m.get("account") or {}).get("verdict"):
            text += f"where they differ: {m['account']['verdict']}\n"
    return text


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]], left: tuple[int, ...]) -> str:
    """``header``, a rule and ``rows``, columns padded to one width; ``left`` columns left-aligned."""
    all_rows = [tuple(header), *(tuple(r) for r in rows)]
    widths = [max(len(row[i]) for row in all_rows) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(all_rows[0]), rule, *(line(r) for r in all_rows[1:])]) + "\n"


#: Each rank folder's compile clock (``dumps.write_compile_clock``).
COMPILE_CLOCK_FILE = "compile_clock.json"

COMPILE_COLUMNS = ("phase", "s", "share")

#: What the compile-time section says its numbers are.
COMPILE_TIME_NOTE = (
    "wall seconds of this process's dhelix compiles per phase (cost_model.compile_clock: a phase "
    "inside another counts only as itself); the rest of a first step is Dynamo's trace and running it"
)


def collect_compile_clocks(dump_dir: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every ``compile_clock.json`` under ``dump_dir`` (its own, ``rank*/``'s), sorted by path:
    the folder relative to ``dump_dir`` and the clock."""
    root = Path(dump_dir)
    return [
        (path.parent.relative_to(root), json.loads(path.read_text())) for path in sorted(root.rglob(COMPILE_CLOCK_FILE))
    ]


def compile_time_rows(clock: dict[str, Any]) -> list[tuple[str, str, str]]:
    """One ``(phase, seconds, share)`` row per phase of ``clock``, then their total (``in phases``);
    a share is of that total ("-" when no phase ran)."""
    seconds: dict[str, float] = clock.get("seconds") or {}
    total_s = math.fsum(seconds.values())

    def share(s: float) -> str:
        return format_pct(s / total_s) if total_s > 0 else "-"

    rows = [(name, f"{s:.2f}", share(s)) for name, s in seconds.items()]
    rows.append(("in phases", f"{total_s:.2f}", share(total_s)))
    return rows


def compile_counts_line(clock: dict[str, Any]) -> str:
    """``"graphs compiled: 3; candidates weighed: 2 merged graphs, 5 decompose variants"``."""
    counts: dict[str, int] = clock.get("counts") or {}
    return (
        f"graphs compiled: {counts.get('graphs', 0)}; candidates weighed: "
        f"{counts.get('candidates', 0)} merged graphs, {counts.get('variants', 0)} decompose variants"
    )


def _rank_label(folder: Path) -> str:
    return "the one process" if folder == Path(".") else folder.as_posix()


def format_compile_time(clocks: Sequence[tuple[Path, dict[str, Any]]]) -> str:
    """The "Compile time" section of the report, one table per rank ("" without clocks)."""
    if not clocks:
        return ""
    text = f"\nCompile time: {COMPILE_TIME_NOTE}\n"
    for folder, clock in clocks:
        text += f"\n{_rank_label(folder)}\n"
        text += _aligned(COMPILE_COLUMNS, compile_time_rows(clock), left=(0,))
        text += compile_counts_line(clock) + "\n"
    return text


def _compile_time_html(clocks: Sequence[tuple[Path, dict[str, Any]]]) -> str:
    if not clocks:
        return ""
    header = "".join(f"<th>{html.escape(c)}</th>" for c in COMPILE_COLUMNS)
    parts = [f"<h2>Compile time</h2>\n<p>{html.escape(COMPILE_TIME_NOTE)}.</p>"]
    for folder, clock in clocks:
        rows = "\n".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in compile_time_rows(clock)
        )
        parts.append(
            f"<h3>{html.escape(_rank_label(folder))}</h3>\n<table><tr>{header}</tr>\n{rows}\n</table>\n"
            f"<p>{html.escape(compile_counts_line(clock))}</p>"
        )
    return "\n".join(parts)


def report(dump_dir: str | Path) -> str:
    """The terminal report of a dump directory: the graphs' tables, then the compile time."""
    found = collect_summaries(dump_dir)
    if not found:
        return f"no summary.json under {dump_dir}\n"
    return format_table(found) + format_compile_time(collect_compile_clocks(dump_dir))


def dump_index_html(dump_dir: str | Path) -> str:
    """A page for a whole dump: one row per graph (``rank*/`` included), linking its page, then
    each rank's compile time."""
    found = collect_summaries(dump_dir)
    header = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    rows = []
    for folder, summary in found:
        cells = table_row(folder, summary)
        link = f'<a href="{html.escape(folder.as_posix())}/index.html">{html.escape(cells[0])}</a>'
        rows.append(f"<tr><td>{link}</td>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells[1:]) + "</tr>")
    body = "\n".join(rows)
    compile_time = _compile_time_html(collect_compile_clocks(dump_dir))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dhelix dump</title>
<style>body {{ font-family: Helvetica, Arial, sans-serif; margin: 24px; }}
table {{ border-collapse: collapse; }} th, td {{ border: 1px solid #ccc; padding: 4px 10px; }}
td {{ font-family: monospace; text-align: right; }} td:first-child {{ text-align: left; }}</style>
</head><body><h1>dhelix dump: {len(found)} graphs (predicted times; measured where profiled)</h1>
<table><tr>{header}</tr>
{body}
</table>
{compile_time}
</body></html>
"""
