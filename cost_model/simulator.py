"""Simulate an ordered graph on one compute stream and N communication channels.

Contract
--------
``simulate(order, estimator)`` walks the nodes in the given order (a valid topological
order is the caller's job) and places each on a resource:

* **compute** nodes run on the single compute stream, one after the other, starting
  when the stream is free and their inputs are ready;
* **collective / P2P issue** nodes are issued at the compute stream's current time; the
  issuing itself takes ``NodeCost.issue_s`` of stream time (0 for most; a P2P exchange copies
  its payload on the caller's thread first), run like compute; the
  transfer starts when that is done, its inputs are ready and a channel is free (the channel
  that frees first, lowest index on ties), and lasts ``NodeCost.time_s``;
* **wait** nodes block the compute stream until the transfer they wait on has finished
  (a wait's completion is its collective's transfer end);
* views and other free nodes take no time; their output is ready when their inputs are.

Contention: compute that runs while at least one transfer is in flight progresses
``contention_factor`` times slower: the transfer's own (``NodeCost.contention_factor``, where
the estimator measured one for its kind; the largest of overlapping transfers), else
``simulate(..., contention_factor=)``, else the estimator's ``contention_factor`` (1.0 for
estimators without contention)::

    timeline of one compute node of work w starting at t0:
      outside transfers: 1 s of wall time does 1 s of work
      inside a transfer: 1 s of wall time does 1/f s of work

Transfers never start later because of compute, so every transfer interval is fixed
when it is issued and compute that follows sees all of them.

Result (all seconds):

* ``makespan_s``: end of the last compute or transfer;
* ``compute_s``: sum of compute ``time_s`` and of issue ``issue_s``, *un-slowed* --
  independent of the order;
* ``comm_s``: sum of transfer times;
* ``exposed_comm_s``: time the compute stream sits idle waiting for a transfer (at a
  wait, or at a node whose input is a transfer still in flight). It is at most
  ``comm_s``; ``comm_s - exposed_comm_s`` is not all hidden, some can run after the last
  compute node and only extends the makespan;
* ``contention_s``: extra compute time caused by the slowdown;
* ``peak_memory_bytes``: peak live bytes in this order (:mod:`cost_model.memory`);
* ``events``: one :class:`SimEvent` per compute node, transfer, and wait that blocked.

The simulation is deterministic: no sets, no ids, ties broken by channel index.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from cost_model.estimator import Estimator, NodeCost
from cost_model.memory import live_bytes_profile
from cost_model.nodes import node_list
from cost_model.op_kinds import is_comm

aten = torch.ops.aten


@dataclass(frozen=True)
class SimEvent:
    """One interval on one resource.

    Attributes:
        node_name: the FX node.
        kind: its ``NodeCost.kind``.
        resource: ``"compute"`` or ``"comm0"``, ``"comm1"``...
        start_s / end_s: interval (a wait's interval is the time it blocked).
        strand: ``node.meta["dhelix"]["strand"]`` (0 when absent).
    """

    node_name: str
    kind: str
    resource: str
    start_s: float
    end_s: float
    strand: int = 0


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate` (see the module docstring for each field)."""

    makespan_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    peak_memory_bytes: int
    events: tuple[SimEvent, ...]
    contention_s: float = 0.0
    held_peak_bytes: int | None = None
    """The peak above the graph inputs the order never frees (``memory.LiveProfile``); None
    where the result was not simulated from an order."""

    def to_chrome_trace(self) -> dict[str, Any]:
        """Events as a Chrome / Perfetto trace (``json.dump`` it; microseconds)."""
        resources: list[str] = []
        for ev in self.events:
            if ev.resource not in resources:
                resources.append(ev.resource)
        tid = {r: i for i, r in enumerate(sorted(resources, key=_resource_key))}
        trace = [
            {
                "name": ev.node_name,
                "cat": ev.kind,
                "ph": "X",
                "pid": 0,
                "tid": tid[ev.resource],
                "ts": ev.start_s * 1e6,
                "dur": (ev.end_s - ev.start_s) * 1e6,
                "args": {"strand": ev.strand},
            }
            for ev in self.events
        ]
        names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": r}} for r, i in tid.items()]
        return {"traceEvents": names + trace, "displayTimeUnit": "ms"}


def _resource_key(resource: str) -> tuple[int, int]:
    if resource == "compute":
        return (0, 0)
    return (1, int(resource.removeprefix("comm") or 0))


def _strand(node: torch.fx.Node) -> int:
    meta = node.meta.get("dhelix")
    if isinstance(meta, dict):
        return int(meta.get("strand", 0))
    return 0


class _BusyIntervals:
    """Where transfers are in flight: sorted, disjoint ``[start, end)`` pieces, each with the
    compute slowdown inside it (where transfers overlap, the largest of their factors)."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.factors: list[float] = []

    def add(self, start: float, end: float, factor: float) -> None:
        if end <= start:
            return
        i = bisect.bisect_right(self.ends, start)  # the first piece ending after ``start``
        j = bisect.bisect_left(self.starts, end)  # the first piece starting at or after ``end``
        pieces: list[tuple[float, float, float]] = []
        t = start
        for s, e, f in zip(self.starts[i:j], self.ends[i:j], self.factors[i:j]):
            if s < start:  # the part before the new transfer keeps its factor
                pieces.append((s, start, f))
            if t < s:  # a gap the new transfer alone covers
                pieces.append((t, s, factor))
            pieces.append((max(s, start), min(e, end), max(f, factor)))
            if e > end:
                pieces.append((end, e, f))
            t = max(t, e)
        if t < end:
            pieces.append((t, end, factor))
        self.starts[i:j] = [p[0] for p in pieces]
        self.ends[i:j] = [p[1] for p in pieces]
        self.factors[i:j] = [p[2] for p in pieces]

    def finish_time(self, start: float, work: float) -> float:
        """Wall time at which ``work`` seconds of compute started at ``start`` finish."""
        if work <= 0:
            return start
        if not self.starts:
            return start + work
        t = start
        remaining = work
        i = bisect.bisect_right(self.ends, t)
        while remaining > 0:
            if i >= len(self.starts):
                return t + remaining
            s, e, factor = self.starts[i], self.ends[i], self.factors[i]
            if t < s:  # free gap before the next busy piece
                gap = s - t
                if remaining <= gap:
                    return t + remaining
                remaining -= gap
                t = s
            # inside [max(t, s), e): slowed
            span = e - t
            if remaining * factor <= span:
                return t + remaining * factor
            remaining -= span / factor
            t = e
            i += 1
        return t


def simulate(
    nodes: Sequence[torch.fx.Node] | torch.fx.Graph,
    estimator: Estimator,
    *,
    num_comm_channels: int = 1,
    contention_factor: float | None = None,
    freeable_inputs: Collection[torch.fx.Node] = (),
) -> SimResult:
    """Simulate ``nodes`` in order (see the module docstring for the model); ``freeable_inputs``:
    graph inputs the order may free after their last reader (``memory.live_bytes_profile``)."""
    if num_comm_channels < 1:
        raise ValueError(f"num_comm_channels must be >= 1, got {num_comm_channels}")
    factor = float(estimator.contention_factor if contention_factor is None else contention_factor)
    if factor < 1.0:
        raise ValueError(f"contention_factor must be >= 1.0, got {factor}")
    order = node_list(nodes)
    costs: dict[torch.fx.Node, NodeCost] = {node: estimator.node_cost(node) for node in order}

    ready: dict[torch.fx.Node, float] = {}
    from_transfer: dict[torch.fx.Node, bool] = {}  # output produced by an unfinished transfer
    channel_free = [0.0] * num_comm_channels
    busy = _BusyIntervals()
    events: list[SimEvent] = []
    now = 0.0  # compute stream
    makespan = 0.0
    # Totals are summed with math.fsum (exactly rounded), so they do not depend on order.
    compute_parts: list[float] = []
    comm_parts: list[float] = []
    exposed_parts: list[float] = []

    for node in order:
        cost = costs[node]
        inputs = node.all_input_nodes
        inputs_ready = max((ready.get(i, 0.0) for i in inputs), default=0.0)
        strand = _strand(node)
        if cost.kind == "compute":
            start = max(now, inputs_ready)
            if start > now and any(from_transfer.get(i, False) for i in inputs):
                exposed_parts.append(start - now)
            end = busy.finish_time(start, cost.time_s)
            compute_parts.append(cost.time_s)
            if cost.time_s > 0:
                events.append(SimEvent(node.name, cost.kind, "compute", start, end, strand))
            now = end
            ready[node] = end
            from_transfer[node] = False
        elif is_comm(cost.kind):
            if cost.issue_s > 0:  # the issuing thread's own work, before the transfer leaves
                issued = busy.finish_time(now, cost.issue_s)
                compute_parts.append(cost.issue_s)
                events.append(SimEvent(node.name, "issue", "compute", now, issued, strand))
                now = issued
            channel = min(range(num_comm_channels), key=lambda c: (channel_free[c], c))
            start = max(now, inputs_ready, channel_free[channel])
            end = start + cost.time_s
            channel_free[channel] = end
            busy.add(start, end, factor if cost.contention_factor is None else max(1.0, cost.contention_factor))
            comm_parts.append(cost.time_s)
            if cost.time_s > 0:
                events.append(SimEvent(node.name, cost.kind, f"comm{channel}", start, end, strand))
            ready[node] = end
            from_transfer[node] = True
        elif cost.kind == "wait":
            done = max(now, inputs_ready)
            if done > now:
                exposed_parts.append(done - now)
                events.append(SimEvent(node.name, cost.kind, "compute", now, done, strand))
            now = done
            ready[node] = done
            from_transfer[node] = False
        else:  # view / other: free, aliases keep the readiness of what they view
            ready[node] = inputs_ready
            from_transfer[node] = any(from_transfer.get(i, False) for i in inputs)
        makespan = max(makespan, now, ready[node])

    makespan = max([makespan, now, *channel_free])

    def allocated(node: torch.fx.Node) -> int:
        cost = costs.get(node)
        return (cost if cost is not None else estimator.node_cost(node)).output_bytes

    memory = live_bytes_profile(order, allocated, freeable_inputs=freeable_inputs)
    compute_s = math.fsum(compute_parts)
    busy_compute_s = math.fsum(e.end_s - e.start_s for e in events if e.kind in ("compute", "issue"))
    return SimResult(
        makespan_s=makespan,
        compute_s=compute_s,
        comm_s=math.fsum(comm_parts),
        exposed_comm_s=math.fsum(exposed_parts),
        peak_memory_bytes=memory.peak_bytes,
        events=tuple(events),
        contention_s=max(0.0, busy_compute_s - compute_s),
        held_peak_bytes=memory.held_peak_bytes,
    )
