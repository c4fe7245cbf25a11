"""The threads that move a process's transfers, and the cores its compute has.

On a CPU rank a transfer runs on threads of its own (gloo's: torch's ``pt_gloo_runloop`` workers
run each collective, gloo's ``gloo_tcp_loop`` moves the bytes). Where every core already runs a
rank's compute, the CPU those threads take comes out of the compute: the profiler prices that
(``cost_model.profile.estimator``: a transfer's ``cpu_share``), and the bench reports it.

Contract
--------
``gloo_thread_ids() -> list[int]``: this process's threads named one of ``GLOO_THREAD_NAMES``
(``/proc/self/task/<tid>/comm``; none where there is no ``/proc``). Listing them takes about
0.2 ms: read them once, then their clocks.

``threads_cpu_s(tids) -> float``: the CPU seconds those threads have run, each from its own CPU
clock (to the nanosecond; ``/proc``'s ticks are 10 ms); a thread that exited counts 0.
``gloo_threads_cpu_s()`` is that over ``gloo_thread_ids()``.

``local_ranks()``: ranks on this machine (``LOCAL_WORLD_SIZE``, else the default group's size,
else 1). ``usable_cores()``: the cores this process may run on.
``compute_fills_cores(threads_per_rank) -> bool``: every core runs a rank's compute
(``local_ranks() x threads_per_rank >= usable_cores()``).

The names are gloo's and torch's, not an API: ``tests/test_comm_threads.py`` checks that a gloo
group still has threads by these names.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

#: Thread names of a gloo process group's communication threads (torch 2.13, gloo).
GLOO_THREAD_NAMES = frozenset({"pt_gloo_runloop", "gloo_tcp_loop"})

_TASKS = Path("/proc/self/task")


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


def thread_cpu_clock(tid: int) -> int:
    """The clock id of thread ``tid``'s CPU time (Linux: ``CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED``
    over the inverted thread id, as glibc's ``pthread_getcpuclockid`` builds it)."""
    return ((~tid) << 3) | 6


def threads_cpu_s(tids: Sequence[int]) -> float:
    """CPU seconds the threads ``tids`` of this process have run (an exited thread counts 0)."""
    total = 0.0
    for tid in tids:
        try:
            total += time.clock_gettime(thread_cpu_clock(tid))
        except OSError:  # the thread exited
            continue
    return total


def gloo_threads_cpu_s() -> float:
    """CPU seconds this process's gloo threads have run (0.0 without gloo threads or ``/proc``)."""
    return threads_cpu_s(gloo_thread_ids())


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


def compute_fills_cores(threads_per_rank: int) -> bool:
    """Every core runs a rank's compute: the ranks on this machine times their compute threads
    reach its usable cores, so a transfer's threads run on a core the compute needs."""
    return local_ranks() * threads_per_rank >= usable_cores()


__all__ = [
    "GLOO_THREAD_NAMES",
    "compute_fills_cores",
    "gloo_thread_ids",
    "gloo_threads_cpu_s",
    "local_ranks",
    "thread_cpu_clock",
    "threads_cpu_s",
    "usable_cores",
]
