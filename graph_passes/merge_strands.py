"""merge_strands: one FX graph M = F(micro-batch i+1) ⊕ B(micro-batch i), every node tagged with its strand.

``helix`` runs the forward of one micro-batch and the backward of the previous one as a single
graph so that one strand's communication can run under the other's compute. This module builds
that graph from the two scheduled partitions AOTAutograd produced for one micro-batch; the
``interleave`` pass then picks its node order.

Contract
    ``merge_strands(fwd, bwd, shared_fwd_inputs=...) -> MergedStrands``

    - Placeholders: F's placeholders in order, then B's placeholders that are not shared, in
      order. ``bwd_input_keep[k]`` says whether B's k-th input is an input of M, so the runtime
      builds M's arguments as ``fwd_args + [a for a, keep in zip(bwd_args, bwd_input_keep) if keep]``.
    - Shared inputs: a B placeholder whose name is the name of an F placeholder at one of the
      positions ``shared_fwd_inputs`` (the forward's parameters and buffers) reads F's
      placeholder instead. AOTAutograd's partitioner names the backward's saved inputs after
      the forward nodes they come from, and a parameter is the same tensor for every
      micro-batch, so the parameters are shared inputs of the two strands. Data inputs saved
      for the backward (the micro-batch itself) are never shared: they differ per micro-batch.
    - Output: one flat tuple ``(*F outputs, *B outputs)``; ``num_fwd_outputs`` splits it.
      ``None`` entries of B's output (no gradient) are kept. Positions a strand's output node
      marks as handed over as they are made (``cost_model.memory.RELEASED_OUTPUTS``) are
      marked on M's, shifted.
    - Nodes: copies of F's nodes (names prefixed ``f_``), then B's (``b_``): a valid
      topological order, F wholly before B. Each copy keeps its ``meta`` (values, stack
      traces) with ``meta["dhelix"]`` updated: ``strand`` = :data:`FWD_STRAND` (0) for F,
      :data:`BWD_STRAND` (1) for B, and ``phase`` = ``"fwd"`` / ``"bwd"``.
    - The inputs are not modified. The two strands share no node except the shared inputs.

Picture::

    F: primals_1 (param), primals_3 (data) ──► ... ──► (loss, saved...)
    B: primals_1, relu, tangents_1          ──► ... ──► (grads...)
    M: f_primals_1, f_primals_3, b_relu, b_tangents_1 ──► F ops (strand 0) ┐
                                                      ──► B ops (strand 1) ┴► (loss, saved..., grads...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch.fx

from cost_model.memory import RELEASED_OUTPUTS
from graph_passes.annotate import META_KEY

FWD_STRAND = 0
"""Strand id of the forward strand (micro-batch i+1) in a merged graph."""
BWD_STRAND = 1
"""Strand id of the backward strand (micro-batch i) in a merged graph."""


@dataclasses.dataclass(frozen=True)
class MergedStrands:
    """The merged graph and how to call it (see the module docstring)."""

    gm: torch.fx.GraphModule
    num_fwd_inputs: int
    num_fwd_outputs: int
    bwd_input_keep: tuple[bool, ...]

    def merged_args(self, fwd_args: list[Any], bwd_args: list[Any]) -> list[Any]:
        """M's argument list from the two strands' argument lists."""
        return [*fwd_args, *(a for a, keep in zip(bwd_args, self.bwd_input_keep, strict=True) if keep)]

    def merged_positions(self, fwd_positions: Collection[int], bwd_positions: Collection[int]) -> tuple[int, ...]:
        """M's input positions of the given positions in the two strands' argument lists, as
        :meth:`merged_args` places them; a backward input M reads from the forward's has none."""
        bwd_at = [i for i, keep in enumerate(self.bwd_input_keep) if keep]
        return (
            *sorted(i for i in fwd_positions if i < self.num_fwd_inputs),
            *(self.num_fwd_inputs + k for k, j in enumerate(bwd_at) if j in bwd_positions),
        )


def merge_strands(
    fwd: torch.fx.GraphModule,
    bwd: torch.fx.GraphModule,
    *,
    shared_fwd_inputs: Collection[int] = (),
    phases: tuple[str, str] = ("fwd", "bwd"),
) -> MergedStrands:
    """Merge a forward and a backward partition into one graph; see the module docstring.

    ``phases``: the ``phase`` tags of the two strands' nodes. Two partitions of one phase merge
    the same way (``helix``'s "same_phase" schedule: F(i+1) ⊕ F(i), B(i+1) ⊕ B(i)); strand 0
    is always ``fwd``'s, strand 1 ``bwd``'s.
    """
    graph = torch.fx.Graph()
    fwd_placeholders = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    shareable = {fwd_placeholders[i].name: i for i in sorted(shared_fwd_inputs) if i < len(fwd_placeholders)}

    fwd_env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in fwd_placeholders:
        fwd_env[node] = _copy_placeholder(graph, node, "f_", FWD_STRAND, phases[0])
    bwd_env: dict[torch.fx.Node, torch.fx.Node] = {}
    keep: list[bool] = []
    for node in bwd.graph.nodes:
        if node.op != "placeholder":
            continue
        shared_index = shareable.get(node.name)
        if shared_index is not None:
            bwd_env[node] = fwd_env[fwd_placeholders[shared_index]]
            keep.append(False)
        else:
            bwd_env[node] = _copy_placeholder(graph, node, "b_", BWD_STRAND, phases[1])
            keep.append(True)

    fwd_outputs = _copy_body(graph, fwd, fwd_env, "f_", FWD_STRAND, phases[0])
    bwd_outputs = _copy_body(graph, bwd, bwd_env, "b_", BWD_STRAND, phases[1])
    output = graph.output((*fwd_outputs, *bwd_outputs))
    released = [
        *_released(fwd),
        *(len(fwd_outputs) + i for i in _released(bwd)),
    ]
    if released:  # the strands' outputs handed over as they are made stay so (cost_model.memory)
        output.meta[RELEASED_OUTPUTS] = frozenset(released)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph, class_name="MergedStrands")
    return MergedStrands(
        gm=gm,
        num_fwd_inputs=len(fwd_placeholders),
        num_fwd_outputs=len(fwd_outputs),
        bwd_input_keep=tuple(keep),
    )


def _released(source: torch.fx.GraphModule) -> frozenset[int]:
    output = source.graph.output_node()
    return frozenset(output.meta.get(RELEASED_OUTPUTS, ()))


def _copy_placeholder(
    graph: torch.fx.Graph, node: torch.fx.Node, prefix: str, strand: int, phase: str
) -> torch.fx.Node:
    copy = graph.placeholder(prefix + node.name)
    _copy_meta(node, copy, strand, phase)
    return copy


def _copy_body(
    graph: torch.fx.Graph,
    source: torch.fx.GraphModule,
    env: dict[torch.fx.Node, torch.fx.Node],
    prefix: str,
    strand: int,
    phase: str,
) -> tuple[Any, ...]:
    """Copy ``source``'s non-placeholder nodes into ``graph``; return its (mapped) outputs."""
    for node in source.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outputs = node.args[0]
            mapped = torch.fx.map_arg(outputs, lambda n: env[n])
            return tuple(mapped) if isinstance(mapped, (tuple, list)) else (mapped,)
        if node.op not in ("call_function", "call_method"):
            raise ValueError(
                f"merge_strands: node {node.name!r} of graph {type(source).__name__} is a {node.op!r}; "
                "only call_function / call_method nodes can be merged (a partition with submodules "
                "or attributes is not supported)"
            )
        copy = graph.create_node(
            node.op,
            node.target,
            torch.fx.map_arg(node.args, lambda n: env[n]),
            torch.fx.map_arg(node.kwargs, lambda n: env[n]),
            name=prefix + node.name,
        )
        _copy_meta(node, copy, strand, phase)
        env[node] = copy
    raise ValueError(f"merge_strands: graph {type(source).__name__} has no output node")


def _copy_meta(source: torch.fx.Node, target: torch.fx.Node, strand: int, phase: str) -> None:
    target.meta = dict(source.meta)
    tags = dict(source.meta.get(META_KEY, {}))
    tags.update(strand=strand, phase=phase)
    target.meta[META_KEY] = tags
