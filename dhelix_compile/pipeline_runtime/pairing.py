"""Which forward and backward of a pipeline rank run as one merged graph: pure schedule arithmetic.

A pipeline schedule is, per rank, an ordered list of compute steps: ``F`` (a stage's forward of
one micro-batch), ``B`` (its full backward), ``I``/``W`` (a backward split into input and weight
gradients, zero-bubble schedules) and overlaps, a forward and a backward that the schedule says
may run at once (``OVERLAP_F_B``, DualPipeV's steady state). Nothing here knows torch.

    one_f_one_b(num_stages, n)       Schedule1F1B's order (stage s on rank s)
    as_full_backwards(order)         I becomes B, W goes: a compiled stage's backward computes
                                     input and weight gradients in one graph
    pair_forwards_with_backwards(order, num_stages)
                                     each F followed on its rank by a B of another micro-batch
                                     becomes an Overlap (the DHelix pairing), unless that would
                                     deadlock the pipeline or lengthen its makespan: in torch's
                                     1F1B order every pair would, and none is made; eager
                                     1F1B's are kept
    find_deadlock(order, num_stages) the steps no rank can start, or None

Dependencies (one model cut into ``num_stages`` stages, micro-batches independent):
``F(s, j)`` needs ``F(s-1, j)``; ``B(s, i)`` needs ``F(s, i)`` and ``B(s+1, i)`` (the last stage's
backward starts from its loss); ``W(s, i)`` needs ``I(s, i)``. An overlap starts when both its
steps may start, and its two steps must not depend on each other: ``B(b, i)`` depends on
``F(a, j)`` exactly when ``i == j`` (the backward of a micro-batch needs its whole forward).

Merging a pair moves the backward's wait for its gradient before the forward, and the forward's
send after the backward: on another rank this can turn a wait into a cycle. Candidates are
therefore accepted one at a time, each only if the whole schedule still completes
(:func:`find_deadlock`, a round-robin simulation like torch's own lowering of sends and receives).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Literal

Kind = Literal["F", "B", "I", "W"]


@dataclasses.dataclass(frozen=True)
class Compute:
    """One compute step: ``kind`` of ``stage`` on ``microbatch``."""

    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class Overlap:
    """A forward and a backward of another micro-batch, run as one merged graph."""

    forward: Compute
    backward: Compute

    def __post_init__(self) -> None:
        if self.forward.kind != "F" or self.backward.kind not in ("B", "I"):
            raise ValueError(f"an overlap pairs a forward with a backward, got {self.forward} and {self.backward}")
        if self.forward.microbatch == self.backward.microbatch:
            raise ValueError(f"{self.backward} depends on {self.forward}: they cannot overlap")

    @property
    def steps(self) -> tuple[Compute, Compute]:
        return (self.forward, self.backward)

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})"


Step = Compute | Overlap
Order = dict[int, list[Step]]
"""rank -> its compute steps, in order."""


def steps_of(item: Step) -> tuple[Compute, ...]:
    """The compute steps of one order entry."""
    return item.steps if isinstance(item, Overlap) else (item,)


def one_f_one_b(num_stages: int, n_microbatches: int, *, eager: bool = False) -> Order:
    """torch's ``Schedule1F1B`` order: stage ``s`` (on rank ``s``) runs ``min(n, num_stages - s)``
    forwards, then alternates backward and forward, then the remaining backwards.

    ``eager``: Alpa's eager 1F1B (Zhuang et al., MLSys 2023, section 5): ``2 (num_stages - s) - 1``
    warm-up forwards, so a stage's next forward is already computed when the one before it is sent
    and a send overlaps compute instead of waiting for the backward; it holds up to twice the
    activations of 1F1B in flight on the first stage."""
    if num_stages < 1 or n_microbatches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {num_stages} and {n_microbatches}")
    order: Order = {}
    for stage in range(num_stages):
        ahead = 2 * (num_stages - stage) - 1 if eager else num_stages - stage
        warmup = min(n_microbatches, ahead)
        steps: list[Step] = [Compute("F", stage, j) for j in range(warmup)]
        for i in range(n_microbatches):
            steps.append(Compute("B", stage, i))
            if warmup + i < n_microbatches:
                steps.append(Compute("F", stage, warmup + i))
        order[stage] = steps
    return order


def as_full_backwards(order: Mapping[int, Iterable[Step]]) -> Order:
    """``order`` with every ``I`` turned into a full backward ``B`` and every ``W`` dropped."""

    def full(step: Compute) -> Compute:
        return dataclasses.replace(step, kind="B") if step.kind == "I" else step

    out: Order = {}
    for rank, items in order.items():
        kept: list[Step] = []
        for item in items:
            if isinstance(item, Overlap):
                kept.append(Overlap(item.forward, full(item.backward)))
            elif item.kind != "W":
                kept.append(full(item))
        out[rank] = kept
    return out


def pair_forwards_with_backwards(order: Mapping[int, Iterable[Step]], num_stages: int) -> Order:
    """Each ``F`` directly followed on its rank by a ``B`` of another micro-batch becomes an
    :class:`Overlap`, in rank and step order, when the schedule then still completes and its
    :func:`makespan` does not grow (a pair costs its two steps: merging hides communication, which
    this count leaves out, but delays the forward's output to the pair's end, which it does not).

    Overlaps already in ``order`` are kept. Raises ``ValueError`` if ``order`` itself deadlocks.
    """
    paired: Order = {rank: list(items) for rank, items in order.items()}
    stuck = find_deadlock(paired, num_stages)
    if stuck is not None:
        raise ValueError(f"the schedule cannot complete: no rank can start {', '.join(map(str, stuck))}")
    current = makespan(paired, num_stages)
    for rank in sorted(paired):
        items = paired[rank]
        k = 0
        while k + 1 < len(items):
            first, second = items[k], items[k + 1]
            if _pairable(first, second):
                assert isinstance(first, Compute) and isinstance(second, Compute)
                trial = [*items[:k], Overlap(first, second), *items[k + 2 :]]
                length = makespan({**paired, rank: trial}, num_stages)  # inf where it deadlocks
                if length <= current:
                    items = paired[rank] = trial
                    current = length
            k += 1
    return paired


def makespan(
    order: Mapping[int, Iterable[Step]], num_stages: int, forward_s: float = 1.0, backward_s: float = 2.0
) -> float:
    """When the last step of ``order`` ends, every step taking ``forward_s`` (F) or ``backward_s``
    (B, I, W split it in halves) and an overlap the sum of its two, each starting when its rank
    is free and its dependencies have ended (sends and receives free). ``inf`` if it deadlocks."""
    end_s, stuck = _simulate(
        order, num_stages, {"F": forward_s, "B": backward_s, "I": backward_s / 2, "W": backward_s / 2}
    )
    return float("inf") if stuck is not None else end_s


def _pairable(first: Step, second: Step) -> bool:
    return (
        isinstance(first, Compute)
        and isinstance(second, Compute)
        and first.kind == "F"
        and second.kind == "B"
        and first.microbatch != second.microbatch
    )


def find_deadlock(order: Mapping[int, Iterable[Step]], num_stages: int) -> list[Step] | None:
    """``None`` if every rank can run its steps in order; else the steps at the head of the
    ranks that are stuck waiting on each other."""
    return _simulate(order, num_stages, dict.fromkeys(("F", "B", "I", "W"), 1.0))[1]


def _simulate(
    order: Mapping[int, Iterable[Step]], num_stages: int, cost_s: Mapping[str, float]
) -> tuple[float, list[Step] | None]:
    """Run ``order`` round-robin over the ranks (as torch lowers its sends and receives): each
    rank's next entry starts once its steps' dependencies have ended, and when its rank is free.
    Returns when the last entry ends and, if no rank can go on, the entries they are stuck at."""
    queues = {rank: list(items) for rank, items in order.items()}
    heads = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    ended: dict[Compute, float] = {}
    while any(heads[rank] < len(queues[rank]) for rank in queues):
        progress = False
        for rank in sorted(queues):
            if heads[rank] == len(queues[rank]):
                continue
            item = queues[rank][heads[rank]]
            waits = [_dependency_end(step, ended, num_stages) for step in steps_of(item)]
            if any(w is None for w in waits):
                continue
            start = max([free[rank], *(w for w in waits if w is not None)])
            free[rank] = start + sum(cost_s[step.kind] for step in steps_of(item))
            ended.update(dict.fromkeys(steps_of(item), free[rank]))
            heads[rank] += 1
            progress = True
        if not progress:
            return max(free.values()), [queues[r][heads[r]] for r in sorted(queues) if heads[r] < len(queues[r])]
    return max(free.values(), default=0.0), None


def _dependency_end(step: Compute, ended: Mapping[Compute, float], num_stages: int) -> float | None:
    """When the last step ``step`` depends on ended (0 for none), or ``None`` while one has not.
    A backward's gradient comes from the next stage's B or I, whichever the schedule runs."""
    s, m = step.stage, step.microbatch
    if step.kind == "F":
        needs: list[tuple[Compute, ...]] = [] if s == 0 else [(Compute("F", s - 1, m),)]
    elif step.kind == "W":
        needs = [(Compute("I", s, m),)]
    else:
        needs = [(Compute("F", s, m),)]
        if s < num_stages - 1:
            needs.append((Compute("B", s + 1, m), Compute("I", s + 1, m)))
    end = 0.0
    for alternatives in needs:
        done = [ended[a] for a in alternatives if a in ended]
        if not done:
            return None
        end = max(end, min(done))
    return end
