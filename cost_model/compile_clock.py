"""Where compile time goes: the seconds dhelix's compiles spend per phase, summed over the process.

Contract
    ``with phase("passes"): ...`` (or a function decorated ``@timed("passes")``) adds the block's wall seconds to the phase ``"passes"``;
    :func:`totals` returns every phase's seconds so far, :func:`since` the seconds added after an
    earlier :func:`totals`. Phases nest, and a phase's seconds exclude the phases inside it (the
    profiling a pass asks for counts as profiling, not as the pass), so the totals add up to the
    time spent inside any phase and never count a second twice. Each thread keeps its own stack
    (helix compiles on its strands' two threads); the totals are the process's.

    ============  ===============================================================================
    profiling     measuring ops, collectives and segment pairs on the live group (cost_model.profile)
    passes        dhelix's graph passes, on the graphs compiled and on the merged candidates weighed
    agreement     waiting for the other ranks at compile time (the rank-consistency check)
    codegen       Inductor's code generation and C++ compile of the scheduled graphs
    ============  ===============================================================================

    What no phase holds of a first step -- Dynamo's trace, AOTAutograd's joint graph and
    partitioner, running the step -- is the caller's to compute (the bench: "capture and run").
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal, ParamSpec, TypeVar

Phase = Literal["profiling", "passes", "agreement", "codegen"]
PHASES: tuple[Phase, ...] = ("profiling", "passes", "agreement", "codegen")

_P = ParamSpec("_P")
_R = TypeVar("_R")

_lock = threading.Lock()
_totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
_local = threading.local()


@contextlib.contextmanager
def phase(name: Phase) -> Iterator[None]:
    """Count the block's wall seconds, less those of the phases inside it, as ``name``."""
    stack: list[list[float]] = _local.__dict__.setdefault("stack", [])
    frame = [time.perf_counter(), 0.0]  # [start, seconds of the phases inside]
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        elapsed = time.perf_counter() - frame[0]
        if stack:
            stack[-1][1] += elapsed
        with _lock:
            _totals[name] += elapsed - frame[1]


def timed(name: Phase) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """A decorator: every call of the function counts as :func:`phase` ``name``."""

    def decorate(function: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(function)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with phase(name):
                return function(*args, **kwargs)

        return call

    return decorate


#: The phases a bench table shows, in its order ("profiling / passes / codegen").
SHOWN: tuple[Phase, ...] = ("profiling", "passes", "codegen")


def format_phases(phases: dict[str, float] | None) -> str | None:
    """``"profiling / passes / codegen"`` seconds of a compile (``"4.0 / 2.1 / 9.3"``), or None
    when none of them ran (no dhelix graph was compiled)."""
    phases = phases or {}
    if not any(phases.get(name) for name in SHOWN):
        return None
    return " / ".join(f"{phases.get(name, 0.0):.1f}" for name in SHOWN)


def totals() -> dict[str, float]:
    """Seconds per phase in this process so far (every phase named, 0.0 when none ran)."""
    with _lock:
        return dict(_totals)


def since(before: dict[str, float]) -> dict[str, float]:
    """Seconds per phase added after ``before`` (an earlier :func:`totals`)."""
    now = totals()
    return {name: now[name] - before.get(name, 0.0) for name in PHASES}
