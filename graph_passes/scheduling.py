"""The list scheduler: one algorithm; what to run next is a rule passed in.

Contract
    ``list_schedule(nodes, estimator, rule)`` returns a permutation of ``nodes`` that is a valid
    topological order of the graph, extended with ordering edges that keep
    *order-sensitive* nodes where they were (see :func:`is_order_sensitive`): a node that
    mutates memory, has side effects or draws random numbers is a barrier — everything before
    it in the original order stays before it, everything after stays after. Deterministic: the
    ready list is always sorted by original position, and the rule sees nothing else that varies.

Pseudo-code::

    ready = nodes whose inputs (and barrier edges) are satisfied, by original position
    while ready:
        node = rule(ready, state)            # the priority rule picks one ready node
        state.advance(node)                  # clocks, in-flight transfers, live bytes
        release node's users whose inputs are now all scheduled

``SchedulerState`` keeps an incremental version of the simulator's timeline (one compute
stream, one FIFO comm channel; ``cost_model.simulator`` has the full model, which passes use
to judge a finished order) and the live bytes of the order so far (the liveness rules of
``cost_model.memory``). Rules read it to decide "issue now", "is this transfer done yet?",
"are we over the memory budget?".
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.fx

from cost_model.estimator import Estimator
from cost_model.memory import fused_pointwise, in_place_input, released_nodes, storage_root
from cost_model.op_kinds import is_comm, kind_of
from graph_passes._torch_compat import OpOverload
from graph_passes.annotate import issue_of

Rule = Callable[[Sequence[torch.fx.Node], "SchedulerState"], torch.fx.Node]


def is_order_sensitive(node: torch.fx.Node) -> bool:
    """Mutating, side-effecting or random-number-drawing nodes: they never move.

    Reordering two RNG draws changes which random numbers each gets; moving a read across a
    ``copy_`` into a graph input (AOTAutograd's epilogue for mutated buffers) reads the wrong
    value. Functional collectives are not order-sensitive: they are pure tensors until waited.
    Targets that are not aten ops (higher-order ops, Python callables) are treated as
    order-sensitive, except ``operator.*`` on sizes and tuples.
    """
    if node.op != "call_function":
        return False
    kind = kind_of(node)
    if is_comm(kind) or kind == "wait":
        return False
    target = node.target
    if isinstance(target, OpOverload):
        return target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
    return getattr(target, "__module__", "") != "_operator"


@dataclasses.dataclass
class InFlight:
    """A transfer issued and not yet fully waited on."""

    issue: torch.fx.Node
    done_s: float  # predicted completion on the comm channel
    issued_at_step: int
    waits_left: int


class SchedulerState:
    """What rules may read: positions, costs, clocks, transfers in flight, live bytes.

    ``live_bytes`` counts bytes allocated by scheduled nodes and not yet freed (graph inputs
    excluded: they are live in every order; what the graph outputs counts from its making to
    the end, as ``cost_model.memory`` counts it); ``peak_bytes`` is its maximum so far.
    ``freeable_inputs``: graph inputs counted live from the start and freed at their last use
    (a merged graph's backward strand's saved activations, as ``cost_model.memory`` counts them
    for the interleave pass).
    """

    def __init__(
        self, nodes: Sequence[torch.fx.Node], estimator: Estimator, freeable_inputs: Sequence[torch.fx.Node] = ()
    ) -> None:
        self.position = {n: i for i, n in enumerate(nodes)}
        self.costs = {n: estimator.node_cost(n) for n in [*nodes, *freeable_inputs]}
        self.order: list[torch.fx.Node] = []
        self.compute_clock_s = 0.0
        self.channel_free_s = 0.0
        self.in_flight: dict[torch.fx.Node, InFlight] = {}
        self.live_bytes = sum(self.costs[n].output_bytes for n in freeable_inputs)
        self.peak_bytes = self.live_bytes
        self._root = {n: storage_root(n) for n in [*nodes, *freeable_inputs]}
        self._uses_left: dict[torch.fx.Node, int] = {}
        self._pinned: set[torch.fx.Node] = set()
        self._kept: set[torch.fx.Node] = set()
        freeable = set(freeable_inputs)
        released = released_nodes(nodes)
        self._fused = fused_pointwise(nodes)  # no buffer: their reads are their reader's
        for node in [*nodes, *freeable_inputs]:
            root = self._root[node]
            if root not in freeable and (root not in self.position or root.op in ("placeholder", "get_attr")):
                self._pinned.add(root)  # graph inputs (or their views) are live in every order
            for user in node.users:
                if user.op == "output" and node in released:
                    continue  # handed over as it is made
                if user in self.position and user.op != "output":
                    self._uses_left[root] = self._uses_left.get(root, 0) + 1
                elif root in self.position:
                    self._kept.add(root)  # made here, read by the output: live from its making to the end
                else:
                    self._pinned.add(root)

    @property
    def step(self) -> int:
        """How many nodes are scheduled."""
        return len(self.order)

    def flight_of(self, wait: torch.fx.Node) -> InFlight | None:
        """The in-flight transfer that ``wait`` completes, if it is in flight."""
        issue = issue_of(wait)
        return self.in_flight.get(issue) if issue is not None else None

    def transfer_done_s(self, wait: torch.fx.Node) -> float:
        """Predicted completion of the transfer that ``wait`` completes (0 if not in flight)."""
        flight = self.flight_of(wait)
        return 0.0 if flight is None else flight.done_s

    def alloc_bytes(self, node: torch.fx.Node) -> int:
        """Bytes scheduling ``node`` next allocates (0 for a view or a graph input's)."""
        root = self._root[node]
        if root is not node or root in self._pinned or root in self._fused:
            return 0
        return self.costs[node].output_bytes

    def _reads(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The roots whose uses scheduling ``node`` spends: its inputs', and, through the fused
        nodes it reads, theirs (a fused node spends none: its reader does)."""
        if node in self._fused:
            return []
        reads = []
        pending = list(node.all_input_nodes)
        while pending:
            inp = pending.pop()
            root = self._root.get(inp)
            if root is None or root in self._pinned:
                continue
            reads.append(root)
            if root in self._fused:
                pending.extend(root.all_input_nodes)
        return reads

    def _frees(self, root: torch.fx.Node) -> int:
        return 0 if root in self._kept or root in self._fused else self.costs[root].output_bytes

    def _dying(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The buffers scheduling ``node`` next frees: the roots it reads for the last time."""
        uses: dict[torch.fx.Node, int] = {}
        for root in self._reads(node):
            uses[root] = uses.get(root, 0) + 1
        return [r for r, n in uses.items() if self._uses_left.get(r, 0) <= n and self._frees(r)]

    def net_bytes(self, node: torch.fx.Node) -> int:
        """Live bytes scheduling ``node`` next would add: what it allocates, less the inputs it
        is the last user of."""
        return self.alloc_bytes(node) - sum(self._frees(r) for r in self._dying(node))

    def new_bytes(self, node: torch.fx.Node) -> int:
        """Bytes scheduling ``node`` next adds before it frees anything: what it allocates, or
        nothing where it writes into an input it reads last (``cost_model.memory.in_place_input``)."""
        return 0 if self._in_place(node) is not None else self.alloc_bytes(node)

    def _in_place(self, node: torch.fx.Node) -> torch.fx.Node | None:
        if self.alloc_bytes(node) == 0:
            return None
        return in_place_input(node, self._dying(node), lambda n: self.costs[n].output_bytes)

    def advance(self, node: torch.fx.Node) -> None:
        """Schedule ``node`` next: update clocks, transfers in flight and live bytes."""
        cost = self.costs[node]
        if is_comm(cost.kind):
            self.compute_clock_s += cost.issue_s
            start_s = max(self.compute_clock_s, self.channel_free_s)
            self.channel_free_s = start_s + cost.time_s
            self.in_flight[node] = InFlight(node, self.channel_free_s, self.step, len(_waits_of(node)))
        elif cost.kind == "wait":
            flight = self.flight_of(node)
            if flight is not None:
                self.compute_clock_s = max(self.compute_clock_s, flight.done_s)
                flight.waits_left -= 1
                if flight.waits_left <= 0:
                    del self.in_flight[flight.issue]
        else:
            self.compute_clock_s += cost.time_s
        self.order.append(node)
        taken = self._in_place(node)  # an input whose buffer becomes the output's
        allocated = self.alloc_bytes(node)
        if allocated:
            self.live_bytes += 0 if taken is not None else allocated
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            if self._uses_left.get(node, 0) == 0 and node not in self._kept:  # dead on arrival
                self.live_bytes -= allocated
        for root in self._reads(node):
            self._uses_left[root] -= 1
            if self._uses_left[root] == 0 and root is not taken:
                self.live_bytes -= self._frees(root)


def _waits_of(issue: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``wait_tensor`` nodes completing ``issue`` (through ``getitem`` for list outputs)."""
    waits = []
    for user in issue.users:
        if kind_of(user) == "wait":
            waits.append(user)
        else:
            waits.extend(u for u in user.users if kind_of(u) == "wait")
    return waits


def list_schedule(
    nodes: Sequence[torch.fx.Node], estimator: Estimator, rule: Rule, freeable_inputs: Sequence[torch.fx.Node] = ()
) -> list[torch.fx.Node]:
    """Order ``nodes`` by repeatedly asking ``rule`` which ready node runs next."""
    state = SchedulerState(nodes, estimator, freeable_inputs)
    position = state.position
    preds: dict[torch.fx.Node, set[torch.fx.Node]] = {n: {i for i in n.all_input_nodes if i in position} for n in nodes}
    _add_barrier_edges(nodes, preds)
    waiting = {n: len(p) for n, p in preds.items()}
    succs: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}
    for n in nodes:
        for p in sorted(preds[n], key=position.__getitem__):
            succs[p].append(n)
    ready = [position[n] for n in nodes if waiting[n] == 0]  # kept sorted
    while ready:
        chosen = rule([nodes[i] for i in ready], state)
        ready.remove(position[chosen])
        state.advance(chosen)
        for succ in succs[chosen]:
            waiting[succ] -= 1
            if waiting[succ] == 0:
                bisect.insort(ready, position[succ])
    if len(state.order) != len(nodes):
        raise RuntimeError("list_schedule: the dependency graph has a cycle")
    return state.order


def _add_barrier_edges(nodes: Sequence[torch.fx.Node], preds: dict[torch.fx.Node, set[torch.fx.Node]]) -> None:
    """Order-sensitive nodes become barriers: ordered after all earlier nodes, before all later."""
    last_barrier: torch.fx.Node | None = None
    since_barrier: list[torch.fx.Node] = []
    for node in nodes:
        if is_order_sensitive(node):
            preds[node].update(since_barrier)
            if last_barrier is not None:
                preds[node].add(last_barrier)
            last_barrier, since_barrier = node, []
        else:
            if last_barrier is not None:
                preds[node].add(last_barrier)
            since_barrier.append(node)
