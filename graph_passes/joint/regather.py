"""regather: parameters gathered again in the backward, as FSDP2's ``reshard_after_forward=True``.

A joint-graph pass (forward and backward in one graph, before AOTAutograd's min-cut partitioner
splits it), not one of the partition passes of ``pass_list.PASSES``. ``data_parallel`` with
``reshard_after_forward=True`` traces each parameter's all-gather inside
``torch.fx.traceback.annotate(REGATHER)``, so those nodes carry ``meta["custom"]``. Left alone,
the partitioner saves the gathered weight (or its transpose, which a matmul's backward reads) for
the backward: ZeRO-3's memory saving is gone between the forward and the backward. Marking the
gather recomputable is not enough, as the transpose is then saved instead; this pass marks the
whole chain the backward reads.

Contract
    Input: an aten joint graph (``tangents_*`` placeholders feed the backward). Marks
    ``meta["recompute"] = MUST_RECOMPUTE`` (and an ``ac_graph_id``, as selective checkpointing
    does) on every forward node annotated ``REGATHER`` (the cast to the compute dtype, the
    all-gather, its wait, the reassembly of a non-zero gather dim) and on every forward node that
    only reshapes or casts marked nodes (views, ``_to_copy``, ``convert_element_type``),
    transitively. Forward: not reached from a tangent. The partitioner then recomputes the chain
    in the backward from the stored shard: the all-gather runs again there, where the partition
    passes schedule it like any collective. Nothing else changes; returns the number of marked
    nodes.

Pseudo-code::

    forward = nodes not reachable from a tangent
    marked  = {n in forward | n.meta["custom"] holds REGATHER}
    for n in graph order, n in forward:
        if n reshapes or casts and all its node inputs are in marked: marked += n
    for n in marked: n.meta["recompute"] = MUST_RECOMPUTE
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from cost_model.op_kinds import reshapes_or_casts

__all__ = ["REGATHER", "REGATHER_AC_GRAPH_ID", "mark_regathers"]

#: The annotation (``torch.fx.traceback.annotate``) of a parameter's gather to do again in the backward.
REGATHER: dict[str, str] = {"dhelix": "regather"}

#: The ``ac_graph_id`` of the marked nodes: one region of its own, as selective checkpointing numbers its regions.
REGATHER_AC_GRAPH_ID = 1_000_000


def _annotated(node: torch.fx.Node) -> bool:
    custom = node.meta.get("custom")
    return isinstance(custom, dict) and all(custom.get(k) == v for k, v in REGATHER.items())


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes reached from a ``tangents_*`` placeholder."""
    reached: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            source in reached for source in node.all_input_nodes
        ):
            reached.add(node)
    return reached


def mark_regathers(graph: torch.fx.Graph) -> int:
    """Mark the annotated gathers and what reshapes them recomputable; see the module docstring."""
    if not any(_annotated(node) for node in graph.nodes):
        return 0
    backward = _backward_nodes(graph)
    marked: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node in backward or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if _annotated(node) or (reshapes_or_casts(node) and inputs and all(source in marked for source in inputs)):
            marked.add(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = REGATHER_AC_GRAPH_ID
    return len(marked)
