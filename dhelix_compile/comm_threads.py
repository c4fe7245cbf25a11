"""Gloo's communication threads ahead of the compute: what lets a transfer fly under it on CPU ranks.

A CPU rank computes on its own thread; gloo moves its transfers on threads of its own (torch's
``pt_gloo_runloop`` workers run each collective, gloo's ``gloo_tcp_loop`` moves the bytes). A
transfer needs those threads several times on its way (to send, to receive, to mark the work
done), and with every core computing, each time it waits for the scheduler. On this project's
2-core machine (BENCHMARKS.md, 2026-11-26, sixth session) a 512 KiB all-to-all took 0.6 ms
alone and 3.1-4.3 ms while both ranks ran matmuls, on loopback and over a 1.4 Gbit/s link alike,
and a lower priority for the compute thread (nice 10 or 19, ``SCHED_BATCH``) did not change
that. With gloo's threads at the lowest real-time priority it took 0.6 ms under the matmuls too,
and ``helix``'s step on the reference model went from 1.31x to 1.07x of the machine's ceiling.

Contract
--------
``prioritize_gloo_threads(local_ranks, threads_per_rank) -> ThreadPriority``: unless the ranks
on this machine oversubscribe its cores (below), every thread of this process named one of
``GLOO_THREAD_NAMES`` (``/proc/self/task/<tid>/comm``) that runs under the normal policy moves to
``SCHED_FIFO`` priority 1: the lowest real-time priority, ahead of every normal thread (a waking
gloo thread preempts the compute at once) and behind every other real-time one.

* Idempotent; threads already real-time are counted (``already``), not touched. Threads of
  process groups created later are not moved: call again (the backend does, before it plans
  each graph with communication).
* Nothing to move (no gloo group in this process): ``ThreadPriority(0, 0)``.
* Not permitted (no ``CAP_SYS_NICE``) or not Linux: nothing changes, ``reason`` says why; the
  backend logs it once.
* **Oversubscribed** (``local_ranks x threads_per_rank`` above the cores this process may run
  on): nothing changes, ``reason`` says so. With more ranks than cores, a real-time thread can
  hold a core that a rank its peers wait for needs: 4 ranks on this project's 2 cores, compiling
  a graph with profiled costs, had their ``gloo_tcp_loop`` threads at 96% of a core each and did
  not finish in 240 s (21 s at normal priority).
* A thread that exits meanwhile is skipped.

``gloo_threads_cpu_s() -> float``: the CPU seconds this process's gloo threads have run so far
(each thread's own CPU clock, to the nanosecond; ``/proc``'s ticks are 10 ms). The bench takes it
around each step, to tell the CPU the transfers took from the compute's.

The kernel's real-time throttling (``/proc/sys/kernel/sched_rt_runtime_us``, 95% of each second
by default) keeps real-time threads from holding a core whole; gloo's threads block between
transfers (``epoll_wait``, condition variables), so they take only the CPU the transfers need.
The names are gloo's and torch's, not an API: ``tests/test_comm_threads.py`` checks that a gloo
group still has threads by these names.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

#: Thread names of a gloo process group's communication threads (torch 2.13, gloo).
GLOO_THREAD_NAMES = frozenset({"pt_gloo_runloop", "gloo_tcp_loop"})

_TASKS = Path("/proc/self/task")


@dataclasses.dataclass(frozen=True)
class ThreadPriority:
    """What :func:`prioritize_gloo_threads` did."""

    moved: int
    """Gloo threads this call moved to real-time priority."""
    already: int
    """Gloo threads found at a real-time priority already."""
    reason: str | None = None
    """Why threads that should have moved did not (None: nothing failed)."""


def gloo_thread_ids() -> list[int]:
    """This process's threads named one of :data:`GLOO_THREAD_NAMES` (none where there is no ``/proc``)."""
    found = []
    try:
        tasks = sorted(_TASKS.iterdir(), key=lambda p: int(p.name))
    except OSError:
        return []
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread exited
            continue
        if name in GLOO_THREAD_NAMES:
            found.append(int(task.name))
    return found


def _thread_cpu_clock(tid: int) -> int:
    """The clock id of thread ``tid``'s CPU time (Linux: ``CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED``
    over the inverted thread id, as glibc's ``pthread_getcpuclockid`` builds it)."""
    return ((~tid) << 3) | 6


def gloo_threads_cpu_s() -> float:
    """CPU seconds this process's gloo threads have run (0.0 without gloo threads or ``/proc``)."""
    if not hasattr(os, "sched_setscheduler"):
        return 0.0
    total = 0.0
    for tid in gloo_thread_ids():
        try:
            total += time.clock_gettime(_thread_cpu_clock(tid))
        except OSError:  # the thread exited
            continue
    return total


def local_ranks() -> int:
    """Ranks on this machine: ``LOCAL_WORLD_SIZE`` (torchrun sets it), else every rank of the
    default process group (one machine), else 1."""
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(os.environ["LOCAL_WORLD_SIZE"])
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform tells, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def prioritize_gloo_threads(local_ranks: int = 1, threads_per_rank: int = 1) -> ThreadPriority:
    """Move this process's gloo threads ahead of its compute (see the module docstring):
    ``local_ranks`` ranks on this machine, each computing on ``threads_per_rank`` threads."""
    tids = gloo_thread_ids()
    if not tids:
        return ThreadPriority(0, 0)
    cores = usable_cores()
    if local_ranks * threads_per_rank > cores:
        reason = f"{local_ranks} ranks x {threads_per_rank} threads on {cores} cores: oversubscribed"
        return ThreadPriority(0, 0, reason)
    if not hasattr(os, "sched_setscheduler"):
        return ThreadPriority(0, 0, "this platform has no sched_setscheduler")
    moved = already = 0
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) in (os.SCHED_FIFO, os.SCHED_RR):
                already += 1
                continue
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
            moved += 1
        except ProcessLookupError:  # the thread exited
            continue
        except PermissionError as exc:
            reason = f"no permission for real-time priority (CAP_SYS_NICE): {exc.strerror}"
            return ThreadPriority(moved, already, reason)
    return ThreadPriority(moved, already)


__all__ = [
    "GLOO_THREAD_NAMES",
    "ThreadPriority",
    "gloo_thread_ids",
    "gloo_threads_cpu_s",
    "local_ranks",
    "prioritize_gloo_threads",
    "usable_cores",
]
