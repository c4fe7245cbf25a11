"""Gloo's threads ahead of the compute (``dhelix_compile.comm_threads``) and the backend's use of it."""

from __future__ import annotations

import errno
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


@linux_only
@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_gloo_groups_threads_move_to_real_time_once() -> None:
    """torch and gloo still name their threads as ``GLOO_THREAD_NAMES`` says (if a release renames
    them, this fails, not the overlap silently), and they move to SCHED_FIFO where permitted."""
    for result in run_on_ranks(_prioritize_on_a_gloo_group, 2, timeout_s=80):
        assert result["before"] and set(result["before"]) == {os.SCHED_OTHER}
        assert result["sum"] == [4.0] * 4
        cpu_before, cpu_after = result["gloo_cpu_s"]
        assert 0.0 < cpu_before < cpu_after, "gloo's threads' CPU clocks read, and they ran the transfers"
        first, second = result["first"], result["second"]
        if first.reason is not None:  # an unprivileged runner or a 1-core one: nothing moved, and it says why
            assert "CAP_SYS_NICE" in first.reason or "oversubscribed" in first.reason
            assert set(result["after"]) == {os.SCHED_OTHER}
            continue
        assert (first.moved, first.already, first.reason) == (len(result["before"]), 0, None)
        assert (second.moved, second.already, second.reason) == (0, len(result["before"]), None)
        assert 0 < first.share <= comm_threads.MAX_SHARE
        assert set(result["after"]) == {comm_threads.SCHED_DEADLINE}


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


def _compile_on_ranks(rank: int, world_size: int, priority: str) -> list[int]:
    import dhelix_compile

    def f(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    compiled = torch.compile(
        f,
        backend=dhelix_compile.backend(codegen="eager", cost_model="analytic", gloo_thread_priority=priority),
        fullgraph=True,
    )
    x = torch.full((4,), float(rank))
    torch.testing.assert_close(compiled(x), f(x))
    return _policies()


@linux_only
@pytest.mark.multirank
@pytest.mark.timeout(180)
@pytest.mark.parametrize("priority", ["realtime", "normal"])
def test_the_backend_moves_gloo_threads_when_it_compiles_a_graph_with_collectives(priority: str) -> None:
    moves = priority == "realtime" and os.geteuid() == 0 and comm_threads.usable_cores() >= 2
    expected = {comm_threads.SCHED_DEADLINE if moves else os.SCHED_OTHER}
    for policies in run_on_ranks(_compile_on_ranks, 2, priority, timeout_s=150):
        assert policies and set(policies) == expected
