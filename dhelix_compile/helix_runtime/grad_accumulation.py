"""A helix backward graph adds each parameter's gradient into its ``.grad`` itself.

A backward graph returns one gradient per input of its Dynamo graph (AOTAutograd's flat inputs),
and autograd adds each into its parameter's ``.grad`` after the graph returns. In a merged graph
that holds micro-batch i's gradients, a parameter's size over again, while micro-batch i+1's
forward runs: on the MoE layer, whose experts' weights outweigh its activations, the helix
step's peak was 1.24x the eager accumulation loop's with both memory budgets at 1.0.

:func:`add_grads_in_graph` routes each parameter's gradient output through ``dhelix::grad_total``
(``dhelix_compile.ops.accumulated_grad``) right where it is computed: the op adds it into
``.grad``'s own buffer and returns that buffer, which autograd stores back, so the gradient's
memory is free at once. It runs on the scheduled graph, after the passes and the merged
candidates' measurements, which run the graph as it was planned; :func:`mark_released` tells
the passes' memory model beforehand that those outputs are not held to the graph's end
(``cost_model.memory.RELEASED_OUTPUTS``), so the memory budgets count what the graph will hold.
Each ``grad_total`` node names an ``aten.add`` of its gradient as its stand-in
(``cost_model.estimator.STAND_IN_KEY``): the final graph's predicted timeline prices the add
(measured, with profiled costs), not the analytic guess for an op it cannot run.

Slots name parameters by object (:func:`parameter_slots`), so the rewrite is for graphs that are
called with the same parameters every time: not a pipeline's, where one Dynamo graph serves every
stage module of one structure.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from cost_model.estimator import STAND_IN_KEY, stand_in_node
from cost_model.memory import RELEASED_OUTPUTS
from dhelix_compile import _torch_compat as compat
from dhelix_compile.ops.accumulated_grad import GRAD_TOTAL, accumulator_slot

log = logging.getLogger("dhelix")

#: Per AOTAutograd flat input of a Dynamo graph: the parameter's accumulator slot, or None.
Slots = tuple[int | None, ...]


def parameter_slots(example_inputs: Sequence[Any]) -> Slots:
    """A slot for each flat input that is a parameter requiring grad, or a DTensor parameter's
    local shard (its one inner tensor; its mesh is a flat input too); None for every other."""
    slots: list[int | None] = []
    for value in example_inputs:
        leaves = compat.aot_flat_inputs(value)
        row: list[int | None] = [None] * len(leaves)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if isinstance(value, torch.nn.Parameter) and value.requires_grad and len(tensors) == 1:
            row[tensors[0]] = accumulator_slot(value)
        slots.extend(row)
    return tuple(slots)


def graph_outputs(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, list[Any]]:
    """``gm``'s output node and the values it returns."""
    output = gm.graph.output_node()
    values = output.args[0]
    assert isinstance(values, (list, tuple)), f"an AOTAutograd partition returns a tuple, not {values!r}"
    return output, list(values)


def _gradients(outs: Sequence[Any], offset: int, length: int, slots: Slots) -> list[tuple[int, int]]:
    """(output position, slot) of each parameter gradient among ``outs[offset:offset + length]``;
    none when those outputs do not match ``slots`` one to one (logged)."""
    if length != len(slots) or offset + length > len(outs):
        log.debug("helix: %d gradient outputs against %d inputs: .grad is added after the graph", length, len(slots))
        return []
    return [
        (index, slot)
        for index, slot in enumerate(slots, start=offset)
        if slot is not None
        and isinstance(outs[index], torch.fx.Node)
        and isinstance(outs[index].meta.get("val"), torch.Tensor)
    ]


def mark_released(gm: torch.fx.GraphModule, slots: Slots) -> None:
    """Mark the backward graph ``gm``'s parameter gradients (the outputs :func:`add_grads_in_graph`
    will route) as handed over as they are made, for the passes' memory model."""
    output, outs = graph_outputs(gm)
    released = [index for index, _ in _gradients(outs, 0, len(outs), slots)]
    if released:
        output.meta[RELEASED_OUTPUTS] = frozenset(released)


def add_grads_in_graph(gm: torch.fx.GraphModule, parts: Sequence[tuple[int, int, Slots]]) -> int:
    """Route ``gm``'s parameter gradients through ``dhelix::grad_total``; returns how many.

    ``parts``: per backward graph whose outputs ``gm`` returns (one, or two in a merged graph),
    the index of its first output among ``gm``'s, its number of outputs and its slots.
    """
    graph = gm.graph
    output, outs = graph_outputs(gm)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    added = 0
    for offset, length, slots in parts:
        for index, slot in _gradients(outs, offset, length, slots):
            grad = outs[index]
            value = grad.meta["val"]
            anchor = grad if grad.op != "placeholder" else placeholders[-1]
            with graph.inserting_after(anchor):
                total = graph.call_function(GRAD_TOTAL, (grad, slot))
            with getattr(value, "fake_mode", None) or contextlib.nullcontext():
                total.meta["val"] = torch.empty_like(value)
            if "dhelix" in grad.meta:
                total.meta["dhelix"] = {**grad.meta["dhelix"], "kind": "compute"}
            # priced as what it does to memory: two gradient-sized reads and one write
            total.meta[STAND_IN_KEY] = stand_in_node(total, torch.ops.aten.add.Tensor, (grad, grad))
            outs[index] = total
            added += 1
    if added:
        output.args = (tuple(outs), *output.args[1:])
        graph.lint()
        gm.recompile()
    return added
