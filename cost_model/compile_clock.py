"""Where compile time goes: the seconds dhelix's compiles spend per phase, and what they compiled,
summed over the process.

Contract
    ``with phase("passes"): ...`` (or a function decorated ``@timed("passes")``) adds the block's wall seconds to the phase ``"passes"``;
    :func:`totals` returns every phase's seconds so far, :func:`since` the seconds added after an
    earlier :func:`totals`. Phases nest, and a phase's seconds exclude the phases inside it (the
    profiling a pass asks for counts as profiling, not as the pass), so the totals add up to the
    time spent inside any phase and never count a second twice. Each thread keeps its own stack
    (helix compiles on its strands' two threads); the totals are the process's.

    ============  ===============================================================================
    capture       AOTAutograd's own work on a Dynamo graph: the joint forward-backward graph, the
                  joint passes and the partitioner (the partitions' compiles inside it count as
                  their own phases below)
    profiling     measuring ops, collectives and segment pairs on the live group (cost_model.profile)
    passes        dhelix's graph passes, on the graphs compiled and on the merged candidates weighed
    plan          the strand plan's search in a merged graph: segmenting, the interleave DP, its
                  local search and the simulator's judgement of the orders (graph_passes.interleave)
    agreement     waiting for the other ranks at compile time (the rank-consistency check)
    codegen       Inductor's code generation and C++ compile of the scheduled graphs
    dumps         writing the graph dumps, with ``dump_dir`` (``dhelix_compile.observe.dumps``)
    ============  ===============================================================================

    ``count("graphs")`` adds to a count the same way (:func:`counts`, under the same lock):

    ============  ===============================================================================
    graphs        graphs handed to code generation (one per compiled partition or merged graph)
    candidates    merged graphs planned to choose which one to compile, where there was a choice
                  (``helix_runtime.merged_candidates``: the rewritten strands', the plain ones', ...)
    variants      rewrites of one site priced to choose one, or none (``graph_passes.decompose``)
    ============  ===============================================================================

    What no phase holds of a first step -- Dynamo's trace, running the step, and AOTAutograd's
    own work on the backward, which it compiles at the first backward outside ``capture`` (the
    backward's passes and codegen count as theirs) -- is the caller's to compute.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal, ParamSpec, TypeVar

Phase = Literal["capture", "profiling", "passes", "plan", "agreement", "codegen", "dumps"]
PHASES: tuple[Phase, ...] = ("capture", "profiling", "passes", "plan", "agreement", "codegen", "dumps")
Count = Literal["graphs", "candidates", "variants"]
COUNTS: tuple[Count, ...] = ("graphs", "candidates", "variants")

_P = ParamSpec("_P")
_R = TypeVar("_R")

_lock = threading.Lock()
_totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
_counts: dict[str, int] = dict.fromkeys(COUNTS, 0)
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


#: The phases a bench table shows, in the order a compile runs them (what :data:`SHOWN_HEADER` names):
#: not ``agreement`` (waiting) nor ``dumps`` (the bench's own observation), which its JSON keeps.
SHOWN: tuple[Phase, ...] = ("capture", "profiling", "passes", "plan", "codegen")
#: The column header of :func:`format_phases`' cells: ``"capture / profiling / passes / plan / codegen"``.
SHOWN_HEADER = " / ".join(SHOWN)


def format_phases(phases: dict[str, float] | None) -> str | None:
    """The :data:`SHOWN` phases' seconds of a compile (``"1.2 / 4.0 / 2.1 / 0.3 / 9.3"``), ``-``
    for a phase the record lacks (a run recorded with fewer phases); None when none of them ran
    (no dhelix graph was compiled)."""
    phases = phases or {}
    if not any(phases.get(name) for name in SHOWN):
        return None
    return " / ".join(f"{phases[name]:.1f}" if name in phases else "-" for name in SHOWN)


def totals() -> dict[str, float]:
    """Seconds per phase in this process so far (every phase named, 0.0 when none ran)."""
    with _lock:
        return dict(_totals)


def since(before: dict[str, float]) -> dict[str, float]:
    """Seconds per phase added after ``before`` (an earlier :func:`totals`)."""
    now = totals()
    return {name: now[name] - before.get(name, 0.0) for name in PHASES}


def count(name: Count, n: int = 1) -> None:
    """Add ``n`` to the count ``name`` (see the module docstring)."""
    with _lock:
        _counts[name] += n


def counts() -> dict[str, int]:
    """Each count in this process so far (every count named, 0 when nothing was counted)."""
    with _lock:
        return dict(_counts)
