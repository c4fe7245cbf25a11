"""The profiled estimator: a graph's ops and collectives measured on the live device and group.

Contract
--------
``ProfiledEstimator(base, cache_dir, process_group)`` answers ``node_cost`` like ``base``,
except that a node whose *signature* has been measured gets the measured time.
``calibrate(gm)`` does the measuring::

    sigs   = unique signatures of the graph's compute and collective nodes, graph order
    check  every rank has the same list (hash agreed via all_reduce)  -> else RuntimeError
    need   = signatures missing on *any* rank (all_reduce MAX of flags) from what this
             process measured before and, for compute ops only, the disk cache's settled
             entries (``cache.settled``: measured by two calibrations)
    for sig in need (graph order, same on every rank):
        compute:    real tensors of the node's shapes/strides/dtypes (size hints for
                    symbols), ``warmup`` calls, then the median of ``repeats`` timed calls
                    (one warm-up and at most three timed calls for an op whose first call
                    takes 10 ms or more: ``running.median_op_run_or_nan_s``);
                    the lower of that and the cache's earlier measurement at the machine's
                    speed now, if there is one (``speed``)
        collective: the same on the live process group (barrier first, wait included)
    speed  the disk cache keeps each op's lowest time: the machine at its fastest, and a
           machine's speed drifts from day to day (this project's CPU VM ran a ``bmm`` cached at
           3.2 ms in 3.7-4.3 ms on 2026-11-27, and the cached times priced the MoE layer's
           profiled steps at 0.70-0.75x of their measured time on loopback, where no transfer
           slows them). Where this call takes times
           from the cache, it measures its SPEED_PROBES slowest cached ops again (graph order on
           ties; not counted as measured) and speed = the median of now / cached over every
           probe of this process. Each compute time with a cache entry becomes
           min(measured now (if it was), cached lowest x speed); one without keeps its
           measurement. The probes' times join their cache entries (the lowest stand)
    again  every collective and exchange measured above, measured once more after all of
           them, in the same order: the lower median stands. A transfer's time on a link
           shared with other traffic comes in epochs: on this project's emulated link a
           256 KiB all-to-all took about 1 ms, and 4-10 ms for a few hundred ms at a time
           (every call of a measurement that fell in one), which priced one collective 4x
           its neighbour of the same bytes
    stalls every compute op whose time (measured now, or from the cache or this process) is
           above STALL_RATIO times what the graph's typical ratio (measured / base estimate,
           the median over its compute ops) makes of its base estimate, plus STALL_OVERHEAD_S,
           measured once more, here (once per op and process: an op the base model misprices
           stays above the line in every graph that holds it: HF Llama TP's two helix variants
           in one bench spent 5 s of their 26 calibrations measuring ops again): the lower
           stands and joins the op's cache entry. A compute op's time only ever errs high,
           and rarely by 30-40x: on this project's CPU machine a 655k-element ``neg``
           was settled in the cache at 7.6 ms (two calibrations) that takes 0.19 ms, and a
           fresh calibration timed a 1280-element ``mul`` at 4.1 ms that takes 0.12 ms. The
           ``neg`` priced the MoE layer's merged graph 16 ms above its compute, and its plan
           left an all-to-all of 12 ms exposed. Those two were 10x and 16x the typical ratio;
           honest ops reach 17x only where the call's own overhead (tens of microseconds)
           dominates a tiny op, which the added STALL_OVERHEAD_S covers, and otherwise stay
           within 2.5x of it (a MoE layer's forward and backward). Each rank measures its own
           (no transfer is involved)
    times  = all_reduce(MAX) over ranks of every signature's time -> every rank plans the
             same schedule from the same numbers
    contention factors (optional), one per kind of transfer (``profile.contention``): a
             measured compute op timed alone and with all_reduces ("reduce") or all-to-alls
             ("move") in flight on the group throughout; ratio, agreed by MAX. A kind's factor
             is the median of every one measured in this process (each graph measures with
             its own slowest op and largest transfer, until ``contention.MAX_FACTORS`` of the
             kind are measured): one measurement varies by up to 1.2x
             from the next on this project's CPU machine, more than from op to op, and a
             merged graph priced with a low one was predicted 17% short of its measured time.
             Each transfer's ``NodeCost.contention_factor`` is its kind's (a gloo reduce-scatter,
             sent as an all-to-all whose adding runs after the wait, is a "move":
             ``running.scatter_sent_as_all_to_all``); ``contention_factor`` the largest
    cpu share  per measured transfer: the CPU its transfer threads (gloo's,
             ``profile.threads``) ran during each timed run over the run's wall time, median,
             agreed by MAX (``transfer_cpu_shares``); per kind, the stand-in's own
             (``standin_cpu_shares``, pooled like the factors). Where those threads run on
             cores the compute needs (``transfers_take_compute_cpu``: a CPU device, and every
             core runs a rank's compute, ``threads.compute_fills_cores``; on any rank, agreed),
             the compute keeps only the rest of its core while a transfer is in flight. The
             kind's factor holds the stand-in's share, so a transfer's factor is
             kind's x (1 - stand-in share) / (1 - its share), at least 1 (shares at most
             MAX_CPU_SHARE): a transfer whose threads take more of the core than the stand-in's
             1 MiB all-to-alls slows the compute more. On this project's 2-core machine the
             reference transformer's many smaller collectives kept gloo's threads busy 68 ms per
             step beside 278 ms of compute thread, and its merged graph ran about 93 ms per call
             against 67.6 predicted without this (2026-11-27, `f544563`, a 2-core Intel Xeon)
    write the compute ops' measurements to the cache (JSON, one file per device, atomically
             replaced; ``cost_model.profile.cache``)
    progress bar (cost_model.progress): rank 0 only; ``progress=None`` shows it when stderr
             is a terminal and at least 8 signatures are measured

Collectives are never cached on disk: their time depends on the link, which nothing in
the key names (the same shapes on NVLink, InfiniBand or a rate-limited veth). Nor are contention
factors, for the same reason: a transfer's CPU per second grows with its rate, so a factor
measured over loopback (a test's) is not the one on a 1 Gbit/s link: a cached factor gave a bench
on the link 1.0 for both kinds, where compute under a 1 MiB all-reduce on that link measured
1.2-1.3x slower (2026-11-25). Both are measured once per process
(``self.measurements``, ``_contention_cache``).

P2P exchanges (``dhelix::exchange``, which the decompose pass creates and hands to
``measure_new``) on a live group are measured like collectives, each rank running its own
transfer of the signature (``signatures.p2p_signature``: peers and tag left out), and give two
numbers: the *issue* -- the seconds the call itself takes on the calling thread (copying the
payload and handing it to the backend: 0.4-1.7 ms for 0.5-8 MiB on this project's CPU
machine) -- and the whole, issue to both halves done. ``NodeCost.issue_s``
is the issue (agreed by MAX), ``time_s`` the rest.

Nodes that cannot be measured (unknown groups, a fake process group, an op that raises on
random inputs) keep the base estimate; ``CalibrationReport.skipped`` counts why. P2P
transfers that are not measured get the base estimate times ``link_scale``, the median over every collective measured so far of
measured / base time -- the link as measured, agreed like the times it comes from.
The decompose pass measures its variants' new nodes (``measure_new``) before it prices them. A compute node that was never measured gets the base estimate times ``compute_scale``: the
median measured / base time of the measured nodes of its op (of all compute nodes when none
has it), so that a half-size matmul costs about half the measured whole one rather than the
base model's peak-FLOP guess.
With the measured time ``t`` and the base estimate ``b(sizes)``, ``time_expr`` becomes
``b(sizes) * t / b(hints)``: exact at the hints, the base model's growth elsewhere.

The pieces: signatures :mod:`cost_model.profile.signatures`, the disk cache
:mod:`cost_model.profile.cache`, running a node alone :mod:`cost_model.profile.running`, the
contention factor :mod:`cost_model.profile.contention`, segment pairs
(``segment_pair_times``) :mod:`cost_model.profile.pairs`, segments run with their dataflow
(``segment_times``, the decompose pass's candidates) :mod:`cost_model.profile.segments`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import sympy
import torch
import torch.fx

from cost_model import compile_clock
from cost_model.comm_nodes import bound_args, describe_comm, resolve_group_size, resolve_process_group
from cost_model.estimator import Estimator, EstimatorBase, NodeCost
from cost_model.memory import is_schema_view
from cost_model.nodes import NodesLike, call_target, node_list
from cost_model.op_kinds import P2P_OP_NAMES, PURE_OP_NAMES, kind_of, op_name
from cost_model.profile.cache import MeasurementCache, cached_seconds, device_key, settled, with_sample
from cost_model.profile.contention import (
    CONTENTION_KEY_PREFIX,
    TRANSFERS,
    Transfer,
    factors_of,
    measure_contention,
    transfer_of,
)
from cost_model.profile.pairs import SegmentSignature, segment_pair_times, segment_signature
from cost_model.profile.replay import MeasurementLog, call_key, state_delta
from cost_model.profile.running import (
    device_of_nodes,
    median_op_run_or_nan_s,
    median_run_or_nan_s,
    real_args,
    run_node,
    scatter_sent_as_all_to_all,
    transfer_tensors,
)
from cost_model.profile.segments import segment_times
from cost_model.profile.signatures import (
    collective_signature,
    compute_signature,
    is_collective_signature,
    p2p_signature,
)
from cost_model.profile.threads import compute_fills_cores, gloo_thread_ids, threads_cpu_s
from cost_model.progress import item_label, progress_bar
from cost_model.rank_agreement import FAILED_S, agree_max, agree_max_s, backend_name, check_same_signatures
from cost_model.strand_plan import Pair
from cost_model.symbolic import size_hints, tensors_in

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

#: ``progress=None`` shows the bar from this many measurements on (and only on a terminal).
PROGRESS_MIN_MEASUREMENTS: int = 8


@dataclass(frozen=True)
class CalibrationReport:
    """What :meth:`ProfiledEstimator.calibrate` did.

    Attributes:
        measured: signatures measured in this call.
        cached: signatures taken from the disk cache.
        skipped: reason -> number of nodes left to the base estimate.
        contention_factor: the largest compute slowdown over the kinds of transfer, each
            kind's the median of this process's measurements so far (None if this call
            measured none).
        seconds: wall time of the calibration.
        measured_again: compute signatures measured once more as stalled (module docstring:
            ``stalls``).
        speed: how much slower this machine runs now than its cached times (module docstring:
            ``speed``; below 1: faster); None when no cached time was used.
    """

    measured: int
    cached: int
    skipped: dict[str, int]
    contention_factor: float | None
    seconds: float
    measured_again: int = 0
    speed: float | None = None


#: Op namespaces whose ops the profiler runs on random inputs: torch's own, free of side effects.
#: Any other op (``dhelix::with_accumulated_grad`` clears a parameter's ``.grad``; a user's custom
#: op may do anything) keeps the base estimate times ``compute_scale``.
_PURE_NAMESPACES = ("aten", "prims")


def _scaled(cost: NodeCost, scale: float | None) -> NodeCost:
    """``cost`` with its time (and time expression) multiplied by ``scale`` (unchanged for None)."""
    if scale is None:
        return cost
    return dataclasses.replace(cost, time_s=cost.time_s * scale, time_expr=cost.time_expr * sympy.Float(scale))


@dataclass
class _Item:
    """One signature to price, with the first node that has it.

    ``is_collective``: a transfer (collective or P2P): measured on the live group, never cached
    on disk; ``is_p2p``: a P2P exchange, whose issue is measured too."""

    sig: str
    node: torch.fx.Node
    is_collective: bool
    is_p2p: bool = False


class ProfiledEstimator(EstimatorBase):
    """``base`` corrected by measurements (see the module docstring).

    Args:
        base: the estimator to fall back on (and to scale symbolic expressions with).
        cache_dir: directory of the JSON cache (created if missing).
        process_group: group for collectives and for agreeing on measurements; None means
            the group named by each collective node and the default group for agreement
            (when ``torch.distributed`` is initialized).
        warmup / repeats: untimed and timed calls per signature.
        progress: progress bar on stderr: True, False, or None for "on rank 0 when stderr
            is a terminal and there are at least 8 measurements".
        device_name: overrides the cache key of the device.
        measure_contention: measure the compute slowdown under a collective when a real
            (non-fake) multi-rank group is available.
        runner: runs measurements made while a graph pass is running
            (:meth:`segment_pair_times`); ``dhelix_compile`` passes one that leaves the
            compiler's fake-tensor mode. None runs them inline.
        replay_link: the link key of a measurement log (:mod:`cost_model.profile.replay`):
            the measuring calls replay a log another process of the same program wrote under
            ``cache_dir`` for this key, and write their own. None keeps no log.
        before_measuring: called once, before the first measurement this estimator makes
            (``dhelix_compile`` waits for Inductor's compile workers there).
    """

    def __init__(
        self,
        base: Estimator,
        cache_dir: str | os.PathLike[str],
        process_group: Any = None,
        *,
        warmup: int = 2,
        repeats: int = 5,
        progress: bool | None = None,
        device_name: str | None = None,
        measure_contention: bool = True,
        runner: Callable[[Callable[[], Any]], Any] | None = None,
        replay_link: str | None = None,
        before_measuring: Callable[[], object] | None = None,
    ) -> None:
        if repeats < 1 or warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
        self.base = base
        self.cache_dir = pathlib.Path(cache_dir)
        self.disk_cache = MeasurementCache(self.cache_dir)
        self.process_group = process_group
        self.warmup = warmup
        self.repeats = repeats
        self.progress = progress
        self.device_name = device_name
        self.measure_contention = measure_contention
        self.runner = runner
        self.measurements: dict[str, float] = {}
        #: measured issue seconds of P2P signatures (module docstring); their totals are in ``measurements``
        self.issue_measurements: dict[str, float] = {}
        #: compute slowdown under each kind of transfer (cost_model.profile.contention), as measured
        self.measured_contention: dict[Transfer, float] = {}
        #: per measured transfer signature: the CPU its transfer threads ran per second of the
        #: transfer (module docstring: ``cpu share``), agreed by MAX
        self.transfer_cpu_shares: dict[str, float] = {}
        #: per kind of transfer: the contention stand-in's own CPU share (cost_model.profile.contention),
        #: the median of every one measured in this process, as ``measured_contention``
        self.standin_cpu_shares: dict[Transfer, float] = {}
        self._standin_shares: dict[str, float] = {}  # by contention key, as ``_contention_cache``
        #: the transfers' threads run on cores the compute needs (a CPU device whose cores every
        #: rank's compute fills; set by ``calibrate``): a transfer's share, against the stand-in's,
        #: moves its factor
        self.transfers_take_compute_cpu = False
        #: every contention measurement of this process by its key: never on disk (module docstring);
        #: ``measured_contention`` holds each kind's median of them
        self._contention_cache: dict[str, float] = {}
        self._link_ratios: dict[str, float] = {}  # collective signature -> measured / base time
        self._compute_ratios: dict[str, dict[str, float]] = {}  # op -> {signature: measured / base time}
        #: now / cached lowest time of every speed probe of this process (module docstring: ``speed``)
        self._speed_ratios: list[float] = []
        #: compute signatures this process measured again as stalls (module docstring: ``stalls``)
        self._measured_again: set[str] = set()
        self._signature_cache: dict[torch.fx.Node, tuple[Any, str | None]] = {}
        #: measured segment pairs (cost_model.profile.pairs), kept for later compiles in this process
        self.pair_measurements: dict[tuple[SegmentSignature, SegmentSignature], float] = {}
        #: measured segments (cost_model.profile.segments), kept for later compiles in this process
        self.segment_measurements: dict[SegmentSignature, float] = {}
        self.replay_link = replay_link
        self._log: MeasurementLog | None = None
        self._before_measuring = before_measuring

    # ------------------------------------------------------------------ estimator API

    @property
    def contention_factor(self) -> float:
        """The largest measured slowdown (each transfer's own kind's is in its ``NodeCost``)."""
        if self.measured_contention:
            return max(self.measured_contention.values())
        return float(self.base.contention_factor)

    @property
    def link_scale(self) -> float | None:
        """Median measured / base time of the collectives measured so far (None before any)."""
        return statistics.median(self._link_ratios.values()) if self._link_ratios else None

    def compute_scale(self, node: torch.fx.Node) -> float | None:
        """Median measured / base time of the measured compute nodes of ``node``'s op (of every
        measured compute node when none has that op); None before any was measured."""
        ratios = self._compute_ratios.get(op_name(node, qualified=True))
        if not ratios:
            ratios = {sig: r for by_sig in self._compute_ratios.values() for sig, r in by_sig.items()}
        return statistics.median(ratios.values()) if ratios else None

    def node_cost(self, node: torch.fx.Node) -> NodeCost:
        cost = self._priced(node)
        if cost.kind in ("collective", "p2p") and self.measured_contention:
            transfer = "move" if scatter_sent_as_all_to_all(node) else transfer_of(cost.collective)
            factor = self.measured_contention.get(transfer)
            if factor is None:
                return cost
            if self.transfers_take_compute_cpu:
                share = self.transfer_cpu_shares.get(self.signature(node) or "")
                if share is not None:
                    standin = self.standin_cpu_shares.get(transfer, 0.0)
                    factor = max(1.0, factor * (1.0 - min(standin, MAX_CPU_SHARE)) / (1.0 - min(share, MAX_CPU_SHARE)))
            return dataclasses.replace(cost, contention_factor=factor)
        return cost

    def _priced(self, node: torch.fx.Node) -> NodeCost:
        cost = self.base.node_cost(node)
        if cost.kind == "p2p":
            sig = self.signature(node)
            total = self.measurements.get(sig) if sig is not None else None
            if total is not None and sig is not None:
                issue = min(self.issue_measurements.get(sig, 0.0), total)
                return dataclasses.replace(
                    cost, time_s=total - issue, time_expr=sympy.Float(total - issue), issue_s=issue
                )
            return _scaled(cost, self.link_scale) if self._link_ratios else cost
        if not self.measurements or cost.kind not in ("compute", "collective"):
            return cost
        sig = self.signature(node)
        measured = self.measurements.get(sig) if sig is not None else None
        if measured is None:
            return _scaled(cost, self.compute_scale(node)) if cost.kind == "compute" else cost
        expr: sympy.Expr
        if cost.time_s > 0 and cost.time_expr.free_symbols:
            expr = cost.time_expr * sympy.Float(measured / cost.time_s)
        else:
            expr = sympy.Float(measured)
        return dataclasses.replace(cost, time_s=measured, time_expr=expr)

    def measure_new(self, nodes: Sequence[torch.fx.Node]) -> CalibrationReport:
        """``calibrate`` nodes a pass created after calibration (the decompose pass's variants),
        through ``runner``; every rank must call it with the same signatures, in the same order."""
        return self.runner(lambda: self.calibrate(nodes)) if self.runner is not None else self.calibrate(nodes)

    @compile_clock.timed("profiling")
    def segment_pair_times(
        self,
        fwd: Sequence[Sequence[torch.fx.Node]],
        bwd: Sequence[Sequence[torch.fx.Node]],
        pairs: Collection[Pair] | None = None,
    ) -> dict[Pair, float]:
        """Measured co-execution time of segment pairs (:mod:`cost_model.profile.pairs`)."""
        sigs = [
            *(_joined(segment_signature(self, s)) for s in fwd),
            "||",
            *(_joined(segment_signature(self, s)) for s in bwd),
        ]  # not ``pairs``: a logged call's delta holds the pairs it measured, the memo answers any subset
        return self._logged("pairs", sigs, lambda: segment_pair_times(self, fwd, bwd, runner=self.runner, pairs=pairs))

    @compile_clock.timed("profiling")
    def segment_times(self, segments: Sequence[Sequence[torch.fx.Node]]) -> list[float | None]:
        """Measured seconds of each segment run with its dataflow (:mod:`cost_model.profile.segments`)."""
        sigs = [f"{len(s)}:{_joined(segment_signature(self, s))}" for s in segments]
        return self._logged("segments", sigs, lambda: segment_times(self, segments, runner=self.runner))

    # ------------------------------------------------------------------ measurement log

    def state(self) -> dict[str, Any]:
        """Every number a plan reads that measuring sets, as JSON holds it (tuple keys as JSON
        text): what a measurement log records (:mod:`cost_model.profile.replay`)."""
        state: dict[str, Any] = {name: dict(getattr(self, name)) for name in _STATE_DICTS}
        state["_compute_ratios"] = {op: dict(r) for op, r in self._compute_ratios.items()}
        state["pair_measurements"] = {json.dumps(k): t for k, t in self.pair_measurements.items()}
        state["segment_measurements"] = {json.dumps(k): t for k, t in self.segment_measurements.items()}
        state["_speed_ratios"] = list(self._speed_ratios)
        state["transfers_take_compute_cpu"] = self.transfers_take_compute_cpu
        return state

    def apply_state(self, delta: dict[str, Any]) -> None:
        """Set the entries of a :meth:`state` delta (:func:`cost_model.profile.replay.state_delta`)."""
        for name in _STATE_DICTS:
            getattr(self, name).update(delta.get(name, {}))
        for op, ratios in delta.get("_compute_ratios", {}).items():
            self._compute_ratios[op] = dict(ratios)
        for k, t in delta.get("pair_measurements", {}).items():
            self.pair_measurements[_tuples(json.loads(k))] = t
        for k, t in delta.get("segment_measurements", {}).items():
            self.segment_measurements[_tuples(json.loads(k))] = t
        self._speed_ratios.extend(delta.get("_speed_ratios", []))
        if "transfers_take_compute_cpu" in delta:
            self.transfers_take_compute_cpu = bool(delta["transfers_take_compute_cpu"])

    def _replayed(self, kind: str, signatures: Sequence[str]) -> tuple[str, dict[str, Any] | None] | None:
        """(the call's key, its logged delta or None to measure), or None without a log."""
        if self.replay_link is None:
            return None
        if self._log is None:
            self._log = MeasurementLog(self.cache_dir, self.replay_link, self.agreement_group())
        key = call_key(kind, signatures)
        log = self._log
        # the ranks agree on the log by collectives: outside the compiler's fake-tensor mode, as
        # the measurements run (a collective issued inside it was seen to block every rank)
        if self.runner is not None:
            return key, self.runner(lambda: log.next_delta(key))
        return key, log.next_delta(key)

    def _logged(self, kind: str, signatures: Sequence[str], measure: Callable[[], _R]) -> _R:
        """``measure()`` with the log: its delta applied first when replayed (the memos then
        answer it without measuring), else recorded after it."""
        replayed = self._replayed(kind, signatures)
        if replayed is None:
            return measure()
        key, delta = replayed
        if delta is not None:
            self.apply_state(delta)
            return measure()
        before = self.state()
        self._measuring()
        result = measure()
        self._record(key, before)
        return result

    def _measuring(self) -> None:
        """``before_measuring``, the first time this estimator may measure."""
        if self._before_measuring is not None:
            hook, self._before_measuring = self._before_measuring, None
            hook()

    def _link_as_logged(self, items: Sequence[_Item], delta: dict[str, Any]) -> bool:
        """Whether the link still runs the slowest collective of a replayed calibration in its
        logged time (:meth:`cost_model.profile.replay.MeasurementLog.check_link`)."""
        logged = delta.get("measurements", {})
        transfers = [it for it in items if it.is_collective and not it.is_p2p and it.sig in logged]

        def measure() -> tuple[float, float] | None:
            if not transfers:
                return None
            item = max(transfers, key=lambda it: logged[it.sig])  # graph order on ties
            shares, issues = dict(self.transfer_cpu_shares), dict(self.issue_measurements)
            now = agree_max_s([self._measure(item)], self.agreement_group())[0]
            self.transfer_cpu_shares, self.issue_measurements = shares, issues  # the log's stand
            return logged[item.sig], now

        assert self._log is not None
        return self._log.check_link(measure)

    def _record(self, key: str, before: dict[str, Any]) -> None:
        if self._log is not None:
            self._log.record(key, state_delta(before, self.state()))

    def signature(self, node: torch.fx.Node) -> str | None:
        """The node's measurement key (:mod:`cost_model.profile.signatures`), or None for nodes
        that are never measured (neither compute nor collective; a collective without a live group)."""
        kind = kind_of(node)
        if kind not in ("compute", "collective", "p2p"):
            return None
        val = node.meta.get("val")
        hit = self._signature_cache.get(node)
        if hit is not None and hit[0] is val:  # same metadata object: same signature
            return hit[1]
        sig: str | None
        if kind == "compute":
            sig = compute_signature(node)
        else:
            group = self._group_of(node)
            if group is None:
                sig = None
            elif kind == "p2p":
                sig = p2p_signature(node, group)
            else:
                sig = collective_signature(node, group)
        self._signature_cache[node] = (val, sig)
        return sig

    def skip_reason(self, node: torch.fx.Node) -> str | None:
        """Why ``node`` is not measured (``"free"``: costs nothing), or None when it is."""
        kind = kind_of(node)
        if kind == "p2p":
            group = self._group_of(node)
            live = group is not None and backend_name(group) != "fake" and resolve_group_size(group) not in (None, 1)
            schema = getattr(node.target, "_schema", None)
            exchange = schema is not None and schema.name in P2P_OP_NAMES
            return None if live and exchange else "p2p: base estimate times link_scale"
        if kind == "compute":
            if is_schema_view(node):
                return "free"
            schema = getattr(node.target, "_schema", None)
            pure = schema is not None and schema.name in PURE_OP_NAMES
            if getattr(node.target, "namespace", None) not in _PURE_NAMESPACES and not pure:
                return "not a torch op: may have side effects"
            vals = [node.meta.get("val"), *(i.meta.get("val") for i in node.all_input_nodes)]
            for t in (t for v in vals for t in tensors_in(v)):
                if t.device.type == "cuda" and not torch.cuda.is_available():
                    return "device unavailable"
                if t.device.type not in ("cpu", "cuda"):
                    return "device unavailable"
            if not any(tensors_in(v) for v in vals):
                return "no tensor metadata"
            return None
        if kind == "collective":
            group = self._group_of(node)
            if group is None:
                return "no process group"
            if backend_name(group) == "fake":
                return "fake process group"
            size = resolve_group_size(group)
            try:
                call = describe_comm(node, size)
            except ValueError:
                return "unknown collective"
            if size is not None and call.group_size != size:
                return "group size mismatch"
            return None
        return "free"

    def agreement_group(self) -> Any:
        """The process group measurements are agreed over (None: a single process)."""
        if self.process_group is not None:
            return self.process_group
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.group.WORLD
        except Exception:  # noqa: BLE001 - no usable default group: measure without agreement
            return None
        return None

    def real_args(
        self, node: torch.fx.Node, hints: dict[sympy.Symbol, int], is_collective: bool
    ) -> tuple[list[Any], dict[str, Any]]:
        """Real arguments for running ``node`` alone (:func:`cost_model.profile.running.real_args`);
        a collective's (``is_collective``) on the live group it runs on."""
        if not is_collective:
            return real_args(node, hints)
        group = self._group_of(node)
        if group is None:
            raise RuntimeError(f"{node.name}: no live process group to run the collective on")
        return real_args(node, hints, group)

    def _group_of(self, node: torch.fx.Node) -> Any:
        """The live process group a collective node runs on (``process_group`` wins)."""
        if self.process_group is not None:
            return self.process_group
        return resolve_process_group(bound_args(node).get("group_name"))

    # ------------------------------------------------------------------ calibration

    @compile_clock.timed("profiling")
    def calibrate(self, gm: NodesLike) -> CalibrationReport:
        """Measure the graph's ops and collectives; see the module docstring."""
        t_start = time.perf_counter()
        nodes = node_list(gm)
        device = device_of_nodes(nodes)
        key = self.device_name or device_key(device)
        cache = self.disk_cache.load(key)
        agree_group = self.agreement_group()

        skipped: dict[str, int] = {}
        items: list[_Item] = []
        seen: dict[str, None] = {}
        for node in nodes:
            reason = self.skip_reason(node)
            if reason is not None:
                if reason != "free":
                    skipped[reason] = skipped.get(reason, 0) + 1
                continue
            sig = self.signature(node)
            if sig is None or sig in seen:
                continue
            seen[sig] = None
            kind = kind_of(node)
            items.append(_Item(sig, node, kind in ("collective", "p2p"), kind == "p2p"))

        check_same_signatures([it.sig for it in items], agree_group)
        replayed = self._replayed("calibrate", [it.sig for it in items])
        if replayed is not None and replayed[1] is not None:
            if self._link_as_logged(items, replayed[1]):
                self.apply_state(replayed[1])
                return CalibrationReport(
                    measured=0,
                    cached=len(items),
                    skipped=skipped,
                    contention_factor=max(self.measured_contention.values(), default=None),
                    seconds=time.perf_counter() - t_start,
                    speed=self.speed,
                )
            assert self._log is not None
            self._log.reject()
        before = self.state() if replayed is not None else None
        self._measuring()
        # Collectives depend on the link, which the cache key cannot name: they come only from
        # this process's own measurements, never from (or into) the disk cache.
        settled_s = {k: cached_seconds(v) for k, v in cache.items() if settled(v) and not is_collective_signature(k)}
        known = {**settled_s, **self.measurements}
        missing = [0.0 if it.sig in known else 1.0 for it in items]
        missing = agree_max(missing, agree_group)

        times: list[float] = []
        fresh: dict[str, float] = {}  # compute signature -> this rank's measurement in this call
        measured = cached = 0
        to_measure = int(sum(missing))
        with progress_bar(
            to_measure, f"dhelix calibrate {key}", enabled=self._show_progress(to_measure, agree_group)
        ) as bar:
            for item, need in zip(items, missing, strict=True):
                if need:
                    bar.set_postfix_str(item_label(op_name(item.node, qualified=True)), refresh=False)
                    t = self._measure(item)
                    if not item.is_collective and not math.isnan(t):
                        fresh[item.sig] = t
                    measured += 1
                    bar.update()
                else:
                    t = known[item.sig]
                    cached += 1
                times.append(t)
        base_times = [self.base.node_cost(item.node).time_s for item in items]
        measured_again = self._measure_stalls_again(items, times, base_times, fresh)
        speed = self._at_machine_speed(items, times, cache, fresh)
        # compute signature -> its disk-cache entry with this rank's measurement
        new_samples = {sig: with_sample(cache.get(sig, []), t) for sig, t in fresh.items()}
        self._measure_transfers_again(items, missing, times)
        times = agree_max_s(times, agree_group)
        if any(it.is_p2p for it in items):  # the same on every rank: the signatures are agreed
            issues = agree_max_s([self.issue_measurements.get(it.sig, 0.0) for it in items], agree_group)
            for item, issue_s in zip(items, issues, strict=True):
                if item.is_p2p:
                    self.issue_measurements[item.sig] = issue_s
        if any(it.is_collective for it in items):
            shares = agree_max([self.transfer_cpu_shares.get(it.sig, 0.0) for it in items], agree_group)
            for item, share in zip(items, shares, strict=True):
                if item.is_collective:
                    self.transfer_cpu_shares[item.sig] = share
            # agreed, as every number a plan reads: machines of one job may differ in cores
            takes = device.type == "cpu" and compute_fills_cores(torch.get_num_threads())
            self.transfers_take_compute_cpu = agree_max([1.0 if takes else 0.0], agree_group)[0] > 0

        for item, t, base_s in zip(items, times, base_times, strict=True):
            if t == FAILED_S:
                skipped["measurement failed"] = skipped.get("measurement failed", 0) + 1
                continue
            self.measurements[item.sig] = t
            if not item.is_collective:
                if item.sig in new_samples:
                    cache[item.sig] = new_samples[item.sig]
                if base_s > 0:
                    self._compute_ratios.setdefault(op_name(item.node, qualified=True), {})[item.sig] = t / base_s
            elif base_s > 0 and not item.is_p2p:  # link_scale prices the P2P transfers not measured
                self._link_ratios[item.sig] = t / base_s

        contention = None
        if self.measure_contention:
            measured_compute = [
                (t, it.sig, it.node)
                for it, t in zip(items, times, strict=True)
                if not it.is_collective and t != FAILED_S
            ]
            measured_comms = [
                (t, it.node) for it, t in zip(items, times, strict=True) if it.is_collective and t != FAILED_S
            ]
            for transfer in TRANSFERS:
                factor = measure_contention(
                    measured_compute,
                    measured_comms,
                    agree_group,
                    self._contention_cache,
                    self.repeats,
                    transfer,
                    self._standin_shares,
                )
                if factor is not None:
                    pooled = statistics.median(factors_of(self._contention_cache, transfer))
                    self.measured_contention[transfer] = pooled
                    standin_shares = factors_of(self._standin_shares, transfer)
                    if standin_shares:
                        self.standin_cpu_shares[transfer] = statistics.median(standin_shares)
                    contention = max(contention or 1.0, pooled)
        self.disk_cache.store(key, {k: v for k, v in cache.items() if not k.startswith(CONTENTION_KEY_PREFIX)})
        if replayed is not None and before is not None:
            self._record(replayed[0], before)
        return CalibrationReport(
            measured=measured,
            cached=cached,
            skipped=skipped,
            contention_factor=contention,
            seconds=time.perf_counter() - t_start,
            measured_again=measured_again,
            speed=speed,
        )

    def _measure_stalls_again(
        self, items: Sequence[_Item], times: list[float], base_times: Sequence[float], fresh: dict[str, float]
    ) -> int:
        """Measure once more each compute op whose time is a stall's (module docstring:
        ``stalls``; ``base_times``: the base estimate of each item); the lower time stands in
        ``times`` and in ``fresh`` (this call's measurements). How many were measured again."""
        base_s = {
            index: base
            for index, (item, base) in enumerate(zip(items, base_times, strict=True))
            # NaN and failed measurements have no ratio
            if not item.is_collective and times[index] > 0 and base > 0
        }
        if len(base_s) < STALL_PEERS:
            return 0
        typical = statistics.median(times[index] / base for index, base in base_s.items())
        stalled = [
            index
            for index, base in base_s.items()
            if times[index] > STALL_RATIO * typical * base + STALL_OVERHEAD_S
            and items[index].sig not in self._measured_again
        ]
        for index in stalled:
            self._measured_again.add(items[index].sig)
            again = self._measure(items[index])
            if math.isnan(again):
                continue
            sig = items[index].sig
            fresh[sig] = min(fresh.get(sig, again), again)
            times[index] = min(times[index], again)
        return len(stalled)

    @property
    def speed(self) -> float | None:
        """How much slower this machine runs now than its cached compute times (module
        docstring: ``speed``): the median of this process's probes; None before any."""
        return statistics.median(self._speed_ratios) if self._speed_ratios else None

    def _at_machine_speed(
        self, items: Sequence[_Item], times: list[float], cache: dict[str, list[float]], fresh: dict[str, float]
    ) -> float | None:
        """Put the compute times that come from the disk cache at the machine's speed now (module
        docstring: ``speed``): probe the slowest cached ops not measured in this call, pool now /
        cached, and make each such time in ``times`` min(``fresh``'s, cached lowest x speed).
        The probes join ``fresh``. The speed, None when no cached time is used."""
        cached_s = {
            item.sig: cached_seconds(cache[item.sig])
            for item in items
            if not item.is_collective and item.sig in cache and item.sig not in self.measurements
        }
        if not cached_s:
            return None
        probes = sorted(
            (sig for sig in cached_s if sig not in fresh),
            key=lambda sig: -cached_s[sig],  # stable: graph order on ties
        )[:SPEED_PROBES]
        for sig in probes:
            now = self._measure(next(item for item in items if item.sig == sig))
            if math.isfinite(now) and now > 0 and cached_s[sig] > 0:
                fresh[sig] = now
                self._speed_ratios.append(now / cached_s[sig])
        speed = self.speed
        for index, item in enumerate(items):
            if item.sig in cached_s and not math.isnan(times[index]):  # NaN: its measurement failed
                at_speed = cached_s[item.sig] * (speed or 1.0)
                times[index] = min(fresh[item.sig], at_speed) if item.sig in fresh else at_speed
        return speed

    def _measure_transfers_again(self, items: Sequence[_Item], missing: Sequence[float], times: list[float]) -> None:
        """Measure each transfer measured by this calibration once more; keep the lower (module
        docstring: ``again``). ``missing`` is agreed, so every rank measures the same ones."""
        for index, (item, need) in enumerate(zip(items, missing, strict=True)):
            if not (need and item.is_collective):
                continue
            issue_s = self.issue_measurements.get(item.sig)
            share = self.transfer_cpu_shares.get(item.sig)
            again = self._measure(item)
            if math.isnan(times[index]) or again < times[index]:
                times[index] = again
                continue
            # the first measurement stands, with its issue time and CPU share
            if issue_s is not None:
                self.issue_measurements[item.sig] = issue_s
            if share is not None:
                self.transfer_cpu_shares[item.sig] = share

    def _show_progress(self, total: int, group: Any) -> bool:
        """The bar's rule: rank 0 only; then ``progress`` when set, else a terminal and enough work."""
        if _rank(group) != 0:
            return False
        if self.progress is not None:
            return self.progress
        return sys.stderr.isatty() and total >= PROGRESS_MIN_MEASUREMENTS

    def _measure(self, item: _Item) -> float:
        """Median seconds of one signature; NaN when it cannot run."""
        node = item.node
        hints = size_hints([node, *node.all_input_nodes])
        device = device_of_nodes([node])
        try:
            args, kwargs = self.real_args(node, hints, item.is_collective)
        except Exception:  # noqa: BLE001 - an op that cannot run on materialized inputs is priced by the base model
            return math.nan
        if item.is_collective:
            group = self._group_of(node)
            issued_s: list[float] = []
            shares: list[float] = []
            threads = gloo_thread_ids()  # listed once: each run reads only their clocks

            def run() -> object:
                cpu0 = threads_cpu_s(threads)
                t0 = time.perf_counter()
                out = run_node(node, args, kwargs)
                issued_s.append(time.perf_counter() - t0)
                for t in transfer_tensors(out):
                    c10d.wait_tensor(t)
                shares.append((threads_cpu_s(threads) - cpu0) / max(time.perf_counter() - t0, 1e-9))
                return out

            total = median_run_or_nan_s(run, self.warmup, self.repeats, device, group)  # NaN: the base model prices it
            if not math.isnan(total):
                self.transfer_cpu_shares[item.sig] = statistics.median(shares[self.warmup :])
                if item.is_p2p:
                    self.issue_measurements[item.sig] = statistics.median(issued_s[self.warmup :])
            return total

        def run_compute() -> object:
            return call_target(node)(*args, **kwargs)

        return median_op_run_or_nan_s(run_compute, self.warmup, self.repeats, device)


_R = TypeVar("_R")

#: ``ProfiledEstimator.state``'s flat dicts of floats, by attribute name.
_STATE_DICTS: tuple[str, ...] = (
    "measurements",
    "issue_measurements",
    "measured_contention",
    "transfer_cpu_shares",
    "standin_cpu_shares",
    "_standin_shares",
    "_contention_cache",
    "_link_ratios",
)


def _joined(signature: SegmentSignature | None) -> str:
    """A segment signature as one string (``-`` for a segment that cannot be measured)."""
    return "-" if signature is None else "|".join(signature)


def _tuples(value: Any) -> Any:
    """JSON lists back as the tuples they were (a logged key)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


#: ``speed`` (module docstring): cached compute ops measured again by each calibration that uses the cache
SPEED_PROBES: int = 3

#: ``cpu share`` (module docstring): the most of the compute's core a transfer's threads are
#: taken to hold (the factor grows as 1 / (1 - share); a share near 1 would stop the compute)
MAX_CPU_SHARE: float = 0.75

#: ``stalls`` (module docstring): a compute op measured above this many times what the graph's
#: typical measured / base ratio makes of its base estimate ...
STALL_RATIO: float = 5.0
#: ... plus this much (a tiny op's call overhead) is measured again ...
STALL_OVERHEAD_S: float = 1e-4
#: ... where at least this many compute ops have a base estimate
STALL_PEERS: int = 3


def _rank(group: Any) -> int:
    if group is None:
        return 0
    try:
        return int(group.rank())
    except Exception:  # noqa: BLE001 - a group without a rank: measure as rank 0
        return 0


__all__ = ["PROGRESS_MIN_MEASUREMENTS", "CalibrationReport", "ProfiledEstimator"]
