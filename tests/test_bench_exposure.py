"""Where a step's communication is exposed, part by part (``bench.exposure``): the arithmetic on
given spans and transfers; the emulated bench's own parts are checked in test_emulation.py."""

from __future__ import annotations

import threading

import pytest

from dhelix_compile.bench.exposure import OUTSIDE, Repeat, TimedTransfer, markdown_parts, part_rows, reason
from dhelix_compile.step_phases import PhaseSpan, current_step_phase, recording_phases, step_phase


def _spans(*parts: tuple[str, float]) -> list[PhaseSpan]:
    spans, t = [], 0.0
    for name, seconds in parts:
        spans.append(PhaseSpan(name, t, t + seconds))
        t += seconds
    return spans


def test_each_part_gets_what_it_issued_and_what_its_waits_blocked() -> None:
    transfers = [
        TimedTransfer("all_gather", 0.010, "F0", "F0", blocked_s=0.008, queued_s=0.0),
        TimedTransfer("reduce_scatter", 0.010, "B0+F1", "B0+F1", 0.006, 0.005, 2_000_000, 0.021, 0.025),
        TimedTransfer("all_gather", 0.010, "B0+F1", "B1", blocked_s=0.002, queued_s=0.0),
        TimedTransfer("all_reduce", 0.004, None, None, blocked_s=0.004, queued_s=0.0),
    ]
    repeat = Repeat(
        on_link=_spans(("F0", 0.020), ("B0+F1", 0.040), ("B1", 0.015)),
        link_free=_spans(("F0", 0.012), ("B0+F1", 0.034), ("B1", 0.013)),
        transfers=transfers,
    )
    rows = {row.name: row for row in part_rows([repeat, repeat])}
    assert list(rows) == ["F0", "B0+F1", "B1", OUTSIDE]
    assert rows["B0+F1"].comm_s == pytest.approx(0.020)
    assert rows["B0+F1"].ops == {"all_gather": 1, "reduce_scatter": 1}
    assert rows["B0+F1"].exposed_s == pytest.approx(0.006) and rows["B0+F1"].busy_s == pytest.approx(0.005)
    assert rows["B0+F1"].reason == "link busy"
    assert rows["B0+F1"].exposed_transfers == [
        {
            "op": "reduce_scatter",
            "mb": 2.0,
            "issued_ms": pytest.approx(1.0),
            "link_ms": 10.0,
            "work_before_wait_ms": pytest.approx(4.0),
            "blocked_ms": 6.0,
        }
    ]
    assert rows["B1"].exposed_by_op == {"all_gather": pytest.approx(0.002)}
    assert rows["F0"].reason == "one strand"
    assert rows[OUTSIDE].comm_s == pytest.approx(0.004) and rows[OUTSIDE].step_s == 0.0
    assert sum(row.comm_s for row in rows.values()) == pytest.approx(sum(t.seconds for t in transfers))
    receives = Repeat(
        _spans(("F0", 0.02)), _spans(("F0", 0.01)), [*transfers[:1], TimedTransfer("recv", 0.007, "F0", "F0", 0, 0)]
    )
    (row,) = part_rows([receives])
    assert row.comm_s == pytest.approx(0.010)  # a receive runs on the other side of the link, beside the send
    table = markdown_parts("helix", [row.as_dict() for row in rows.values()])
    assert table[0].startswith("| helix | F0 |") and len(table) == 4
    assert "| - | communication-bound |" in table[3]  # transfers outside every part: no span, no slowed time
    assert (
        "| 8.0 (all_gather 8.0) | 0.0 | 0.0 | one strand |" in table[0]
    )  # exposed, link busy, slowed (20 - 12 - 8 ms)


def test_medians_over_repeats() -> None:
    def repeat(blocked: float) -> Repeat:
        return Repeat(
            _spans(("F0", 0.01 + blocked)),
            _spans(("F0", 0.01)),
            [TimedTransfer("all_reduce", 0.005, "F0", "F0", blocked, 0.0)],
        )

    (row,) = part_rows([repeat(0.001), repeat(0.004), repeat(0.002)])
    assert row.exposed_s == pytest.approx(0.002) and row.step_s == pytest.approx(0.012)
    assert row.exposed_by_op == {"all_reduce": pytest.approx(0.007 / 3)}


@pytest.mark.parametrize(
    ("name", "step", "compute", "comm", "exposed", "busy", "why"),
    [
        ("B0+F1", 0.100, 0.099, 0.050, 0.0005, 0.0, "hidden"),
        ("B0+F1", 0.090, 0.040, 0.060, 0.030, 0.020, "communication-bound"),
        ("B0+F1", 0.100, 0.050, 0.040, 0.010, 0.0, "slowed"),
        ("B0+F1", 0.100, 0.080, 0.050, 0.020, 0.015, "link busy"),
        ("F0", 0.100, 0.080, 0.050, 0.020, 0.0, "one strand"),
        ("B0+F1", 0.100, 0.080, 0.050, 0.020, 0.0, "used soon"),
        (OUTSIDE, 0.0, 0.0, 0.004, 0.004, 0.0, "communication-bound"),
    ],
)
def test_the_reason_is_the_first_that_holds(
    name: str, step: float, compute: float, comm: float, exposed: float, busy: float, why: str
) -> None:
    assert reason(name, step, compute, comm, exposed, busy) == why


def test_no_repeats_no_rows() -> None:
    assert part_rows([]) == []


def test_the_step_part_is_process_wide_and_recorded_when_it_ends() -> None:
    seen: list[str | None] = []
    with recording_phases() as spans, step_phase("B0+F1"):
        worker = threading.Thread(target=lambda: seen.append(current_step_phase()))
        worker.start()
        worker.join()
        with step_phase("inner"):
            pass
    assert seen == ["B0+F1"] and current_step_phase() is None
    assert [s.name for s in spans] == ["inner", "B0+F1"]
    assert spans[1].start_s <= spans[0].start_s <= spans[0].end_s <= spans[1].end_s
