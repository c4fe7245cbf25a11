"""Tests of ``dhelix_compile.testing.multirank.run_on_ranks``: results, errors, hangs, cleanup.

The rank functions are module-level so that the rank processes can import them by name. No test
here asserts a wall-clock time: on a loaded machine that would fail for the wrong reason.
"""

from __future__ import annotations

import atexit
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dhelix_compile.testing.multirank import MultiRankError, MultiRankTimeout, run_on_ranks

# ---- rank functions ---------------------------------------------------------------------------


def _sum_of_ranks(rank: int, world_size: int, offset: int, *, scale: float) -> dict[str, object]:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "value": scale * (rank + offset),
        "sum_of_ranks": total.item(),
        "tensor": torch.full((2,), float(rank)),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
    }


def _inner_helper_that_raises(rank: int) -> None:
    raise ValueError(f"boom from rank {rank}")


def _one_rank_raises_others_wait(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        _inner_helper_that_raises(rank)
    dist.barrier()  # never completes: bad_rank never joins
    return rank


def _rank0_blocks_in_collective_rank1_sleeps(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins (and never exits)
    else:
        time.sleep(3600)


def _crash_unpicklable_and_stuck(rank: int, world_size: int) -> object:
    # every rank past the group's set-up first: a rank that exits while a slower one still
    # connects makes that one's init raise (a CI run under load reported rank 3 as an exception)
    dist.barrier()
    if rank == 1:
        os._exit(7)
    if rank == 2:
        return lambda: None  # not picklable
    if rank == 3:
        time.sleep(3600)  # unaware of the others' failures: killed after grace_s
    return rank


def _abort_in_named_helper() -> None:
    os.abort()  # what glibc does on heap corruption: SIGABRT, no Python exception


def _rank1_aborts(rank: int, world_size: int) -> int:
    if rank == 1:
        _abort_in_named_helper()
    return rank


def _rank1_reports_then_does_not_exit(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 1:
        atexit.register(time.sleep, 3600)  # what a thread or a teardown that never ends does
    raise ValueError(f"boom from rank {rank}")


# ---- helpers ----------------------------------------------------------------------------------


def _assert_reaped(pids: list[int] | tuple[int, ...]) -> None:
    """Every worker is gone: reaped (no zombie) and not running."""
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} still exists"


def _zombie_children() -> list[int]:
    zombies = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.append(int(entry))
    return zombies


# ---- tests ------------------------------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_results_are_collected_in_rank_order(world_size: int) -> None:
    results = run_on_ranks(_sum_of_ranks, world_size, 10, scale=0.5, timeout_s=90)
    assert [r["rank"] for r in results] == list(range(world_size))
    expected_sum = float(sum(range(world_size)))
    for rank, r in enumerate(results):
        assert r["world_size"] == world_size
        assert r["value"] == 0.5 * (rank + 10)
        assert r["sum_of_ranks"] == expected_sum
        assert r["threads"] == 1
        torch.testing.assert_close(r["tensor"], torch.full((2,), float(rank)))
    assert len({r["pid"] for r in results}) == world_size
    _assert_reaped([r["pid"] for r in results])
    assert _zombie_children() == []


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_exception_names_the_rank_and_its_traceback() -> None:
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_one_rank_raises_others_wait, 4, 2, timeout_s=90, grace_s=2.0)
    err = info.value
    assert not isinstance(err, MultiRankTimeout)
    # The peers blocked in the barrier either fail too (gloo: "Connection closed by peer") or
    # are killed after grace_s; either way rank 2 is named as the first failure.
    assert err.first_failure is not None and err.first_failure.rank == 2
    assert sorted(err.failed_ranks + err.unfinished_ranks) == [0, 1, 2, 3]
    text = str(err)
    assert text.startswith("run_on_ranks: rank 2 of 4 failed first (exception)")
    assert "ValueError: boom from rank 2" in text
    assert "_inner_helper_that_raises" in text  # the remote traceback, not just the message
    _assert_reaped(err.pids)
    assert _zombie_children() == []


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_hang_fails_with_timeout_naming_unfinished_ranks() -> None:
    timeout_s = 12.0  # includes spawning the workers and importing torch (a few seconds)
    with pytest.raises(MultiRankTimeout) as info:
        run_on_ranks(_rank0_blocks_in_collective_rank1_sleeps, 2, timeout_s=timeout_s)
    err = info.value
    assert err.unfinished_ranks == [0, 1]
    assert err.failed_ranks == []
    assert "did not finish within timeout_s=12" in str(err)
    stacks = {f.rank: f.stack for f in err.failures}
    assert "all_reduce" in stacks[0]
    assert "_rank0_blocks_in_collective_rank1_sleeps" in stacks[1]
    _assert_reaped(err.pids)
    assert _zombie_children() == []


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_crash_unpicklable_result_and_stuck_rank_are_reported() -> None:
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_crash_unpicklable_and_stuck, 4, timeout_s=90, grace_s=2.0)
    err = info.value
    assert not isinstance(err, MultiRankTimeout)
    by_rank = {f.rank: f for f in err.failures}
    assert sorted(by_rank) == [1, 2, 3]  # rank 0 returned
    assert by_rank[1].kind == "crashed"
    assert "exited with code 7" in by_rank[1].detail
    assert by_rank[2].kind == "exception"
    assert "pickle" in by_rank[2].detail.lower()
    assert by_rank[3].kind == "not_finished"
    assert "after another rank failed" in by_rank[3].detail
    assert "_crash_unpicklable_and_stuck" in by_rank[3].stack
    _assert_reaped(err.pids)
    assert _zombie_children() == []


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_rank_that_reports_and_does_not_exit_is_flagged() -> None:
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_rank1_reports_then_does_not_exit, 2, timeout_s=90, grace_s=3.0)
    failures = {f.rank: f for f in info.value.failures}
    assert failures[1].kind == "exception" and failures[1].left_running
    assert failures[0].kind == "exception" and not failures[0].left_running
    assert "ValueError: boom from rank 1" in str(info.value)
    assert "rank 1 reported this but did not exit; killed" in str(info.value)
    _assert_reaped(info.value.pids)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_fatal_signal_reports_the_python_stack() -> None:
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(_rank1_aborts, 2, timeout_s=60)
    (failure,) = info.value.failures
    assert (failure.rank, failure.kind) == (1, "crashed")
    assert "code -6" in failure.detail
    assert "_abort_in_named_helper" in failure.detail  # faulthandler's stack, on the rank's stderr
    _assert_reaped(info.value.pids)


def test_unpicklable_function_fails_fast_without_leaving_workers() -> None:
    with pytest.raises(Exception, match=r"pickle|Can't get|local object"):
        run_on_ranks(lambda rank, world_size: rank, 2, timeout_s=30)
    assert _zombie_children() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"world_size": 0}, "world_size"), ({"world_size": 2, "timeout_s": 0}, "timeout_s")],
)
def test_invalid_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_on_ranks(_sum_of_ranks, **kwargs)


def _rank(rank: int, world_size: int) -> int:
    return rank


def _failure(detail: str) -> Any:
    from dhelix_compile.testing.multirank import MultiRankError, RankFailure

    return MultiRankError("run_on_ranks: rank 0 of 2 failed first", [RankFailure(0, "exception", detail)], 2, [1, 2])


_NOT_CONNECTED = (
    'Traceback (most recent call last):\n  File "rank_main.py", line 40, in main\n'
    '    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))\n'
    "RuntimeError: Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:4790"
)


def test_a_mesh_gloo_could_not_connect_is_launched_once_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a failure inside init_process_group's socket mesh, before fn ran, is launched again, once."""
    from dhelix_compile.testing import multirank

    calls: list[int] = []

    def flaky(*args: Any) -> list[int]:
        calls.append(1)
        if len(calls) == 1:
            raise _failure(_NOT_CONNECTED)
        return [0, 1]

    monkeypatch.setattr(multirank, "_run_job", flaky)
    assert multirank.run_on_ranks(_rank, 2) == [0, 1] and len(calls) == 2

    def always(*args: Any) -> list[int]:
        calls.append(1)
        raise _failure(_NOT_CONNECTED)

    calls.clear()
    monkeypatch.setattr(multirank, "_run_job", always)
    with pytest.raises(multirank.MultiRankError, match="connectFullMesh"):
        multirank.run_on_ranks(_rank, 2)
    assert len(calls) == 2

    def raises_in_fn(*args: Any) -> list[int]:
        calls.append(1)
        raise _failure("RuntimeError: Connection closed by peer (in fn, after init_process_group)")

    calls.clear()
    monkeypatch.setattr(multirank, "_run_job", raises_in_fn)
    with pytest.raises(multirank.MultiRankError):
        multirank.run_on_ranks(_rank, 2)
    assert len(calls) == 1
