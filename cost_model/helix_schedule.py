"""Which strand calls of a helix step run together: the step's schedule (pure; no torch).

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

The runtime runs these steps (``dhelix_compile.helix_runtime``); the cluster model prices them
(``cost_model.cluster.emulated``).

Contract
    ``helix_schedule(n, kind) -> list[ScheduleStep]``: each F(i) and B(i) exactly once, F(i)
    before B(i), the B(i) in increasing i, each step one or two calls. n >= 1.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

#: The schedules (``helix_schedule`` option): the module docstring draws each.
HelixScheduleKind = Literal["forward_backward", "paired_ends", "same_phase"]

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
