"""Profiled calibration: measure a graph's ops and collectives on the live device and group.

Contract
--------
``ProfiledEstimator(base, cache_dir, process_group)`` answers ``node_cost`` like ``base``,
except that a node whose *signature* has been measured gets the measured time.
``calibrate(gm)`` does the measuring::

    sigs   = unique signatures of the graph's compute and collective nodes, graph order
    check  every rank has the same list (hash agreed via all_reduce)  -> else RuntimeError
    need   = signatures missing on *any* rank (all_reduce MAX of flags) from what this
             process measured before and, for compute ops only, the disk cache
    for sig in need (graph order, same on every rank):
        compute:    real tensors of the node's shapes/strides/dtypes (size hints for
                    symbols), ``warmup`` calls, then the median of ``repeats`` timed calls
        collective: the same on the live process group (barrier first, wait included)
    times  = all_reduce(MAX) over ranks of every signature's time -> every rank plans the
             same schedule from the same numbers
    contention factor (optional): a measured compute op timed alone and while an async
             all_reduce is in flight on the group; ratio, agreed by MAX
    write the compute ops to the cache (JSON, one file per device, atomically replaced)

Collectives are never cached on disk: their time depends on the link, which nothing in
the key names (the same shapes on NVLink, InfiniBand or a rate-limited veth).

Signature: ``op | args | kwargs | -> output`` where tensors appear as
``T(shape, stride, dtype)`` at the size hints and bare scalars by their type (offsets differ
by rank, cost does not); collectives add the group size and backend but not the group's name.
Cache file: ``<cache_dir>/<device name>.json`` with ``{"entries": {signature: seconds}}``.

Nodes that cannot be measured (unknown groups, a fake process group, an op that raises on
random inputs) keep the base estimate; ``CalibrationReport.skipped`` counts why. P2P
transfers are not measured (the decompose pass creates them after calibration); they get
the base estimate times ``link_scale``, the median over every collective measured so far of
measured / base time -- the link as measured, agreed like the times it comes from.
The decompose pass measures its variants' new compute nodes (``measure_new``) before it
prices them. A compute node that was never measured gets the base estimate times ``compute_scale``: the
median measured / base time of the measured nodes of its op (of all compute nodes when none
has it), so that a half-size matmul costs about half the measured whole one rather than the
base model's peak-FLOP guess.
With the measured time ``t`` and the base estimate ``b(sizes)``, ``time_expr`` becomes
``b(sizes) * t / b(hints)``: exact at the hints, the base model's growth elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import sympy
import torch
import torch.fx

from cost_model.nodes import node_list
from cost_model.comm_nodes import bound_args, describe_comm, resolve_group_size, resolve_process_group
from cost_model.estimator import Estimator, EstimatorBase, NodeCost
from cost_model.memory import is_schema_view
from cost_model.op_kinds import kind_of
from cost_model.rank_agreement import agree_max, backend_name, check_same_signatures, comm_device
from cost_model.symbolic import (
    concretize,
    evaluate,
    hinted_shape,
    hinted_stride,
    size_hints,
    tensors_in,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

CACHE_VERSION: int = 1
_FAILED: float = -1.0


@dataclass(frozen=True)
class CalibrationReport:
    """What :meth:`ProfiledEstimator.calibrate` did.

    Attributes:
        measured: signatures measured in this call.
        cached: signatures taken from the disk cache.
        skipped: reason -> number of nodes left to the base estimate.
        contention_factor: measured compute slowdown under a collective (None if not
            measured).
        seconds: wall time of the calibration.
    """

    measured: int
    cached: int
    skipped: dict[str, int]
    contention_factor: float | None
    seconds: float


class ProgressBar:
    """A dependency-free progress bar on stderr: ``label [#####.....] 5/10 op``."""

    def __init__(self, total: int, label: str, enabled: bool, stream: TextIO | None = None,
                 width: int = 30) -> None:
        self.total = max(total, 0)
        self.label = label
        self.enabled = enabled and total > 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0

    def step(self, item: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {item[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _cpu_name() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu-{model}-{torch.get_num_threads()}t"


def device_key(device: torch.device) -> str:
    """Cache key of a device: GPU product name, or CPU model + thread count."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return _cpu_name()


def _safe_filename(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "device"


def _tensor_sig(val: torch.Tensor, hints: dict[sympy.Symbol, int]) -> str:
    shape = hinted_shape(val, hints)
    stride = hinted_stride(val, hints)
    dtype = str(val.dtype).removeprefix("torch.")
    return f"T({list(shape)},{list(stride)},{dtype})"


def _arg_sig(value: Any, hints: dict[sympy.Symbol, int]) -> str:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return _tensor_sig(val, hints)
        return repr(concretize(val, hints))
    if isinstance(value, (list, tuple)):
        inner = ",".join(_arg_sig(v, hints) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(concretize(value, hints))


def _scalar_free_sig(value: Any, hints: dict[sympy.Symbol, int]) -> str:
    """``_arg_sig``, except a bare int/float argument is written as its type."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value).__name__
    return _arg_sig(value, hints)


def _op_name(node: torch.fx.Node) -> str:
    return str(node.target)


def _scaled(cost: NodeCost, scale: float | None) -> NodeCost:
    """``cost`` with its time (and time expression) multiplied by ``scale`` (unchanged for None)."""
    if scale is None:
        return cost
    return dataclasses.replace(cost, time_s=cost.time_s * scale, time_expr=cost.time_expr * sympy.Float(scale))


def _is_collective_sig(sig: str) -> bool:
    return sig.startswith("_c10d_functional.")


def device_of_nodes(nodes: Iterable[torch.fx.Node]) -> torch.device:
    """The device of the first tensor value among ``nodes`` (CPU if none has one)."""
    for node in nodes:
        for t in tensors_in(node.meta.get("val")):
            return torch.device(t.device)
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _materialize(val: torch.Tensor, hints: dict[sympy.Symbol, int]) -> torch.Tensor:
    """A real tensor with ``val``'s (hinted) shape, strides, dtype and device."""
    shape = hinted_shape(val, hints)
    stride = hinted_stride(val, hints)
    t = torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.normal_()
    else:
        t.zero_()  # zeros are valid indices, masks and divisors-free integers
    return t


@dataclass
class _Item:
    """One signature to price, with the first node that has it."""

    sig: str
    node: torch.fx.Node
    is_collective: bool


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
    ) -> None:
        if repeats < 1 or warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
        self.base = base
        self.cache_dir = pathlib.Path(cache_dir)
        self.process_group = process_group
        self.warmup = warmup
        self.repeats = repeats
        self.progress = progress
        self.device_name = device_name
        self.measure_contention = measure_contention
        self.runner = runner
        self.measurements: dict[str, float] = {}
        self.measured_contention_factor: float | None = None
        self._link_ratios: dict[str, float] = {}  # collective signature -> measured / base time
        self._compute_ratios: dict[str, dict[str, float]] = {}  # op -> {signature: measured / base time}
        self._signature_cache: dict[torch.fx.Node, tuple[Any, str | None]] = {}

    # ------------------------------------------------------------------ estimator API

    @property
    def contention_factor(self) -> float:
        if self.measured_contention_factor is not None:
            return self.measured_contention_factor
        return float(self.base.contention_factor)

    @property
    def link_scale(self) -> float | None:
        """Median measured / base time of the collectives measured so far (None before any)."""
        return statistics.median(self._link_ratios.values()) if self._link_ratios else None

    def compute_scale(self, node: torch.fx.Node) -> float | None:
        """Median measured / base time of the measured compute nodes of ``node``'s op (of every
        measured compute node when none has that op); None before any was measured."""
        ratios = self._compute_ratios.get(_op_name(node))
        if not ratios:
            ratios = {sig: r for by_sig in self._compute_ratios.values() for sig, r in by_sig.items()}
        return statistics.median(ratios.values()) if ratios else None

    def node_cost(self, node: torch.fx.Node) -> NodeCost:
        cost = self.base.node_cost(node)
        if cost.kind == "p2p" and self._link_ratios:
            return _scaled(cost, self.link_scale)
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

    def segment_pair_times(
        self, fwd: Sequence[Sequence[torch.fx.Node]], bwd: Sequence[Sequence[torch.fx.Node]]
    ) -> dict[tuple[int | None, int | None], float]:
        """Measured co-execution time of segment pairs (``cost_model.pair_profile``)."""
        from cost_model.pair_profile import segment_pair_times

        return segment_pair_times(self, fwd, bwd, runner=self.runner)

    def signature(self, node: torch.fx.Node) -> str | None:
        """The node's cache key, or None for nodes that are never measured."""
        kind = kind_of(node)
        if kind not in ("compute", "collective"):
            return None
        val = node.meta.get("val")
        hit = self._signature_cache.get(node)
        if hit is not None and hit[0] is val:  # same metadata object: same signature
            return hit[1]
        sig = self._compute_signature(node, kind)
        self._signature_cache[node] = (val, sig)
        return sig

    def _group_of(self, node: torch.fx.Node) -> Any:
        """The live process group a collective node runs on (``process_group`` wins)."""
        if self.process_group is not None:
            return self.process_group
        return resolve_process_group(bound_args(node).get("group_name"))

    def _compute_signature(self, node: torch.fx.Node, kind: str) -> str | None:
        hints = size_hints([node, *node.all_input_nodes])
        if kind == "collective":
            args = bound_args(node)
            group = self._group_of(node)
            if group is None:
                return None  # no live group: never measured
            call = describe_comm(node, _group_size(group))
            parts = [
                f"{k}={_arg_sig(v, hints)}"
                for k, v in args.items()
                if k not in ("group_name", "group_size")
            ]
            return (
                f"{node.target}|{';'.join(parts)}|group_size={call.group_size}"
                f"|backend={backend_name(group)}"
            )
        # Top-level Python scalars (offsets, fill values) vary by rank but not cost: they are
        # written by type, so every rank of an SPMD graph has the same signatures. The output
        # keeps apart ops whose scalar (a dim) changes the result's shape. A cat's parts are
        # written in sorted order: their order does not change its cost, and per-peer rewrites
        # cat the same parts in an order that depends on the rank.
        args_sig = ",".join(_scalar_free_sig(a, hints) for a in node.args)
        if node.target is torch.ops.aten.cat.default and isinstance(node.args[0], (list, tuple)):
            parts = ",".join(sorted(_arg_sig(p, hints) for p in node.args[0]))
            args_sig = ",".join([f"[{parts}]", *(_scalar_free_sig(a, hints) for a in node.args[1:])])
        kwargs_sig = ",".join(f"{k}={_scalar_free_sig(v, hints)}" for k, v in sorted(node.kwargs.items()))
        out = node.meta.get("val")
        out_sig = _tensor_sig(out, hints) if isinstance(out, torch.Tensor) else ""
        return f"{node.target}|{args_sig}|{kwargs_sig}|->{out_sig}"

    # ------------------------------------------------------------------ calibration

    def calibrate(
        self, gm: torch.fx.GraphModule | torch.fx.Graph | Sequence[torch.fx.Node]
    ) -> CalibrationReport:
        """Measure the graph's ops and collectives; see the module docstring."""
        t_start = time.perf_counter()
        nodes = node_list(gm)
        device = device_of_nodes(nodes)
        key = self.device_name or device_key(device)
        cache = self._load_cache(key)
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
            items.append(_Item(sig, node, kind_of(node) == "collective"))

        check_same_signatures([it.sig for it in items], agree_group)
        # Collectives depend on the link, which the cache key cannot name: they come only from
        # this process's own measurements, never from (or into) the disk cache.
        known = {**{k: v for k, v in cache.items() if not _is_collective_sig(k)}, **self.measurements}
        missing = [0.0 if it.sig in known else 1.0 for it in items]
        missing = agree_max(missing, agree_group)

        times: list[float] = []
        measured = cached = 0
        bar = ProgressBar(
            total=int(sum(missing)),
            label=f"dhelix calibrate {key}",
            enabled=self._progress_enabled(int(sum(missing)), agree_group),
        )
        try:
            for item, need in zip(items, missing, strict=True):
                if need:
                    t = self._measure(item)
                    measured += 1
                    bar.step(str(item.node.target))
                else:
                    t = known[item.sig]
                    cached += 1
                times.append(t if not math.isnan(t) else _FAILED)
        finally:
            bar.close()
        times = agree_max(times, agree_group)

        for item, t in zip(items, times, strict=True):
            if t == _FAILED:
                skipped["measurement failed"] = skipped.get("measurement failed", 0) + 1
                continue
            self.measurements[item.sig] = t
            base_s = self.base.node_cost(item.node).time_s
            if not item.is_collective:
                cache[item.sig] = t
                if base_s > 0:
                    self._compute_ratios.setdefault(_op_name(item.node), {})[item.sig] = t / base_s
            elif base_s > 0:
                self._link_ratios[item.sig] = t / base_s

        contention = None
        if self.measure_contention:
            contention = self._measure_contention(items, times, agree_group, cache)
            if contention is not None:
                self.measured_contention_factor = contention
        self._store_cache(key, cache)
        return CalibrationReport(
            measured=measured,
            cached=cached,
            skipped=skipped,
            contention_factor=contention,
            seconds=time.perf_counter() - t_start,
        )

    def skip_reason(self, node: torch.fx.Node) -> str | None:
        """Why ``node`` is not measured (``"free"``: costs nothing), or None when it is."""
        kind = kind_of(node)
        if kind == "p2p":
            return "p2p: base estimate times link_scale"
        if kind == "compute":
            if is_schema_view(node):
                return "free"
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
            size = _group_size(group)
            try:
                call = describe_comm(node, size)
            except ValueError:
                return "unknown collective"
            if size is not None and call.group_size != size:
                return "group size mismatch"
            return None
        return "free"

    def _progress_enabled(self, total: int, group: Any) -> bool:
        if _rank(group) != 0:
            return False
        if self.progress is not None:
            return self.progress
        return sys.stderr.isatty() and total >= 8

    def agreement_group(self) -> Any:
        """The process group measurements are agreed over (None: a single process)."""
        if self.process_group is not None:
            return self.process_group
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.group.WORLD
        except Exception:
            return None
        return None

    # ------------------------------------------------------------------ measuring

    def _measure(self, item: _Item) -> float:
        """Median seconds of one signature; NaN when it cannot run."""
        node = item.node
        hints = size_hints([node, *node.all_input_nodes])
        device = device_of_nodes([node])
        try:
            args, kwargs = self.real_args(node, hints, item.is_collective)
        except Exception:
            return math.nan
        if item.is_collective:
            group = self._group_of(node)
            import torch.distributed as dist

            def run() -> object:
                out = node.target(*args, **kwargs)
                for t in out if isinstance(out, (list, tuple)) else (out,):
                    c10d.wait_tensor(t)
                return out

            try:
                dist.barrier(group=group)
                return median_run_s(run, self.warmup, self.repeats, device)
            except Exception:
                return math.nan

        def run_compute() -> object:
            return node.target(*args, **kwargs)

        try:
            return median_run_s(run_compute, self.warmup, self.repeats, device)
        except Exception:
            return math.nan

    def real_args(
        self, node: torch.fx.Node, hints: dict[sympy.Symbol, int], is_collective: bool
    ) -> tuple[list[Any], dict[str, Any]]:
        """Real arguments for running ``node`` alone: random tensors of its inputs' shapes at
        ``hints``; a collective's group arguments resolved to the live group when ``is_collective``."""
        made: dict[torch.fx.Node, Any] = {}

        def real(value: Any) -> Any:
            if isinstance(value, torch.fx.Node):
                if value not in made:
                    val = value.meta.get("val")
                    if isinstance(val, torch.Tensor):
                        made[value] = _materialize(val, hints)
                    elif isinstance(val, (list, tuple)):
                        made[value] = type(val)(
                            _materialize(v, hints)
                            if isinstance(v, torch.Tensor)
                            else concretize(v, hints)
                            for v in val
                        )
                    else:
                        made[value] = concretize(val, hints)
                return made[value]
            if isinstance(value, list):
                return [real(v) for v in value]
            if isinstance(value, tuple):
                return tuple(real(v) for v in value)
            return concretize(value, hints)

        args = [real(a) for a in node.args]
        kwargs = {k: real(v) for k, v in node.kwargs.items()}
        if is_collective:
            group = self._group_of(node)
            schema = node.target._schema  # type: ignore[union-attr]
            for i, arg in enumerate(schema.arguments):
                if arg.name != "group_name":
                    continue
                if i < len(args):
                    args[i] = group.group_name
                else:
                    kwargs["group_name"] = group.group_name
        return args, kwargs

    def _measure_contention(
        self, items: Sequence[_Item], times: Sequence[float], group: Any, cache: dict[str, float]
    ) -> float | None:
        """Slowdown of the slowest measured compute op while an all_reduce is in flight.

        The op is repeated to span about one transfer of the graph's largest collective,
        timed alone and with an async all_reduce of that size (1 MiB..64 MiB) in flight.
        """
        if group is None or backend_name(group) == "fake" or _group_size(group) in (None, 1):
            return None
        compute = [(t, it.sig, it) for it, t in zip(items, times, strict=True)
                   if not it.is_collective and t != _FAILED]
        comms = [
            (_comm_nbytes(it.node), t) for it, t in zip(items, times, strict=True)
            if it.is_collective and t != _FAILED
        ]
        if not compute or not comms:
            return None
        t_compute, sig, item = max(compute, key=lambda c: (c[0], c[1]))
        largest_bytes, t_comm = max(comms)
        nbytes = int(min(max(largest_bytes, 1 << 20), 64 << 20))
        # Repeat the op so that it spans the transfer (capped at ~20 ms per sample).
        iters = int(min(1000, max(1, math.ceil(min(t_comm, 0.02) / max(t_compute, 1e-7)))))
        key = (
            f"contention|{sig}|bytes={nbytes}|iters={iters}"
            f"|backend={backend_name(group)}|size={_group_size(group)}"
        )
        # Every rank must take the same branch: measure unless the key is cached everywhere.
        if not agree_max([0.0 if key in cache else 1.0], group)[0]:
            factor = agree_max([cache[key]], group)[0]
            cache[key] = factor
            return factor
        import torch.distributed as dist

        node = item.node
        hints = size_hints([node, *node.all_input_nodes])
        device = device_of_nodes([node])
        try:
            args, kwargs = self.real_args(node, hints, False)
        except Exception:
            args = None
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=comm_device(group, device))

        def compute_once() -> None:
            if args is not None:
                for _ in range(iters):
                    node.target(*args, **kwargs)
                _synchronize(device)

        alone: list[float] = []
        busy: list[float] = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            compute_once()
            alone.append(time.perf_counter() - t0)
            dist.barrier(group=group)
            work = dist.all_reduce(buf, group=group, async_op=True)
            t0 = time.perf_counter()
            compute_once()
            busy.append(time.perf_counter() - t0)
            work.wait()
        base = statistics.median(alone)
        local = max(1.0, statistics.median(busy) / base) if base > 0 else 1.0
        factor = agree_max([local], group)[0]
        cache[key] = factor
        return factor

    # ------------------------------------------------------------------ cache

    def _cache_path(self, key: str) -> pathlib.Path:
        return self.cache_dir / f"{_safe_filename(key)}.json"

    def _load_cache(self, key: str) -> dict[str, float]:
        path = self._cache_path(key)
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        if data.get("version") != CACHE_VERSION or data.get("device") != key:
            return {}
        return {str(k): float(v) for k, v in data.get("entries", {}).items()}

    def _store_cache(self, key: str, cache: dict[str, float]) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self._cache_path(key)
        payload = {
            "version": CACHE_VERSION,
            "device": key,
            "entries": {k: cache[k] for k in sorted(cache)},
        }
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


# ---------------------------------------------------------------------- helpers



def _group_size(group: Any) -> int | None:
    if group is None:
        return None
    return resolve_group_size(group)


def _rank(group: Any) -> int:
    if group is None:
        return 0
    try:
        return int(group.rank())
    except Exception:
        return 0


def _comm_nbytes(node: torch.fx.Node) -> int:
    try:
        call = describe_comm(node, 1)
    except ValueError:
        return 0
    nbytes = call.nbytes
    if isinstance(nbytes, int):
        return nbytes
    return int(evaluate(nbytes, size_hints([node, *node.all_input_nodes])))


def median_run_s(
    fn: Callable[[], object], warmup: int, repeats: int, device: torch.device
) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after ``warmup`` calls (device synchronized)."""
    for _ in range(warmup):
        fn()
    _synchronize(device)
    samples: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _synchronize(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


__all__ = [
    "CalibrationReport",
    "ProfiledEstimator",
    "ProgressBar",
    "device_key",
]
