"""Fit an order to a memory budget: run later what a reordering ran early and holds at the peak.

Contract
    ``sink_to_budget(order, output_bytes, budget_bytes)`` returns ``order`` with some of its
    compute moved later, each to just before the first node that reads it, until the order's
    held peak (``cost_model.memory.held_peak_bytes``: the peak above the inputs it never frees)
    is at most ``budget_bytes``, or until nothing more can be moved; the caller checks which.
    - Semantics: a valid topological order of the same nodes. Collectives, waits and
      order-sensitive nodes (``scheduling.is_order_sensitive``) never move, nor does anything
      move past an order-sensitive node.
    - Deterministic: a function of the order and the byte counts.

Why: the list scheduler (``scheduling.list_schedule``) checks the memory budget when it runs a
node, against the bytes live at that moment. Work that hides a transfer early in a graph fits
then; its outputs stay live until their readers, much later, where the graph peaks. On the MLP
block's backward (per-peer steps) the reorder ran the SiLU's three 3 MiB intermediates under
the first exchange: predicted held peak 3 MiB over the budget's base, measured 1.27x the eager
accumulation loop's peak (BENCHMARKS.md).

Algorithm, until the held peak fits::

    p = the first position of the peak
    candidates: a compute node n before p that allocates and is still read after p, with its
      views up to p and the compute only they read (transitively: a pointwise chain such as
      neg -> exp -> add -> div moves whole), whose first reader outside comes after p, with no
      order-sensitive node in between
    gain = the bytes of the group live at p - the bytes of the inputs it reads last, which
      moving it keeps live through p
    move a group, in its order, to just before that reader: the first of the largest gains
      that, in the profile, lowers the bytes live at p without raising the peak
    none: stop
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch.fx

from cost_model.memory import fused_pointwise, live_bytes_profile, memoized_storage_root
from cost_model.op_kinds import is_comm, kind_of
from graph_passes.scheduling import is_order_sensitive

#: Nodes that never move: they are placed for their transfers, or they are the graph's frame.
_FIXED_KINDS = ("wait",)


def sink_to_budget(
    order: Sequence[torch.fx.Node],
    output_bytes: Callable[[torch.fx.Node], int],
    budget_bytes: int,
    *,
    freeable_inputs: Collection[torch.fx.Node] = (),
) -> list[torch.fx.Node]:
    """``order`` with compute moved later until its held peak is within ``budget_bytes``, or
    nothing more can move (module docstring)."""
    order = list(order)
    freeable = frozenset(freeable_inputs)
    root_of = memoized_storage_root()

    profile = live_bytes_profile(order, output_bytes, freeable_inputs=freeable)
    for _ in range(len(order)):  # each move lowers the bytes live where the order peaked
        if profile.held_peak_bytes <= budget_bytes:
            break
        peak_at = profile.live_after_alloc_bytes.index(profile.peak_bytes)
        for group, before in _moves(order, peak_at, output_bytes, root_of, freeable)[:MAX_TRIES]:
            moved = _moved_before(order, group, before)
            after = live_bytes_profile(moved, output_bytes, freeable_inputs=freeable)
            at = moved.index(order[peak_at])
            if after.peak_bytes <= profile.peak_bytes and after.live_after_alloc_bytes[at] < profile.peak_bytes:
                order, profile = moved, after
                break
        else:
            break  # no move lowers this peak
    return order


#: Moves tried at each peak, by their expected gain: the gain counts what the moved group reads
#: directly, not what a fused reader keeps live, so the profile decides.
MAX_TRIES = 8


def _moved_before(
    order: Sequence[torch.fx.Node], group: Sequence[torch.fx.Node], before: torch.fx.Node
) -> list[torch.fx.Node]:
    members = set(group)
    rest = [n for n in order if n not in members]
    at = rest.index(before)
    return rest[:at] + list(group) + rest[at:]


def _movable(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and kind_of(node) not in _FIXED_KINDS
        and not is_comm(kind_of(node))
        and not is_order_sensitive(node)
    )


def _moves(
    order: Sequence[torch.fx.Node],
    peak_at: int,
    output_bytes: Callable[[torch.fx.Node], int],
    root_of: Callable[[torch.fx.Node], torch.fx.Node],
    freeable: frozenset[torch.fx.Node],
) -> list[tuple[list[torch.fx.Node], torch.fx.Node]]:
    """The groups that may move past the peak at ``peak_at`` (each in its order, and the node it
    moves before), largest expected gain first (the first of equals)."""
    position = {n: i for i, n in enumerate(order)}
    reads: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # root -> the nodes reading it (or a view)
    for node in order:
        for inp in node.all_input_nodes:
            reads.setdefault(root_of(inp), []).append(node)
    sensitive = [i for i, n in enumerate(order) if is_order_sensitive(n)]
    views: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in order[: peak_at + 1]:
        root = root_of(node)
        if root is not node:
            views.setdefault(root, []).append(node)
    fused = fused_pointwise(order)  # computed inside their reader: no buffer of their own

    def buffer(node: torch.fx.Node) -> int:
        return 0 if node in fused else output_bytes(node)

    def last_read(root: torch.fx.Node, besides: Collection[torch.fx.Node] = ()) -> int:
        return max((position[n] for n in reads.get(root, ()) if n not in besides), default=-1)

    def allocates(node: torch.fx.Node) -> bool:
        return position.get(node, peak_at) < peak_at and root_of(node) is node and _movable(node)

    def with_views(node: torch.fx.Node) -> list[torch.fx.Node] | None:
        members = [node, *views.get(node, ())]
        return members if all(_movable(m) for m in members) else None

    moves: list[tuple[int, int, list[torch.fx.Node], torch.fx.Node]] = []
    for i in range(peak_at):
        node = order[i]
        if not allocates(node) or buffer(node) <= 0 or last_read(node) <= peak_at:
            continue
        members = with_views(node)
        if members is None:
            continue
        group = _with_private_producers(set(members), allocates, with_views, root_of)
        readers = [position[u] for n in group for u in n.users if u not in group and u in position]
        if not readers or min(readers) <= peak_at:
            continue
        first = min(readers)
        start = min(position[n] for n in group)
        if any(start < s < first for s in sensitive):
            continue
        inputs = {root_of(inp) for n in group for inp in n.all_input_nodes} - group
        # an input read outside the group only before the peak: the move keeps it live through it
        kept_live = [r for r in inputs if (r.op == "call_function" or r in freeable) and last_read(r, group) < peak_at]
        gain = sum(buffer(n) for n in group if root_of(n) is n and last_read(n) > peak_at)
        gain -= sum(buffer(r) for r in kept_live)
        if gain > 0:
            moves.append((-gain, i, sorted(group, key=position.__getitem__), order[first]))
    moves.sort(key=lambda m: (m[0], m[1]))
    return [(group, before) for _, _, group, before in moves]


def _with_private_producers(
    group: set[torch.fx.Node],
    allocates: Callable[[torch.fx.Node], bool],
    with_views: Callable[[torch.fx.Node], list[torch.fx.Node] | None],
    root_of: Callable[[torch.fx.Node], torch.fx.Node],
) -> set[torch.fx.Node]:
    """``group`` with the compute that only it reads, transitively (a pointwise chain such as
    neg -> exp -> add -> div moves whole: moving its last node alone would keep the one before
    it live instead)."""
    grew = True
    while grew:
        grew = False
        for member in list(group):
            for inp in member.all_input_nodes:
                root = root_of(inp)
                if root in group or not allocates(root):
                    continue
                members = with_views(root)
                if members is not None and all(u in group or u in members for m in members for u in m.users):
                    group.update(members)
                    grew = True
    return group
