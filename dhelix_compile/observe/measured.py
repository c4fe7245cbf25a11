"""Measured timelines: N calls of a compiled graph under ``torch.profiler``, cut into segments.

Contract
--------
``profile_first_steps(compiled, plan, steps, on_done)`` wraps a partition's *boxed* callable
(AOTAutograd's convention). The first call is a warm-up and runs unprofiled: it may do
one-time work (the process group's first use of a peer connection, the caching allocator
growing, lazy initialisation, CUDA graph recording) that would skew the median of a few. The next
``steps`` calls each run inside their own ``torch.profiler.profile`` session (CPU activity;
CUDA too when CUDA is available), marked by a ``record_function("dhelix::<graph>")`` span
around the call. After the last of them it hands a :class:`MeasuredTimeline` to ``on_done``
(``GraphDumper.write_measured`` writes the files) and from then on forwards every call
straight to ``compiled``: one attribute lookup and one Python call, no profiler. A call made
while another profiler is running (the user's own ``torch.profiler``) is not profiled and does
not count; a failure while reading the profile logs a warning and stops profiling --
measuring never fails a training step.

Segments
--------
The graph is cut at its communication *boundaries*: its collective / P2P issues and waits
(``cost_model.op_kinds.kind_of``: ``collective``, ``p2p``, ``wait``), in graph order
(:func:`comm_boundaries`). Segment ``i`` runs from the moment boundary ``i - 1`` returned (the
call's start for ``i = 0``) to the moment boundary ``i`` returned (the call's end for the
last segment). ``B`` boundaries give ``B + 1`` segments, their times add up to the whole call,
and each segment holds the compute before its closing boundary plus that boundary's own time --
for a wait, the time the caller sat blocked, i.e. exposed communication::

    call       |-- seg 0 --------|-- seg 1 -----------|-- seg 2 ----------|-- seg 3 --|
    host ops    mm  mul [all_reduce] mm relu mm [wait_tensor▒▒▒▒] sum add   ...      end
    boundaries             ^ all_reduce returned     ^ wait_tensor returned

* predicted (:func:`predicted_segments_s`): the simulator's compute-stream clock right after
  each boundary node of the scheduled order (an issue takes no stream time; a wait ends when
  its transfer does); the last segment ends at the makespan;
* measured (:func:`measure`): the end of each boundary's profiler event on the calling
  thread. The profiler events of the functional collectives (``_c10d_functional::all_reduce``,
  ``_c10d_functional::wait_tensor``, ...; the outermost ones, not the ``c10d::`` ops they
  call) are matched to the boundaries in order. Inductor's code calls the in-place and
  ``_out`` variants (``all_reduce_``, ``all_gather_into_tensor_out``), which match their
  functional op. When a call's events do not match the graph's boundaries one for one, that
  call only has its whole-call time, :attr:`MeasuredStep.mismatch` says why, and the table
  keeps only its whole-call row.

Per segment the rows give the predicted seconds, the median over the profiled steps of the
measured seconds, and their ratio (measured / predicted); the whole call gets a row too (its
measured value is the median of the step totals, not the sum of the segment medians).
:meth:`MeasuredTimeline.account` (``"account"`` in the numbers) says where the difference went:
segments that end at a wait (blocked on a transfer) against those that end at an issue
(compute), and the *per-call variation* -- the median call minus the sum of the segment
medians, time that lands in different segments in different calls::

    call 1:  |seg0|seg1|seg2▒▒▒▒|seg3|      medians: |seg0|seg1|seg2|seg3|   sum 4 units
    call 2:  |seg0|seg1▒▒▒▒|seg2|seg3|      median call: 5 units -> variation 1 unit
    call 3:  |seg0▒▒▒▒|seg1|seg2|seg3|      (each segment's median is its short time)
:meth:`MeasuredTimeline.gantt` turns the median call into a timeline ``timeline.gantt_svg``
draws like a predicted one (:func:`measured_sim_result`).

Clock: times are the host thread's. On CPU that is where compute and waits happen. On CUDA
the call ends with ``torch.cuda.synchronize()`` so the step total includes the device's work,
but the segment boundaries are host-side launch times (an NCCL wait does not block the host).
Profiling costs a few microseconds per recorded op, so measured times of tiny graphs run high.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.profiler import ProfilerActivity, profile, record_function

from cost_model import SimEvent, SimResult
from cost_model.op_kinds import COLLECTIVE_OPS, P2P_OP_NAMES, P2P_OPS, WAIT_OPS, NodeKind, kind_of, op_name
from cost_model.units import format_ms
from dhelix_compile import _torch_compat as compat
from dhelix_compile.observe.timeline import LabelledTimeline
from graph_passes.annotate import issue_of

log = logging.getLogger("dhelix")

#: Node kinds that cut a graph into segments.
BOUNDARY_KINDS: tuple[NodeKind, ...] = ("collective", "p2p", "wait")

#: Calls run unprofiled before the profiled ones (see the module docstring).
WARMUP_CALLS = 1

#: The profiler's category of the ``record_function`` span around one call, and of ops.
_ANNOTATION_CAT = "user_annotation"
_OP_CAT = "cpu_op"


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One communication node of the graph, where a segment ends.

    Attributes:
        node: the FX node's name (as in the graph dumps and the predicted trace).
        op: the op's name without namespace or overload, e.g. ``"all_gather_into_tensor"``.
        namespace: the op's namespace, e.g. ``"_c10d_functional"``.
        kind: ``"collective"``, ``"p2p"`` or ``"wait"``.
        issue: for a wait, the node name of the issue it waits on (``None`` if not found).
        strand: ``node.meta["dhelix"]["strand"]`` (0 when absent).
    """

    node: str
    op: str
    namespace: str
    kind: NodeKind
    issue: str | None = None
    strand: int = 0


def comm_boundaries(gm: torch.fx.GraphModule) -> tuple[Boundary, ...]:
    """The graph's collective / P2P issues and waits, in graph order."""
    found = []
    for node in gm.graph.nodes:
        kind = kind_of(node)
        if kind not in BOUNDARY_KINDS:
            continue
        namespace, _, op = _schema_name(node.target).partition("::")
        meta = node.meta.get("dhelix")
        strand = int(meta.get("strand", 0)) if isinstance(meta, dict) else 0
        issue_node = issue_of(node) if kind == "wait" else None
        issue = issue_node.name if issue_node is not None else None
        found.append(Boundary(node.name, op, namespace, kind, issue, strand))
    return tuple(found)


def _schema_name(target: Any) -> str:
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else str(target)


def base_op(name: str) -> str:
    """``"_c10d_functional::all_reduce_"`` -> ``"all_reduce"``: the functional op an event runs.

    Inductor calls the in-place (``all_reduce_``) and ``_out`` (``all_gather_into_tensor_out``)
    variants of the functional op in the graph.
    """
    op = name.rpartition("::")[2]
    op = op.removesuffix("_out")
    return op.rstrip("_")


@dataclasses.dataclass(frozen=True)
class Segment:
    """The span from one boundary returning to the next (``None``: the call's start / end)."""

    index: int
    start: str | None
    end: str | None

    @property
    def label(self) -> str:
        return f"{self.start or 'start'} \u2192 {self.end or 'end'}"


@dataclasses.dataclass(frozen=True)
class MeasurementPlan:
    """What to measure for one graph, fixed at compile time (before codegen rewrites the graph).

    Attributes:
        graph_name: the dump folder's graph name; the profiler span is ``dhelix::<graph_name>``.
        boundaries: :func:`comm_boundaries` of the graph that is compiled.
        predicted_segments_s: :func:`predicted_segments_s`, ``None`` without a prediction.
        predicted_step_s: the predicted makespan of the whole call, ``None`` without one.
    """

    graph_name: str
    boundaries: tuple[Boundary, ...]
    predicted_segments_s: tuple[float, ...] | None = None
    predicted_step_s: float | None = None

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, graph_name: str, predicted: SimResult | None) -> MeasurementPlan:
        """The plan of ``gm``; ``predicted`` is ``simulate(gm.graph, estimator)`` if there is one."""
        boundaries = comm_boundaries(gm)
        if predicted is None:
            return cls(graph_name, boundaries)
        order = [n.name for n in gm.graph.nodes]
        try:
            segments_s = predicted_segments_s(order, predicted, boundaries)
        except KeyError as exc:  # a prediction of another graph: measure without it
            log.warning("%s: the prediction does not cover node %s; measuring without it", graph_name, exc)
            return cls(graph_name, boundaries)
        return cls(graph_name, boundaries, segments_s, predicted.makespan_s)

    @property
    def marker(self) -> str:
        """Name of the ``record_function`` span around each profiled call."""
        return f"dhelix::{self.graph_name}"

    def segments(self) -> list[Segment]:
        names = [b.node for b in self.boundaries]
        starts: list[str | None] = [None, *names]
        ends: list[str | None] = [*names, None]
        return [Segment(i, s, e) for i, (s, e) in enumerate(zip(starts, ends))]


def predicted_segments_s(order: Sequence[str], result: SimResult, boundaries: Sequence[Boundary]) -> tuple[float, ...]:
    """Predicted seconds of each segment: the compute-stream clock after each boundary, differenced.

    ``order`` is the simulated order's node names. The clock after a node is the end of the
    last compute-stream event (compute or blocking wait) at or before it in the order.
    """
    stream_end = {ev.node_name: ev.end_s for ev in result.events if ev.resource == "compute"}
    clock_after: dict[str, float] = {}
    now_s = 0.0
    for name in order:
        now_s = max(now_s, stream_end.get(name, now_s))
        clock_after[name] = now_s
    instants = [0.0, *(clock_after[b.node] for b in boundaries), max(result.makespan_s, now_s)]
    return tuple(b - a for a, b in itertools.pairwise(instants))


# --------------------------------------------------------------------------- measuring one step


@dataclasses.dataclass(frozen=True)
class Span:
    """One profiler event on the calling thread, microseconds on the trace's clock."""

    name: str
    start_us: float
    end_us: float


@dataclasses.dataclass(frozen=True)
class MeasuredStep:
    """One profiled call.

    Attributes:
        call: the ``dhelix::<graph>`` span around the call.
        boundaries: the boundary ops' events, one per :attr:`MeasurementPlan.boundaries`,
            ``None`` when they did not match (see ``mismatch``).
        mismatch: why this step has no segment times, or ``None``.
    """

    call: Span
    boundaries: tuple[Span, ...] | None
    mismatch: str | None = None

    @property
    def step_s(self) -> float:
        return (self.call.end_us - self.call.start_us) * 1e-6

    def segments_s(self) -> list[float] | None:
        if self.boundaries is None:
            return None
        instants = [self.call.start_us, *(b.end_us for b in self.boundaries), self.call.end_us]
        return [(b - a) * 1e-6 for a, b in itertools.pairwise(instants)]


#: The communication ops an event may run (``base_op`` names): the namespace of a graph's boundaries
#: holds others too (``dhelix::grad_total`` beside ``dhelix::exchange``), which are compute.
_COMM_OPS = frozenset(
    base_op(name) for name in (*(op_name(op) for op in (*COLLECTIVE_OPS, *P2P_OPS, *WAIT_OPS)), *P2P_OP_NAMES)
)


def read_step(plan: MeasurementPlan, events: Sequence[dict[str, Any]]) -> MeasuredStep:
    """The call span and boundary events of one profiled call (``events``: Chrome trace events)."""
    calls = [
        e for e in events if e.get("ph") == "X" and e.get("cat") == _ANNOTATION_CAT and e.get("name") == plan.marker
    ]
    if len(calls) != 1:
        raise ValueError(f"{plan.marker}: expected one profiler span per call, found {len(calls)}")
    call = _span(calls[0])
    namespaces = {b.namespace for b in plan.boundaries}
    candidates = sorted(
        (
            _span(e)
            for e in events
            if e.get("ph") == "X"
            and e.get("cat") == _OP_CAT
            and e.get("tid") == calls[0].get("tid")
            and str(e.get("name", "")).partition("::")[0] in namespaces
            and base_op(str(e.get("name", ""))) in _COMM_OPS
        ),
        key=lambda s: (s.start_us, -s.end_us),
    )
    outermost: list[Span] = []
    for span in candidates:
        inside_call = call.start_us <= span.start_us and span.end_us <= call.end_us
        if inside_call and (not outermost or span.start_us >= outermost[-1].end_us):
            outermost.append(span)
    return MeasuredStep(call, *_match(plan.boundaries, outermost))


def _match(boundaries: Sequence[Boundary], spans: list[Span]) -> tuple[tuple[Span, ...] | None, str | None]:
    if len(spans) != len(boundaries):
        return None, f"the graph has {len(boundaries)} communication ops, the profile {len(spans)}"
    for i, (b, span) in enumerate(zip(boundaries, spans)):
        if base_op(span.name) != base_op(b.op):  # a merged graph may hold all_reduce_ too
            return None, f"communication op {i}: the graph has {b.op} ({b.node}), the profile {span.name}"
    return tuple(spans), None


def _span(event: dict[str, Any]) -> Span:
    start = float(event["ts"])
    return Span(str(event["name"]), start, start + float(event.get("dur", 0.0)))


# --------------------------------------------------------------------------- the result


@dataclasses.dataclass(frozen=True)
class SegmentRow:
    """Predicted vs measured seconds of one segment (or of the whole call: ``index`` is ``None``)."""

    index: int | None
    label: str
    predicted_s: float | None
    measured_s: float | None
    measured_steps_s: tuple[float, ...]

    @property
    def ratio(self) -> float | None:
        """measured / predicted; ``None`` when either is missing or the prediction is 0."""
        if self.predicted_s is None or self.measured_s is None or self.predicted_s <= 0:
            return None
        return self.measured_s / self.predicted_s

    def to_json(self) -> dict[str, Any]:
        return {
            "segment": self.index,
            "label": self.label,
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
            "ratio": self.ratio,
            "measured_steps_s": list(self.measured_steps_s),
        }


#: How many of the most variable segments :class:`CallAccount` names.
MOST_VARIABLE = 3


@dataclasses.dataclass(frozen=True)
class CallAccount:
    """Where a measured call's time went against its prediction, segment by segment.

    Segments are split by what closes them: a wait (``blocked_*``: compute, then the time the
    caller sat blocked on a transfer) or an issue / the call's end (``compute_*``: compute and
    issuing). ``segment_medians_s`` adds up each segment's median over the profiled calls: what a
    call takes when every segment takes its typical time. ``variation_s`` is the median call
    minus that sum: time lost because, in each call, some segments run long -- different ones
    in different calls (the operating system descheduling a rank, a transfer late by a
    scheduling quantum), which no per-segment number shows and the simulator does not model.
    ``most_variable``: ``(index, label, max - min seconds)`` of the segments whose time varied
    most between calls.

    ``verdict()`` says in one sentence which of the three is the gap.
    """

    predicted_s: float | None
    measured_s: float
    compute_predicted_s: float
    compute_measured_s: float
    blocked_predicted_s: float
    blocked_measured_s: float
    segment_medians_s: float
    variation_s: float
    most_variable: tuple[tuple[int, str, float], ...]

    def verdict(self) -> str:
        """The gap between measured and predicted, by part, largest first."""
        if self.predicted_s is None or self.predicted_s <= 0:
            return "no prediction"
        gaps = {
            "compute segments (ending at an issue)": self.compute_measured_s - self.compute_predicted_s,
            "blocked segments (ending at a wait)": self.blocked_measured_s - self.blocked_predicted_s,
            "per-call variation (segments running long in some calls, not in their median)": self.variation_s,
        }
        total = self.measured_s - self.predicted_s
        parts = "; ".join(
            f"{name} {format_ms(gap, 1)} ms" for name, gap in sorted(gaps.items(), key=lambda item: -abs(item[1]))
        )
        worst = ", ".join(f"#{index} ({format_ms(spread, 1)} ms)" for index, _, spread in self.most_variable)
        return (
            f"measured {format_ms(self.measured_s, 1)} ms against predicted {format_ms(self.predicted_s, 1)} ms "
            f"({format_ms(total, 1)} ms): {parts}" + (f"; most variable segments {worst}" if worst else "")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "compute_predicted_s": self.compute_predicted_s,
            "compute_measured_s": self.compute_measured_s,
            "blocked_predicted_s": self.blocked_predicted_s,
            "blocked_measured_s": self.blocked_measured_s,
            "segment_medians_s": self.segment_medians_s,
            "variation_s": self.variation_s,
            "most_variable": [
                {"segment": index, "label": label, "spread_s": spread} for index, label, spread in self.most_variable
            ],
            "verdict": self.verdict(),
        }


@dataclasses.dataclass(frozen=True)
class MeasuredTimeline:
    """The profiled calls of one graph; see the module docstring."""

    plan: MeasurementPlan
    steps: tuple[MeasuredStep, ...]
    trace: dict[str, Any]
    clock: str = "host"

    def rows(self) -> list[SegmentRow]:
        """One row per segment (when every step matched the graph), then the whole call."""
        per_step = [s.segments_s() for s in self.steps]
        rows: list[SegmentRow] = []
        if per_step and all(p is not None for p in per_step):
            predicted = self.plan.predicted_segments_s
            for seg in self.plan.segments():
                values = tuple(p[seg.index] for p in per_step if p is not None)
                rows.append(
                    SegmentRow(
                        seg.index,
                        seg.label,
                        predicted[seg.index] if predicted is not None else None,
                        statistics.median(values),
                        values,
                    )
                )
        totals = tuple(s.step_s for s in self.steps)
        rows.append(
            SegmentRow(
                None, "whole call", self.plan.predicted_step_s, statistics.median(totals) if totals else None, totals
            )
        )
        return rows

    def numbers(self) -> dict[str, Any]:
        """What ``predicted_vs_measured.json`` and ``summary.json["measured"]`` hold."""
        rows = self.rows()
        whole = rows[-1]
        mismatches = sorted({s.mismatch for s in self.steps if s.mismatch})
        account = self.account()
        return {
            "steps": len(self.steps),
            "clock": self.clock,
            "predicted_step_s": whole.predicted_s,
            "measured_step_s": whole.measured_s,
            "ratio": whole.ratio,
            "measured_steps_s": list(whole.measured_steps_s),
            "segments": [r.to_json() for r in rows[:-1]],
            "segments_note": "; ".join(mismatches) or None,
            "account": account.to_json() if account is not None else None,
        }

    def account(self) -> CallAccount | None:
        """Where the measured call's time went against the prediction (``None`` without segment
        times for every profiled call or without a prediction per segment)."""
        rows = self.rows()
        segments, whole = rows[:-1], rows[-1]
        if not segments or whole.measured_s is None or any(r.predicted_s is None for r in segments):
            return None
        closing = [b.kind for b in self.plan.boundaries] + [None]  # the last segment ends the call
        parts: dict[str, list[float]] = {"blocked": [0.0, 0.0], "compute": [0.0, 0.0]}
        for row, kind in zip(segments, closing, strict=True):
            part = parts["blocked" if kind == "wait" else "compute"]
            part[0] += row.predicted_s or 0.0
            part[1] += row.measured_s or 0.0
        spreads = sorted(
            ((max(r.measured_steps_s) - min(r.measured_steps_s), r) for r in segments if r.measured_steps_s),
            key=lambda item: (-item[0], item[1].index),
        )
        medians_s = math.fsum(r.measured_s or 0.0 for r in segments)
        return CallAccount(
            predicted_s=whole.predicted_s,
            measured_s=whole.measured_s,
            compute_predicted_s=parts["compute"][0],
            compute_measured_s=parts["compute"][1],
            blocked_predicted_s=parts["blocked"][0],
            blocked_measured_s=parts["blocked"][1],
            segment_medians_s=medians_s,
            variation_s=whole.measured_s - medians_s,
            most_variable=tuple((r.index or 0, r.label, spread) for spread, r in spreads[:MOST_VARIABLE]),
        )

    def median_step(self) -> int:
        """Index of the step whose total is the median (the lower one for an even count)."""
        order = sorted(range(len(self.steps)), key=lambda i: (self.steps[i].step_s, i))
        return order[(len(order) - 1) // 2]

    def gantt(self, step: int | None = None) -> LabelledTimeline:
        """One measured call as a timeline the Gantt chart draws (see :func:`measured_sim_result`)."""
        step = self.median_step() if step is None else step
        label = f"measured, profiled call {step + 1} of {len(self.steps)}"
        if len(self.steps) > 1 and step == self.median_step():
            label += " (median)" if len(self.steps) % 2 else " (lower median)"
        result = measured_sim_result(self.plan, self.steps[step])
        header = f"{label}: {format_ms(result.makespan_s, 3)} ms"
        if self.steps[step].boundaries is None:
            header += f", no segments ({self.steps[step].mismatch})" if self.steps[step].mismatch else ""
        elif self.plan.boundaries:
            header += (
                f", blocked in waits {format_ms(result.exposed_comm_s, 3)} ms; comm bars: issue → its wait returned"
            )
        return LabelledTimeline(label, result, header)


def measured_sim_result(plan: MeasurementPlan, step: MeasuredStep) -> SimResult:
    """One measured call in the simulator's terms, times from the call's start.

    Compute stream: one ``compute`` bar per segment (the host time between two boundaries),
    each issue op's own time as a ``compute`` bar, each wait op's time as a ``wait`` (exposed
    communication). Comm channels: each transfer as in flight from its issue's start until
    its wait returned (an upper bound of the transfer), on the first free channel.
    """
    t0 = step.call.start_us

    def s(us: float) -> float:
        return (us - t0) * 1e-6

    events: list[SimEvent] = []
    if step.boundaries is None:
        events.append(SimEvent("whole call (no segments)", "compute", "compute", 0.0, s(step.call.end_us)))
        return SimResult(s(step.call.end_us), s(step.call.end_us), 0.0, 0.0, 0, tuple(events))
    segments = plan.segments()
    prev_end = t0
    for seg, boundary, span in zip(segments, plan.boundaries, step.boundaries):
        if span.start_us > prev_end:
            events.append(
                SimEvent(f"segment {seg.index}", "compute", "compute", s(prev_end), s(span.start_us), boundary.strand)
            )
        kind = "wait" if boundary.kind == "wait" else "compute"
        events.append(SimEvent(boundary.node, kind, "compute", s(span.start_us), s(span.end_us), boundary.strand))
        prev_end = span.end_us
    if step.call.end_us > prev_end:
        last = segments[-1]
        events.append(SimEvent(f"segment {last.index}", "compute", "compute", s(prev_end), s(step.call.end_us)))
    issued = {b.node: (b, span) for b, span in zip(plan.boundaries, step.boundaries) if b.kind != "wait"}
    transfers: list[tuple[float, float, Boundary]] = []
    for b, span in zip(plan.boundaries, step.boundaries):
        if b.kind == "wait" and b.issue in issued:
            issue, issue_span = issued.pop(b.issue)
            transfers.append((issue_span.start_us, span.end_us, issue))
    for issue, issue_span in issued.values():  # never waited on in this graph: until the call ends
        transfers.append((issue_span.start_us, step.call.end_us, issue))
    channel_free: list[float] = []
    for start, end, issue in sorted(transfers, key=lambda t: (t[0], t[1])):
        channel = next((c for c, free in enumerate(channel_free) if free <= start), len(channel_free))
        if channel == len(channel_free):
            channel_free.append(end)
        channel_free[channel] = end
        events.append(SimEvent(issue.node, issue.kind, f"comm{channel}", s(start), s(end), issue.strand))
    compute_s = math.fsum(e.end_s - e.start_s for e in events if e.resource == "compute" and e.kind != "wait")
    return SimResult(
        makespan_s=s(step.call.end_us),
        compute_s=compute_s,
        comm_s=math.fsum(e.end_s - e.start_s for e in events if e.resource != "compute"),
        exposed_comm_s=math.fsum(e.end_s - e.start_s for e in events if e.kind == "wait"),
        peak_memory_bytes=0,
        events=tuple(events),
    )


def measure(plan: MeasurementPlan, traces: Sequence[dict[str, Any]], clock: str = "host") -> MeasuredTimeline:
    """The :class:`MeasuredTimeline` of one Chrome trace (profiler export) per profiled call."""
    steps = tuple(read_step(plan, t["traceEvents"]) for t in traces)
    return MeasuredTimeline(plan, steps, merged_trace(plan, traces, steps), clock)


# --------------------------------------------------------------------------- the trace file


def merged_trace(
    plan: MeasurementPlan, traces: Sequence[dict[str, Any]], steps: Sequence[MeasuredStep]
) -> dict[str, Any]:
    """The profiled calls' traces as one Chrome / Perfetto trace, plus a ``dhelix`` process.

    Times are rebased so the first event is at 0 (``baseTimeNanoseconds`` moves with them, so
    wall-clock times stay right). Metadata events (``ph="M"``) appear once. The ``dhelix``
    process has a ``profiled calls`` track and a ``segments (measured)`` track whose slices are
    each call's segments, with the predicted and measured milliseconds in ``args``.
    """
    t0_us = min((float(e["ts"]) for t in traces for e in t["traceEvents"] if "ts" in e), default=0.0)
    events: list[dict[str, Any]] = []
    seen_metadata: set[str] = set()
    pids: list[int] = []
    for trace in traces:
        for event in trace["traceEvents"]:
            event = dict(event)
            if isinstance(event.get("pid"), int):
                pids.append(event["pid"])
            if event.get("ph") == "M":
                key = json.dumps(
                    [event.get("name"), event.get("pid"), event.get("tid"), event.get("args")], sort_keys=True
                )
                if key in seen_metadata:
                    continue
                seen_metadata.add(key)
            if "ts" in event:
                event["ts"] = float(event["ts"]) - t0_us
            events.append(event)
    pid = max(pids, default=0) + 1
    events.extend(_segment_events(plan, steps, pid, t0_us))
    merged = {k: v for k, v in (traces[0] if traces else {}).items() if k != "traceEvents"}
    if "baseTimeNanoseconds" in merged:
        merged["baseTimeNanoseconds"] = int(merged["baseTimeNanoseconds"]) + round(t0_us * 1000)
    merged["displayTimeUnit"] = "ms"
    merged["traceEvents"] = events
    return merged


def _segment_events(
    plan: MeasurementPlan, steps: Sequence[MeasuredStep], pid: int, t0_us: float
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"dhelix: {plan.graph_name}"}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": -1}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "profiled calls"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "segments (measured)"}},
    ]
    predicted = plan.predicted_segments_s
    segments = plan.segments()
    for n, step in enumerate(steps):
        events.append(
            {
                "name": f"profiled call {n + 1}",
                "cat": "dhelix_call",
                "ph": "X",
                "pid": pid,
                "tid": 0,
                "ts": step.call.start_us - t0_us,
                "dur": step.call.end_us - step.call.start_us,
                "args": {
                    "measured_ms": step.step_s * 1e3,
                    "predicted_ms": _ms(plan.predicted_step_s),
                    "mismatch": step.mismatch,
                },
            }
        )
        if step.boundaries is None:
            continue
        instants = [step.call.start_us, *(b.end_us for b in step.boundaries), step.call.end_us]
        for seg, (start_us, end_us) in zip(segments, itertools.pairwise(instants)):
            events.append(
                {
                    "name": seg.label,
                    "cat": "dhelix_segment",
                    "ph": "X",
                    "pid": pid,
                    "tid": 1,
                    "ts": start_us - t0_us,
                    "dur": end_us - start_us,
                    "args": {
                        "segment": seg.index,
                        "measured_ms": (end_us - start_us) * 1e-3,
                        "predicted_ms": _ms(predicted[seg.index] if predicted is not None else None),
                    },
                }
            )
    return events


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# --------------------------------------------------------------------------- the wrapper


def profile_first_steps(
    compiled: Callable[[list[Any]], Any],
    plan: MeasurementPlan,
    steps: int,
    on_done: Callable[[MeasuredTimeline], None],
    *,
    warmup_calls: int = WARMUP_CALLS,
) -> FirstStepsProfiler:
    """A boxed callable running ``compiled``; after ``warmup_calls`` calls, ``steps`` calls are profiled.

    See the module docstring.
    """
    if steps < 1:
        raise ValueError(f"profile_first_steps: steps must be >= 1, got {steps}")
    if warmup_calls < 0:
        raise ValueError(f"profile_first_steps: warmup_calls must be >= 0, got {warmup_calls}")
    return FirstStepsProfiler(compiled, plan, steps, on_done, warmup_calls)


class FirstStepsProfiler:
    """The boxed callable of :func:`profile_first_steps`."""

    def __init__(
        self,
        compiled: Callable[[list[Any]], Any],
        plan: MeasurementPlan,
        steps: int,
        on_done: Callable[[MeasuredTimeline], None],
        warmup_calls: int,
    ) -> None:
        self._compiled = compiled
        # an instance attribute: AOTAutograd wraps the backward with functools.wraps, which copies __dict__
        self._boxed_call = True
        self._plan = plan
        self._steps = steps
        self._on_done = on_done
        self._warmup_left = warmup_calls
        self._traces: list[dict[str, Any]] = []
        self._warned_busy = False
        self._call: Callable[[list[Any]], Any] = self._profiled_call

    def __call__(self, args: list[Any]) -> Any:
        return self._call(args)

    def __getattr__(self, name: str) -> Any:
        # attributes AOTAutograd or Inductor look up on the compiled callable
        if name.startswith("__") or name == "_compiled":
            raise AttributeError(name)
        return getattr(self._compiled, name)

    @property
    def profiling(self) -> bool:
        """True until the last profiled call finished (or profiling failed)."""
        return self._call is not self._compiled

    def _profiled_call(self, args: list[Any]) -> Any:
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return self._compiled(args)
        if _a_profiler_is_running():
            if not self._warned_busy:
                log.warning("%s: another profiler is running; this call is not profiled", self._plan.graph_name)
                self._warned_busy = True
            return self._compiled(args)
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof, record_function(self._plan.marker):
            out = self._compiled(args)
            if cuda:
                torch.cuda.synchronize()
        try:
            self._traces.append(_export(prof))
            if len(self._traces) == self._steps:
                self._call = self._compiled
                traces, self._traces = self._traces, []
                self._on_done(measure(self._plan, traces))
        except Exception as exc:  # noqa: BLE001 - measuring must not fail a training step
            log.warning("%s: reading the profile failed, profiling stopped: %s", self._plan.graph_name, exc)
            self._call = self._compiled
            self._traces = []
        return out


def _a_profiler_is_running() -> bool:
    """Whether a torch profiler session is on; nesting one inside it silently breaks both."""
    return compat.profiler_running()


def _export(prof: profile) -> dict[str, Any]:
    """The profile as a Chrome trace dict (the profiler only exports to a file)."""
    with tempfile.TemporaryDirectory(prefix="dhelix_profile_") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())
