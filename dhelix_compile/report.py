"""Summaries of a dump: the numbers, a per-graph ``index.html`` and a terminal table.

Contract
--------
* :func:`timeline_numbers` -- from the simulated original order and dhelix's schedule of
  one graph, the summary numbers (all predicted, seconds and bytes)::

      makespan_before_s / makespan_after_s         SimResult.makespan_s
      exposed_comm_before_s / exposed_comm_after_s SimResult.exposed_comm_s
      compute_s, comm_s                            the graph's totals (order-independent)
      hidden_share     (T_seq - T_after) / (T_seq - max(compute, comm)),  T_seq = compute + comm:
                       the share of the hideable communication that the schedule hides
                       (None when nothing can be hidden: no communication)
      peak_memory_before_bytes / peak_memory_after_bytes

  ``GraphDumper`` stores them under ``"timeline"`` in each graph's ``summary.json``.
* :func:`index_html` -- one graph folder's page: the numbers, pass times, the Gantt chart
  inline and links to every file in the folder.
* :func:`collect_summaries` / :func:`format_table` -- every ``summary.json`` under a dump
  directory (``rank*/`` folders included), as rows of a plain-text table; what
  ``python -m dhelix_compile report DUMP_DIR`` prints. :func:`dump_index_html` is the same
  table as a page linking each graph's ``index.html`` (``report --html`` writes it).
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cost_model import SimResult


def timeline_numbers(before: SimResult, after: SimResult) -> dict[str, Any]:
    """The predicted summary numbers of one graph (see the module docstring)."""
    compute_s, comm_s = after.compute_s, after.comm_s
    sequential_s = compute_s + comm_s
    hideable_s = sequential_s - max(compute_s, comm_s)
    return {
        "makespan_before_s": before.makespan_s,
        "makespan_after_s": after.makespan_s,
        "exposed_comm_before_s": before.exposed_comm_s,
        "exposed_comm_after_s": after.exposed_comm_s,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "hidden_share": (sequential_s - after.makespan_s) / hideable_s if hideable_s > 0 else None,
        "peak_memory_before_bytes": before.peak_memory_bytes,
        "peak_memory_after_bytes": after.peak_memory_bytes,
    }


# --------------------------------------------------------------------------- formatting


def _ms(value_s: Any) -> str:
    return "-" if value_s is None else f"{value_s * 1e3:.3f}"


def _mib(value_bytes: Any) -> str:
    return "-" if value_bytes is None else f"{value_bytes / 2**20:.2f}"


def _percent(share: Any) -> str:
    return "-" if share is None else f"{share * 100:.1f}%"


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``(label, value)`` pairs of one graph's summary, as the page and the table show them."""
    t = summary.get("timeline") or {}
    rows = [
        ("predicted makespan, original order (ms)", _ms(t.get("makespan_before_s"))),
        ("predicted makespan, dhelix schedule (ms)", _ms(t.get("makespan_after_s"))),
        ("exposed communication, original order (ms)", _ms(t.get("exposed_comm_before_s"))),
        ("exposed communication, dhelix schedule (ms)", _ms(t.get("exposed_comm_after_s"))),
        ("compute / communication total (ms)", f"{_ms(t.get('compute_s'))} / {_ms(t.get('comm_s'))}"),
        ("share of hideable communication hidden", _percent(t.get("hidden_share"))),
        ("peak memory, original order (MiB)", _mib(t.get("peak_memory_before_bytes"))),
        ("peak memory, dhelix schedule (MiB)", _mib(t.get("peak_memory_after_bytes"))),
    ]
    for name, seconds in (summary.get("pass_seconds") or {}).items():
        rows.append((f"pass {name} (ms)", _ms(seconds)))
    if summary.get("fallback"):
        rows.append(("fell back to plain Inductor", str(summary["fallback"])))
    return rows


def index_html(folder: Path, summary: dict[str, Any]) -> str:
    """The page of one graph folder (see the module docstring)."""
    name = str(summary.get("graph", folder.name))
    table = "\n".join(
        f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>"
        for label, value in summary_rows(summary)
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
    links = "\n".join(
        f'<li><a href="{html.escape(p.name)}">{html.escape(p.name)}</a></li>'
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != "index.html"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dhelix: {html.escape(name)}</title>
<style>
body {{ font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; }}
th {{ background: #f4f4f4; font-weight: normal; }}
td {{ font-family: monospace; }}
</style></head>
<body>
<h1>dhelix: {html.escape(name)} ({html.escape(str(summary.get("phase", "")))})</h1>
<h2>Summary (predicted by the cost model)</h2>
<table>
{table}
</table>
{picture}
<h2>Final graph</h2>
<p><a href="graph.svg">graph.svg</a> (<a href="graph.dot">graph.dot</a>): nodes filled by kind, outlined by strand.</p>
<h2>Files</h2>
<ul>
{links}
</ul>
</body></html>
"""


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
)


def table_row(folder: Path, summary: dict[str, Any]) -> tuple[str, ...]:
    """One table row of a graph's summary."""
    t = summary.get("timeline") or {}
    pass_total_s = sum((summary.get("pass_seconds") or {}).values())
    return (
        str(folder),
        _ms(t.get("makespan_before_s")),
        _ms(t.get("makespan_after_s")),
        _ms(t.get("exposed_comm_before_s")),
        _ms(t.get("exposed_comm_after_s")),
        _percent(t.get("hidden_share")),
        _mib(t.get("peak_memory_before_bytes")),
        _mib(t.get("peak_memory_after_bytes")),
        _ms(pass_total_s),
    )


def format_table(found: Sequence[tuple[Path, dict[str, Any]]]) -> str:
    """A plain-text table, one row per graph, columns aligned."""
    rows = [COLUMNS, *(table_row(folder, summary) for folder, summary in found)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]

    def line(row: Sequence[str]) -> str:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule, *(line(r) for r in rows[1:])]) + "\n"


def report(dump_dir: str | Path) -> str:
    """The terminal report of a dump directory."""
    found = collect_summaries(dump_dir)
    if not found:
        return f"no summary.json under {dump_dir}\n"
    return format_table(found)


def dump_index_html(dump_dir: str | Path) -> str:
    """A page for a whole dump: one row per graph (``rank*/`` included), linking its page."""
    found = collect_summaries(dump_dir)
    header = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    rows = []
    for folder, summary in found:
        cells = table_row(folder, summary)
        link = f'<a href="{html.escape(folder.as_posix())}/index.html">{html.escape(cells[0])}</a>'
        rows.append(f"<tr><td>{link}</td>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells[1:]) + "</tr>")
    body = "\n".join(rows)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dhelix dump</title>
<style>body {{ font-family: Helvetica, Arial, sans-serif; margin: 24px; }}
table {{ border-collapse: collapse; }} th, td {{ border: 1px solid #ccc; padding: 4px 10px; }}
td {{ font-family: monospace; text-align: right; }} td:first-child {{ text-align: left; }}</style>
</head><body><h1>dhelix dump: {len(found)} graphs (predicted times)</h1>
<table><tr>{header}</tr>
{body}
</table></body></html>
"""
