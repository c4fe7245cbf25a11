"""Which forwards and backwards of a pipeline rank merge: pure schedule arithmetic (no torch run)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dhelix_compile.pipeline_runtime.pairing import (
    Compute,
    Order,
    Overlap,
    as_full_backwards,
    find_deadlock,
    makespan,
    one_f_one_b,
    pair_forwards_with_backwards,
    steps_of,
)


def _text(order: Order) -> dict[int, str]:
    return {rank: " ".join(map(str, steps)) for rank, steps in order.items()}


def test_one_f_one_b_on_two_stages_pairs_nothing_it_would_serialize() -> None:
    """Stage 0's F1 merged with B0 sends its output only when B0 ends, and B0 waits for stage 1's
    B0: stage 1 idles through every pair and stage 0 through every stage-1 step (measured: 1.6x
    slower than torch's run). The pairs lengthen the step, so none is made."""
    order = one_f_one_b(2, 4)
    assert _text(pair_forwards_with_backwards(order, 2)) == _text(order)
    forced = {0: [Compute("F", 0, 0), *(Overlap(Compute("F", 0, j + 1), Compute("B", 0, j)) for j in range(3))]}
    forced[0].append(Compute("B", 0, 3))
    assert makespan({**order, **forced}, 2) > makespan(order, 2)


#: Merged steps per rank that helix_pipeline runs on Schedule1F1B: (stages, micro-batches) ->
#: (torch's order, eager 1F1B's). docs/pipelines.md and the README say these numbers.
ONE_F_ONE_B_MERGED = {
    (2, 8): ([0, 0], [6, 0]),
    (2, 16): ([0, 0], [14, 0]),
    (4, 8): ([0, 0, 0, 0], [2, 4, 6, 0]),
    (4, 16): ([0, 0, 0, 0], [10, 12, 14, 0]),
}


@pytest.mark.parametrize(("num_stages", "n"), sorted(ONE_F_ONE_B_MERGED))
def test_how_many_steps_merge_on_one_f_one_b(num_stages: int, n: int) -> None:
    """torch's 1F1B order keeps no pair: helix_pipeline runs every step of a Schedule1F1B on its
    own. Eager 1F1B merges each steady-state F with the B after it on every stage but the last."""
    torchs, eager = ONE_F_ONE_B_MERGED[num_stages, n]
    for order, expected in ((one_f_one_b(num_stages, n), torchs), (one_f_one_b(num_stages, n, eager=True), eager)):
        paired = pair_forwards_with_backwards(order, num_stages)
        assert [sum(isinstance(step, Overlap) for step in paired[rank]) for rank in range(num_stages)] == expected


def test_the_docs_say_how_many_steps_merge_on_one_f_one_b() -> None:
    root = Path(__file__).resolve().parents[1]
    row = next(line for line in (root / "docs" / "pipelines.md").read_text().splitlines() if "| `Schedule1F1B`" in line)
    assert row.startswith("| `Schedule1F1B` | nothing, in torch's order") and "0 merged steps" in row
    totals = {key: sum(eager) for key, (_, eager) in ONE_F_ONE_B_MERGED.items()}
    assert f"{totals[2, 8]} and {totals[2, 16]} with 2 stages" in row
    assert f"{totals[4, 8]} and {totals[4, 16]} with 4 stages" in row
    readme = " ".join((root / "README.md").read_text().split())
    assert "so `Schedule1F1B` runs each F and B on its own (compiled, none merged)" in readme


def test_eager_one_f_one_b_leaves_room_for_pairs() -> None:
    """Eager 1F1B's extra forwards ahead give stage 1 inputs to work on while stage 0 runs a pair."""
    paired = pair_forwards_with_backwards(one_f_one_b(2, 6, eager=True), 2)
    assert _text(paired)[0] == "0F0 0F1 (0F2;0B0) (0F3;0B1) (0F4;0B2) (0F5;0B3) 0B4 0B5"
    assert makespan(paired, 2) <= makespan(one_f_one_b(2, 6, eager=True), 2)


def test_one_f_one_b_is_torchs_warmup_steady_cooldown() -> None:
    order = one_f_one_b(4, 6)
    assert _text(order)[0] == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert _text(order)[3] == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"
    assert find_deadlock(order, 4) is None


def test_eager_one_f_one_b_runs_more_forwards_ahead_and_still_completes() -> None:
    """Alpa's eager 1F1B: stage s runs 2 (p - s) - 1 forwards before its first backward."""
    order = one_f_one_b(4, 8, eager=True)
    assert _text(order)[0].startswith("0F0 0F1 0F2 0F3 0F4 0F5 0F6 0B0 0F7 0B1")
    assert _text(order)[2].startswith("2F0 2F1 2F2 2B0 2F3 2B1")
    assert _text(order)[3] == _text(one_f_one_b(4, 8))[3]  # the last stage: F and B alternate anyway
    assert find_deadlock(order, 4) is None
    paired = pair_forwards_with_backwards(order, 4)
    assert find_deadlock(paired, 4) is None
    assert any(isinstance(step, Overlap) for step in paired[0])


def test_a_pair_that_would_deadlock_the_pipeline_stays_apart() -> None:
    """Rank 0's B0 needs rank 1's B0, which comes after rank 1's F1, which needs rank 0's F1:
    merged with B0, F1 would wait on itself."""
    gpipe_last = [Compute("F", 1, 0), Compute("F", 1, 1), Compute("B", 1, 0), Compute("B", 1, 1)]
    first = [Compute("F", 0, 0), Compute("F", 0, 1), Compute("B", 0, 0), Compute("B", 0, 1)]
    assert find_deadlock({0: [Compute("F", 0, 0), Overlap(first[1], first[2]), first[3]], 1: gpipe_last}, 2) == [
        Overlap(first[1], first[2]),
        Compute("F", 1, 1),
    ]
    assert _text(pair_forwards_with_backwards({0: first, 1: gpipe_last}, 2))[0] == "0F0 0F1 0B0 0B1"


def test_a_schedule_that_cannot_complete_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot complete"):
        pair_forwards_with_backwards({0: [Compute("B", 0, 0), Compute("F", 0, 0)]}, 1)


def test_an_overlap_of_dependent_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="depends on"):
        Overlap(Compute("F", 0, 3), Compute("B", 1, 3))


def test_split_backwards_become_full_backwards() -> None:
    order: Order = {
        0: [Compute("F", 0, 0), Compute("I", 0, 0), Overlap(Compute("F", 0, 1), Compute("I", 1, 0)), Compute("W", 0, 0)]
    }
    assert _text(as_full_backwards(order)) == {0: "0F0 0B0 (0F1;1B0)"}


def _random_order(num_ranks: int, stages_per_rank: int, n: int, seed: int) -> Order:
    """A random schedule that can complete: a random topological order of every F and B, each
    rank keeping its own steps (looped placement, stage s on rank s % num_ranks)."""
    rng = random.Random(seed)
    num_stages = num_ranks * stages_per_rank
    pending = {Compute(k, s, m) for k in ("F", "B") for s in range(num_stages) for m in range(n)}  # type: ignore[arg-type]
    order: Order = {rank: [] for rank in range(num_ranks)}
    done: set[Compute] = set()
    while pending:
        ready = sorted((c for c in pending if _deps_done(c, done, num_stages)), key=str)
        step = rng.choice(ready)
        pending.discard(step)
        done.add(step)
        order[step.stage % num_ranks].append(step)
    return order


def _deps_done(step: Compute, done: set[Compute], num_stages: int) -> bool:
    s, m = step.stage, step.microbatch
    if step.kind == "F":
        return s == 0 or Compute("F", s - 1, m) in done
    return Compute("F", s, m) in done and (s == num_stages - 1 or Compute("B", s + 1, m) in done)


@settings(max_examples=40, deadline=None)
@given(
    num_ranks=st.integers(1, 3),
    stages_per_rank=st.integers(1, 2),
    n=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_pairing_keeps_every_step_in_order_and_the_pipeline_completes(
    num_ranks: int, stages_per_rank: int, n: int, seed: int
) -> None:
    num_stages = num_ranks * stages_per_rank
    order = _random_order(num_ranks, stages_per_rank, n, seed)
    assert find_deadlock(order, num_stages) is None
    paired = pair_forwards_with_backwards(order, num_stages)
    assert find_deadlock(paired, num_stages) is None
    for rank, steps in paired.items():
        assert [s for item in steps for s in steps_of(item)] == order[rank]
        for item in steps:
            if isinstance(item, Overlap):
                assert item.forward.microbatch != item.backward.microbatch
    # every F directly followed by a B of another micro-batch was paired, or pairing it deadlocks
    # or lengthens the step; pairing never lengthens it
    assert makespan(paired, num_stages) <= makespan(order, num_stages)
    for rank, steps in paired.items():
        for k in range(len(steps) - 1):
            a, b = steps[k], steps[k + 1]
            unpaired = isinstance(a, Compute) and isinstance(b, Compute) and (a.kind, b.kind) == ("F", "B")
            if unpaired and a.microbatch != b.microbatch:  # type: ignore[union-attr]
                trial = {**paired, rank: [*steps[:k], Overlap(a, b), *steps[k + 2 :]]}  # type: ignore[arg-type]
                assert find_deadlock(trial, num_stages) is not None or makespan(trial, num_stages) > makespan(
                    paired, num_stages
                )
