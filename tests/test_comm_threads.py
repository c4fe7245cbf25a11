"""Gloo's threads ahead of the compute (``dhelix_compile.comm_threads``) and the backend's use of it."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cost_model.profile.threads import thread_cpu_clock
from dhelix_compile import comm_threads
from dhelix_compile.comm_threads import ThreadPriority, gloo_thread_ids, prioritize_gloo_threads
from dhelix_compile.testing.multirank import run_on_ranks

linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are listed from /proc")


def _policies() -> list[int]:
    return [os.sched_getscheduler(tid) for tid in gloo_thread_ids()]


def _prioritize_on_a_gloo_group(rank: int, world_size: int) -> dict[str, Any]:
    t = torch.ones(4)
    dist.all_reduce(t)  # the group's threads exist and have worked
    cpu_before = comm_threads.gloo_threads_cpu_s()
    big = torch.ones(1 << 20)
    for _ in range(4):
        dist.all_reduce(big)  # 4 MiB each way: gloo's threads run
    cpu_after = comm_threads.gloo_threads_cpu_s()
    before = _policies()
    first = prioritize_gloo_threads(world_size, 1)
    second = prioritize_gloo_threads(world_size, 1)
    dist.all_reduce(t)  # still works with its threads real-time
    return {
        "before": before,
        "first": first,
        "second": second,
        "after": _policies(),
        "sum": t.tolist(),
        "gloo_cpu_s": (cpu_before, cpu_after),
    }


_BANDWIDTH_FULL = "deadline bandwidth is full"


def _assert_all_or_none(call: ThreadPriority, threads: int, already: int) -> bool:
    """``call`` moved all ``threads`` or, the kernel's deadline bandwidth full (other processes on
    a busy machine hold it), none; True where it moved them."""
    if call.reason is None:
        assert (call.moved, call.already) == (threads, already)
        assert 0 < call.share <= comm_threads.MAX_SHARE
        assert call.refused_share == 0.0 or call.share < call.refused_share
        return True
    assert _BANDWIDTH_FULL in call.reason, call.reason
    assert (call.moved, call.already, call.share) == (0, already, 0.0)
    assert call.refused_share >= comm_threads.MIN_SHARE
    return False


@linux_only
@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_gloo_groups_threads_move_to_real_time_once() -> None:
    """torch and gloo still name their threads as ``GLOO_THREAD_NAMES`` says (if a release renames
    them, this fails, not the overlap silently), and they move to SCHED_DEADLINE where permitted,
    all of them or, where other processes hold the kernel's deadline bandwidth, none."""
    for result in run_on_ranks(_prioritize_on_a_gloo_group, 2, timeout_s=80):
        assert result["before"] and set(result["before"]) == {os.SCHED_OTHER}
        assert result["sum"] == [4.0] * 4
        cpu_before, cpu_after = result["gloo_cpu_s"]
        assert 0.0 < cpu_before < cpu_after, "gloo's threads' CPU clocks read, and they ran the transfers"
        first, second = result["first"], result["second"]
        threads = len(result["before"])
        if first.reason is not None and _BANDWIDTH_FULL not in first.reason:
            # an unprivileged runner or a 1-core one: nothing moved, and it says why
            assert "CAP_SYS_NICE" in first.reason or "oversubscribed" in first.reason
            assert set(result["after"]) == {os.SCHED_OTHER}
            continue
        if _assert_all_or_none(first, threads, already=0):
            assert (second.moved, second.already, second.reason) == (0, threads, None)
            assert set(result["after"]) == {comm_threads.SCHED_DEADLINE}
        else:  # refused, every thread left at normal priority: the second call tries again
            moved = _assert_all_or_none(second, threads, already=0)
            assert set(result["after"]) == {comm_threads.SCHED_DEADLINE if moved else os.SCHED_OTHER}


@linux_only
def test_a_threads_cpu_clock_is_read_from_outside_it() -> None:
    """``gloo_threads_cpu_s`` reads other threads' CPU clocks by thread id: the clock id it builds
    reads what the thread itself measures with ``time.thread_time``."""
    seen: dict[str, float] = {}
    started, stop = threading.Event(), threading.Event()

    def spin() -> None:
        started.set()
        while not stop.is_set():
            pass
        seen["own"] = time.thread_time()

    thread = threading.Thread(target=spin)
    thread.start()
    started.wait()
    time.sleep(0.05)
    assert thread.native_id is not None
    clock = thread_cpu_clock(thread.native_id)
    first = time.clock_gettime(clock)
    stop.set()
    time.sleep(0.01)  # the thread reads its own clock before it exits
    thread.join()
    assert 0.0 < first <= seen["own"] < first + 0.05


def test_without_gloo_threads_nothing_happens(monkeypatch: Any) -> None:
    monkeypatch.setattr(comm_threads, "gloo_thread_ids", lambda: [])
    assert prioritize_gloo_threads() == ThreadPriority(0, 0)


def _refuse(code: int) -> Any:
    def set_deadline(tid: int, runtime_ns: int) -> None:
        raise OSError(code, os.strerror(code))

    return set_deadline


@pytest.mark.parametrize(("code", "says"), [(errno.EPERM, "CAP_SYS_NICE"), (errno.EBUSY, "deadline bandwidth is full")])
def test_a_refusal_says_why_and_changes_nothing(monkeypatch: Any, code: int, says: str) -> None:
    monkeypatch.setattr(comm_threads, "gloo_thread_ids", lambda: [101, 102])
    monkeypatch.setattr(os, "sched_getscheduler", lambda tid: os.SCHED_OTHER)
    monkeypatch.setattr(comm_threads, "_set_deadline", _refuse(code))
    result = prioritize_gloo_threads()
    assert result.moved == 0 and result.reason is not None and says in result.reason


class _Kernel:
    """``SCHED_DEADLINE``'s admission control over threads 101, 102, ...: ``free`` of a core's
    bandwidth left by other processes; a thread holds its share from its move until it leaves
    ``SCHED_DEADLINE``, and, as on Linux 6.18.44 for a sleeping thread, keeps holding it after
    (``leaked``)."""

    def __init__(self, free: float) -> None:
        self.free = free
        self.share: dict[int, float] = {}
        self.leaked = 0.0
        self.moved_back: list[int] = []

    def set_deadline(self, tid: int, runtime_ns: int, period_ns: int = comm_threads.PERIOD_NS) -> None:
        held = self.leaked + sum(self.share.values()) - self.share.get(tid, 0.0)
        if held + runtime_ns / period_ns > self.free + 1e-9:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        self.share[tid] = runtime_ns / period_ns

    def set_scheduler(self, tid: int, policy: int, param: Any) -> None:
        assert policy == os.SCHED_OTHER
        self.leaked += self.share.pop(tid)
        self.moved_back.append(tid)

    def install(self, monkeypatch: Any, threads: int) -> None:
        monkeypatch.setattr(comm_threads, "gloo_thread_ids", lambda: list(range(101, 101 + threads)))
        monkeypatch.setattr(comm_threads, "usable_cores", lambda: 2)
        monkeypatch.setattr(os, "sched_getscheduler", lambda tid: os.SCHED_OTHER)
        monkeypatch.setattr(comm_threads, "_set_deadline", self.set_deadline)
        monkeypatch.setattr(os, "sched_setscheduler", self.set_scheduler)


def test_a_busy_kernel_admits_half_the_share_to_every_thread(monkeypatch: Any) -> None:
    """Other processes hold all but 0.6 of a core's deadline bandwidth: 3 threads at 30% do not
    fit (the kernel admits 2, refuses the third), and those 2 go back, shrunk first so that the
    kernel keeps next to none of their bandwidth, before all 3 move at 15%."""
    kernel = _Kernel(free=0.6)
    kernel.install(monkeypatch, threads=3)
    result = prioritize_gloo_threads(local_ranks=2, threads_per_rank=1)
    assert result == ThreadPriority(3, 0, None, comm_threads.MAX_SHARE / 2, comm_threads.MAX_SHARE)
    assert kernel.moved_back == [101, 102] and kernel.leaked < 1e-5
    assert kernel.share == pytest.approx({tid: comm_threads.MAX_SHARE / 2 for tid in (101, 102, 103)})


def test_a_full_kernel_leaves_every_thread_at_normal_priority(monkeypatch: Any) -> None:
    """Refused down to the least share worth moving, no thread stays moved (a transfer needs all
    of them), nothing raises, and the reason says what was refused."""
    kernel = _Kernel(free=0.2)  # 3 threads at 30%: none fits; at 15%: one; at 7.5%: two
    kernel.install(monkeypatch, threads=3)
    result = prioritize_gloo_threads(local_ranks=2, threads_per_rank=1)
    assert (result.moved, result.already, result.share, result.refused_share) == (0, 0, 0.0, comm_threads.MAX_SHARE)
    assert result.reason is not None and _BANDWIDTH_FULL in result.reason and "30% down to 7.5%" in result.reason
    assert kernel.share == {} and kernel.moved_back == [101, 101, 102] and kernel.leaked < 1e-5
    kernel.free = 1.0  # the processes that held it exit: the next call moves them all
    assert prioritize_gloo_threads(local_ranks=2, threads_per_rank=1) == ThreadPriority(3, 0, None, 0.3)


def test_a_narrow_cpu_affinity_is_named_where_the_kernel_refuses_permission(monkeypatch: Any) -> None:
    """``SCHED_DEADLINE`` needs an affinity over the machine's cores: root under ``taskset -c 0``
    is refused too, and the reason names both causes."""
    monkeypatch.setattr(comm_threads, "gloo_thread_ids", lambda: [101])
    monkeypatch.setattr(comm_threads, "usable_cores", lambda: 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "sched_getscheduler", lambda tid: os.SCHED_OTHER)
    monkeypatch.setattr(comm_threads, "_set_deadline", _refuse(errno.EPERM))
    result = prioritize_gloo_threads()
    assert result.moved == 0 and result.reason is not None
    assert "CAP_SYS_NICE" in result.reason and "affinity of 1 of the machine's 2 cores" in result.reason


def test_the_backend_warns_once_per_process_why_the_threads_stay(monkeypatch: Any, caplog: Any) -> None:
    """The first reason a process's threads stay at normal priority is its one warning, with what it
    means for overlap; later reasons go to INFO, and a later call that moves them says so there."""
    from dhelix_compile import capture

    monkeypatch.setattr(capture, "_THREAD_REASONS", set())
    full = ThreadPriority(0, 0, "the kernel's deadline bandwidth is full (30% down to 7.5% ...)")
    answers = iter(
        [full, full, ThreadPriority(0, 0, "no permission (CAP_SYS_NICE)"), ThreadPriority(3, 0, None, 0.15, 0.3)]
    )
    monkeypatch.setattr(capture, "prioritize_gloo_threads", lambda ranks, threads: next(answers))
    with caplog.at_level(logging.INFO, logger="dhelix"):
        for _ in range(4):
            capture._gloo_threads_ahead()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and full.reason in warnings[0] and "hides less" in warnings[0]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 2 and "CAP_SYS_NICE" in infos[0]
    assert "3 gloo threads moved" in infos[1] and "15.0% of each ms" in infos[1] and "refused 30.0%" in infos[1]


def test_more_ranks_than_cores_leaves_the_threads_alone(monkeypatch: Any) -> None:
    """A thread ahead of the compute on an oversubscribed machine can starve a rank its peers wait
    for (4 ranks on 2 cores did not finish a profiled compile): nothing moves, and the reason says so."""
    monkeypatch.setattr(comm_threads, "gloo_thread_ids", lambda: [101])
    monkeypatch.setattr(comm_threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(comm_threads, "_set_deadline", _refuse(errno.EINVAL))  # must not be called
    monkeypatch.setattr(os, "sched_getscheduler", lambda tid: os.SCHED_OTHER)
    result = prioritize_gloo_threads(local_ranks=4, threads_per_rank=1)
    assert result.moved == 0 and result.reason == "4 ranks x 1 threads on 2 cores: oversubscribed"
    assert prioritize_gloo_threads(local_ranks=2, threads_per_rank=2).reason is not None
    moved = []
    monkeypatch.setattr(comm_threads, "_set_deadline", lambda tid, runtime_ns: moved.append(tid))
    assert prioritize_gloo_threads(local_ranks=2, threads_per_rank=1) == ThreadPriority(1, 0, None, 0.3)


def test_each_thread_gets_a_bounded_share_that_the_kernel_can_admit() -> None:
    """At most MAX_SHARE of a core per period; all ranks' gloo threads together under 90% of the
    cores (the kernel admits 95%); too small a share moves nothing."""
    assert comm_threads.deadline_share(2, 3, 2) == comm_threads.MAX_SHARE  # 6 x 0.3 = 1.8 of 2 cores
    assert comm_threads.deadline_share(2, 6, 2) == pytest.approx(0.15)
    assert comm_threads.deadline_share(8, 8, 2) == 0.0
    for ranks, threads, cores in [(1, 1, 1), (2, 3, 2), (4, 5, 16), (2, 9, 2)]:
        share = comm_threads.deadline_share(ranks, threads, cores)
        assert share == 0.0 or ranks * threads * share <= 0.9 * cores + 1e-12


def test_too_many_threads_for_the_bandwidth_move_none(monkeypatch: Any) -> None:
    monkeypatch.setattr(comm_threads, "gloo_thread_ids", lambda: list(range(101, 141)))
    monkeypatch.setattr(comm_threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(comm_threads, "_set_deadline", _refuse(errno.EINVAL))  # must not be called
    result = prioritize_gloo_threads(local_ranks=2, threads_per_rank=1)
    assert result.moved == 0 and result.reason is not None and "too little deadline bandwidth" in result.reason


def test_local_ranks_come_from_torchrun_else_the_default_group(monkeypatch: Any) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert comm_threads.local_ranks() == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert comm_threads.local_ranks() == (dist.get_world_size() if dist.is_initialized() else 1)


def test_a_thread_that_exits_meanwhile_is_skipped(monkeypatch: Any) -> None:
    monkeypatch.setattr(comm_threads, "gloo_thread_ids", lambda: [101, 102])
    monkeypatch.setattr(comm_threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(os, "sched_getscheduler", lambda tid: os.SCHED_OTHER)
    moved = []

    def set_deadline(tid: int, runtime_ns: int) -> None:
        if tid == 101:
            raise ProcessLookupError(3, "No such process")
        moved.append((tid, runtime_ns))

    monkeypatch.setattr(comm_threads, "_set_deadline", set_deadline)
    assert prioritize_gloo_threads() == ThreadPriority(moved=1, already=0, share=comm_threads.MAX_SHARE)
    assert moved == [(102, int(comm_threads.MAX_SHARE * comm_threads.PERIOD_NS))]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _compile_on_ranks(rank: int, world_size: int, priority: str) -> tuple[list[int], list[str]]:
    import dhelix_compile

    def f(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    warnings = _Records()
    logging.getLogger("dhelix").addHandler(warnings)
    compiled = torch.compile(
        f,
        backend=dhelix_compile.backend(codegen="eager", cost_model="analytic", gloo_thread_priority=priority),
        fullgraph=True,
    )
    x = torch.full((4,), float(rank))
    torch.testing.assert_close(compiled(x), f(x))
    thread_warnings = [m for m in warnings.messages if "gloo's threads" in m]
    return _policies(), thread_warnings


@linux_only
@pytest.mark.multirank
@pytest.mark.timeout(180)
@pytest.mark.parametrize("priority", ["realtime", "normal"])
def test_the_backend_moves_gloo_threads_when_it_compiles_a_graph_with_collectives(priority: str) -> None:
    """Where the kernel admits them, the threads move; where other processes hold its deadline
    bandwidth (a busy machine), they stay at normal priority, the compile goes on and one warning
    says why."""
    moves = priority == "realtime" and os.geteuid() == 0 and comm_threads.usable_cores() >= 2
    expected = {comm_threads.SCHED_DEADLINE if moves else os.SCHED_OTHER}
    for policies, warnings in run_on_ranks(_compile_on_ranks, 2, priority, timeout_s=150):
        assert policies
        if moves and set(policies) == {os.SCHED_OTHER}:  # refused: the fallback and its one warning
            assert len(warnings) == 1 and _BANDWIDTH_FULL in warnings[0], warnings
            continue
        assert set(policies) == expected
        assert len(warnings) == (1 if priority == "realtime" and not moves else 0), warnings
