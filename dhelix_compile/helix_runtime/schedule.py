"""Which strand calls of a helix step run together: the step's schedule.

A helix step over n micro-batches makes 2n strand calls: F(i), the forward of micro-batch i, and
B(i), its backward. A schedule groups them into steps of one call (it runs alone) or two (they
run as one merged graph: the first call parks, the second takes it, ``strands``).

Three schedules, all with the eager loop's results (B(i) before B(i+1), so gradients accumulate
in micro-batch order; F(i) before B(i)):

    "forward_backward" (DHelix's strand interleaving)::

        F0 | B0+F1 | B1+F2 | ... | B(n-2)+F(n-1) | B(n-1)

      The first forward and the last backward run alone: at n = 4 a quarter of the step's work
      has no other strand to hide its communication under.

    "paired_ends"::

        F0+F1 | B0+F2 | B1+F3 | ... | B(n-3)+F(n-1) | B(n-2)+B(n-1)

      "forward_backward" shifted by one micro-batch: the first forward pairs with the second,
      the last backward with the one before, every step between is a forward beside a
      backward. One micro-batch's activations more are held between steps (two, three for a
      moment inside a B+F step).

    "same_phase"::

        F0+F1 | B0+B1 | F2+F3 | B2+B3 | ...          (n even)
        ... | F(n-3)+F(n-2) | B(n-3)+F(n-1) | B(n-2)+B(n-1)   (n odd >= 3: the last three)

      Every call has a partner. At most two micro-batches' activations are held at a time (as in
      "forward_backward"), three for a moment in the odd tail's B+F step.

Contract
    ``helix_schedule(n, kind) -> list[ScheduleStep]``: each F(i) and B(i) exactly once, F(i)
    before B(i), the B(i) in increasing i, each step one or two calls. n >= 1.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Literal

from dhelix_compile.config import HelixSchedule as HelixScheduleKind

SCHEDULE_KINDS: tuple[HelixScheduleKind, ...] = typing.get_args(HelixScheduleKind)


@dataclasses.dataclass(frozen=True)
class StrandCall:
    """F(index) (``phase="fwd"``) or B(index) (``phase="bwd"``)."""

    phase: Literal["fwd", "bwd"]
    index: int

    def __str__(self) -> str:
        return f"{'F' if self.phase == 'fwd' else 'B'}{self.index}"


#: One call alone, or (first, second): first parks, second takes it and runs the merged graph.
ScheduleStep = tuple[StrandCall] | tuple[StrandCall, StrandCall]


def F(index: int) -> StrandCall:
    return StrandCall("fwd", index)


def B(index: int) -> StrandCall:
    return StrandCall("bwd", index)


def helix_schedule(n: int, kind: HelixScheduleKind) -> list[ScheduleStep]:
    """The steps of a helix step over ``n`` micro-batches; see the module docstring."""
    if n < 1:
        raise ValueError(f"a helix schedule needs at least one micro-batch, got {n}")
    if n == 1:
        return [(F(0),), (B(0),)]
    if kind == "forward_backward":
        return [(F(0),), *((B(i), F(i + 1)) for i in range(n - 1)), (B(n - 1),)]
    if kind == "paired_ends":
        return [(F(0), F(1)), *((B(i), F(i + 2)) for i in range(n - 2)), (B(n - 2), B(n - 1))]
    if kind != "same_phase":
        raise ValueError(f"unknown helix schedule {kind!r}; expected one of {', '.join(SCHEDULE_KINDS)}")
    paired = n if n % 2 == 0 else n - 3
    steps: list[ScheduleStep] = []
    for i in range(0, paired, 2):
        steps += [(F(i), F(i + 1)), (B(i), B(i + 1))]
    if n % 2:
        i = n - 3
        steps += [(F(i), F(i + 1)), (B(i), F(i + 2)), (B(i + 1), B(i + 2))]
    return steps


def describe(steps: list[ScheduleStep]) -> str:
    """``"F0+F1 | B0+B1"``: a schedule as the module docstring writes it."""
    return " | ".join("+".join(str(call) for call in step) for step in steps)


def merged_graph_kind(first: str, second: str) -> str:
    """The name suffix of the merged graph of a ``first``-phase call that takes a parked
    ``second``-phase call: ``merged`` (F ⊕ B, as the "forward_backward" schedule has always
    named it), ``fwdpair`` (F ⊕ F) or ``bwdpair`` (B ⊕ B)."""
    return f"{first}pair" if first == second else "merged"


def graph_calls(steps: list[ScheduleStep]) -> dict[str, int]:
    """How many times a step calls each graph kind: ``fwd`` / ``bwd`` (a call alone) and the
    merged kinds of :func:`merged_graph_kind` (the second call of a step takes the first)."""
    calls: dict[str, int] = {}
    for step in steps:
        kind = step[0].phase if len(step) == 1 else merged_graph_kind(step[1].phase, step[0].phase)
        calls[kind] = calls.get(kind, 0) + 1
    return calls


#: The name suffixes of merged graphs (their dump folders: ``<graph>_<kind>``).
MERGED_GRAPH_KINDS = ("merged", "fwdpair", "bwdpair")


def merged_graph_dirs(root: Path) -> list[Path]:
    """The dump folders of merged graphs under ``root`` (a rank's dump folder), sorted."""
    return sorted(p for kind in MERGED_GRAPH_KINDS for p in root.glob(f"*_{kind}") if p.is_dir())


#: The file a helix step with ``dump_dir`` writes into its rank's dump folder: the schedule it ran.
SCHEDULE_FILE = "helix_schedule.json"


def write_schedule(folder: Path, kind: HelixScheduleKind, steps: list[ScheduleStep]) -> None:
    """Record the schedule of a helix step in ``folder`` (a rank's dump folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SCHEDULE_FILE).write_text(json.dumps({"kind": kind, "steps": describe(steps)}) + "\n")


def read_schedule_kind(folder: Path) -> HelixScheduleKind | None:
    """The schedule kind :func:`write_schedule` recorded in ``folder`` (None: none recorded)."""
    path = folder / SCHEDULE_FILE
    if not path.exists():
        return None
    kind = json.loads(path.read_text())["kind"]
    assert kind in SCHEDULE_KINDS, kind
    return kind
