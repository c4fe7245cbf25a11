"""dhelix cost model: hardware tables, per-node estimates, collectives, calibration, simulator.

A library that knows nothing of passes: passes receive an :class:`Estimator` and may run
:func:`simulate` on candidate orders.

    hardware        Device / Link tables with sources; measured "cpu" entry
    op_kinds        node classification (compute / collective / wait / p2p / view / other), op_name
    flops           FLOPs and bytes per aten op (torch.utils.flop_counter formulas)
    collectives     alpha-beta models (ring / tree, nccl / gloo)
    estimator       NodeCost, the Estimator protocol and EstimatorBase (its neutral answers),
                    AnalyticEstimator, TableEstimator, MemoizedEstimator, PlannedCosts
    profile/        ProfiledEstimator: measured ops, collectives and segment pairs, agreed across
                    ranks, cached (estimator, signatures, cache, running, contention, pairs)
    rank_agreement  every rank plans with the same numbers (tensor collectives)
    memory          aliasing and liveness, peak live bytes of an order
    simulator       one compute stream + N comm channels -> makespan, exposed comm, events
    strand_plan     the Strand Interleaving DP over two strands' segments (DHelix's plan)
    symbolic        sympy sizes and their hints
    cluster/        the DHelix paper's settings at cluster scale (``dhelix simulate``)
    units           numbers as text: format_ms, format_pct, format_ratio
    progress        the progress bar (tqdm)
"""

from __future__ import annotations

from cost_model.collectives import (
    collective_bytes_on_wire,
    collective_time_expr,
    collective_time_s,
)
from cost_model.comm_nodes import CommCall, describe_comm
from cost_model.estimator import (
    AnalyticEstimator,
    Estimator,
    EstimatorBase,
    MemoizedEstimator,
    NodeCost,
    PlannedCosts,
    StubEstimator,
    TableEstimator,
    graph_size_hints,
    graph_time_expr,
)
from cost_model.flops import op_bytes, op_flops
from cost_model.hardware import (
    DEVICES,
    LINKS,
    Device,
    Link,
    UnknownHardwareError,
    get_device,
    get_link,
    load_hardware_file,
    measure_cpu_device,
    register_device,
    register_link,
)
from cost_model.memory import (
    RELEASED_OUTPUTS,
    alias_source,
    live_bytes_profile,
    peak_memory_bytes,
    released_nodes,
    storage_root,
)
from cost_model.op_kinds import NodeKind, is_comm, kind_of, op_name
from cost_model.profile import CalibrationReport, ProfiledEstimator
from cost_model.simulator import SimEvent, SimResult, simulate
from cost_model.symbolic import evaluate, size_hints

__all__ = [
    "DEVICES",
    "LINKS",
    "RELEASED_OUTPUTS",
    "AnalyticEstimator",
    "CalibrationReport",
    "CommCall",
    "Device",
    "Estimator",
    "EstimatorBase",
    "Link",
    "MemoizedEstimator",
    "NodeCost",
    "NodeKind",
    "PlannedCosts",
    "ProfiledEstimator",
    "SimEvent",
    "SimResult",
    "StubEstimator",
    "TableEstimator",
    "UnknownHardwareError",
    "alias_source",
    "collective_bytes_on_wire",
    "collective_time_expr",
    "collective_time_s",
    "describe_comm",
    "evaluate",
    "get_device",
    "get_link",
    "graph_size_hints",
    "graph_time_expr",
    "is_comm",
    "kind_of",
    "live_bytes_profile",
    "load_hardware_file",
    "measure_cpu_device",
    "op_bytes",
    "op_flops",
    "op_name",
    "peak_memory_bytes",
    "register_device",
    "register_link",
    "released_nodes",
    "simulate",
    "size_hints",
    "storage_root",
]
