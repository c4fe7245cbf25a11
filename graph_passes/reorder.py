"""reorder: issue each collective as early as its inputs allow, wait as late as its consumers allow.

Contract
    Input: an annotated graph (``meta["dhelix"]``) and ``ctx.estimator``. Output: the same
    nodes in a new topological order, or the graph untouched with the reason counted.
    - Semantics: only the order changes; order-sensitive nodes (mutation, RNG, side effects)
      keep their relative position (``scheduling.is_order_sensitive``).
    - Memory: the new order's peak live bytes above the inputs it never frees
      (``cost_model.memory.held_peak_bytes``; a backward frees its saved activations after
      their last use, ``_torch_compat.backward_handed_inputs``) stay within
      ``memory_budget_ratio`` x the original order's. Where the list scheduler's order does
      not, ``memory_fit.sink_to_budget`` runs later what it ran early and held at the peak;
      if that does not fit either, the original order stays.
    - Determinism: the order is a function of the graph and the estimator's numbers only, so
      every rank (same graph, same agreed costs) computes the same schedule.
    - Judged by the simulator: kept only if ``cost_model.simulate`` predicts a shorter makespan.
      ``ctx.records["reorder"]`` holds the predictions before/after and
      ``predicted_makespan_s`` of the order the pass returns.

Reason codes (``ctx.stats["reorder"]``; details in ``ctx.notes["reorder"]``)::

    reordered graphs                              the new order is kept
    nodes moved                                   (counted by how many positions changed)
    skipped: no collectives
    skipped: no estimator
    skipped: merged strands                       a helix graph: ``interleave`` orders it
    kept original order: no predicted gain        detail: both predicted makespans
    nodes run later to fit the memory budget      (``memory_fit``, counted by how many moved)
    kept original order: over the memory budget   detail: both peaks and the ratio

The algorithm is ``scheduling.list_schedule``; this module is its priority rule.

Priority rule (first that applies), over the ready nodes::

    1. a ready wait that costs nothing now (its transfer is predicted done), is overdue
       (more than max_issue_distance nodes since its issue) or we are over the memory budget
    2. a ready collective issue (the most urgent: lowest urgency, then original position),
       while fewer than max_in_flight transfers are in flight and its buffer fits the memory budget
    3. a ready non-wait node whose allocation fits the memory budget; first those that feed
       the next collective to issue (the earliest not yet issued, by original position: so
       the next transfer can start sooner), then by original position; when none fits, the one
       that adds the fewest live bytes (frees most)
    4. otherwise the wait whose transfer is predicted to finish first

Picture (a backward TP slice: dgrad feeds the reduce-scatter, wgrad is independent)::

    before:  mm_dgrad  mm_wgrad  rs  wait(rs)  add          comm: ........[rs]
    after:   mm_dgrad  rs  mm_wgrad  wait(rs)  add          comm: ....[rs]      (hidden by mm_wgrad)

Why rule 3 ranks only the next collective's feeders first, then original position: ranking
every ready node by how soon its collective comes ran the work of later collectives ahead of
this layer's weight gradients whenever the next collective's feeders waited on a transfer. Those
later collectives then took the one channel ahead of the next one, and their buffers the memory
budget (then the over-budget rule ran the weight gradients before the issue they should hide).
The reference transformer's backward with per-peer steps (analytic costs, a 40 MB/s link) was
predicted slower in that order than in the original, so the pass kept the original (316 ms);
in this rule's order it is predicted at 275 ms. The bench's other models' predictions changed by
under 0.5 ms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch.fx

from cost_model.estimator import Estimator, MemoizedEstimator
from cost_model.memory import held_peak_bytes
from cost_model.op_kinds import is_comm, kind_of
from cost_model.simulator import simulate
from graph_passes._torch_compat import backward_handed_inputs
from graph_passes.context import PassContext
from graph_passes.memory_fit import sink_to_budget
from graph_passes.node_order import apply_order
from graph_passes.scheduling import Rule, SchedulerState, list_schedule


@dataclasses.dataclass(frozen=True)
class ReorderOptions:
    """Knobs of the reorder pass (``DHelixConfig`` fields of the same names)."""

    memory_budget_ratio: float = 1.0
    """Peak live bytes of the new order may be at most this times the original order's."""
    max_in_flight: int = 2
    """At most this many transfers issued and not yet waited on."""
    max_issue_distance: int = 512
    """At most this many nodes between a collective's issue and its wait."""


def collective_urgency(nodes: Sequence[torch.fx.Node]) -> dict[torch.fx.Node, float]:
    """For each node, the original position of the earliest collective issue downstream of it.

    ``inf`` for nodes that feed no collective. Lower is more urgent: running the node brings
    a transfer closer to being issued.
    """
    return _lowest_downstream(nodes, {n: float(i) for i, n in enumerate(nodes) if is_comm(kind_of(n))})


def _lowest_downstream(nodes: Sequence[torch.fx.Node], rank: dict[torch.fx.Node, float]) -> dict[torch.fx.Node, float]:
    """For each node, the lowest ``rank`` of itself and the nodes downstream of it (``inf``: none ranked)."""
    lowest: dict[torch.fx.Node, float] = {}
    for node in reversed(nodes):
        best = rank.get(node, math.inf)
        for user in node.users:
            best = min(best, lowest.get(user, math.inf))
        lowest[node] = best
    return lowest


def critical_urgency(nodes: Sequence[torch.fx.Node], estimator: Estimator) -> dict[torch.fx.Node, float]:
    """:func:`collective_urgency` with the collectives ranked by the longest path from their issue
    to the end of ``nodes`` (compute and transfer seconds, ``estimator``'s), longest first, instead
    of by original position: the transfer with the most work behind it is issued first, and its
    feeders run first.

    Two strands merged (``interleave``): the forward's first all-to-all of an MoE layer has its
    experts, a second all-to-all and the combine behind it, the backward's all-to-all only
    the backward's experts. Issued in original position (the backward's strand first), the
    forward's waits behind the backward's on the one link and its second all-to-all ends the
    graph exposed; issued first, it is the backward's experts that hide the second.
    """
    position = {n: i for i, n in enumerate(nodes)}
    tail_s: dict[torch.fx.Node, float] = {}
    for node in reversed(nodes):
        after = max((tail_s[user] for user in node.users if user in tail_s), default=0.0)
        tail_s[node] = estimator.node_cost(node).time_s + after
    comms = sorted((n for n in nodes if is_comm(kind_of(n))), key=lambda n: (-tail_s[n], position[n]))
    return _lowest_downstream(nodes, {n: float(i) for i, n in enumerate(comms)})


def overlap_rule(options: ReorderOptions, urgency: dict[torch.fx.Node, float], budget_bytes: int) -> Rule:
    """The priority rule of the module docstring, as a function for ``list_schedule``."""

    # original positions of the collectives not yet issued, earliest first (a comm node's
    # urgency is its own position); the rule is the only one that picks, so it pops them
    unissued = sorted(u for n, u in urgency.items() if is_comm(kind_of(n)))
    issued: set[float] = set()

    def next_issue_position() -> float:
        while unissued and unissued[0] in issued:
            unissued.pop(0)
        return unissued[0] if unissued else math.inf

    def rule(ready: Sequence[torch.fx.Node], state: SchedulerState) -> torch.fx.Node:
        chosen = pick(ready, state)
        if is_comm(state.costs[chosen].kind):
            issued.add(urgency[chosen])
        return chosen

    def pick(ready: Sequence[torch.fx.Node], state: SchedulerState) -> torch.fx.Node:
        over_budget = state.live_bytes > budget_bytes
        waits = [n for n in ready if state.costs[n].kind == "wait"]
        for wait in waits:
            flight = state.flight_of(wait)
            if (
                over_budget
                or flight is None
                or flight.done_s <= state.compute_clock_s
                or state.step - flight.issued_at_step > options.max_issue_distance
            ):
                return wait
        if len(state.in_flight) < options.max_in_flight:
            issues = [
                n
                for n in ready
                if is_comm(state.costs[n].kind) and state.live_bytes + state.costs[n].output_bytes <= budget_bytes
            ]
            if issues:
                return min(issues, key=lambda n: (urgency[n], state.position[n]))
        others = [n for n in ready if state.costs[n].kind != "wait" and not is_comm(state.costs[n].kind)]
        if others:
            within = [n for n in others if state.live_bytes + state.alloc_bytes(n) <= budget_bytes]
            within = within or [n for n in others if state.live_bytes + state.new_bytes(n) <= budget_bytes]
            if within:
                next_issue = next_issue_position()
                return min(within, key=lambda n: (urgency[n] != next_issue, state.position[n]))
            # nothing stays within the budget: what frees the most first
            return min(others, key=lambda n: (state.net_bytes(n), urgency[n], state.position[n]))
        if waits:
            return min(waits, key=lambda n: (state.transfer_done_s(n), state.position[n]))
        return ready[0]  # only issues, all channels full: issue anyway (nothing else can run)

    return rule


def overlap_schedule(
    body: Sequence[torch.fx.Node],
    estimator: Estimator,
    options: ReorderOptions,
    freeable_inputs: Sequence[torch.fx.Node] = (),
    critical: bool = False,
) -> list[torch.fx.Node]:
    """``body`` (a graph's nodes minus placeholders and output) in the order the rule picks.

    The memory budget is ``options.memory_budget_ratio`` x the peak of ``body``'s current order;
    ``freeable_inputs`` are counted as ``SchedulerState`` says. ``critical``: collectives ranked
    by :func:`critical_urgency` rather than by original position.
    """
    budget_bytes = int(options.memory_budget_ratio * _peak_of_order(body, estimator, freeable_inputs))
    urgency = critical_urgency(body, estimator) if critical else collective_urgency(body)
    rule = overlap_rule(options, urgency, budget_bytes)
    return list_schedule(body, estimator, rule, freeable_inputs)


def reorder_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Reorder for overlap; see the module docstring."""
    options = ctx.pass_options.get("reorder", ReorderOptions())
    assert isinstance(options, ReorderOptions)
    graph = gm.graph
    all_nodes = list(graph.nodes)
    if not any(is_comm(kind_of(n)) for n in all_nodes):
        ctx.count("reorder", "skipped: no collectives")
        return gm
    if ctx.estimator is None:
        ctx.count("reorder", "skipped: no estimator")
        return gm
    if len({n.meta.get("dhelix", {}).get("strand", 0) for n in all_nodes}) > 1:
        ctx.count("reorder", "skipped: merged strands")
        return gm
    estimator = MemoizedEstimator(ctx.estimator)  # several orders are simulated below
    body = [n for n in all_nodes if n.op not in ("placeholder", "output")]
    head = [n for n in all_nodes if n.op == "placeholder"]
    tail = [n for n in all_nodes if n.op == "output"]

    def output_bytes(node: torch.fx.Node) -> int:
        return estimator.node_cost(node).output_bytes

    # a backward frees its saved activations as it goes: an order that reads them later holds them longer
    handed = backward_handed_inputs(graph) if ctx.phase == "bwd" else []

    def held_peak(order: Sequence[torch.fx.Node]) -> int:
        return held_peak_bytes(order, output_bytes, freeable_inputs=handed)

    before = simulate(all_nodes, estimator)
    peak_before = held_peak(all_nodes)
    budget_bytes = int(options.memory_budget_ratio * peak_before)
    new_nodes = head + overlap_schedule(body, estimator, options, freeable_inputs=handed) + tail
    peak_after = held_peak(new_nodes)
    if peak_after > budget_bytes:
        fitted = sink_to_budget(new_nodes, output_bytes, budget_bytes, freeable_inputs=handed)
        ctx.count("reorder", "nodes run later to fit the memory budget", _moved(new_nodes, fitted))
        new_nodes, peak_after = fitted, held_peak(fitted)
    order = new_nodes[len(head) : len(new_nodes) - len(tail)]
    after = simulate(new_nodes, estimator)
    ctx.record(
        "reorder",
        predicted_makespan_before_s=before.makespan_s,
        predicted_makespan_after_s=after.makespan_s,
        predicted_exposed_comm_before_s=before.exposed_comm_s,
        predicted_exposed_comm_after_s=after.exposed_comm_s,
    )
    ctx.record("reorder", predicted_makespan_s=before.makespan_s)
    if after.makespan_s >= before.makespan_s:
        ctx.explain(
            "reorder",
            "kept original order: no predicted gain",
            f"{ctx.graph_name}: the new order predicts {after.makespan_s:.4g} s, the original {before.makespan_s:.4g} s",
        )
        return gm
    ctx.record(
        "reorder",
        predicted_held_peak_before_bytes=float(peak_before),
        predicted_held_peak_after_bytes=float(peak_after),
    )
    if peak_after > budget_bytes:
        ctx.explain(
            "reorder",
            "kept original order: over the memory budget",
            f"{ctx.graph_name}: peak {peak_after} B > {options.memory_budget_ratio} x the original's {peak_before} B",
        )
        return gm
    ctx.record("reorder", predicted_makespan_s=after.makespan_s)
    ctx.count("reorder", "nodes moved", apply_order(graph, order))
    ctx.count("reorder", "reordered graphs")
    return gm


def _peak_of_order(
    body: Sequence[torch.fx.Node], estimator: Estimator, freeable_inputs: Sequence[torch.fx.Node] = ()
) -> int:
    """Peak live bytes of ``body`` in its current order, as the scheduler counts them."""
    state = SchedulerState(body, estimator, freeable_inputs)
    for node in body:
        state.advance(node)
    return state.peak_bytes


def _moved(before: Sequence[torch.fx.Node], after: Sequence[torch.fx.Node]) -> int:
    """How many nodes ``after`` places elsewhere than ``before`` does."""
    return sum(a is not b for a, b in zip(before, after, strict=True))
