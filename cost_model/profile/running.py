"""Running a graph's node alone, for real, and timing it: what every measurement of the profiler shares.

Contract
--------
* :func:`real_args` -- the arguments to call ``node.target`` with outside its graph: every input
  node becomes a random tensor of its ``meta["val"]``'s shape, strides, dtype and device at the
  size hints (:func:`materialize`: normal floats, zero integers -- valid indices and masks);
  given a live ``group``, a collective's ``group_name`` argument names that group.
* :func:`median_run_s` (``cost_model.timing``, where every clock reading is taken) -- ``warmup``
  untimed calls, then the median wall time of ``repeats`` calls, the device synchronized after
  each; :func:`median_runs_interleaved_s` -- the same for
  candidates to compare, their calls interleaved round by round, after a barrier on a group
  that runs them together, NaN for one that raises (the profiler's failure value);
  :func:`median_run_or_nan_s` -- that for one function; :func:`median_op_run_or_nan_s` -- that
  for a compute op one rank times alone, with fewer calls for a long one (``LONG_OP_S``).
* :func:`device_of_nodes` -- where the nodes' tensors live (the first one found; CPU if none).
* :func:`run_node` -- call a node's target on real arguments, as the compiled graph will
  (``graph_passes.gloo_collectives`` says why): on a gloo group, an all-gather goes as one
  all-to-all of its shard repeated once per rank (:func:`gather_as_all_to_all`), and a
  reduce-scatter the pass rewrites (:func:`why_scatter_stays` says which) as one all-to-all of
  its input (:func:`reduce_scatter_as_all_to_all`) whose
  received chunks the wait run by ``run_node`` adds up (the wait's value is the reduce-scatter's);
  :func:`transfer_tensors` lists what a transfer's result leaves in flight.

Nothing here knows estimators: :mod:`cost_model.profile.estimator` (ops and collectives alone)
and :mod:`cost_model.profile.pairs` (two segments together) both build on it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch.utils.weak import WeakIdKeyDictionary

from cost_model.comm_nodes import resolve_process_group
from cost_model.nodes import call_target
from cost_model.rank_agreement import backend_name
from cost_model.symbolic import concretize, hinted_shape, hinted_stride, tensors_in
from cost_model.timing import median_run_s, synchronize, time_samples_s

_C10D = torch.ops._c10d_functional


def gather_as_all_to_all(shard: torch.Tensor, ranks: int, group_name: str) -> torch.Tensor:
    """``all_gather_into_tensor(shard, ranks, group_name)`` sent as ``graph_passes.gloo_collectives``
    sends it: one all-to-all of the shard repeated ``ranks`` times, every split the shard's rows
    (its output, in flight, is the gathered tensor; wait it with ``wait_tensor``)."""
    repeated = shard.repeat(ranks, *([1] * (shard.dim() - 1)))
    splits = [shard.shape[0]] * ranks
    return _C10D.all_to_all_single.default(repeated, splits, splits, group_name)


def reduce_scatter_as_all_to_all(x: torch.Tensor, ranks: int, group_name: str) -> torch.Tensor:
    """``reduce_scatter_tensor(x, "sum", ranks, group_name)`` sent as ``graph_passes.gloo_collectives``
    sends it: one all-to-all of ``x`` (contiguous), every split ``x``'s rows / ``ranks``. Its
    output, in flight, holds every rank's chunk for this rank: :func:`sum_received` of the
    waited output is the reduce-scatter's."""
    x = x.contiguous()
    splits = [x.shape[0] // ranks] * ranks
    return _C10D.all_to_all_single.default(x, splits, splits, group_name)


def sum_received(received: torch.Tensor, ranks: int) -> torch.Tensor:
    """The reduce-scatter's result from :func:`reduce_scatter_as_all_to_all`'s waited output."""
    return received.view(ranks, received.shape[0] // ranks, *received.shape[1:]).sum(0)


#: Outputs of reduce-scatters sent as all-to-alls by :func:`run_node`, in flight: their ranks.
_SUMMED_AFTER_WAIT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _on_gloo(group_name: str) -> bool:
    return backend_name(resolve_process_group(group_name)) == "gloo"


def why_scatter_stays(node: torch.fx.Node) -> str | None:
    """Why a ``reduce_scatter_tensor`` node is not sent as an all-to-all on a gloo group (None:
    it is): another reduce op, symbolic or indivisible rows, or a reader other than one wait.
    ``graph_passes.gloo_collectives`` rewrites by this rule and :func:`run_node` runs by it."""
    x, op, ranks = node.args[0], str(node.args[1]), int(str(node.args[2]))
    value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    rows = value.shape[0] if isinstance(value, torch.Tensor) else None
    if op != "sum":
        return f"reduce op {op}"
    if not isinstance(rows, int):
        return "symbolic rows"
    if rows % ranks:
        return f"{rows} rows on {ranks} ranks"
    users = list(node.users)
    if len(users) != 1 or users[0].target is not _C10D.wait_tensor.default:
        return "not read by one wait"
    return None


def scatter_sent_as_all_to_all(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a reduce-scatter that goes as an all-to-all (:func:`run_node`): its
    transfer only moves bytes, and the adding happens after the wait, on the rank's own thread."""
    return (
        call_target(node) is _C10D.reduce_scatter_tensor.default
        and why_scatter_stays(node) is None
        and _on_gloo(str(node.args[3]))
    )


def run_node(node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
    """``node``'s target on real ``args``/``kwargs``, as the compiled graph runs it (module docstring)."""
    target = call_target(node)
    if target is _C10D.all_gather_into_tensor.default:
        shard, ranks, group = args[0], int(args[1]), str(args[2])
        if _on_gloo(group):
            return gather_as_all_to_all(shard, ranks, group)
    if target is _C10D.reduce_scatter_tensor.default and why_scatter_stays(node) is None and _on_gloo(str(args[3])):
        ranks = int(args[2])  # the group the caller runs it on (a profiler's live group)
        received = reduce_scatter_as_all_to_all(args[0], ranks, str(args[3]))
        _SUMMED_AFTER_WAIT[received] = ranks
        return received
    if target is _C10D.wait_tensor.default and args[0] in _SUMMED_AFTER_WAIT:
        return sum_received(_C10D.wait_tensor.default(args[0]), _SUMMED_AFTER_WAIT.pop(args[0]))
    return target(*args, **kwargs)


def transfer_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors a transfer's result (:func:`run_node`) leaves in flight, to wait for."""
    return list(out) if isinstance(out, (list, tuple)) else [out]


def device_of_nodes(nodes: Iterable[torch.fx.Node]) -> torch.device:
    """The device of the first tensor value among ``nodes`` (CPU if none has one)."""
    for node in nodes:
        for t in tensors_in(node.meta.get("val")):
            return torch.device(t.device)
    return torch.device("cpu")


def median_runs_interleaved_s(
    fns: Sequence[Callable[[], object]],
    warmup: int,
    repeats: int,
    device: torch.device,
    barrier_group: Any = None,
) -> list[float]:
    """Each of ``fns``' median wall time, their calls interleaved: ``warmup`` untimed calls of
    each, then ``repeats`` rounds that call every one once, round ``r`` starting at
    ``fns[r % len(fns)]`` (the device synchronized after each call), all after a barrier on
    ``barrier_group`` when given (ranks that run transfers together start together).

    Candidates measured one after the other are compared across whatever the machine did
    meanwhile: a transfer's time on this project's emulated link comes in epochs of a few hundred
    ms (``estimator``), and a slow one on one candidate's repeats alone would decide the choice.
    Interleaved, a slow spell falls on every candidate alike.

    NaN for a function whose call raised (it is not called again), for every one when the
    barrier raised. Every rank calls the same functions in the same order."""
    times: list[list[float]] = [[] for _ in fns]
    failed = [False] * len(fns)

    def call(i: int) -> float:
        t0 = time.perf_counter()
        try:
            fns[i]()
            synchronize(device)
        except Exception:  # noqa: BLE001 - a failed measurement is NaN; the caller's agreement marks it failed
            failed[i] = True
        return time.perf_counter() - t0

    if not fns:
        return []
    try:
        if barrier_group is not None:
            import torch.distributed as dist

            dist.barrier(group=barrier_group)
    except Exception:  # noqa: BLE001 - as a failed call, for every function
        return [math.nan] * len(fns)
    for i in range(len(fns)):
        for _ in range(warmup):
            if not failed[i]:
                call(i)
    for r in range(repeats):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            if not failed[i]:
                times[i].append(call(i))
    return [math.nan if failed[i] else statistics.median(times[i]) for i in range(len(fns))]


def median_run_or_nan_s(
    fn: Callable[[], object], warmup: int, repeats: int, device: torch.device, barrier_group: Any = None
) -> float:
    """:func:`median_runs_interleaved_s` of ``fn`` alone."""
    return median_runs_interleaved_s([fn], warmup, repeats, device, barrier_group)[0]


#: A compute op whose first call takes at least this long (seconds) is timed with one warm-up
#: call and at most LONG_OP_REPEATS timed ones (:func:`median_op_run_or_nan_s`).
LONG_OP_S: float = 0.01
LONG_OP_REPEATS: int = 3


def median_op_run_or_nan_s(fn: Callable[[], object], warmup: int, repeats: int, device: torch.device) -> float:
    """:func:`median_run_or_nan_s` of a compute op that this rank times on its own (no barrier,
    so ranks need not call it equally often): where its first warm-up call takes ``LONG_OP_S``
    or more, that call is the whole warm-up and ``min(repeats, LONG_OP_REPEATS)`` calls are
    timed. Such an op's calls dwarf the timer's and the dispatch's jitter, and its calls are
    most of a calibration's time: profiling the first ZeRO-3 step of the reference
    transformer's ``medium`` took 12.5 s with two warm-ups and five timed calls of every op,
    9.5 s this way (docs/backend.md)."""
    if warmup < 1:
        return median_run_or_nan_s(fn, warmup, repeats, device)
    try:
        first_s = time_samples_s(fn, 1, 0, device)[0]
    except Exception:  # noqa: BLE001 - as median_runs_interleaved_s: a call that raises is NaN
        return math.nan
    if first_s >= LONG_OP_S:
        return median_run_or_nan_s(fn, 0, min(repeats, LONG_OP_REPEATS), device)
    return median_run_or_nan_s(fn, warmup - 1, repeats, device)


def materialize(val: torch.Tensor, hints: dict[sympy.Symbol, int]) -> torch.Tensor:
    """A real tensor with ``val``'s (hinted) shape, strides, dtype and device."""
    shape = hinted_shape(val, hints)
    stride = hinted_stride(val, hints)
    # the storage the strides reach (an expanded value's 0 strides share elements): filled, then viewed
    extent = 1 + sum((size - 1) * st for size, st in zip(shape, stride)) if all(shape) else 0
    base = torch.empty(extent, dtype=val.dtype, device=val.device)
    if base.dtype.is_floating_point or base.dtype.is_complex:
        base.normal_()
    else:
        base.zero_()  # zeros are valid indices, masks and divisors-free integers
    return base.as_strided(shape, stride)


def real_value(node: torch.fx.Node, hints: dict[sympy.Symbol, int]) -> Any:
    """A real stand-in for ``node``'s output: random tensors of its ``meta["val"]`` (each tensor
    of a list or tuple), its other values at ``hints``."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return materialize(val, hints)
    if isinstance(val, (list, tuple)):
        return type(val)(materialize(v, hints) if isinstance(v, torch.Tensor) else concretize(v, hints) for v in val)
    return concretize(val, hints)


def real_args(
    node: torch.fx.Node, hints: dict[sympy.Symbol, int], group: Any = None
) -> tuple[list[Any], dict[str, Any]]:
    """Real arguments for running ``node`` alone: random tensors of its inputs' shapes at
    ``hints``; with a ``group``, the collective's ``group_name`` argument names it."""
    made: dict[torch.fx.Node, Any] = {}

    def real(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            if value not in made:
                made[value] = real_value(value, hints)
            return made[value]
        if isinstance(value, list):
            return [real(v) for v in value]
        if isinstance(value, tuple):
            return tuple(real(v) for v in value)
        return concretize(value, hints)

    args = [real(a) for a in node.args]
    kwargs = {k: real(v) for k, v in node.kwargs.items()}
    if group is not None:
        target = node.target
        assert isinstance(target, torch._ops.OpOverload), f"{node.name}: a collective calls an OpOverload"
        for i, arg in enumerate(target._schema.arguments):
            if arg.name != "group_name":
                continue
            if i < len(args):
                args[i] = group.group_name
            else:
                kwargs["group_name"] = group.group_name
    return args, kwargs


__all__ = [
    "device_of_nodes",
    "materialize",
    "median_op_run_or_nan_s",
    "median_run_or_nan_s",
    "median_run_s",
    "median_runs_interleaved_s",
    "real_args",
    "real_value",
    "synchronize",
]
