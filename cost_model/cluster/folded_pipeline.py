"""The folded pipeline (model folding: two chunks per rank, V-shaped), simulated action by action.

DHelix runs pipeline parallelism with *model folding*: the ``2p`` layer chunks of a ``p``-stage
pipeline are laid out as a V, chunk ``c`` on rank ``c`` for ``c < p`` and on rank ``2p - 1 - c``
otherwise (torch's ``ScheduleDualPipeV`` layout), so every rank holds one chunk on the way down and
one on the way up, and in the steady state it has a forward of one chunk and a backward of the
other to run at once -- the pair the Strand Interleaving DP merges.

Contract
--------
``simulate_folded(pp, micro_batches, costs, merge) -> FoldedRun``; pure and deterministic.

* Actions: the forward ``F(c, j)`` and backward ``B(c, j)`` of chunk ``c`` on micro-batch ``j``.
  ``F(c, j)`` needs ``F(c - 1, j)``; ``B(c, j)`` needs ``B(c + 1, j)`` (the last chunk: its own
  ``F(c, j)``, the loss). A result crossing ranks arrives ``costs.p2p_s`` after it was computed
  (an asynchronous send: it costs the receiver a wait, not the sender compute time).
* Each rank is a list scheduler: when free, it runs a ready backward first (oldest micro-batch
  first, as 1F1B does, which frees activations), else a ready forward (oldest first), else it
  waits for the next result to arrive. A micro-batch enters the pipeline (chunk 0's forward) only
  while fewer than ``2p`` are in it (one per chunk: the folded schedule's warm-up depth, which
  bounds the activations a rank holds as 1F1B's ``p`` does). With ``merge``, a ready forward and a ready backward of
  the two chunks run as one merged action of ``costs.pair_s`` (one forward and one backward under
  the DP's plan), and a rank with only one of the two ready waits for the other when it arrives
  sooner than the pair saves (``forward_s + backward_s - pair_s``); without ``merge``, one after
  the other.
* ``FoldedRun.step_s`` is the makespan of one step's actions on every rank; ``busy_s`` the busiest
  rank's time computing; ``bubble_s = step_s - busy_s``, the time that rank waited for a peer
  (warm-up, cool-down, transfers not covered); ``pairs`` the merged actions over all ranks.

What is costed how: chunks are equal (each ``L / 2p`` layers, ``costs`` from the stage's strands
halved: the head and embedding sit on rank 0's two chunks in a real V and are spread here); a
merged pair is the DP's plan of one chunk's forward with the other's backward. Left out: the
optimizer, data-parallel synchronization (the step model adds it) and any P2P cost on the sender.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkCosts:
    """Seconds of one chunk's actions on one micro-batch."""

    forward_s: float
    backward_s: float
    pair_s: float
    """A forward of one chunk and a backward of another, merged (the Strand Interleaving plan)."""
    p2p_s: float
    """An activation, or its gradient, from one rank to the next."""


@dataclass(frozen=True)
class FoldedRun:
    """One simulated step of the folded pipeline (see the module docstring)."""

    step_s: float
    busy_s: float
    bubble_s: float
    pairs: int
    actions: int


def rank_of_chunk(chunk: int, pp: int) -> int:
    """The rank holding ``chunk`` of ``2 pp`` in the V layout."""
    return chunk if chunk < pp else 2 * pp - 1 - chunk


def simulate_folded(pp: int, micro_batches: int, costs: ChunkCosts, *, merge: bool) -> FoldedRun:
    """One step of the folded pipeline of ``pp`` ranks over ``micro_batches`` (module docstring)."""
    if pp < 1 or micro_batches < 1:
        raise ValueError(f"a folded pipeline needs pp >= 1 and micro_batches >= 1, got {pp} and {micro_batches}")
    chunks = 2 * pp
    ready_at: dict[tuple[str, int, int], float] = {("F", 0, j): 0.0 for j in range(micro_batches)}
    done: set[tuple[str, int, int]] = set()
    free_at = [0.0] * pp
    busy = [0.0] * pp
    pairs = actions = 0
    events: list[tuple[float, int]] = [(0.0, r) for r in range(pp)]  # (time a rank looks for work, rank)

    def finish(action: tuple[str, int, int], at: float) -> None:
        kind, chunk, mb = action
        done.add(action)
        successor: tuple[str, int, int]
        if kind == "F":
            successor = ("F", chunk + 1, mb) if chunk + 1 < chunks else ("B", chunk, mb)
        elif chunk > 0:
            successor = ("B", chunk - 1, mb)
        else:
            return  # the micro-batch's last backward
        crosses = rank_of_chunk(successor[1], pp) != rank_of_chunk(chunk, pp)
        arrival = at + (costs.p2p_s if crosses else 0.0)
        ready_at[successor] = arrival
        heapq.heappush(events, (arrival, rank_of_chunk(successor[1], pp)))

    def ready(rank: int, kind: str, now: float) -> list[tuple[str, int, int]]:
        found = [
            a
            for a, t in ready_at.items()
            if a[0] == kind and t <= now and rank_of_chunk(a[1], pp) == rank  # taken ones are popped
        ]
        return sorted(found, key=lambda a: (a[2], -a[1] if kind == "B" else a[1]))

    total = 2 * chunks * micro_batches
    while len(done) < total:
        now, rank = heapq.heappop(events)
        if free_at[rank] > now + 1e-15:
            continue  # busy: it looks again when it is free
        backwards = ready(rank, "B", now)
        in_flight = sum(1 for j in range(micro_batches) if ("F", 0, j) in done and ("B", 0, j) not in done)
        forwards = [a for a in ready(rank, "F", now) if a[1] > 0 or in_flight < chunks]
        if merge and bool(backwards) != bool(forwards):
            # the other half of a pair arrives soon: waiting for it costs less than the pair saves
            other = "F" if backwards else "B"
            coming = [
                t
                for a, t in ready_at.items()
                if a[0] == other and rank_of_chunk(a[1], pp) == rank and t > now and (a[1] > 0 or in_flight < chunks)
            ]
            if coming and min(coming) - now < costs.forward_s + costs.backward_s - costs.pair_s:
                heapq.heappush(events, (min(coming), rank))
                continue
        taken: list[tuple[str, int, int]]
        if merge and backwards and forwards:
            taken, duration = [forwards[0], backwards[0]], costs.pair_s
            pairs += 1
        elif backwards:
            taken, duration = [backwards[0]], costs.backward_s
        elif forwards:
            taken, duration = [forwards[0]], costs.forward_s
        else:
            continue  # nothing ready: the next arrival for this rank wakes it
        for action in taken:
            ready_at.pop(action)
        end = now + duration
        free_at[rank], busy[rank] = end, busy[rank] + duration
        actions += 1
        for action in taken:
            finish(action, end)
        heapq.heappush(events, (end, rank))
    step = max(free_at)
    busiest = max(busy)
    return FoldedRun(step_s=step, busy_s=busiest, bubble_s=step - busiest, pairs=pairs, actions=actions)


__all__ = ["ChunkCosts", "FoldedRun", "rank_of_chunk", "simulate_folded"]
