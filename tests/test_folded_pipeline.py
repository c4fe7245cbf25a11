"""The folded-pipeline simulator (``cost_model.cluster.folded_pipeline``): every action runs once,
after what it depends on; merging pairs pays in the steady state."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model.cluster.folded_pipeline import ChunkCosts, rank_of_chunk, simulate_folded


def test_v_layout_puts_two_chunks_on_every_rank() -> None:
    assert [rank_of_chunk(c, 3) for c in range(6)] == [0, 1, 2, 2, 1, 0]


def test_one_microbatch_is_its_critical_path() -> None:
    """One micro-batch: down and up the V forward, back down and up backward, a P2P per rank crossing."""
    costs = ChunkCosts(forward_s=1.0, backward_s=2.0, pair_s=2.5, p2p_s=0.25)
    run = simulate_folded(2, 1, costs, merge=True)
    crossings = 2 * 2  # chunk 0 -> 1 and 2 -> 3 forward, the same two backward
    assert run.step_s == pytest.approx(4 * 1.0 + 4 * 2.0 + crossings * 0.25)
    assert run.pairs == 0 and run.actions == 8


@settings(max_examples=60, deadline=None)
@given(
    pp=st.integers(1, 4),
    micro_batches=st.integers(1, 10),
    forward=st.floats(0.1, 3.0),
    backward=st.floats(0.1, 6.0),
    pair_share=st.floats(0.3, 0.9),
    p2p=st.floats(0.0, 2.0),
)
def test_steps_cover_the_work_and_merging_pays(
    pp: int, micro_batches: int, forward: float, backward: float, pair_share: float, p2p: float
) -> None:
    pair = max(forward, backward) + pair_share * min(forward, backward)  # cheaper than the two apart
    costs = ChunkCosts(forward, backward, pair, p2p)
    apart = simulate_folded(pp, micro_batches, costs, merge=False)
    merged = simulate_folded(pp, micro_batches, costs, merge=True)
    work = 2 * micro_batches * (forward + backward)  # every rank: two chunks, every micro-batch
    assert apart.actions == 4 * pp * micro_batches and apart.pairs == 0
    assert apart.busy_s == pytest.approx(work)
    assert merged.actions == 4 * pp * micro_batches - merged.pairs
    saving = forward + backward - pair
    assert work - merged.pairs * saving - 1e-9 <= merged.busy_s <= work + 1e-9
    path = 2 * pp * (forward + backward)  # one micro-batch down and up the V, forward and backward
    assert apart.step_s >= path - 1e-9 and merged.step_s >= path - 1e-9
    assert apart.step_s >= apart.busy_s - 1e-9 and merged.step_s >= merged.busy_s - 1e-9
    # no claim that merging always shortens the step: a merged pair hands its forward's output on
    # only when the pair ends, which can delay the next rank (as a merged graph does)


def test_merging_pays_in_the_steady_state() -> None:
    costs = ChunkCosts(forward_s=1.0, backward_s=2.0, pair_s=2.2, p2p_s=0.1)
    apart = simulate_folded(2, 8, costs, merge=False)
    merged = simulate_folded(2, 8, costs, merge=True)
    assert merged.pairs >= 8 and merged.step_s < 0.9 * apart.step_s


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="pp >= 1"):
        simulate_folded(0, 4, ChunkCosts(1, 1, 1, 0), merge=True)
