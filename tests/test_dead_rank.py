"""A rank that dies is an error, not a hang: every other rank's step fails within the README's bounds.

A victim rank SIGKILLs itself inside helix's merged graph, inside a helix_pipeline step (its
neighbours waiting on receives), during reshard's broadcasts and inside a data_parallel step's
forward, compiled and eager (``dhelix_compile.testing.dead_rank_checks``). Every survivor must
raise within ``SEEN_BOUND_S`` of the kill, with no non-daemon thread left, and exit by itself; no
process may outlive the run. A victim that SIGSTOPs itself (a peer that hangs, or whose death is
not seen) must fail the survivors at their groups' timeout (``group_timeout_s``, else the default
group's), also on groups torch makes with its own 30 minutes, and also where a survivor waits on
nothing but a send to it. A victim killed before the first step fails the others at their first
wait for it: a transfer at once, a wait at the c10d store while they compile (which sees no
death) at ``consistency_timeout_s`` or the groups' timeout where shorter. The same from a user's
script that leaves the error uncaught and never calls ``destroy_process_group``: the survivors
exit by themselves within ``SCRIPT_BOUND_S``.

The 4-rank runs and the remaining stopped cases run with DHELIX_TEST_FULL=1 (the default
suite's budget).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dhelix_compile.launch.ranks import launch_ranks
from dhelix_compile.testing.dead_rank_checks import RECORD_MARK, die_mid_step, survivor_records, victim_record
from dhelix_compile.testing.multirank import MultiRankError, run_on_ranks

pytestmark = pytest.mark.multirank


#: Every survivor's error, after a kill its kernel sees, where each rank closes its connections
#: as its error unwinds (``run_on_ranks``' ranks call ``destroy_process_group``): the README's bound.
SEEN_BOUND_S = 2.0
#: The same where the ranks just exit on the uncaught error (README): a rank that waited only on
#: other survivors fails when their processes end.
SCRIPT_BOUND_S = 15.0
#: A stopped peer: the survivors fail at the timeout, and at most this much after it.
TIMEOUT_MARGIN_S = 2.0
#: The same where the survivor still computes a backward over 64 MiB after the stop, before it sends.
SENDS_MARGIN_S = 10.0
#: A victim killed before the first step: a survivor that waits for it at the c10d store fails
#: this long at most after the wait's bound (its own compile up to the wait comes first).
COMPILE_MARGIN_S = 30.0
OPTIONS: dict[str, Any] = {"codegen": "eager", "cost_model": "analytic"}
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer")
_TIMED_OUT = re.compile(r"Timed out waiting \d+ms for (recv|send) operation")
#: Where the victim was when it died: a name among dhelix's frames on its stack (the eager
#: data_parallel step's death point is in the model's own forward, with none of dhelix's).
_VICTIM_AT = {
    "helix": "_run_merged",
    "pipeline": "forward_one_chunk",
    "pipeline_sends": "backward_one_chunk",
    "reshard": "move",  # resharding.move.move: issuing the broadcasts
    "data_parallel": "<fx graph>",
    "data_parallel_eager": None,
}

#: (case, world size, victim): a middle pipeline stage on 4 ranks, so that the stages on either
#: side wait on it and the last one only on a survivor.
KILLED = [
    ("helix", 2, 1),
    ("pipeline", 2, 1),
    ("reshard", 2, 0),
    ("data_parallel", 2, 1),
    ("data_parallel_eager", 2, 1),
    pytest.param("helix", 4, 2, marks=pytest.mark.full),
    pytest.param("pipeline", 4, 1, marks=pytest.mark.full),
    pytest.param("reshard", 4, 0, marks=pytest.mark.full),
    pytest.param("data_parallel", 4, 3, marks=pytest.mark.full),
    pytest.param("data_parallel_eager", 4, 3, marks=pytest.mark.full),
]


def _options(case: str, **options: Any) -> dict[str, Any]:
    """dhelix's options for ``case`` (``data_parallel_eager`` takes ``data_parallel``'s, and no compiler's)."""
    return options if case == "data_parallel_eager" else {**OPTIONS, **options}


def _assert_gone(pids: tuple[int, ...] | list[int]) -> None:
    """No process of any rank's process group is left (its children included)."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


def _die(case: str, world_size: int, victim: int, record_dir: Path, grace_s: float, **kwargs: Any) -> MultiRankError:
    with pytest.raises(MultiRankError) as info:
        run_on_ranks(die_mid_step, world_size, case, victim, str(record_dir), timeout_s=300, grace_s=grace_s, **kwargs)
    return info.value


@pytest.mark.parametrize(("case", "world_size", "victim"), KILLED)
def test_a_killed_rank_fails_every_other_rank_at_once(case: str, world_size: int, victim: int, tmp_path: Path) -> None:
    # grace_s: a survivor that reported and did not exit would be killed, and flagged, after it
    error = _die(case, world_size, victim, tmp_path, grace_s=60, **_options(case))
    failures = {f.rank: f for f in error.failures}
    assert failures[victim].kind == "crashed" and "code -9" in failures[victim].detail, error
    victim_at = _VICTIM_AT[case]
    assert victim_at is None or victim_at in victim_record(str(tmp_path))["frames"]
    records = survivor_records(error)
    assert sorted(records) == [r for r in range(world_size) if r != victim], error
    for rank, record in records.items():
        assert _PEER_GONE.search(record["error"]), record
        assert record["after_s"] <= SEEN_BOUND_S, record
        assert record["threads"] == [], record  # nothing non-daemon left to keep the process alive
        assert failures[rank].kind == "exception" and not failures[rank].left_running
    if case == "helix":  # the survivors failed inside their own merged graphs
        assert all("_run_merged" in r["frames"] for r in records.values()), records
    if case == "pipeline":  # a stage beside the victim was waiting on a receive from it
        assert any("_wait_received" in r["frames"] for r in records.values()), records
    _assert_gone(error.pids)


#: (case, victim, options, init_process_group's timeout, the timeout the survivors should see):
#: on groups that torch makes with its own 30 minutes (``group="new"``; reshard's are its own).
STOPPED = [
    ("helix", 1, {"group_timeout_s": 3.0}, None, 3.0),  # the option, over the harness's long default
    ("pipeline", 1, {}, 4.0, 4.0),  # the default group's timeout, on the stages' receives
    pytest.param(
        "pipeline_sends", 0, {}, 4.0, 4.0, marks=pytest.mark.full
    ),  # on the last stage's send, which torch's runtime waits for
    ("data_parallel_eager", 1, {}, 4.0, 4.0),  # its mesh's groups, bounded when it wraps the model
    pytest.param("reshard", 1, {}, 4.0, 4.0, marks=pytest.mark.full),
    pytest.param("data_parallel", 1, {}, 4.0, 4.0, marks=pytest.mark.full),
    pytest.param("data_parallel_eager", 1, {"group_timeout_s": 2.5}, None, 2.5, marks=pytest.mark.full),
]


@pytest.mark.parametrize(("case", "victim", "options", "pg_timeout_s", "expected_s"), STOPPED)
def test_a_stopped_rank_fails_the_others_at_the_group_timeout(
    case: str, victim: int, options: dict[str, Any], pg_timeout_s: float | None, expected_s: float, tmp_path: Path
) -> None:
    error = _die(
        case,
        2,
        victim,
        tmp_path,
        grace_s=2,
        pg_timeout_s=pg_timeout_s,
        stop=True,
        group="new",
        **_options(case, **options),
    )
    failures = {f.rank: f for f in error.failures}
    assert failures[victim].kind == "not_finished"  # stopped, then killed by the harness
    (record,) = survivor_records(error).values()
    assert _TIMED_OUT.search(record["error"]), record
    margin_s = SENDS_MARGIN_S if case == "pipeline_sends" else TIMEOUT_MARGIN_S
    assert expected_s - 0.05 <= record["after_s"] <= expected_s + margin_s, record
    if case == "pipeline_sends":  # it waited on nothing but the send, at the end of its step
        assert record["frames"][-2:] == ["_step_microbatches", "_wait_transfers"], record
    assert not failures[1 - victim].left_running
    _assert_gone(error.pids)


#: (case, world size, victim, options, init_process_group's timeout, how long the survivors wait
#: at the c10d store; None: they meet the victim's absence in a transfer, at once).
KILLED_BEFORE_COMPILING = [
    ("data_parallel", 2, 1, {}, 3.0, 3.0),  # the consistency check: the default group's timeout
    ("reshard", 2, 0, {}, 3.0, 3.0),  # reshard's agreement on its first call: the same
    pytest.param("helix", 2, 1, {"group_timeout_s": 2.0}, None, 2.0, marks=pytest.mark.full),  # the option
    pytest.param("pipeline", 2, 1, {}, None, None, marks=pytest.mark.full),  # torch's warm-up receive
    pytest.param("data_parallel_eager", 2, 1, {}, None, None, marks=pytest.mark.full),
    pytest.param("data_parallel", 4, 2, {"group_timeout_s": 2.0}, None, 2.0, marks=pytest.mark.full),
    pytest.param("reshard", 4, 2, {}, 3.0, 3.0, marks=pytest.mark.full),  # 0 and 1 distribute the source between them
]
#: What a survivor raises at the store (one of its causes): the check naming the victim and the wait.
_CONSISTENCY = r"RankMismatchError: .* rank {victim} of process group '.*' did not publish .* within {wait:g} s"
_STORE_WAIT = {
    "helix": _CONSISTENCY,
    "data_parallel": _CONSISTENCY,
    "reshard": r"ReshardError: rank {victim} of the two meshes did not call reshard within {wait:g} s",
}


@pytest.mark.parametrize(("case", "world_size", "victim", "options", "pg_timeout_s", "wait_s"), KILLED_BEFORE_COMPILING)
def test_a_rank_killed_before_compiling_fails_the_others_at_their_first_wait(
    case: str,
    world_size: int,
    victim: int,
    options: dict[str, Any],
    pg_timeout_s: float | None,
    wait_s: float | None,
    tmp_path: Path,
) -> None:
    error = _die(
        case,
        world_size,
        victim,
        tmp_path,
        grace_s=60,
        pg_timeout_s=pg_timeout_s,
        before_compiling=True,
        **_options(case, **options),
    )
    records = survivor_records(error)
    assert sorted(records) == [r for r in range(world_size) if r != victim], error
    for record in records.values():
        assert record["threads"] == [], record
        if wait_s is None:
            assert _PEER_GONE.search(record["error"]) and record["after_s"] <= SEEN_BOUND_S, record
            continue
        waited = re.compile(_STORE_WAIT[case].format(victim=victim, wait=wait_s))
        assert any(waited.search(line) for line in [record["error"], *record["causes"]]), record
        assert wait_s - 0.05 <= record["after_s"] <= wait_s + COMPILE_MARGIN_S, record
    _assert_gone(error.pids)


@pytest.mark.parametrize(("world_size", "victim"), [(2, 1), pytest.param(4, 2, marks=pytest.mark.full)])
def test_the_survivors_of_a_script_exit_by_themselves(world_size: int, victim: int, tmp_path: Path) -> None:
    """Ranks started cold, as a user's processes (a forked rank exits without joining its
    threads); the survivors leave the error uncaught and never destroy the process group."""
    argv = [sys.executable, "-m", "dhelix_compile.testing.dead_rank_checks", "helix", str(victim), str(tmp_path)]
    result = launch_ranks(
        [*argv, json.dumps(OPTIONS)],
        world_size,
        timeout_s=300,
        env={"TORCHINDUCTOR_COMPILE_THREADS": "1"},
        failure_grace_s=60,
    )
    returned = time.time()
    died_at = victim_record(str(tmp_path))["at"]
    assert result.unfinished == [], result.stderr
    assert result.returncodes == [-9 if r == victim else 1 for r in range(world_size)], result.stderr
    for rank in range(world_size):
        if rank == victim:
            continue
        (line,) = [line for line in result.stdout[rank].splitlines() if RECORD_MARK in line]
        record = json.loads(line.split(RECORD_MARK, 1)[1])
        assert _PEER_GONE.search(record["error"]) and record["threads"] == [], record
        assert record["after_s"] <= SCRIPT_BOUND_S, record
    assert returned - died_at <= SCRIPT_BOUND_S
    _assert_gone(result.pids)
