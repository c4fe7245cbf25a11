"""The Strand Interleaving plan over two segment sequences (DHelix's DP), free of any graph.

A *segment* is a run of one strand's work: compute, then (at most) one transfer whose wait
opens a later segment of the same strand. ``plan_pairs`` aligns a forward strand's segments
with a backward strand's so that each strand's transfer runs under the other's compute::

    P(F_i, ∅) = C_F + X_F          P(∅, B_j) = C_B + X_B        (transfer exposed)
    P(F_i, B_j) = max(C_F + C_B + (f-1)·overlap,  X_F + X_B)   (one channel: the transfers
        queue behind each other; f = contention factor: compute under a transfer runs slower)
    T[i][j] = min(T[i-1][j] + P(F_i, ∅), T[i][j-1] + P(∅, B_j), T[i-1][j-1] + P(F_i, B_j))

with moves whose live bytes exceed a budget forbidden. ``graph_passes.interleave`` builds the
segments from a merged FX graph (and may measure ``P``); ``cost_model.cluster`` builds them
from a transformer layer's analytic costs. Deterministic: ties go to the first move tried.

``P`` is additive: it cannot see that a transfer left in flight at the end of one step runs
under the next step's compute, nor a wait that a chain of transfers leaves exposed.
``refine_path`` corrects the DP's path by local search against ``path_time``, a simulation of a
whole path at segment granularity (one compute stream, one channel, transfers in issue order,
a segment's first wait blocking until its strand's previous transfer is done)::

    moves, each keeping both strands' orders:
      split a pair      (i, j)              -> (∅, j), (i, ∅)   or   (i, ∅), (∅, j)
      join two singles  (i, ∅), (∅, j)      -> (i, j)           (either order)
      swap two singles  (i, ∅), (∅, j)      -> (∅, j), (i, ∅)
    first improvement, scanning left to right, until none improves or ``max_evals``

``plan_timed`` is the DP again with ``path_time``'s clocks (:class:`PathState`, stepped by
``advance``) in place of ``P``: each cell keeps the partial paths whose clocks no other kept one
dominates (up to ``width``). ``advance`` is monotone in the clocks, so with an unbounded width
it finds the path of least ``path_time`` (checked against every path of small instances in the
tests); a transfer then runs under as many of the other strand's segments as it needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch.fx


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of one strand's work: compute, ending in (at most) one transfer.

    ``nodes``: its FX nodes (empty for analytic segments). ``live_after_bytes`` /
    ``peak_bytes``: the strand's live bytes after the segment and its peak within it.
    """

    strand: int
    nodes: tuple[torch.fx.Node, ...]
    compute_s: float
    comm_s: float
    live_after_bytes: int
    peak_bytes: int
    lead_s: float = 0.0
    """Compute before the segment's first wait on its strand's earlier transfers (0: it waits
    first, or has no wait and ``waits`` is False)."""
    waits: bool = True
    """Whether the segment waits for its strand's previous transfer (conservatively True)."""


Pair = tuple[int | None, int | None]
"""One step of a plan: (forward segment index or None, backward segment index or None)."""


def pair_time(f: Segment | None, b: Segment | None, contention_factor: float = 1.0) -> float:
    """``P(F_i, B_j)``: predicted time of co-executing two segments (see the module docstring)."""
    if f is None and b is None:
        return 0.0
    if f is None or b is None:
        only = f if f is not None else b
        assert only is not None
        return only.compute_s + only.comm_s
    compute = f.compute_s + b.compute_s
    comm = f.comm_s + b.comm_s
    overlap = min(compute, comm)
    return max(compute + (contention_factor - 1.0) * overlap, comm)


PairCost = Callable[[int | None, int | None], float]
"""``P`` of (forward segment index or None, backward segment index or None)."""


def formula_cost(fwd: Sequence[Segment], bwd: Sequence[Segment], contention_factor: float = 1.0) -> PairCost:
    """``P`` from the segments' costs (:func:`pair_time`)."""

    def cost(i: int | None, j: int | None) -> float:
        return pair_time(fwd[i] if i is not None else None, bwd[j] if j is not None else None, contention_factor)

    return cost


def plan_pairs(
    fwd: Sequence[Segment],
    bwd: Sequence[Segment],
    *,
    cost: PairCost | None = None,
    budget_bytes: float = math.inf,
    fwd_base_bytes: int = 0,
    bwd_base_bytes: int = 0,
) -> tuple[list[Pair], float]:
    """The DHelix DP over two segment sequences; returns the path and its predicted time.

    ``cost``: ``P`` of a move (default :func:`formula_cost`). ``fwd_base_bytes`` /
    ``bwd_base_bytes``: each strand's live bytes before its first segment. A move whose live
    bytes exceed ``budget_bytes`` is forbidden; the sequential path (all of B, then all of F)
    is the fallback if every path is.
    """
    cost = cost or formula_cost(fwd, bwd)
    a, b = len(fwd), len(bwd)
    peaks = _MovePeaks(fwd, bwd, fwd_base_bytes, bwd_base_bytes)
    inf = math.inf
    best = [[inf] * (b + 1) for _ in range(a + 1)]
    step: list[list[Pair | None]] = [[None] * (b + 1) for _ in range(a + 1)]
    best[0][0] = 0.0
    for i in range(a + 1):
        for j in range(b + 1):
            here = best[i][j]
            if here == inf:
                continue
            for ti, tj, pair in _moves(i, j, a, b):
                _relax(best, step, ti, tj, here + cost(*pair), pair, peaks.of(i, j, pair), budget_bytes)
    if best[a][b] == inf:  # nothing fits the budget: the sequential order
        path = sequential_path(a, b)
        return path, math.fsum(cost(*p) for p in path)
    path = []
    i, j = a, b
    while (i, j) != (0, 0):
        taken = step[i][j]
        assert taken is not None
        path.append(taken)
        i, j = i - (taken[0] is not None), j - (taken[1] is not None)
    path.reverse()
    return path, best[a][b]


def usable_pairs(
    fwd: Sequence[Segment],
    bwd: Sequence[Segment],
    *,
    budget_bytes: float = math.inf,
    fwd_base_bytes: int = 0,
    bwd_base_bytes: int = 0,
) -> list[Pair]:
    """The pairs whose ``P`` can decide :func:`plan_pairs`' path and time with these arguments,
    in ``(i, j)`` order: each move within the budget from a state that moves within the budget
    reach from the start to a state from which they reach the end, and the sequential path's
    moves (its fallback when no path fits). ``P`` of any other pair is never read into the
    path's time: a caller that measures ``P`` measures these alone and plans the same path."""
    a, b = len(fwd), len(bwd)
    peaks = _MovePeaks(fwd, bwd, fwd_base_bytes, bwd_base_bytes)
    fits = {
        (i, j, ti, tj, pair)
        for i in range(a + 1)
        for j in range(b + 1)
        for ti, tj, pair in _moves(i, j, a, b)
        if peaks.of(i, j, pair) <= budget_bytes
    }
    reached = {(0, 0)}
    for i in range(a + 1):  # moves only increase i and j: one pass in this order settles both sets
        for j in range(b + 1):
            if (i, j) in reached:
                reached.update((ti, tj) for ti, tj, _ in _moves(i, j, a, b) if (i, j, ti, tj, _) in fits)
    reaching = {(a, b)}
    for i in range(a, -1, -1):
        for j in range(b, -1, -1):
            if any((ti, tj) in reaching for ti, tj, p in _moves(i, j, a, b) if (i, j, ti, tj, p) in fits):
                reaching.add((i, j))
    used = {pair for i, j, ti, tj, pair in fits if (i, j) in reached and (ti, tj) in reaching}
    used.update(sequential_path(a, b))
    return sorted(used, key=pair_order)


def pair_order(pair: Pair) -> tuple[int, int]:
    """A sort key of pairs: by forward index, then backward index, "no segment" first."""
    return (-1 if pair[0] is None else pair[0], -1 if pair[1] is None else pair[1])


def sequential_path(fwd_segments: int, bwd_segments: int) -> list[Pair]:
    """All of the backward, then all of the forward: the plans' fallback and their yardstick."""
    return [(None, j) for j in range(bwd_segments)] + [(i, None) for i in range(fwd_segments)]


def _moves(i: int, j: int, a: int, b: int) -> list[tuple[int, int, Pair]]:
    """The DPs' moves from state ``(i, j)`` as ``(next i, next j, pair)``, in their fixed order
    (ties go to the first): F_{i+1} alone, B_{j+1} alone, B_{j+1} then F_{i+1}."""
    moves: list[tuple[int, int, Pair]] = []
    if i < a:
        moves.append((i + 1, j, (i, None)))
    if j < b:
        moves.append((i, j + 1, (None, j)))
    if i < a and j < b:
        moves.append((i + 1, j + 1, (i, j)))
    return moves


class _MovePeaks:
    """Live bytes of each move, as every plan and path check counts them against the budget."""

    def __init__(self, fwd: Sequence[Segment], bwd: Sequence[Segment], fwd_base_bytes: int, bwd_base_bytes: int):
        self.fwd, self.bwd = fwd, bwd
        #: each strand's live bytes after its first i / j segments
        self.f_after = [fwd_base_bytes, *(s.live_after_bytes for s in fwd)]
        self.b_after = [bwd_base_bytes, *(s.live_after_bytes for s in bwd)]

    def of(self, i: int, j: int, pair: Pair) -> int:
        """Live bytes of the move ``pair`` from state ``(i, j)``: F_i alone, B_j alone, or B_j then F_i."""
        with_f, with_b = pair[0] is not None, pair[1] is not None
        if with_f and with_b:
            return max(self.f_after[i] + self.bwd[j].peak_bytes, self.fwd[i].peak_bytes + self.b_after[j + 1])
        if with_f:
            return self.fwd[i].peak_bytes + self.b_after[j]
        return self.f_after[i] + self.bwd[j].peak_bytes


def _relax(
    best: list[list[float]],
    step: list[list[Pair | None]],
    i: int,
    j: int,
    cost: float,
    pair: Pair,
    peak_bytes: float,
    budget_bytes: float,
) -> None:
    # strict '<' with a fixed move order (F alone, B alone, pair) keeps ties deterministic
    if peak_bytes <= budget_bytes and cost < best[i][j]:
        best[i][j] = cost
        step[i][j] = pair


@dataclasses.dataclass(frozen=True)
class PathState:
    """Where a path's simulation (:func:`path_time`) stands after some of its steps.

    ``now``: the compute stream's clock; ``channel``: when the one channel is free (busy,
    without a gap, until then); ``done``: per strand (0 = forward, 1 = backward), when its
    latest transfer ends.
    """

    now: float = 0.0
    channel: float = 0.0
    done: tuple[float, float] = (0.0, 0.0)

    @property
    def end_s(self) -> float:
        """The makespan if the path ended here: compute done and every transfer landed."""
        return max(self.now, self.channel)

    def dominates(self, other: PathState) -> bool:
        """No later than ``other`` in every clock: every continuation of ``self`` ends no later."""
        return (
            self.now <= other.now
            and self.channel <= other.channel
            and self.done[0] <= other.done[0]
            and self.done[1] <= other.done[1]
        )


def advance(
    state: PathState, pair: Pair, fwd: Sequence[Segment], bwd: Sequence[Segment], contention_factor: float = 1.0
) -> PathState:
    """``state`` after running one step of a path as ``interleave.emit`` orders it: B's segment,
    then F's. A segment computes ``lead_s``, then (if ``waits``) blocks until its strand's latest
    transfer has finished, computes the rest and issues its transfer, which starts when the one
    channel is free. Compute while the channel is busy runs ``contention_factor`` times slower."""
    now, channel = state.now, state.channel
    done = list(state.done)

    def run(start: float, work: float) -> float:
        if work <= 0.0:
            return start
        if start < channel:
            wall = min(channel - start, work * contention_factor)
            return start + wall + (work - wall / contention_factor)
        return start + work

    i, j = pair
    for side, segment in ((1, bwd[j] if j is not None else None), (0, fwd[i] if i is not None else None)):
        if segment is None:
            continue
        lead = min(segment.lead_s, segment.compute_s)
        now = run(now, lead)
        if segment.waits:
            now = max(now, done[side])
        now = run(now, segment.compute_s - lead)
        if segment.comm_s > 0.0:
            channel = max(now, channel) + segment.comm_s
            done[side] = channel
    return PathState(now, channel, (done[0], done[1]))


def path_time(
    path: Sequence[Pair], fwd: Sequence[Segment], bwd: Sequence[Segment], contention_factor: float = 1.0
) -> float:
    """Makespan of a path run as ``interleave.emit`` orders it, at segment granularity
    (:func:`advance`, step by step)."""
    state = PathState()
    for pair in path:
        state = advance(state, pair, fwd, bwd, contention_factor)
    return state.end_s


def plan_timed(
    fwd: Sequence[Segment],
    bwd: Sequence[Segment],
    *,
    contention_factor: float = 1.0,
    budget_bytes: float = math.inf,
    fwd_base_bytes: int = 0,
    bwd_base_bytes: int = 0,
    width: int = 4,
) -> tuple[list[Pair], float]:
    """The DP of :func:`plan_pairs` with :func:`path_time`'s clocks in place of additive pair costs.

    Each cell ``(i, j)`` keeps up to ``width`` partial paths whose :class:`PathState` no other
    kept state dominates (earliest ``end_s`` first), and every move runs :func:`advance` from
    each of them. So a transfer left in flight runs under the following steps' compute, however
    many: the additive ``P`` charges a long transfer (a forward's last gather) to the one pair it
    ends, and pairs it with one short backward segment. Not exact (a state dropped for
    ``width`` may have been the best start for the rest), which is why the pass judges the result
    beside the DP's. Returns the path and its ``path_time``; the sequential path if no path fits
    the budget. Deterministic: fixed move order, stable sorts.
    """
    a, b = len(fwd), len(bwd)
    peaks = _MovePeaks(fwd, bwd, fwd_base_bytes, bwd_base_bytes)
    cells: list[list[list[_Partial]]] = [[[] for _ in range(b + 1)] for _ in range(a + 1)]
    cells[0][0] = [_Partial(PathState(), None, None)]
    for i in range(a + 1):
        for j in range(b + 1):
            kept = cells[i][j] = _frontier(cells[i][j], width)
            for ti, tj, pair in _moves(i, j, a, b):
                if peaks.of(i, j, pair) <= budget_bytes:
                    cells[ti][tj].extend(
                        _Partial(advance(p.state, pair, fwd, bwd, contention_factor), p, pair) for p in kept
                    )
    if not cells[a][b]:
        path = sequential_path(a, b)
        return path, path_time(path, fwd, bwd, contention_factor)
    best = cells[a][b][0]
    return best.path(), best.state.end_s


@dataclasses.dataclass(frozen=True)
class _Partial:
    """A partial path of :func:`plan_timed`: its clocks, and its steps as a linked list."""

    state: PathState
    parent: _Partial | None
    pair: Pair | None

    def path(self) -> list[Pair]:
        steps: list[Pair] = []
        node: _Partial | None = self
        while node is not None and node.pair is not None:
            steps.append(node.pair)
            node = node.parent
        return steps[::-1]


def _frontier(partials: list[_Partial], width: int) -> list[_Partial]:
    """Up to ``width`` partial paths no other kept one dominates, earliest ``end_s`` first (stable)."""
    kept: list[_Partial] = []
    for partial in sorted(partials, key=lambda p: (p.state.end_s, p.state.now)):
        if not any(k.state.dominates(partial.state) for k in kept):
            kept.append(partial)
            if len(kept) == width:
                break
    return kept


def path_peak_bytes(
    path: Sequence[Pair],
    fwd: Sequence[Segment],
    bwd: Sequence[Segment],
    fwd_base_bytes: int = 0,
    bwd_base_bytes: int = 0,
) -> int:
    """Peak live bytes of a path, as ``plan_pairs`` counts them for each move."""
    peaks = _MovePeaks(fwd, bwd, fwd_base_bytes, bwd_base_bytes)
    fi = bj = 0
    peak = 0
    for i, j in path:
        if i is not None or j is not None:
            peak = max(peak, peaks.of(fi, bj, (i, j)))
        fi, bj = fi + (i is not None), bj + (j is not None)
    return peak


def _neighbours(path: list[Pair], k: int) -> list[list[Pair]]:
    """Paths one move away at position ``k`` (see the module docstring), both orders kept."""
    out: list[list[Pair]] = []
    i, j = path[k]
    if i is not None and j is not None:
        out.append([*path[:k], (None, j), (i, None), *path[k + 1 :]])
        out.append([*path[:k], (i, None), (None, j), *path[k + 1 :]])
    if k + 1 < len(path):
        a, b = path[k], path[k + 1]
        singles = (a[0] is None) != (a[1] is None) and (b[0] is None) != (b[1] is None)
        if singles and (a[0] is None) != (b[0] is None):  # one forward single, one backward single
            fi = a[0] if a[0] is not None else b[0]
            bj = a[1] if a[1] is not None else b[1]
            out.append([*path[:k], (fi, bj), *path[k + 2 :]])
            out.append([*path[:k], b, a, *path[k + 2 :]])
    return out


def refine_path(
    path: Sequence[Pair],
    fwd: Sequence[Segment],
    bwd: Sequence[Segment],
    *,
    contention_factor: float = 1.0,
    budget_bytes: float = math.inf,
    fwd_base_bytes: int = 0,
    bwd_base_bytes: int = 0,
    max_evals: int = 4000,
) -> tuple[list[Pair], float]:
    """Local search from ``path`` against :func:`path_time` within the memory budget.

    Returns the best path found and its ``path_time``; deterministic (a fixed evaluation
    budget, never a time limit, so every rank finds the same path).
    """
    best = list(path)
    best_s = path_time(best, fwd, bwd, contention_factor)
    evals = 0
    k = 0
    while k < len(best) and evals < max_evals:
        improved = False
        for candidate in _neighbours(best, k):
            evals += 1
            if path_peak_bytes(candidate, fwd, bwd, fwd_base_bytes, bwd_base_bytes) > budget_bytes:
                continue
            value = path_time(candidate, fwd, bwd, contention_factor)
            if value < best_s - 1e-12:
                best, best_s, improved = candidate, value, True
                break
        k = max(k - 1, 0) if improved else k + 1
    return best, best_s
