"""``helix_runtime.schedule``: every call once, forwards before their backwards, backwards in order."""

from __future__ import annotations

import pytest

from dhelix_compile.helix_runtime.schedule import SCHEDULE_KINDS, B, F, describe, graph_calls, helix_schedule


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("n", range(1, 10))
def test_every_call_once_in_a_valid_order(kind: str, n: int) -> None:
    steps = helix_schedule(n, kind)  # type: ignore[arg-type]
    calls = [call for step in steps for call in step]
    assert sorted(calls, key=lambda c: (c.phase, c.index)) == [*map(B, range(n)), *map(F, range(n))]
    assert all(1 <= len(step) <= 2 for step in steps)
    position = {call: k for k, call in enumerate(calls)}
    assert all(position[F(i)] < position[B(i)] for i in range(n))
    assert [c.index for c in calls if c.phase == "bwd"] == list(range(n))  # gradients accumulate in order
    live, peak = 0, 0  # micro-batches whose activations are held: at most 3 (the odd tail's B+F)
    for step in steps:
        live += sum(1 for c in step if c.phase == "fwd")
        peak = max(peak, live)
        live -= sum(1 for c in step if c.phase == "bwd")
    assert peak <= {"forward_backward": 2, "same_phase": 2 if n % 2 == 0 else 3, "paired_ends": min(n, 3)}[kind]


def test_same_phase_gives_every_call_a_partner() -> None:
    assert describe(helix_schedule(4, "same_phase")) == "F0+F1 | B0+B1 | F2+F3 | B2+B3"
    assert describe(helix_schedule(5, "same_phase")) == "F0+F1 | B0+B1 | F2+F3 | B2+F4 | B3+B4"
    assert describe(helix_schedule(3, "forward_backward")) == "F0 | B0+F1 | B1+F2 | B2"
    assert describe(helix_schedule(4, "paired_ends")) == "F0+F1 | B0+F2 | B1+F3 | B2+B3"
    assert describe(helix_schedule(1, "same_phase")) == "F0 | B0"
    assert graph_calls(helix_schedule(5, "same_phase")) == {"fwdpair": 2, "bwdpair": 2, "merged": 1}
    assert graph_calls(helix_schedule(4, "forward_backward")) == {"fwd": 1, "merged": 3, "bwd": 1}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one micro-batch"):
        helix_schedule(0, "same_phase")
    with pytest.raises(ValueError, match="unknown helix schedule"):
        helix_schedule(2, "zigzag")  # type: ignore[arg-type]
