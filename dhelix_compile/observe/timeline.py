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

Each panel's title line (:func:`panel_header`) gives the order's makespan, compute (the compute
stream's busy time), communication and exposed communication. The legend names each strand by
what it computes (``strand_names``: ``"forward of micro-batch i+1"``), else by its number. The
time axis ends at the first round tick at or above the longer makespan (:func:`axis_end_s`). A
bar shows its node's name only where the whole name fits inside it (:func:`bar_label`); every
bar's tooltip (``<title>``) names it. The SVG is as wide as its longest title line.

Exposed communication (:func:`exposed_intervals`) is every interval in which the compute
stream sits idle: a blocking ``wait`` (the simulator records it) or a gap before a compute
node whose input is still in flight (the simulator records only its length). Both are the
gaps of the compute track, so that is how they are found; their lengths sum to
``SimResult.exposed_comm_s``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
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
_RIGHT_MARGIN_PX = 30
_TRACK_H_PX = 26
_TRACK_GAP_PX = 6
_PANEL_TITLE_H_PX = 24
_PANEL_GAP_PX = 18
_AXIS_H_PX = 34
_TOP_PX = 36
_LEGEND_ROW_H_PX = 20
_BAR_LABEL_SIZE_PX = 10
_BAR_LABEL_PAD_PX = 3
_TITLE_SIZE_PX = 15
_HEADER_SIZE_PX = 13
_LEGEND_SIZE_PX = 11
_TICK_SIZE_PX = 10

#: Tick steps (x 10^k) the time axis may take, and how many intervals it may have.
_NICE_STEPS = (1.0, 2.0, 2.5, 5.0)
_MIN_INTERVALS, _MAX_INTERVALS = 4, 12


@dataclass(frozen=True)
class _Scale:
    end_s: float
    step_s: float

    def x(self, t_s: float) -> float:
        return _LABEL_W_PX + (t_s / self.end_s) * _PLOT_W_PX if self.end_s > 0 else _LABEL_W_PX


def gantt_svg(
    timelines: Sequence[LabelledTimeline], title: str = "", strand_names: Mapping[int, str] | None = None
) -> str:
    """An SVG Gantt chart of ``timelines`` on a shared time axis (see the module docstring).

    ``strand_names``: what each strand is (``"forward of micro-batch i+1"``), for the legend and
    the bars' tooltips; a strand without one is called ``strand <n>``.
    """
    names = dict(strand_names or {})
    end_s = max((t.result.makespan_s for t in timelines), default=0.0)
    scale = _Scale(*axis_end_s(end_s))
    parts: list[str] = [_svg_defs()]
    widest_px = float(_LABEL_W_PX + _PLOT_W_PX)
    if title:
        parts.append(svg.text(8, 22, title, size=_TITLE_SIZE_PX, weight="bold"))
        widest_px = max(widest_px, 8 + svg.text_width_px(title, _TITLE_SIZE_PX, weight="bold"))
    y_px: float = _TOP_PX
    for timeline in timelines:
        header = panel_header(timeline)
        widest_px = max(widest_px, 8 + svg.text_width_px(header, _HEADER_SIZE_PX, weight="bold"))
        panel, y_px = _panel(timeline, header, scale, y_px, names)
        parts.append(panel)
        y_px += _PANEL_GAP_PX
    parts.append(_axis(scale, y_px))
    y_px += _AXIS_H_PX
    strands = sorted({ev.strand for t in timelines for ev in t.result.events})
    legend, y_px = _legend(legend_entries(strands or [0], names), y_px)
    parts.append(legend)
    width_px = math.ceil(widest_px) + _RIGHT_MARGIN_PX
    height_px = y_px + 8
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width_px}" height="{height_px}" '
        f'viewBox="0 0 {width_px} {height_px}" font-family="Helvetica, Arial, sans-serif">\n'
        f'<rect x="0" y="0" width="{width_px}" height="{height_px}" fill="white"/>\n' + "\n".join(parts) + "\n</svg>\n"
    )


def axis_end_s(end_s: float) -> tuple[float, float]:
    """``(axis_end_s, tick_step_s)``: the axis ends at the first tick at or above ``end_s``.

    The step is 1, 2, 2.5 or 5 x 10^k, with 4 to 12 intervals up to the end; of those, the one
    whose last tick lies closest above ``end_s`` (then the most ticks). Data ending at 200.1 ms
    gets an axis to 220 ms in steps of 20 (a step of 50 would end it at 250).
    """
    if end_s <= 0:
        return 1e-4, 1e-4
    best: tuple[float, int, float] | None = None
    top = math.floor(math.log10(end_s / _MIN_INTERVALS))
    for power in range(top - 2, top + 1):
        for mantissa in _NICE_STEPS:
            step_s = mantissa * 10.0**power
            intervals = max(math.ceil(end_s / step_s * (1 - 1e-9)), 1)
            if _MIN_INTERVALS <= intervals <= _MAX_INTERVALS:
                candidate = (intervals * step_s, -intervals, step_s)
                best = candidate if best is None or candidate[:2] < best[:2] else best
    assert best is not None, end_s  # 10^k steps alone reach every count from 4 to 12 over three powers
    return best[0], best[2]


def panel_header(timeline: LabelledTimeline) -> str:
    """A panel's title line: the order's makespan, compute, communication and exposed communication.

    Compute is the compute stream's busy time, as its bars add up: the ops' own time plus what
    running beside transfers adds (``SimResult.contention_s``). ``report.summary_rows`` prints
    the same numbers.
    """
    if timeline.header:
        return timeline.header
    res = timeline.result
    contention = f" (of it {format_ms(res.contention_s, 3)} slowed by transfers)" if res.contention_s > 0 else ""
    return (
        f"{timeline.label}: makespan {format_ms(res.makespan_s, 3)} ms; "
        f"compute {format_ms(res.compute_s + res.contention_s, 3)} ms{contention}; "
        f"communication {format_ms(res.comm_s, 3)} ms, exposed {format_ms(res.exposed_comm_s, 3)} ms"
    )


def _svg_defs() -> str:
    return (
        "<defs>"
        '<pattern id="exposed" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)">'
        f'<rect width="6" height="6" fill="{_EXPOSED_COLOUR}" fill-opacity="0.25"/>'
        f'<rect width="2.5" height="6" fill="{_EXPOSED_COLOUR}"/></pattern>'
        "</defs>"
    )


def _panel(
    timeline: LabelledTimeline, header: str, scale: _Scale, y_px: float, names: Mapping[int, str]
) -> tuple[str, float]:
    res = timeline.result
    parts = [svg.text(8, y_px + 16, header, size=_HEADER_SIZE_PX, weight="bold")]
    y_px += _PANEL_TITLE_H_PX
    for resource in resources_of(res):
        parts.append(_track(res, resource, scale, y_px, names))
        y_px += _TRACK_H_PX + _TRACK_GAP_PX
    end_x = scale.x(res.makespan_s)
    parts.append(
        f'<line x1="{end_x:.1f}" y1="{y_px - _TRACK_H_PX * 2:.1f}" x2="{end_x:.1f}" y2="{y_px:.1f}" '
        'stroke="#222" stroke-dasharray="3,2"/>'
    )
    return "\n".join(parts), y_px


def _track(res: SimResult, resource: str, scale: _Scale, y_px: float, names: Mapping[int, str]) -> str:
    parts = [
        svg.text(8, y_px + _TRACK_H_PX / 2 + 4, track_name(resource), size=12),
        (
            f'<rect x="{_LABEL_W_PX}" y="{y_px:.1f}" width="{_PLOT_W_PX}" height="{_TRACK_H_PX}" '
            'fill="#f4f4f4" stroke="#ccc"/>'
        ),
    ]
    for ev in res.events:
        if ev.resource == resource and ev.kind != "wait":
            parts.append(_bar(ev, scale, y_px, names))
    if resource == "compute":
        for start_s, end_s in exposed_intervals(res):
            parts.append(_exposed_band(start_s, end_s, scale, y_px))
    return "\n".join(parts)


def strand_name(strand: int, names: Mapping[int, str]) -> str:
    """What ``names`` calls ``strand``, else ``strand <n>``."""
    return names.get(strand, f"strand {strand}")


def bar_label(name: str, width_px: float) -> str | None:
    """The text a bar ``width_px`` wide shows: the node's whole name when it fits inside, else
    none (its tooltip names it). A name is never cut: ``f_all_…`` would not say which op the
    bar is."""
    needed_px = svg.text_width_px(name, _BAR_LABEL_SIZE_PX) + 2 * _BAR_LABEL_PAD_PX
    return name if needed_px <= width_px else None


def _bar(ev: SimEvent, scale: _Scale, y_px: float, names: Mapping[int, str]) -> str:
    x0, x1 = scale.x(ev.start_s), scale.x(ev.end_s)
    width = max(x1 - x0, 0.6)
    colour = strand_colour(ev.strand)
    is_compute = ev.resource == "compute"
    fill = colour if is_compute else _lighten(colour)
    tooltip = html.escape(
        f"{ev.node_name} ({ev.kind}, {strand_name(ev.strand, names)}): "
        f"{format_ms(ev.start_s, 4)} - {format_ms(ev.end_s, 4)} ms"
    )
    bar = (
        f'<rect x="{x0:.2f}" y="{y_px + 2:.1f}" width="{width:.2f}" height="{_TRACK_H_PX - 4}" '
        f'fill="{fill}" stroke="{colour if not is_compute else "white"}" '
        f'stroke-width="{1.5 if not is_compute else 0.4}"><title>{tooltip}</title></rect>'
    )
    label = bar_label(ev.node_name, width)
    if label is not None:
        text = svg.text(
            x0 + _BAR_LABEL_PAD_PX,
            y_px + _TRACK_H_PX / 2 + 4,
            label,
            size=_BAR_LABEL_SIZE_PX,
            fill="white" if is_compute else "#222",
        )
        # the label's box is the bar's, for a reader (and the browser test) to compare with
        bar += "\n" + text.replace("<text ", f'<text data-bar-x="{x0:.2f}" data-bar-width="{width:.2f}" ', 1)
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
        label = _format_ms(t_s * 1e3)
        parts.append(f'<line x1="{x:.1f}" y1="{y_px:.1f}" x2="{x:.1f}" y2="{y_px + 5:.1f}" stroke="#222"/>')
        parts.append(svg.text(x - svg.text_width_px(label, _TICK_SIZE_PX) / 2, y_px + 17, label, size=_TICK_SIZE_PX))
    parts.append(svg.text(_LABEL_W_PX + _PLOT_W_PX / 2 - 30, y_px + 31, "time (ms)", size=11))
    return "\n".join(parts)


def legend_entries(strands: Sequence[int], names: Mapping[int, str]) -> list[tuple[str, str]]:
    """``(SVG style, text)`` per legend entry: compute and communication of each strand, named
    by ``names`` (``strand_name``), then exposed communication."""
    entries: list[tuple[str, str]] = []
    for strand in strands:
        colour = strand_colour(strand)
        name = strand_name(strand, names)
        entries.append((f'fill="{colour}" stroke="white"', f"compute, {name}"))
        entries.append((f'fill="{_lighten(colour)}" stroke="{colour}" stroke-width="1.5"', f"communication, {name}"))
    entries.append((f'fill="url(#exposed)" stroke="{_EXPOSED_COLOUR}"', "exposed communication (compute stream waits)"))
    return entries


def _legend(entries: list[tuple[str, str]], y_px: float) -> tuple[str, float]:
    parts: list[str] = []
    x = 8.0
    for style, label in entries:
        width_px = 22 + svg.text_width_px(label, _LEGEND_SIZE_PX) + 16
        if x > 8.0 and x + width_px > _LABEL_W_PX + _PLOT_W_PX:
            x, y_px = 8.0, y_px + _LEGEND_ROW_H_PX
        parts.append(f'<rect x="{x:.1f}" y="{y_px:.1f}" width="16" height="12" {style}/>')
        parts.append(svg.text(x + 22, y_px + 10.5, label, size=_LEGEND_SIZE_PX))
        x += width_px
    return "\n".join(parts), y_px + _LEGEND_ROW_H_PX


def _format_ms(t_ms: float) -> str:
    return f"{t_ms:.4g}"


def _lighten(colour: str, amount: float = 0.6) -> str:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    mix = [round(c + (255 - c) * amount) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)
