"""Estimators: the per-node cost interface passes receive, and the analytic model.

Contract
--------
An :class:`Estimator` maps one FX node to a :class:`NodeCost`; which model stands behind it
(analytic, profiled, a table in a test) is the caller's choice. Besides ``node_cost`` every
estimator answers four questions, with a neutral answer where it has no real one::

    member                        answers                                        neutral answer
    node_cost(node)               the node's cost                                (required)
    contention_factor             compute slowdown while a transfer is in        1.0
                                  flight (the simulator, the interleave DP)
    segment_pair_times(fwd, bwd)  seconds of forward segment i and backward      {}: nothing measured,
                                  segment j run together, keyed (i, j)           the caller keeps its
                                  (None: no segment of that strand)              formula
    measure_new(nodes)            measures nodes a pass created after            nothing
                                  calibration, before they are priced
    segment_times(segments)       seconds of each node list run for real, with   [None, ...]: nothing
                                  its dataflow, on the live group (the           measured
                                  decompose pass's candidates)

Callers call them directly; nothing is probed with ``getattr``. :class:`EstimatorBase` holds the
neutral answers: :class:`AnalyticEstimator` and :class:`TableEstimator` inherit them (and set
their own contention factor), :class:`MemoizedEstimator` forwards all of them to the estimator it
wraps, and :class:`cost_model.profile.ProfiledEstimator` has real answers for all of them.

A pass that lowers a planned node after the planning (``graph_passes.gloo_collectives``: an
all-gather or a reduce-scatter -> an all-to-all at the same issue and wait) may fix the new nodes' costs in
``node.meta[PLANNED_COST_KEY]`` (a :class:`NodeCost`), so that the final graph is priced as it
was planned; :class:`PlannedCosts` reads them (the dumps' predicted timeline of the final graph).
A node added after the planning that runs an op no estimator can time by itself (a custom op
with side effects: helix's ``dhelix::grad_total`` adds a gradient into ``.grad``) may name a
*stand-in* in ``node.meta[STAND_IN_KEY]``: a node of a graph of its own (:func:`stand_in_node`)
calling a pure op on inputs like the node's, which :class:`PlannedCosts` prices in its place
(measured first with ``measure_new`` where the estimator measures).

:class:`AnalyticEstimator` -- the roofline / alpha-beta model::

    compute node   time = launch_overhead + max(flops / peak_flops[dtype], bytes / mem_bw)
    issue node     time = collective_time(op, S, group_size, link)   (cost_model.collectives)
    wait, view, placeholder, output, views by schema, allocations:  time = 0

FLOPs and bytes come from :mod:`cost_model.flops` (``torch.utils.flop_counter``'s formulas
where it has one). With symbolic shapes every quantity is first a sympy expression of the
graph's size symbols; ``NodeCost.time_expr`` keeps it and the numbers are its value at the
symbols' hints. :func:`graph_time_expr` sums the expressions of a whole graph ("how does
this graph's cost grow with sequence length").

``output_bytes`` is what the node *allocates*: its outputs' dense size, 0 for nodes whose
output aliases an input (:func:`cost_model.memory.alias_source`). Placeholders report their
size so liveness can count graph inputs.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import sympy
import torch
import torch.fx

from cost_model.collectives import (
    Algorithm,
    Backend,
    collective_bytes_on_wire,
    collective_time_expr,
    collective_time_s,
)
from cost_model.comm_nodes import describe_comm
from cost_model.flops import ALLOCATION_OPS, op_bytes, op_flops, output_bytes_expr, output_tensors
from cost_model.hardware import Device, Link, get_device, get_link
from cost_model.memory import alias_source, is_schema_view
from cost_model.nodes import node_list
from cost_model.op_kinds import NodeKind, is_comm, kind_of
from cost_model.strand_plan import Pair
from cost_model.symbolic import (
    SizeExpr,
    evaluate,
    evaluate_int,
    free_symbols_sorted,
    shape_env_of_nodes,
    size_hints,
    symbol_hint,
    to_sympy,
)

aten = torch.ops.aten

_ZERO = sympy.Integer(0)


@dataclass(frozen=True)
class NodeCost:
    """Cost of one node.

    Attributes:
        kind: from :func:`cost_model.op_kinds.kind_of`.
        time_s: compute time (compute nodes), transfer time (collective / P2P issue
            nodes), 0 for wait / view / other.
        flops: floating-point operations (at the size hints).
        bytes_accessed: device-memory bytes read + written (compute nodes).
        comm_bytes: bytes this rank sends over its link (issue nodes).
        output_bytes: bytes the node allocates (0 when its output aliases an input).
        time_expr: ``time_s`` as a sympy expression of the graph's size symbols.
        collective: collective name for issue nodes (``"all_gather"``, ``"send"``...).
        group_size: ranks in the collective's group (issue nodes).
        contention_factor: issue nodes: compute runs this many times slower while this
            transfer is in flight (None: the estimator's ``contention_factor``). A profiled
            estimator measures one per kind of transfer (``cost_model.profile.contention``).
        issue_s: issue nodes: seconds the issuing thread itself spends starting the transfer
            (copying the payload, the socket writes gloo makes on the caller's thread for a
            point-to-point send), on the compute stream before the transfer starts; ``time_s``
            is the rest. 0 where nothing measured it (a collective queued to a worker thread or
            a NCCL stream costs microseconds to issue).
    """

    kind: NodeKind
    time_s: float
    flops: int = 0
    bytes_accessed: int = 0
    comm_bytes: int = 0
    output_bytes: int = 0
    time_expr: sympy.Expr = _ZERO
    collective: str | None = None
    group_size: int | None = None
    contention_factor: float | None = None
    issue_s: float = 0.0


@runtime_checkable
class Estimator(Protocol):
    """Anything that prices a node, and answers the questions of the module docstring."""

    @property
    def contention_factor(self) -> float:
        """Compute slowdown (>= 1.0) while at least one transfer is in flight."""
        ...

    def node_cost(self, node: torch.fx.Node) -> NodeCost:
        """The cost of one node."""
        ...

    def segment_pair_times(
        self,
        fwd: Sequence[Sequence[torch.fx.Node]],
        bwd: Sequence[Sequence[torch.fx.Node]],
        pairs: Collection[Pair] | None = None,
    ) -> dict[Pair, float]:
        """Measured seconds of forward segment ``i`` and backward segment ``j`` run together, keyed
        ``(i, j)`` (``None`` for "no segment": one run alone), of the keys in ``pairs`` (None: of
        every pair); pairs without a measurement are absent."""
        ...

    def measure_new(self, nodes: Sequence[torch.fx.Node]) -> object:
        """Measure ``nodes``, created by a pass after calibration, before they are priced; every
        rank calls it with the same nodes in the same order. The return value is for logs only."""
        ...

    def segment_times(self, segments: Sequence[Sequence[torch.fx.Node]]) -> list[float | None]:
        """Measured seconds of each node list run in order with its dataflow (None: not measured);
        every rank calls it with the same segments in the same order."""
        ...


class EstimatorBase:
    """The neutral answers (module docstring); an estimator inherits them and overrides what it can do."""

    #: what ``contention_factor`` answers; AnalyticEstimator and TableEstimator set their own.
    _contention_factor: float = 1.0

    @property
    def contention_factor(self) -> float:
        """Read-only, as in :class:`Estimator` (ProfiledEstimator computes it from its measurements)."""
        return self._contention_factor

    def segment_pair_times(
        self,
        fwd: Sequence[Sequence[torch.fx.Node]],
        bwd: Sequence[Sequence[torch.fx.Node]],
        pairs: Collection[Pair] | None = None,
    ) -> dict[Pair, float]:
        """Nothing measured: ``{}``."""
        return {}

    def measure_new(self, nodes: Sequence[torch.fx.Node]) -> object:
        """Nothing to measure: None."""
        return None

    def segment_times(self, segments: Sequence[Sequence[torch.fx.Node]]) -> list[float | None]:
        """Nothing measured: None for each."""
        return [None] * len(segments)


def _allocated_bytes(node: torch.fx.Node) -> SizeExpr:
    if node.op in ("placeholder", "get_attr"):
        return output_bytes_expr(node)
    if node.op != "call_function" or alias_source(node) is not None:
        return 0
    return output_bytes_expr(node)


def _dtype_of(node: torch.fx.Node) -> torch.dtype | None:
    for inp in node.all_input_nodes:
        tensors = output_tensors(inp)
        if tensors and tensors[0].dtype.is_floating_point:
            return tensors[0].dtype
    outs = output_tensors(node)
    return outs[0].dtype if outs else None


class AnalyticEstimator(EstimatorBase):
    """Roofline compute + alpha-beta communication (see module docstring).

    Args:
        device: a :class:`Device` or its registry name (``"h100_sxm"``, ``"cpu"``...).
        link: the link collectives use (intra-node), object or name.
        world_size: group size when a collective's node does not say it and its group is
            unknown to ``torch.distributed``.
        comm_backend: ``"nccl"`` or ``"gloo"`` (changes the algorithms, see
            :mod:`cost_model.collectives`).
        algorithm: ``"ring"``, ``"tree"`` or ``"auto"`` for all-reduce.
        inter_node_link: link used when a group spans nodes (``group_size >
            ranks_per_node``); defaults to ``link``.
        ranks_per_node: ranks sharing the intra-node link; None means one node.
        contention_factor: overrides ``device.contention_factor``.
    """

    def __init__(
        self,
        device: Device | str,
        link: Link | str,
        world_size: int | None = None,
        comm_backend: Backend = "nccl",
        *,
        algorithm: Algorithm = "ring",
        inter_node_link: Link | str | None = None,
        ranks_per_node: int | None = None,
        contention_factor: float | None = None,
    ) -> None:
        if comm_backend not in ("nccl", "gloo"):
            raise ValueError(f"comm_backend must be 'nccl' or 'gloo', got {comm_backend!r}")
        if algorithm not in ("ring", "tree", "auto"):
            raise ValueError(f"algorithm must be 'ring', 'tree' or 'auto', got {algorithm!r}")
        self.device: Device = get_device(device)
        self.link: Link = get_link(link)
        self.world_size = world_size
        self.comm_backend: Backend = comm_backend
        self.algorithm: Algorithm = algorithm
        self.inter_node_link: Link = get_link(inter_node_link) if inter_node_link else self.link
        self.ranks_per_node = ranks_per_node
        self._contention_factor = self.device.contention_factor if contention_factor is None else contention_factor

    def link_for(self, group_size: int) -> Link:
        """The bottleneck link of a group: inter-node once it spans more than one node."""
        if self.ranks_per_node is not None and group_size > self.ranks_per_node:
            return self.inter_node_link
        return self.link

    def node_cost(self, node: torch.fx.Node) -> NodeCost:
        kind = kind_of(node)
        alloc = _allocated_bytes(node)
        if kind == "compute":
            return self._compute_cost(node, alloc)
        if is_comm(kind):
            return self._comm_cost(node, kind, alloc)
        hints = _hints_for(node, [alloc])
        return NodeCost(kind=kind, time_s=0.0, output_bytes=evaluate_int(alloc, hints))

    # ------------------------------------------------------------------ compute

    def _compute_cost(self, node: torch.fx.Node, alloc: SizeExpr) -> NodeCost:
        packet = getattr(node.target, "overloadpacket", node.target)
        if packet in ALLOCATION_OPS or is_schema_view(node):
            hints = _hints_for(node, [alloc])
            return NodeCost(kind="compute", time_s=0.0, output_bytes=evaluate_int(alloc, hints))
        flops = op_flops(node)
        nbytes = op_bytes(node)
        peak = self.device.flops_per_s(_dtype_of(node))
        bandwidth = self.device.mem_bandwidth_bytes_per_s
        launch = self.device.launch_overhead_s
        if isinstance(flops, int) and isinstance(nbytes, int) and isinstance(alloc, int):
            time_s = launch + max(flops / peak, nbytes / bandwidth)
            return NodeCost(
                kind="compute",
                time_s=time_s,
                flops=flops,
                bytes_accessed=nbytes,
                output_bytes=alloc,
                time_expr=sympy.Float(time_s),
            )
        time_expr = sympy.Float(launch) + sympy.Max(
            to_sympy(flops) / sympy.Float(peak), to_sympy(nbytes) / sympy.Float(bandwidth)
        )
        hints = _hints_for(node, [flops, nbytes, alloc])
        return NodeCost(
            kind="compute",
            time_s=evaluate(time_expr, hints),
            flops=evaluate_int(flops, hints),
            bytes_accessed=evaluate_int(nbytes, hints),
            output_bytes=evaluate_int(alloc, hints),
            time_expr=time_expr,
        )

    # ------------------------------------------------------------------ comm

    def _comm_cost(self, node: torch.fx.Node, kind: NodeKind, alloc: SizeExpr) -> NodeCost:
        call = describe_comm(node, self.world_size)
        link = self.link_for(call.group_size)
        wire = collective_bytes_on_wire(call.op, call.nbytes, call.group_size, self.algorithm, self.comm_backend)
        if isinstance(call.nbytes, int) and isinstance(alloc, int):
            time_s = collective_time_s(call.op, call.nbytes, call.group_size, link, self.algorithm, self.comm_backend)
            return NodeCost(
                kind=kind,
                time_s=time_s,
                comm_bytes=round(float(wire)),
                output_bytes=alloc,
                time_expr=sympy.Float(time_s),
                collective=call.op,
                group_size=call.group_size,
            )
        time_expr = collective_time_expr(call.op, call.nbytes, call.group_size, link, self.algorithm, self.comm_backend)
        hints = _hints_for(node, [call.nbytes, alloc])
        return NodeCost(
            kind=kind,
            time_s=evaluate(time_expr, hints),
            comm_bytes=round(evaluate(wire, hints)),
            output_bytes=evaluate_int(alloc, hints),
            time_expr=time_expr,
            collective=call.op,
            group_size=call.group_size,
        )


def _hints_for(node: torch.fx.Node, exprs: Sequence[object]) -> dict[sympy.Symbol, int]:
    symbolic = [e for e in exprs if isinstance(e, sympy.Basic) and e.free_symbols]
    if not symbolic:
        return {}
    env = shape_env_of_nodes([node, *node.all_input_nodes])
    symbols = free_symbols_sorted(symbolic)
    return {sym: symbol_hint(sym, env) for sym in symbols}


class TableEstimator(EstimatorBase):
    """Times given per node name or per kind; for tests and hand-made schedules.

    Lookup order for ``time_s``: ``times_s[node.name]``, then ``kind_times_s[kind]``,
    then ``default_s`` for compute / collective / p2p nodes and 0 for the rest.
    ``output_bytes``: ``output_bytes[node.name]`` when given, else the node's allocated
    bytes from ``meta["val"]`` (0 without metadata).
    """

    def __init__(
        self,
        times_s: Mapping[str, float] | None = None,
        kind_times_s: Mapping[str, float] | None = None,
        *,
        default_s: float = 0.0,
        output_bytes: Mapping[str, int] | None = None,
        contention_factor: float = 1.0,
    ) -> None:
        self.times_s = dict(times_s or {})
        self.kind_times_s = dict(kind_times_s or {})
        self.default_s = default_s
        self.output_bytes = dict(output_bytes or {})
        self._contention_factor = contention_factor

    def node_cost(self, node: torch.fx.Node) -> NodeCost:
        kind = kind_of(node)
        if node.name in self.times_s:
            time_s = float(self.times_s[node.name])
        elif kind in self.kind_times_s:
            time_s = float(self.kind_times_s[kind])
        elif kind in ("compute", "collective", "p2p"):
            time_s = self.default_s
        else:
            time_s = 0.0
        if node.name in self.output_bytes:
            out_bytes = int(self.output_bytes[node.name])
        else:
            try:
                alloc = _allocated_bytes(node)
                out_bytes = evaluate_int(alloc, _hints_for(node, [alloc]))
            except (AttributeError, TypeError):
                out_bytes = 0
        return NodeCost(kind=kind, time_s=time_s, output_bytes=out_bytes, time_expr=sympy.Float(time_s))


#: ``node.meta`` key of the :class:`NodeCost` a lowering pass fixed for a node it made after the
#: planning (module docstring); read by :class:`PlannedCosts`.
PLANNED_COST_KEY = "dhelix_planned_cost"
#: ``node.meta`` key: the node (:func:`stand_in_node`) whose cost this node has (module docstring).
STAND_IN_KEY = "dhelix_stand_in"


def stand_in_node(node: torch.fx.Node, target: object, args: Sequence[torch.fx.Node]) -> torch.fx.Node:
    """A node of a new graph calling ``target`` on placeholders like ``args`` (their
    ``meta["val"]``), its output like ``node``'s: what ``node`` costs, to keep in
    ``node.meta[STAND_IN_KEY]``. An input named twice gets one placeholder."""
    graph = torch.fx.Graph()
    inputs: dict[torch.fx.Node, torch.fx.Node] = {}
    for arg in args:
        if arg not in inputs:
            inputs[arg] = graph.placeholder(f"{arg.name}_like")
            inputs[arg].meta["val"] = arg.meta.get("val")
    call = graph.call_function(target, tuple(inputs[a] for a in args))  # type: ignore[arg-type]
    call.meta["val"] = node.meta.get("val")
    graph.output(call)
    return call


class MemoizedEstimator:
    """Wraps an estimator so each node is costed once (passes simulate several orders).

    The other members of :class:`Estimator` are the wrapped estimator's. Valid only while the
    nodes' metadata does not change.
    """

    def __init__(self, base: Estimator) -> None:
        self.base = base
        self._costs: dict[torch.fx.Node, NodeCost] = {}

    @property
    def contention_factor(self) -> float:
        return self.base.contention_factor

    def node_cost(self, node: torch.fx.Node) -> NodeCost:
        cost = self._costs.get(node)
        if cost is None:
            cost = self._costs[node] = self.base.node_cost(node)
        return cost

    def segment_pair_times(
        self,
        fwd: Sequence[Sequence[torch.fx.Node]],
        bwd: Sequence[Sequence[torch.fx.Node]],
        pairs: Collection[Pair] | None = None,
    ) -> dict[Pair, float]:
        return self.base.segment_pair_times(fwd, bwd, pairs)

    def measure_new(self, nodes: Sequence[torch.fx.Node]) -> object:
        return self.base.measure_new(nodes)

    def segment_times(self, segments: Sequence[Sequence[torch.fx.Node]]) -> list[float | None]:
        return self.base.segment_times(segments)


class PlannedCosts(MemoizedEstimator):
    """Prices a graph as it was planned: a node carrying ``meta[PLANNED_COST_KEY]`` costs that
    :class:`NodeCost`, one carrying ``meta[STAND_IN_KEY]`` what its stand-in costs, every other
    node what the wrapped estimator says (memoized)."""

    def node_cost(self, node: torch.fx.Node) -> NodeCost:
        planned = node.meta.get(PLANNED_COST_KEY)
        if isinstance(planned, NodeCost):
            return planned
        stand_in = node.meta.get(STAND_IN_KEY)
        return super().node_cost(stand_in if isinstance(stand_in, torch.fx.Node) else node)


#: Alias: the stub estimator tests hand to passes.
StubEstimator = TableEstimator


def graph_time_expr(
    nodes: Iterable[torch.fx.Node] | torch.fx.Graph | torch.fx.GraphModule,
    estimator: Estimator,
    kinds: Sequence[NodeKind] | Literal["all"] = "all",
) -> sympy.Expr:
    """Sum of ``time_expr`` over the nodes (optionally only some kinds): the graph's
    sequential cost as a sympy expression of its size symbols.

    Substitute hints with :func:`cost_model.symbolic.evaluate` and
    :func:`cost_model.symbolic.size_hints`, or other values to extrapolate.
    """
    total: sympy.Expr = _ZERO
    for node in node_list(nodes):
        cost = estimator.node_cost(node)
        if kinds == "all" or cost.kind in kinds:
            total = total + cost.time_expr
    return total


def graph_size_hints(
    nodes: Iterable[torch.fx.Node] | torch.fx.Graph | torch.fx.GraphModule,
) -> dict[sympy.Symbol, int]:
    """The hints of every size symbol of a graph (see :func:`cost_model.symbolic.size_hints`)."""
    return size_hints(node_list(nodes))
