"""The benchmark's timing primitives: CPU time beside wall time, and the ceiling's schedule."""

from __future__ import annotations

import time

import pytest

from dhelix_compile.bench import measure
from dhelix_compile.bench.measure import _shares, ceiling_steps, time_interleaved


def test_time_interleaved_measures_cpu_beside_wall() -> None:
    def busy() -> None:
        end = time.process_time() + 0.02
        while time.process_time() < end:
            pass

    timings = time_interleaved({"busy": busy, "sleep": lambda: time.sleep(0.02)}, repeats=2)
    assert all(len(v) == 2 for v in (*timings.wall_s.values(), *timings.cpu_s.values()))
    assert min(timings.cpu_s["busy"]) >= 0.02  # spinning is CPU time ...
    assert max(timings.cpu_s["sleep"]) < min(timings.wall_s["sleep"]) / 2  # ... sleeping is not


@pytest.mark.parametrize(
    ("count", "weights", "expected"),
    [(10, [1, 1, 1], [3, 4, 3]), (8, [3, 1], [6, 2]), (5, [0, 0], [5, 0]), (4, [], []), (0, [1, 2], [0, 0])],
)
def test_shares_are_proportional_and_sum_to_the_count(count: int, weights: list, expected: list) -> None:
    assert _shares(count, weights) == expected
    assert sum(expected) == (count if weights else 0)


class _FakeReplay:
    """Collectives that record when they are issued and waited for."""

    def __init__(self, n: int, log: list) -> None:
        self.n, self.log = n, log

    def __len__(self) -> int:
        return self.n

    def issue(self, i: int) -> list:
        self.log.append(("issue", i))
        return [i]

    def wait(self, handles: list) -> None:
        self.log.append(("wait", handles[0]))


def test_ceiling_hides_each_collective_under_its_share_of_the_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list = []
    clock = [0.0]

    def run(self, count: int) -> None:  # each matmul takes 1 ms of a fake clock
        clock[0] += count * 0.001
        log.append(("matmuls", count))

    monkeypatch.setattr(measure._Matmuls, "seconds_each", lambda self: 0.002)  # a lone one looked slower
    monkeypatch.setattr(measure._Matmuls, "run", run)
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    agreed: list = []

    def agree(counts: list[int]) -> list[int]:
        agreed.append(counts)
        return [c + 1 for c in counts]  # another rank needed more: every rank runs the agreed counts

    compute_alone, overlapped = ceiling_steps(_FakeReplay(3, log), 0.040, agree, alone_s=[0.010, 0.030, 0.0])
    assert sorted(overlapped) == [1, 2]
    # 20 matmuls from the lone one's 2 ms, agreed to 21; they took 21 ms, so 40 are needed, agreed
    # to 41; those took 41 ms, 40 again, agreed to 41: settled
    assert agreed == [[20], [40], [40]]
    assert log == [("matmuls", 21), ("matmuls", 41)]  # the calibration loops; nothing else runs until a step is called
    log.clear()
    overlapped[1]()
    assert log == [  # 41 matmuls in proportion to the collectives' times alone, one collective in flight
        ("issue", 0),
        ("matmuls", 10),
        ("wait", 0),
        ("issue", 1),
        ("matmuls", 31),
        ("wait", 1),
        ("issue", 2),
        ("matmuls", 0),
        ("wait", 2),
    ]
    log.clear()
    overlapped[2]()
    assert log == [  # two in flight: each is waited for after the next one's share
        ("issue", 0),
        ("matmuls", 10),
        ("issue", 1),
        ("matmuls", 31),
        ("wait", 0),
        ("issue", 2),
        ("matmuls", 0),
        ("wait", 1),
        ("wait", 2),
    ]
    log.clear()
    compute_alone()
    assert log == [("matmuls", 41)]  # the same compute, with no communication


def test_ceiling_calibration_times_the_loop_again_until_the_count_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, loops = [0.0], []

    def run(self, count: int) -> None:  # 1 ms a matmul, but the first loop ran on a busy machine: 2 ms
        clock[0] += count * (0.002 if not loops else 0.001)
        loops.append(count)

    monkeypatch.setattr(measure._Matmuls, "seconds_each", lambda self: 0.001)
    monkeypatch.setattr(measure._Matmuls, "run", run)
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    compute_alone, _ = ceiling_steps(_FakeReplay(1, []), 0.100, lambda counts: counts, alone_s=[0.010])
    # 100 from the lone matmul; the busy loop said 50; the next loop took 50 ms: 100; then settled
    assert loops == [100, 50, 100]
    loops.clear()
    compute_alone()
    assert loops == [100]


def test_ceiling_calibration_stops_after_its_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, loops = [0.0], []

    def run(self, count: int) -> None:  # a machine whose speed keeps changing: the count never settles
        clock[0] += count * (0.001 if len(loops) % 2 else 0.002)
        loops.append(count)

    monkeypatch.setattr(measure._Matmuls, "seconds_each", lambda self: 0.001)
    monkeypatch.setattr(measure._Matmuls, "run", run)
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    ceiling_steps(_FakeReplay(1, []), 0.100, lambda counts: counts, alone_s=[0.010])
    assert len(loops) == measure.CALIBRATION_ROUNDS
