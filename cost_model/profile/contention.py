"""The contention factor, measured: how much slower compute runs while a collective is in flight.

Contract
--------
``measure_contention(compute, comms, group, cache, repeats, transfer) -> float | None``::

    None   without a real multi-rank group (none, a fake one, one rank), without both a
           measured compute op and a measured collective, or when ``cache`` already holds
           ``MAX_FACTORS`` factors of this kind (the caller pools those)
    op     the slowest measured compute op (ties: the larger signature)
    bytes  the largest measured transfer's size (a collective's bytes, a P2P exchange's payload),
           clamped to 1 MiB .. 64 MiB
    iters  calls of the op that fill about 20 ms (1..1000 calls)
    xfer   the transfer that stands for a kind of communication (``TRANSFERS``): "reduce"
           (collectives that add: all_reduce, reduce_scatter) an all_reduce; "move" (every
           other collective and point-to-point transfer) an all_to_all_single, which sends and
           receives without adding -- on CPU the two take very different CPU per byte. An
           all-to-all is what a graph on gloo sends for every move (its all-gathers and
           reduce-scatters, graph_passes.gloo_collectives, and its exchanges, dhelix::exchange):
           every rank sends and receives at once. Broadcasts from each rank in turn
           carry one direction at a time: on a 539 Mbit/s link a 2-rank probe's bmm ran
           1.01-1.23x slower beside them and 1.27-1.45x beside all-to-alls of the same size
           (2026-11-27, a 2-core Intel Xeon; BENCHMARKS.md, "Mixture of experts")
    key    "contention|<op signature>|bytes=..|iters=..|backend=..|size=..|in_flight=..|<xfer>"
           (``cache`` is the caller's in-process memo: the key cannot name the link, so a factor
           never goes to the disk cache; see cost_model.profile.estimator)
    if every rank has key in cache:   factor = max over ranks of the cached factors
    else:  t_one = one xfer(bytes), timed after a warm-up (the slowest rank's)
           k = transfers back to back that outlast the iters calls (1 if t_one outlasts them,
               else 1 + ceil(their time / t_one), <= 64)
           repeats times (at most ``running.LONG_OP_REPEATS`` where the iters calls take
           2 x MAX_SAMPLE_S or more on the slowest rank: a single call of a long op, timed as
           few times as ``running.median_op_run_or_nan_s`` times it):
                           t_alone = time(iters calls)
                           barrier; k async xfer(bytes); t_busy = time(iters calls); wait all
           factor = max over ranks of max(1, median(t_busy) / median(t_alone))
    cache[key] = factor
    share  (with ``shares``) the CPU the stand-in's transfer threads (gloo's,
           ``profile.threads``) ran during each timed busy window over the window, median,
           agreed by MAX: how much of the core its transfers took. Where transfer threads run
           on the compute's cores, the factor holds that much; a transfer that takes more or
           less is priced from it (``profile.estimator``: ``cpu share``)

The timed calls run with a transfer in flight from their first to their last: the slowdown the
simulator applies to compute under a transfer. (One transfer shorter than the calls, as this
measured before, left part of them unslowed: 1.01 for a data-parallel backward whose
reduce-scatters took a third of a core on this machine.)

Every rank takes the same branch (the cache check is agreed first), so the transfers match.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.fx

from cost_model.comm_nodes import describe_comm, resolve_group_size
from cost_model.nodes import call_target
from cost_model.profile.running import LONG_OP_REPEATS, device_of_nodes, real_args
from cost_model.profile.threads import gloo_thread_ids, threads_cpu_s
from cost_model.rank_agreement import agree_max, backend_name, comm_device
from cost_model.symbolic import evaluate, size_hints
from cost_model.timing import synchronize

MIN_BYTES: int = 1 << 20
MAX_BYTES: int = 64 << 20
MAX_SAMPLE_S: float = 0.02
MAX_ITERS: int = 1000
MAX_IN_FLIGHT: int = 64
#: Factors of one kind a process measures; later graphs take their median. Each costs about
#: 160 ms on the 2-core CPU machine (repeats of 20 ms of compute, alone and beside the
#: transfer), and HF Llama TP+SP's first helix step calibrated 25 graphs: 50 factors, 8 s.
MAX_FACTORS: int = 3

Transfer = Literal["reduce", "move"]
CONTENTION_KEY_PREFIX = "contention|"
"""What every contention key starts with (the module docstring's ``key``)."""
TRANSFERS: tuple[Transfer, ...] = ("reduce", "move")
REDUCING_COLLECTIVES = frozenset({"all_reduce", "reduce_scatter", "reduce"})


def transfer_of(collective: str | None) -> Transfer:
    """Which kind of transfer a collective (``NodeCost.collective``) is, for its contention."""
    return "reduce" if collective in REDUCING_COLLECTIVES else "move"


def measure_contention(
    compute: Sequence[tuple[float, str, torch.fx.Node]],
    comms: Sequence[tuple[float, torch.fx.Node]],
    group: Any,
    cache: dict[str, float],
    repeats: int,
    transfer: Transfer = "reduce",
    shares: dict[str, float] | None = None,
) -> float | None:
    """The compute slowdown under a ``transfer`` (module docstring).

    ``compute``: ``(seconds, signature, node)`` of every measured compute op; ``comms``:
    ``(seconds, node)`` of every measured collective issue; ``cache`` gains the factor's key,
    and ``shares`` (when given) the stand-in transfers' CPU share under the same key.
    """
    if len(factors_of(cache, transfer)) >= MAX_FACTORS:  # the same count on every rank: the keys are agreed
        return None
    if group is None or backend_name(group) == "fake" or resolve_group_size(group) in (None, 1):
        return None
    if not compute or not comms:
        return None
    t_compute, sig, node = max(compute, key=lambda c: (c[0], c[1]))
    largest_bytes = max(_comm_nbytes(n) for _, n in comms)
    nbytes = int(min(max(largest_bytes, MIN_BYTES), MAX_BYTES))
    iters = int(min(MAX_ITERS, max(1, math.ceil(MAX_SAMPLE_S / max(t_compute, 1e-7)))))
    key = (
        f"{CONTENTION_KEY_PREFIX}{sig}|bytes={nbytes}|iters={iters}|backend={backend_name(group)}|size={resolve_group_size(group)}"
        f"|in_flight=all|{transfer}"
    )  # ends with the transfer's kind: factors_of reads it back
    # Every rank must take the same branch: measure unless the key is cached everywhere.
    if not agree_max([0.0 if key in cache else 1.0], group)[0]:
        factor = agree_max([cache[key]], group)[0]
        cache[key] = factor
        if shares is not None:
            shares[key] = agree_max([shares.get(key, 0.0)], group)[0]
        return factor
    import torch.distributed as dist

    hints = size_hints([node, *node.all_input_nodes])
    device = device_of_nodes([node])
    try:
        args, kwargs = real_args(node, hints)
    except Exception:  # noqa: BLE001 - no inputs for the op: time the transfer alone
        args = None
    size = int(resolve_group_size(group) or 1)
    buf = torch.zeros(nbytes // 4 // size * size, dtype=torch.float32, device=comm_device(group, device))
    out = torch.empty_like(buf)

    def send(async_op: bool) -> Any:
        if transfer == "reduce":
            return dist.all_reduce(buf, group=group, async_op=async_op)
        return dist.all_to_all_single(out, buf, group=group, async_op=async_op)

    def compute_once() -> None:
        if args is not None:
            for _ in range(iters):
                call_target(node)(*args, **kwargs)
            synchronize(device)

    t0 = time.perf_counter()
    compute_once()
    window_s = time.perf_counter() - t0
    one_s = []
    for _ in range(2):  # a warm-up, then the timed one
        dist.barrier(group=group)
        t0 = time.perf_counter()
        send(async_op=False)
        one_s.append(time.perf_counter() - t0)
    one, window = agree_max([one_s[-1], window_s], group)
    in_flight = 1 if one >= window else int(min(MAX_IN_FLIGHT, 1 + math.ceil(window / max(one, 1e-6))))
    if window >= 2 * MAX_SAMPLE_S:  # one call outlasts the sample; agreed: every rank times as many
        repeats = min(repeats, LONG_OP_REPEATS)
    alone: list[float] = []
    busy: list[float] = []
    busy_shares: list[float] = []
    threads = gloo_thread_ids()  # listed once: each window reads only their clocks
    for _ in range(repeats):
        t0 = time.perf_counter()
        compute_once()
        alone.append(time.perf_counter() - t0)
        dist.barrier(group=group)
        # back to back, so that a transfer is in flight for all of the timed calls (their values
        # race on one buffer; only the time is used)
        works = [send(async_op=True) for _ in range(in_flight)]
        cpu0 = threads_cpu_s(threads)
        t0 = time.perf_counter()
        compute_once()
        busy.append(time.perf_counter() - t0)
        busy_shares.append((threads_cpu_s(threads) - cpu0) / max(busy[-1], 1e-9))
        for work in works:
            work.wait()
    base = statistics.median(alone)
    local = max(1.0, statistics.median(busy) / base) if base > 0 else 1.0
    factor = agree_max([local], group)[0]
    cache[key] = factor
    if shares is not None:
        shares[key] = agree_max([statistics.median(busy_shares)], group)[0]
    return factor


def factors_of(cache: dict[str, float], transfer: Transfer) -> list[float]:
    """The values a memo keyed as ``measure_contention`` keys it holds for ``transfer``'s kind:
    the factors of its ``cache``, or the stand-ins' CPU shares of its ``shares``."""
    return [value for key, value in cache.items() if key.endswith(f"|{transfer}")]


def _comm_nbytes(node: torch.fx.Node) -> int:
    """The bytes a collective moves, or a P2P exchange sends (``describe_comm``); 0 when unknown."""
    try:
        call = describe_comm(node, 1)
    except ValueError:
        return 0
    nbytes = call.nbytes
    if isinstance(nbytes, int):
        return nbytes
    return int(evaluate(nbytes, size_hints([node, *node.all_input_nodes])))


__all__ = [
    "CONTENTION_KEY_PREFIX",
    "MAX_FACTORS",
    "TRANSFERS",
    "Transfer",
    "factors_of",
    "measure_contention",
    "transfer_of",
]
