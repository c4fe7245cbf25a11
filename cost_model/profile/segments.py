"""Measured segments: a few nodes of a graph run for real, in order, with their dataflow.

The decompose pass chooses between a site as traced (a collective, its wait, the compute that
reads it) and its rewrites (per-peer exchanges in 1, 2 or 4 pieces over partitioned compute).
The simulator prices each from per-op times, but on a machine whose transfers take CPU from the
compute (gloo on CPU cores) a transfer in flight costs more than its own time, and more pieces
cost more than the model sees (measured: per-peer in 2 pieces 36% slower than in one on the
TP+SP reference model, predicted 1% faster). Running each candidate on the live group settles
it.

Contract
--------
``segment_times(profiled, segments, runner=None) -> list[float | None]``

* ``profiled``: a :class:`cost_model.profile.pairs.PairProfiler` (signatures, skip reasons,
  agreement group, warmup / repeats) with a ``segment_measurements`` memo.
* ``segments``: node lists, each in an order valid for running (a graph's order, or a pass's
  emitted order). A segment runs as a graph would: each node's inputs are the outputs of the
  nodes before it in the segment, inputs from outside it are random tensors of their shapes
  (``running.real_value``), collectives and P2P exchanges run on their live groups, waits
  wait. Anything still in flight at the end is waited for. The time is the median of
  ``repeats`` runs after ``warmup``, after a barrier, agreed across ranks by
  ``all_reduce(MAX)``. The segments of one call are the candidates of one choice: their runs
  are interleaved round by round (``running.median_runs_interleaved_s``), so a slow spell of
  the link falls on all of them, not on whichever ran in it.
* ``None`` for a segment that cannot be measured: an op outside torch's namespaces (it may
  have side effects), a collective or exchange without a live group (a fake group), or a run
  that raised on every rank (``rank_agreement.agree_max_s``: the ranks that measured set the
  time; every rank gets the same answer).
* Every rank must call it with the same segments (same signatures, same order): checked, a
  mismatch raises before anything is sent. Results are memoized by signature in
  ``profiled.segment_measurements`` (never on disk: they include the link).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.fx

from cost_model.op_kinds import kind_of
from cost_model.profile.pairs import PairProfiler, Segment, SegmentSignature, segment_signature
from cost_model.profile.running import (
    device_of_nodes,
    median_runs_interleaved_s,
    real_value,
    run_node,
    transfer_tensors,
)
from cost_model.rank_agreement import FAILED_S, agree_max_s, check_same_signatures
from cost_model.symbolic import size_hints

c10d = torch.ops._c10d_functional


class SegmentProfiler(PairProfiler, Protocol):
    """What measuring segments needs of the profiled estimator."""

    segment_measurements: dict[SegmentSignature, float]
    """Seconds by segment signature; ``FAILED_S``: the run failed on every rank."""


def segment_times(
    profiled: SegmentProfiler,
    segments: Sequence[Segment],
    *,
    runner: Callable[[Callable[[], Any]], Any] | None = None,
) -> list[float | None]:
    """Measured seconds of each segment run with its dataflow (see the module docstring)."""
    sigs = [_signature(profiled, s) for s in segments]
    cache = profiled.segment_measurements
    todo: list[tuple[SegmentSignature, Segment]] = []
    for sig, segment in zip(sigs, segments, strict=True):
        if sig is not None and sig not in cache and sig not in (t for t, _ in todo):
            todo.append((sig, segment))
    group = profiled.agreement_group()

    def measure_all() -> list[float]:  # the agreements too: a pass may call this under a fake-tensor mode
        check_same_signatures(["|".join(sig) for sig, _ in todo], group)
        return agree_max_s(_measure(profiled, [segment for _, segment in todo]), group)

    measured = runner(measure_all) if runner is not None else measure_all()
    for (sig, _), t in zip(todo, measured, strict=True):
        cache[sig] = t
    return [None if sig is None or cache[sig] == FAILED_S else cache[sig] for sig in sigs]


def _signature(profiled: PairProfiler, nodes: Segment) -> SegmentSignature | None:
    """The segment's measured ops, prefixed by its length (the dataflow runs every node)."""
    sig = segment_signature(profiled, nodes)
    return None if sig is None else (f"{len(nodes)} nodes", *sig)


def _measure(profiled: PairProfiler, segments: Sequence[Segment]) -> list[float]:
    """Median seconds of running each segment with its dataflow, the runs interleaved; NaN for
    one whose inputs cannot be made or whose run raised."""
    runs = [_run_of(nodes) for nodes in segments]
    runnable = [i for i, run in enumerate(runs) if run is not None]
    device = device_of_nodes(n for nodes in segments for n in nodes)
    measured = median_runs_interleaved_s(
        [run for run in runs if run is not None], profiled.warmup, profiled.repeats, device, profiled.agreement_group()
    )
    times = [math.nan] * len(segments)
    for i, t in zip(runnable, measured, strict=True):
        times[i] = t
    return times


def _run_of(nodes: Segment) -> Callable[[], None] | None:
    """One run of ``nodes`` with their dataflow on real inputs; None if an input cannot be made."""
    try:
        outside = _outside_inputs(nodes)
    except Exception:  # noqa: BLE001 - an input that cannot be made: not measurable
        return None
    transfers = [n for n in nodes if kind_of(n) in ("collective", "p2p")]

    def run() -> None:
        env: dict[torch.fx.Node, Any] = dict(outside)
        for node in nodes:
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = run_node(node, args, kwargs)
        for node in transfers:  # what the segment left in flight (waiting a waited tensor is a no-op)
            for t in transfer_tensors(env[node]):
                c10d.wait_tensor(t)

    return run


def _outside_inputs(nodes: Segment) -> dict[torch.fx.Node, Any]:
    """Real values for the nodes the segment reads but does not compute."""
    inside = set(nodes)
    hints = size_hints([i for n in nodes for i in (n, *n.all_input_nodes)])
    made: dict[torch.fx.Node, Any] = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp not in inside and inp not in made:
                made[inp] = real_value(inp, hints)
    return made


__all__ = ["SegmentProfiler", "segment_times"]
