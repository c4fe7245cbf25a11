"""Profiled segment pairs: ``P(F_i, B_j)`` measured by co-executing two segments on the live group.

The Strand Interleaving DP (``graph_passes.interleave``) prices a pair of segments, one from
each strand, by how long they take together: one strand's collective in flight while the
other strand's compute runs. The analytic formula assumes a contention factor; this module
measures it, as DHelix's profiler does.

Contract
--------
``segment_pair_times(profiled, fwd, bwd, runner=None, max_pairs=256, pairs=None) -> dict[(i, j), seconds]``

* ``profiled``: a :class:`PairProfiler` -- what a measurement needs of the profiled estimator
  (its signatures, skip reasons, real arguments, agreement group, warmup / repeats, and the
  memo); :class:`cost_model.profile.ProfiledEstimator` is one, and answers
  ``Estimator.segment_pair_times`` by calling this function with itself.
* ``fwd`` / ``bwd``: each strand's segments as node lists; keys ``(i, j)`` use ``None`` for "no
  segment of that strand" (a segment run alone). ``pairs``: the keys to measure and return
  (None: every pair); the interleave pass asks for those its DP can use
  (``strand_plan.usable_pairs``).
* A segment's *signature* is the tuple of ``profiled.signature`` of its compute and collective
  nodes, and of ``signatures.p2p_signature`` of its P2P transfers (the decompose pass's
  ``dhelix::exchange``: peers and tags left out, so every rank names its own transfer of a
  per-peer step alike). Segments with a node that cannot be measured (no live group, a fake
  group) get no entry: the caller keeps its formula for them. P2P transfers are measured
  here, in pairs, because the formula's perfect overlap is furthest from the truth for them:
  several smaller transfers, each with its own CPU work, under the other strand's compute.
* Pairs are deduplicated by signature (a transformer's layers repeat: a 32-layer model has a
  handful of distinct pairs), measured in first-appearance order, which every rank shares
  because every rank plans the same graph (checked: a mismatch raises, never hangs).
* One measurement of ``(F, B)``: after a barrier, run B's nodes then F's in order -- compute
  nodes on random inputs of their shapes, collective and P2P issues asynchronously (every rank
  runs the same segments in the same order, so each exchange meets its peer's) -- and wait
  for every transfer at the end; the median of ``profiled.repeats`` runs after
  ``profiled.warmup``, agreed across ranks by ``all_reduce(MAX)``.
* More distinct pairs than ``max_pairs`` (of those asked for): nothing is measured (``{}``).
* Results are memoized in ``profiled.pair_measurements`` for later compiles in the same
  process, never on disk: they include collectives, whose cost depends on the link.
* ``runner(fn)`` runs the measurement (``dhelix_compile`` passes one that leaves the compiler's
  fake-tensor mode); ``None`` runs it inline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import sympy
import torch
import torch.fx

from cost_model.comm_nodes import bound_args, resolve_process_group
from cost_model.op_kinds import kind_of
from cost_model.profile.running import device_of_nodes, median_run_or_nan_s, real_args, run_node, transfer_tensors
from cost_model.profile.signatures import p2p_signature
from cost_model.rank_agreement import FAILED_S, agree_max_s, backend_name, check_same_signatures
from cost_model.strand_plan import Pair
from cost_model.symbolic import size_hints

c10d = torch.ops._c10d_functional

Segment = Sequence[torch.fx.Node]
SegmentSignature = tuple[str, ...]


class PairProfiler(Protocol):
    """What measuring segment pairs needs of the profiled estimator."""

    warmup: int
    repeats: int
    pair_measurements: dict[tuple[SegmentSignature, SegmentSignature], float]
    """Seconds by (forward, backward) segment signature; ``FAILED_S``: the measurement failed on every rank."""

    def signature(self, node: torch.fx.Node) -> str | None: ...

    def skip_reason(self, node: torch.fx.Node) -> str | None: ...

    def real_args(
        self, node: torch.fx.Node, hints: dict[sympy.Symbol, int], is_collective: bool
    ) -> tuple[list[Any], dict[str, Any]]: ...

    def agreement_group(self) -> Any: ...


def _live_group_of_p2p(node: torch.fx.Node) -> Any:
    """The live process group a P2P transfer runs on; None for an unknown or fake group."""
    group = resolve_process_group(bound_args(node).get("group_name"))
    return None if group is None or backend_name(group) == "fake" else group


def segment_signature(profiled: PairProfiler, nodes: Segment) -> SegmentSignature | None:
    """The measured ops of a segment, or None if one of them cannot be measured."""
    parts: list[str] = []
    for node in nodes:
        kind = kind_of(node)
        if kind == "p2p":
            group = _live_group_of_p2p(node)
            if group is None:
                return None
            parts.append(p2p_signature(node, group))
            continue
        if kind not in ("compute", "collective"):
            continue
        reason = profiled.skip_reason(node)
        if reason == "free":
            continue
        if reason is not None:
            return None
        sig = profiled.signature(node)
        if sig is None:
            return None
        parts.append(sig)
    return tuple(parts)


def segment_pair_times(
    profiled: PairProfiler,
    fwd: Sequence[Segment],
    bwd: Sequence[Segment],
    *,
    runner: Callable[[Callable[[], Any]], Any] | None = None,
    max_pairs: int = 256,
    pairs: Collection[Pair] | None = None,
) -> dict[Pair, float]:
    """Measured ``P`` for every pair of segments, or for those in ``pairs`` (see the module docstring)."""
    fwd_sigs = [segment_signature(profiled, s) for s in fwd]
    bwd_sigs = [segment_signature(profiled, s) for s in bwd]
    # (segment index or None for "no segment", its signature): unmeasurable segments are left out.
    alone: list[tuple[int | None, SegmentSignature]] = [(None, ())]
    fwd_options = alone + [(i, s) for i, s in enumerate(fwd_sigs) if s is not None]
    bwd_options = alone + [(j, s) for j, s in enumerate(bwd_sigs) if s is not None]
    wanted = None if pairs is None else frozenset(pairs)
    first_of: dict[tuple[SegmentSignature, SegmentSignature], Pair] = {}
    key_of: dict[Pair, tuple[SegmentSignature, SegmentSignature]] = {}
    for i, fwd_sig in fwd_options:
        for j, bwd_sig in bwd_options:
            if (i is None and j is None) or (wanted is not None and (i, j) not in wanted):
                continue
            sig = (fwd_sig, bwd_sig)
            key_of[(i, j)] = sig
            first_of.setdefault(sig, (i, j))
    cache = profiled.pair_measurements
    todo = [sig for sig in first_of if sig not in cache]
    if len(first_of) > max_pairs:
        return {}
    group = profiled.agreement_group()
    check_same_signatures(["|".join(f) + "||" + "|".join(b) for f, b in todo], group)
    if todo:

        def measure_all() -> list[float]:
            times = []
            for sig in todo:
                i, j = first_of[sig]
                times.append(_measure_pair(profiled, fwd[i] if i is not None else (), bwd[j] if j is not None else ()))
            return agree_max_s(times, group)

        measured = runner(measure_all) if runner is not None else measure_all()
        for sig, t in zip(todo, measured, strict=True):
            cache[sig] = t
    return {key: cache[sig] for key, sig in key_of.items() if cache.get(sig, FAILED_S) != FAILED_S}


def _measure_pair(profiled: PairProfiler, fwd: Segment, bwd: Segment) -> float:
    """Median seconds of B's nodes then F's, collectives in flight until the end; NaN on failure."""
    calls: list[tuple[torch.fx.Node, list[Any], dict[str, Any], bool]] = []
    try:
        for node in (*bwd, *fwd):
            kind = kind_of(node)
            if kind not in ("compute", "collective", "p2p") or profiled.skip_reason(node) == "free":
                continue
            hints = size_hints([node, *node.all_input_nodes])
            if kind == "p2p":  # its own arguments name the group and peers: run as the graph would
                args, kwargs = real_args(node, hints)
            else:
                args, kwargs = profiled.real_args(node, hints, kind == "collective")
            calls.append((node, args, kwargs, kind != "compute"))
    except Exception:  # noqa: BLE001 - an op that cannot get inputs: not measurable
        return math.nan
    device = device_of_nodes([c[0] for c in calls])

    def run() -> None:
        in_flight: list[torch.Tensor] = []
        for node, args, kwargs, is_transfer in calls:
            out = run_node(node, args, kwargs)
            if is_transfer:
                in_flight.extend(transfer_tensors(out))
        for t in in_flight:
            c10d.wait_tensor(t)

    return median_run_or_nan_s(run, profiled.warmup, profiled.repeats, device, profiled.agreement_group())


__all__ = ["PairProfiler", "Segment", "SegmentSignature", "segment_pair_times", "segment_signature"]
