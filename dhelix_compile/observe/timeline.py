"""Predicted timelines of a graph: Perfetto / Chrome trace JSON and an SVG Gantt chart.

Contract
--------
Input: one or more *labelled* :class:`cost_model.SimResult` (``simulate(order, estimator)``),
typically the original order and dhelix's schedule of the same graph. Output, both
deterministic (same result, same bytes):

* :func:`chrome_trace` -- a dict to ``json.dump``; one Perfetto *process* per timeline, one
  *thread* (track) per resource: ``compute stream``, ``comm channel 0``, ``comm channel 1``...
  Every slice has ``name`` (the FX node), ``cat`` (its kind), ``ph="X"``, ``ts``/``dur`` in
  microseconds, ``args.strand`` and a ``cname`` that is one reserved Chrome colour per strand.
  Exposed communication appears on the compute track as slices of category ``exposed_comm``.
* :func:`gantt_svg` -- an SVG document: one panel per timeline on a shared time axis (ms),
  tracks labelled, compute bars solid, transfer bars light with a solid border, both coloured
  by strand, and exposed communication as a red hatched band on the compute track::

      original order   compute  |████ ███▒▒▒▒▒████|        ▒ = compute waits on a transfer
                       comm 0   |     [=====]     |
      dhelix schedule  compute  |████████████|
                       comm 0   |[=====]     |

Exposed communication (:func:`exposed_intervals`) is every interval in which the compute
stream sits idle: a blocking ``wait`` (the simulator records it) or a gap before a compute
node whose input is still in flight (the simulator records only its length). Both are the
gaps of the compute track, so that is how they are found; their lengths sum to
``SimResult.exposed_comm_s``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cost_model import SimEvent, SimResult
from cost_model.units import format_ms
from dhelix_compile.observe import svg

#: Chrome trace viewer's reserved colour names (trace_viewer/base/color_scheme.html), one per
#: strand in turn; Perfetto colours slices by name and ignores them.
_STRAND_CNAMES = ("thread_state_running", "rail_load", "rail_animation", "cq_build_passed", "rail_idle")

#: SVG fill per strand (compute bars); transfers use the same hue, lightened.
_STRAND_COLOURS = ("#3b6fb6", "#2e9960", "#8a4fbf", "#c07a1f", "#1f9fb0", "#b0457a")
_EXPOSED_COLOUR = "#d62728"

_EPS_S = 1e-12


@dataclass(frozen=True)
class LabelledTimeline:
    """One simulated order and what to call it (``"original order"``, ``"dhelix schedule"``).

    ``header`` replaces the Gantt panel's title line (label, makespan, exposed communication)
    when the standard wording does not fit, e.g. a measured call (``dhelix_compile.observe.measured``).
    """

    label: str
    result: SimResult
    header: str | None = None


def strand_colour(strand: int) -> str:
    """The SVG colour of a strand (compute bars)."""
    return _STRAND_COLOURS[strand % len(_STRAND_COLOURS)]


def resources_of(result: SimResult) -> list[str]:
    """The resources with events, compute first, then comm channels by index."""
    names = {"compute"} | {ev.resource for ev in result.events}
    return sorted(names, key=_resource_key)


def _resource_key(resource: str) -> tuple[int, int]:
    if resource == "compute":
        return (0, 0)
    return (1, int(resource.removeprefix("comm") or 0))


def track_name(resource: str) -> str:
    """``"compute"`` -> ``"compute stream"``, ``"comm0"`` -> ``"comm channel 0"``."""
    if resource == "compute":
        return "compute stream"
    return f"comm channel {resource.removeprefix('comm')}"


def exposed_intervals(result: SimResult) -> list[tuple[float, float]]:
    """``(start_s, end_s)`` intervals in which the compute stream waits on a transfer."""
    track = sorted((ev for ev in result.events if ev.resource == "compute"), key=lambda e: (e.start_s, e.end_s))
    intervals: list[tuple[float, float]] = []
    now_s = 0.0
    for ev in track:
        if ev.kind == "wait":
            intervals.append((ev.start_s, ev.end_s))
        elif ev.start_s > now_s + _EPS_S:
            intervals.append((now_s, ev.start_s))
        now_s = max(now_s, ev.end_s)
    return _merged(intervals)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1] + _EPS_S:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


# --------------------------------------------------------------------------- trace JSON


def chrome_trace(timelines: Sequence[LabelledTimeline]) -> dict[str, Any]:
    """All ``timelines`` in one Chrome / Perfetto trace (see the module docstring)."""
    events: list[dict[str, Any]] = []
    for pid, timeline in enumerate(timelines):
        events.extend(_trace_metadata(pid, timeline))
        tid = {r: i for i, r in enumerate(resources_of(timeline.result))}
        events.extend(_trace_slice(pid, tid[ev.resource], ev) for ev in timeline.result.events)
        for start_s, end_s in exposed_intervals(timeline.result):
            events.append(
                {
                    "name": "exposed communication",
                    "cat": "exposed_comm",
                    "ph": "X",
                    "pid": pid,
                    "tid": tid["compute"],
                    "ts": start_s * 1e6,
                    "dur": (end_s - start_s) * 1e6,
                    "cname": "terrible",
                    "args": {"note": "compute stream idle, waiting on a transfer"},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _trace_metadata(pid: int, timeline: LabelledTimeline) -> list[dict[str, Any]]:
    res = timeline.result
    label = (
        f"{timeline.label} (predicted: makespan {format_ms(res.makespan_s, 3)} ms, "
        f"exposed comm {format_ms(res.exposed_comm_s, 3)} ms)"
    )
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for tid, resource in enumerate(resources_of(res)):
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track_name(resource)}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return meta


def _trace_slice(pid: int, tid: int, ev: SimEvent) -> dict[str, Any]:
    return {
        "name": ev.node_name,
        "cat": ev.kind,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": ev.start_s * 1e6,
        "dur": (ev.end_s - ev.start_s) * 1e6,
        "cname": "terrible" if ev.kind == "wait" else _STRAND_CNAMES[ev.strand % len(_STRAND_CNAMES)],
        "args": {"strand": ev.strand, "kind": ev.kind},
    }


# --------------------------------------------------------------------------- SVG Gantt

_LABEL_W_PX = 150
_PLOT_W_PX = 900
_TRACK_H_PX = 26
_TRACK_GAP_PX = 6
_PANEL_TITLE_H_PX = 24
_PANEL_GAP_PX = 18
_AXIS_H_PX = 34
_TOP_PX = 36
_LEGEND_ROW_H_PX = 20
_MIN_LABEL_W_PX = 40
_CHAR_W_PX = 6.2


@dataclass(frozen=True)
class _Scale:
    end_s: float
    step_s: float

    def x(self, t_s: float) -> float:
        return _LABEL_W_PX + (t_s / self.end_s) * _PLOT_W_PX if self.end_s > 0 else _LABEL_W_PX


def gantt_svg(timelines: Sequence[LabelledTimeline], title: str = "") -> str:
    """An SVG Gantt chart of ``timelines`` on a shared time axis (see the module docstring)."""
    end_s = max((t.result.makespan_s for t in timelines), default=0.0)
    step_s = _tick_step_s(end_s)
    scale = _Scale(max(math.ceil(end_s / step_s * (1 - 1e-9)), 1) * step_s, step_s)
    parts: list[str] = [_svg_defs()]
    if title:
        parts.append(svg.text(8, 22, title, size=15, weight="bold"))
    y_px: float = _TOP_PX
    for timeline in timelines:
        panel, y_px = _panel(timeline, scale, y_px)
        parts.append(panel)
        y_px += _PANEL_GAP_PX
    parts.append(_axis(scale, y_px))
    y_px += _AXIS_H_PX
    strands = sorted({ev.strand for t in timelines for ev in t.result.events})
    legend, y_px = _legend(strands or [0], y_px)
    parts.append(legend)
    width_px = _LABEL_W_PX + _PLOT_W_PX + 30
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width_px}" height="{y_px + 8}" '
        f'viewBox="0 0 {width_px} {y_px + 8}" font-family="Helvetica, Arial, sans-serif">\n'
        f'<rect x="0" y="0" width="{width_px}" height="{y_px + 8}" fill="white"/>\n' + "\n".join(parts) + "\n</svg>\n"
    )


def _tick_step_s(end_s: float, max_ticks: int = 10) -> float:
    """A round tick step (1, 2 or 5 x 10^k) giving at most ``max_ticks`` ticks up to ``end_s``."""
    if end_s <= 0:
        return 1e-4
    raw = end_s / max_ticks
    base = 10 ** math.floor(math.log10(raw))
    for step in (1, 2, 5, 10):
        if step * base >= raw * (1 - 1e-9):
            return step * base
    return 10 * base


def _svg_defs() -> str:
    return (
        "<defs>"
        '<pattern id="exposed" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)">'
        f'<rect width="6" height="6" fill="{_EXPOSED_COLOUR}" fill-opacity="0.25"/>'
        f'<rect width="2.5" height="6" fill="{_EXPOSED_COLOUR}"/></pattern>'
        "</defs>"
    )


def _panel(timeline: LabelledTimeline, scale: _Scale, y_px: float) -> tuple[str, float]:
    res = timeline.result
    header = timeline.header or (
        f"{timeline.label}: makespan {format_ms(res.makespan_s, 3)} ms, "
        f"exposed communication {format_ms(res.exposed_comm_s, 3)} ms "
        f"of {format_ms(res.comm_s, 3)} ms"
    )
    parts = [svg.text(8, y_px + 16, header, size=13, weight="bold")]
    y_px += _PANEL_TITLE_H_PX
    for resource in resources_of(res):
        parts.append(_track(res, resource, scale, y_px))
        y_px += _TRACK_H_PX + _TRACK_GAP_PX
    end_x = scale.x(res.makespan_s)
    parts.append(
        f'<line x1="{end_x:.1f}" y1="{y_px - _TRACK_H_PX * 2:.1f}" x2="{end_x:.1f}" y2="{y_px:.1f}" '
        'stroke="#222" stroke-dasharray="3,2"/>'
    )
    return "\n".join(parts), y_px


def _track(res: SimResult, resource: str, scale: _Scale, y_px: float) -> str:
    parts = [
        svg.text(8, y_px + _TRACK_H_PX / 2 + 4, track_name(resource), size=12),
        (
            f'<rect x="{_LABEL_W_PX}" y="{y_px:.1f}" width="{_PLOT_W_PX}" height="{_TRACK_H_PX}" '
            'fill="#f4f4f4" stroke="#ccc"/>'
        ),
    ]
    for ev in res.events:
        if ev.resource == resource and ev.kind != "wait":
            parts.append(_bar(ev, scale, y_px))
    if resource == "compute":
        for start_s, end_s in exposed_intervals(res):
            parts.append(_exposed_band(start_s, end_s, scale, y_px))
    return "\n".join(parts)


def _bar(ev: SimEvent, scale: _Scale, y_px: float) -> str:
    x0, x1 = scale.x(ev.start_s), scale.x(ev.end_s)
    width = max(x1 - x0, 0.6)
    colour = strand_colour(ev.strand)
    is_compute = ev.resource == "compute"
    fill = colour if is_compute else _lighten(colour)
    tooltip = (
        f"{ev.node_name} ({ev.kind}, strand {ev.strand}): {format_ms(ev.start_s, 4)} - {format_ms(ev.end_s, 4)} ms"
    )
    bar = (
        f'<rect x="{x0:.2f}" y="{y_px + 2:.1f}" width="{width:.2f}" height="{_TRACK_H_PX - 4}" '
        f'fill="{fill}" stroke="{colour if not is_compute else "white"}" '
        f'stroke-width="{1.5 if not is_compute else 0.4}"><title>{html.escape(tooltip)}</title></rect>'
    )
    if width >= _MIN_LABEL_W_PX:
        label = _fit(ev.node_name, width)
        bar += "\n" + svg.text(
            x0 + 3, y_px + _TRACK_H_PX / 2 + 4, label, size=10, fill="white" if is_compute else "#222"
        )
    return bar


def _exposed_band(start_s: float, end_s: float, scale: _Scale, y_px: float) -> str:
    x0, x1 = scale.x(start_s), scale.x(end_s)
    tooltip = f"exposed communication: {format_ms(start_s, 4)} - {format_ms(end_s, 4)} ms"
    return (
        f'<rect x="{x0:.2f}" y="{y_px:.1f}" width="{max(x1 - x0, 1.0):.2f}" height="{_TRACK_H_PX}" '
        f'fill="url(#exposed)" stroke="{_EXPOSED_COLOUR}" stroke-width="1.2">'
        f"<title>{html.escape(tooltip)}</title></rect>"
    )


def _axis(scale: _Scale, y_px: float) -> str:
    parts = [
        f'<line x1="{_LABEL_W_PX}" y1="{y_px:.1f}" x2="{_LABEL_W_PX + _PLOT_W_PX}" y2="{y_px:.1f}" stroke="#222"/>'
    ]
    ticks = round(scale.end_s / scale.step_s)
    for i in range(ticks + 1):
        t_s = scale.step_s * i
        x = scale.x(t_s)
        parts.append(f'<line x1="{x:.1f}" y1="{y_px:.1f}" x2="{x:.1f}" y2="{y_px + 5:.1f}" stroke="#222"/>')
        parts.append(svg.text(x - 12, y_px + 17, _format_ms(t_s * 1e3), size=10))
    parts.append(svg.text(_LABEL_W_PX + _PLOT_W_PX / 2 - 30, y_px + 31, "time (ms)", size=11))
    return "\n".join(parts)


def _legend(strands: list[int], y_px: float) -> tuple[str, float]:
    parts: list[str] = []
    x = 8.0
    entries: list[tuple[str, str]] = []
    for strand in strands:
        colour = strand_colour(strand)
        entries.append((f'fill="{colour}" stroke="white"', f"compute (strand {strand})"))
        entries.append(
            (f'fill="{_lighten(colour)}" stroke="{colour}" stroke-width="1.5"', f"communication (strand {strand})")
        )
    entries.append((f'fill="url(#exposed)" stroke="{_EXPOSED_COLOUR}"', "exposed communication (compute stream waits)"))
    for style, label in entries:
        width_px = 22 + len(label) * _CHAR_W_PX + 16
        if x + width_px > _LABEL_W_PX + _PLOT_W_PX:
            x, y_px = 8.0, y_px + _LEGEND_ROW_H_PX
        parts.append(f'<rect x="{x:.1f}" y="{y_px:.1f}" width="16" height="12" {style}/>')
        parts.append(svg.text(x + 22, y_px + 10.5, label, size=11))
        x += width_px
    return "\n".join(parts), y_px + _LEGEND_ROW_H_PX


def _format_ms(t_ms: float) -> str:
    return f"{t_ms:.4g}"


def _fit(label: str, width_px: float) -> str:
    max_chars = int((width_px - 6) / _CHAR_W_PX)
    return label if len(label) <= max_chars else label[: max(max_chars - 1, 1)] + "…"


def _lighten(colour: str, amount: float = 0.6) -> str:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    mix = [round(c + (255 - c) * amount) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)
