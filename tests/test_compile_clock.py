"""``cost_model.compile_clock``: seconds per compile phase, nested phases counted once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cost_model import compile_clock


def test_a_phase_inside_another_counts_only_for_itself() -> None:
    before = compile_clock.totals()
    with compile_clock.phase("passes"):
        time.sleep(0.02)
        with compile_clock.phase("profiling"):
            time.sleep(0.05)
    added = compile_clock.since(before)
    assert added["profiling"] >= 0.05
    assert 0.02 <= added["passes"] < 0.05, "the passes' seconds exclude the profiling inside them"
    assert added["agreement"] == added["codegen"] == 0.0


def test_threads_keep_their_own_stacks() -> None:
    before = compile_clock.totals()
    inside = threading.Event()
    release = threading.Event()

    def other() -> None:
        with compile_clock.phase("codegen"):
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=other)
    with compile_clock.phase("passes"):
        thread.start()
        inside.wait(5)
        time.sleep(0.03)
        release.set()
        thread.join(5)
    added = compile_clock.since(before)
    assert added["passes"] >= 0.03, "another thread's phase is not nested in this one's"
    assert added["codegen"] >= 0.03


def test_a_decorated_function_counts_even_when_it_raises() -> None:
    @compile_clock.timed("agreement")
    def wait_then_fail() -> None:
        time.sleep(0.02)
        raise RuntimeError("peer gone")

    before = compile_clock.totals()
    with pytest.raises(RuntimeError, match="peer gone"):
        wait_then_fail()
    assert compile_clock.since(before)["agreement"] >= 0.02


def test_a_dhelix_compile_counts_its_passes_and_its_code_generation() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="dhelix", options={"codegen": "eager"})
    before = compile_clock.totals()
    compiled(torch.randn(4, 8)).sum().backward()
    added = compile_clock.since(before)
    assert added["passes"] > 0 and added["codegen"] > 0
