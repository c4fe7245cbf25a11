"""Gloo's communication threads ahead of the compute: what lets a transfer fly under it on CPU ranks.

A CPU rank computes on its own thread; gloo moves its transfers on threads of its own (torch's
``pt_gloo_runloop`` workers run each collective, gloo's ``gloo_tcp_loop`` moves the bytes). A
transfer needs those threads several times on its way (to send, to receive, to mark the work
done), and with every core computing, each time it waits for the scheduler. On this project's
2-core machine (2026-11-26, an AMD EPYC) a 512 KiB all-to-all took 0.6 ms alone and
3.1-4.3 ms while both ranks ran matmuls, on loopback and over a 1.4 Gbit/s link alike, and a
lower priority for the compute thread (nice 10 or 19, ``SCHED_BATCH``) did not change
that. With gloo's threads at real-time priority it took 0.6 ms under the matmuls too, and
``helix``'s step on the reference model ran at 1.07x of the machine's ceiling, against 1.31x
with gloo's threads at normal priority.

**Why a deadline and not a fixed real-time priority.** Gloo's threads spin-wait for each other
in both directions: the event loop, woken for a pair whose lock a worker holds, skips it
(``try_lock``) and is woken again at once; a worker that frees a buffer the loop still holds
calls ``sched_yield`` until the loop lets go. Under ``SCHED_FIFO`` a spinner keeps its core
until what it waits for has run, and a yield gives the core to no one of lower priority: with
two spinners on two cores, what they wait for ran only in the kernel's real-time throttling slack
(5% of each second). A 2-rank replay of the reference model's
collectives that takes 0.22 s took 1.2-7.2 s in 3 launches of 6 (2026-11-27, 1.5 Gbit/s link;
``gdb`` showed ``gloo_tcp_loop`` and ``pt_gloo_runloop`` in those loops); 4 ranks on 2 cores hung
outright. Under ``SCHED_DEADLINE`` each gloo thread runs ahead of every normal and real-time
thread, but for at most ``runtime`` of every ``PERIOD_NS`` (``MAX_SHARE`` of a core, less where
there are many threads): a waking transfer preempts the compute at once, and a spin costs at
most its share while the thread it waits for runs. The replay took 0.22-0.51 s in 6 launches,
none stalled.

Contract
--------
``prioritize_gloo_threads(local_ranks, threads_per_rank) -> ThreadPriority``: unless the ranks
on this machine oversubscribe its cores (below), every thread of this process named one of
``GLOO_THREAD_NAMES`` (``/proc/self/task/<tid>/comm``) that runs under the normal policy moves to
``SCHED_DEADLINE`` with period and relative deadline ``PERIOD_NS`` and a runtime of
:func:`deadline_share` of it. It never raises, and a call moves all those threads or none: a
transfer needs each of them, so with some ahead of the compute it still waits for the
scheduler for the others, while the moved ones hold bandwidth that a smaller share needs.

* Idempotent; threads already under a deadline or real-time policy are counted (``already``),
  not touched. Threads of process groups created later are not moved: call again (the backend
  does, before it plans each graph with communication).
* Nothing to move (no gloo group in this process): ``ThreadPriority(0, 0)``.
* **The kernel's deadline bandwidth full** (``EBUSY``, its admission control: the deadline
  threads of every process on the machine, other ranks' and other jobs', get at most
  ``sched_rt_runtime_us / sched_rt_period_us``, 95%, of each core): the threads this call moved
  go back to the normal policy (their reservations shrunk first: Linux 6.18 keeps the bandwidth
  of a sleeping thread that leaves ``SCHED_DEADLINE`` otherwise), and it tries again at half the
  share, and half again, none below ``MIN_SHARE``. A smaller share still puts a waking transfer
  ahead of the compute (10% of each period took 30-60% longer than 30% on the reference model's
  collectives; at normal priority a 512 KiB all-to-all beside matmuls took 5-7x as long).
  Admitted: ``reason`` is None, ``share`` says what the threads got, ``refused_share`` what the
  kernel refused first. Refused every share: the threads stay at normal priority and ``reason``
  says so; a later call tries again (the bandwidth frees as the processes holding it exit).
* Not permitted (``EPERM``: no ``CAP_SYS_NICE``, or a CPU affinity narrower than the cores
  the kernel balances the process over, which ``SCHED_DEADLINE`` requires), not Linux, an
  architecture whose ``sched_setattr`` number this module does not know, or any other refusal:
  the threads this call moved go back to the normal policy, ``reason`` says why.
* **Oversubscribed** (``local_ranks x threads_per_rank`` above the cores this process may run
  on): nothing changes, ``reason`` says so. With more ranks than cores, a thread ahead of the
  compute can hold a core that a rank its peers wait for needs: 4 ranks on this project's
  2 cores, compiling a graph with profiled costs, had their ``gloo_tcp_loop`` threads at 96% of
  a core each (``SCHED_FIFO``) and did not finish in 240 s (21 s at normal priority).
* A thread that exits meanwhile is skipped.
* Where threads stay at normal priority, the backend (``capture``) logs the first ``reason`` of
  the process as its one warning (a transfer in flight then waits for the scheduler while the
  rank computes: less of it hides under the compute), later ones at INFO.

``deadline_share(local_ranks, gloo_threads, cores) -> float``: the share of a core each gloo
thread may run per period: ``MAX_SHARE``, or less so that every rank's gloo threads together
stay under 90% of the cores (the kernel admits at most 95%); 0.0 below ``MIN_SHARE``, too little
to move bytes (nothing moves then, and the reason says so).

The threads are found by name, and their CPU read, by ``cost_model.profile.threads`` (the
profiler prices a transfer's CPU with them; re-exported here): ``GLOO_THREAD_NAMES``,
``gloo_thread_ids()``, ``gloo_threads_cpu_s()`` (the bench takes it around each step, to tell the
CPU the transfers took from the compute's), ``local_ranks()``, ``usable_cores()``.
``tests/test_comm_threads.py`` checks that a gloo group still has threads by those names, and
that they move, or stay where the kernel refuses them, as above.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import struct

from cost_model.profile.threads import (
    GLOO_THREAD_NAMES,
    gloo_thread_ids,
    gloo_threads_cpu_s,
    local_ranks,
    usable_cores,
)

#: ``SCHED_DEADLINE``'s period and relative deadline for a gloo thread (1 ms: a transfer's steps
#: are tens of microseconds of CPU; a spin is cut off within a millisecond).
PERIOD_NS = 1_000_000
#: The most of each period a gloo thread may run (30% measured as fast as ``SCHED_FIFO`` on the
#: reference model's collectives; 10% slowed them by 30-60%).
MAX_SHARE = 0.3
#: Below this share per thread, nothing moves.
MIN_SHARE = 0.05
#: The reservation a thread shrinks to before it leaves ``SCHED_DEADLINE`` (see ``_set_normal``):
#: the kernel's least runtime (1024 ns) per second.
_PARK_RUNTIME_NS = 1024
_PARK_PERIOD_NS = 1_000_000_000
#: Linux's ``SCHED_DEADLINE`` (``os`` does not name it) and ``sched_setattr``'s syscall number per architecture.
SCHED_DEADLINE = 6
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}


@dataclasses.dataclass(frozen=True)
class ThreadPriority:
    """What :func:`prioritize_gloo_threads` did."""

    moved: int
    """Gloo threads this call moved to ``SCHED_DEADLINE`` (0 where it fell back: it moves all or
    none, unless the kernel refused to move one back, which then counts here)."""
    already: int
    """Gloo threads found at a real-time priority already."""
    reason: str | None = None
    """Why threads that should have moved did not (None: nothing failed)."""
    share: float = 0.0
    """The share of each period this call gave each thread it moved (0.0 where it moved none;
    threads moved before keep theirs)."""
    refused_share: float = 0.0
    """The first share the kernel refused this call for want of bandwidth (``EBUSY``; 0.0 where
    it refused none): above ``share`` where a smaller one was admitted."""


def deadline_share(local_ranks: int, gloo_threads: int, cores: int) -> float:
    """The share of a core each gloo thread may run per period (see the module docstring)."""
    share = min(MAX_SHARE, 0.9 * cores / max(local_ranks * gloo_threads, 1))
    return share if share >= MIN_SHARE else 0.0


def _set_deadline(tid: int, runtime_ns: int, period_ns: int = PERIOD_NS) -> None:
    """``sched_setattr(tid, SCHED_DEADLINE, runtime, deadline = period)``; raises ``OSError``
    (``PermissionError``, ``ProcessLookupError``, ``EBUSY``) as the kernel refuses."""
    number = _SCHED_SETATTR.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"no sched_setattr number known for {os.uname().machine}")
    # struct sched_attr (SCHED_ATTR_SIZE_VER0 = 48 bytes): size, policy, flags, nice, priority,
    # runtime, deadline, period
    attr = struct.pack("IIQiIQQQ", 48, SCHED_DEADLINE, 0, 0, 0, runtime_ns, period_ns, period_ns)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, tid, ctypes.c_char_p(attr), 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _set_normal(tid: int) -> bool:
    """Thread ``tid`` from ``SCHED_DEADLINE`` back to ``SCHED_OTHER`` (its nice value as before:
    ``SCHED_DEADLINE`` keeps it); False where the kernel refuses.

    It first shrinks the thread's reservation to ``_PARK_RUNTIME_NS`` per ``_PARK_PERIOD_NS``: the
    kernel returns a shrunk reservation's bandwidth at once, but Linux 6.18.44 never returns that
    of a sleeping thread that leaves ``SCHED_DEADLINE`` (measured: each such move kept 0.1 of a
    core admitted until the root domain was rebuilt, and gloo's threads mostly sleep); what
    stays is 1/1048576 of a core."""
    with contextlib.suppress(OSError):  # refused: the move back goes ahead, the reservation may stay
        _set_deadline(tid, _PARK_RUNTIME_NS, _PARK_PERIOD_NS)
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except ProcessLookupError:  # the thread exited
        return True
    except OSError:
        return False
    return True


def _move_all(tids: list[int], runtime_ns: int) -> tuple[list[int], OSError | None]:
    """Every thread of ``tids`` to ``SCHED_DEADLINE``, or at the kernel's first refusal, the ones
    moved back. Returns the threads left under the deadline (those that still exist; after a
    refusal, those the kernel would not move back) and the refusal."""
    moved: list[int] = []
    for tid in tids:
        try:
            _set_deadline(tid, runtime_ns)
        except ProcessLookupError:  # the thread exited
            continue
        except OSError as exc:
            return [t for t in moved if not _set_normal(t)], exc
        moved.append(tid)
    return moved, None


def _refusal(exc: OSError, cores: int) -> str:
    """Why the kernel refused a thread ``SCHED_DEADLINE`` (other than for bandwidth), in words."""
    if exc.errno != errno.EPERM:
        return f"sched_setattr failed: {exc.strerror}"
    all_cores = os.cpu_count() or cores
    if cores < all_cores:
        why = f"no CAP_SYS_NICE, or a CPU affinity of {cores} of the machine's {all_cores} cores"
    else:
        why = "no CAP_SYS_NICE"
    return f"no permission for real-time scheduling ({why}): {exc.strerror}"


def _percent(share: float) -> str:
    return f"{share * 100:g}%"


def prioritize_gloo_threads(local_ranks: int = 1, threads_per_rank: int = 1) -> ThreadPriority:
    """Move this process's gloo threads ahead of its compute, all or none, never raising (see the
    module docstring): ``local_ranks`` ranks on this machine, each computing on ``threads_per_rank``
    threads."""
    tids = gloo_thread_ids()
    if not tids:
        return ThreadPriority(0, 0)
    cores = usable_cores()
    if local_ranks * threads_per_rank > cores:
        reason = f"{local_ranks} ranks x {threads_per_rank} threads on {cores} cores: oversubscribed"
        return ThreadPriority(0, 0, reason)
    if not hasattr(os, "sched_getscheduler") or not hasattr(os, "uname"):
        return ThreadPriority(0, 0, "this platform has no sched_setattr")
    share = deadline_share(local_ranks, len(tids), cores)
    if share == 0.0:
        reason = f"{local_ranks} ranks x {len(tids)} gloo threads on {cores} cores: too little deadline bandwidth each"
        return ThreadPriority(0, 0, reason)
    to_move: list[int] = []
    already = 0
    for tid in tids:
        try:
            policy = os.sched_getscheduler(tid)
        except ProcessLookupError:  # the thread exited
            continue
        except OSError as exc:
            return ThreadPriority(0, already, f"sched_getscheduler failed: {exc.strerror}")
        if policy in (SCHED_DEADLINE, os.SCHED_FIFO, os.SCHED_RR):
            already += 1
        else:
            to_move.append(tid)
    if not to_move:
        return ThreadPriority(0, already)
    refused = 0.0
    while True:
        moved, refusal = _move_all(to_move, int(share * PERIOD_NS))
        if refusal is None:
            return ThreadPriority(len(moved), already, None, share, refused)
        if refusal.errno != errno.EBUSY:
            return ThreadPriority(len(moved), already, _refusal(refusal, cores), 0.0, refused)
        refused = refused or share
        if share / 2 < MIN_SHARE:
            tried = _percent(refused) if share == refused else f"{_percent(refused)} down to {_percent(share)}"
            reason = (
                f"the kernel's deadline bandwidth is full: {refusal.strerror} for {tried} of each ms per "
                "thread (other processes hold it)"
            )
            return ThreadPriority(len(moved), already, reason, 0.0, refused)
        share /= 2


__all__ = [
    "GLOO_THREAD_NAMES",
    "MAX_SHARE",
    "MIN_SHARE",
    "PERIOD_NS",
    "SCHED_DEADLINE",
    "ThreadPriority",
    "deadline_share",
    "gloo_thread_ids",
    "gloo_threads_cpu_s",
    "local_ranks",
    "prioritize_gloo_threads",
    "usable_cores",
]
