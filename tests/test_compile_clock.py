"""``cost_model.compile_clock``: seconds per compile phase, nested phases counted once, and counts."""

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
    assert added["agreement"] == added["codegen"] == added["capture"] == added["plan"] == 0.0


def test_capture_and_plan_hold_only_what_the_phases_inside_them_leave() -> None:
    before = compile_clock.totals()
    with compile_clock.phase("capture"):  # AOTAutograd, and a partition's compile inside it
        time.sleep(0.02)
        with compile_clock.phase("passes"):
            time.sleep(0.02)
            with compile_clock.phase("plan"):
                time.sleep(0.03)
                with compile_clock.phase("profiling"):  # pairs measured for the plan
                    time.sleep(0.04)
        with compile_clock.phase("codegen"):
            time.sleep(0.05)
    added = compile_clock.since(before)
    assert 0.02 <= added["capture"] < 0.03 + 0.02, "capture excludes the passes, plan and codegen inside it"
    assert 0.02 <= added["passes"] < 0.03 + 0.02
    assert 0.03 <= added["plan"] < 0.04 + 0.02
    assert added["profiling"] >= 0.04 and added["codegen"] >= 0.05
    assert list(added) == list(compile_clock.PHASES)


def test_counts_accumulate_across_threads() -> None:
    before = compile_clock.counts()

    def count_graphs() -> None:
        for _ in range(500):
            compile_clock.count("graphs")

    threads = [threading.Thread(target=count_graphs) for _ in range(4)]
    for thread in threads:
        thread.start()
    compile_clock.count("candidates", 3)
    compile_clock.count("variants", 2)
    for thread in threads:
        thread.join(5)
    after = compile_clock.counts()
    assert {name: after[name] - before[name] for name in compile_clock.COUNTS} == {
        "graphs": 2000,
        "candidates": 3,
        "variants": 2,
    }


def test_format_phases_shows_the_shown_phases_in_their_order() -> None:
    assert compile_clock.SHOWN_HEADER == "capture / profiling / passes / plan / codegen"
    phases = dict.fromkeys(compile_clock.PHASES, 0.0) | {"capture": 1.04, "plan": 0.3, "codegen": 9.0, "agreement": 5.0}
    assert compile_clock.format_phases(phases) == "1.0 / 0.0 / 0.0 / 0.3 / 9.0"
    assert compile_clock.format_phases({"profiling": 2.0, "codegen": 1.0}) == "- / 2.0 / - / - / 1.0"
    assert compile_clock.format_phases({"agreement": 1.0}) is None  # no shown phase ran
    assert compile_clock.format_phases(None) is None


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


def test_a_dhelix_compile_counts_its_capture_passes_code_generation_and_graphs() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="dhelix", options={"codegen": "eager"})
    before, counted = compile_clock.totals(), compile_clock.counts()
    loss = compiled(torch.randn(4, 8)).sum()
    forward = compile_clock.since(before)
    assert forward["capture"] > 0 and forward["passes"] > 0 and forward["codegen"] > 0
    assert compile_clock.counts()["graphs"] == counted["graphs"] + 1  # the forward
    at_backward = compile_clock.totals()
    loss.backward()  # AOTAutograd compiles the backward here, outside the capture phase
    backward = compile_clock.since(at_backward)
    assert backward["passes"] > 0 and backward["codegen"] > 0, "the backward's compile counts its own phases"
    assert compile_clock.counts()["graphs"] == counted["graphs"] + 2
