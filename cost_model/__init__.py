"""dhelix cost model: hardware tables, per-node estimates, collectives, calibration, simulator.

A library that knows nothing of passes: passes receive an :class:`Estimator` and may run
:func:`simulate` on candidate orders.

    hardware        the Device table with sources; measured "cpu" entry
    links           the Link table with sources, and the presets users name links by (no torch)
    datasheets      the vendors' datasheets the two tables cite
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
    timing          timing a call (host clock, device synchronized, CUDA events): every measurement's clock
    progress        the progress bar (tqdm)

The names below load with their submodule on first use: ``import cost_model.units`` (or
``links``, ``progress``) imports no torch, so ``dhelix --help`` answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cost_model.lazy_exports import lazy_exports

if TYPE_CHECKING:
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
    from cost_model.hardware import DEVICES, Device, get_device, load_hardware_file, measure_cpu_device, register_device
    from cost_model.links import LINKS, Link, UnknownHardwareError, get_link, register_link
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

#: Each public name -> the submodule that defines it, imported on first use (PEP 562).
_EXPORTS: dict[str, str] = {
    "collective_bytes_on_wire": "collectives",
    "collective_time_expr": "collectives",
    "collective_time_s": "collectives",
    "CommCall": "comm_nodes",
    "describe_comm": "comm_nodes",
    "AnalyticEstimator": "estimator",
    "Estimator": "estimator",
    "EstimatorBase": "estimator",
    "MemoizedEstimator": "estimator",
    "NodeCost": "estimator",
    "PlannedCosts": "estimator",
    "StubEstimator": "estimator",
    "TableEstimator": "estimator",
    "graph_size_hints": "estimator",
    "graph_time_expr": "estimator",
    "op_bytes": "flops",
    "op_flops": "flops",
    "DEVICES": "hardware",
    "Device": "hardware",
    "get_device": "hardware",
    "load_hardware_file": "hardware",
    "measure_cpu_device": "hardware",
    "register_device": "hardware",
    "LINKS": "links",
    "Link": "links",
    "UnknownHardwareError": "links",
    "get_link": "links",
    "register_link": "links",
    "RELEASED_OUTPUTS": "memory",
    "alias_source": "memory",
    "live_bytes_profile": "memory",
    "peak_memory_bytes": "memory",
    "released_nodes": "memory",
    "storage_root": "memory",
    "NodeKind": "op_kinds",
    "is_comm": "op_kinds",
    "kind_of": "op_kinds",
    "op_name": "op_kinds",
    "CalibrationReport": "profile",
    "ProfiledEstimator": "profile",
    "SimEvent": "simulator",
    "SimResult": "simulator",
    "simulate": "simulator",
    "evaluate": "symbolic",
    "size_hints": "symbolic",
}

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
