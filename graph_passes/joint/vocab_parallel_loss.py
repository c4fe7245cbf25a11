"""vocab_parallel_loss: a loss over all-gathered logits, computed from each rank's shard instead.

A joint-graph pass, like ``regather``. Tensor parallelism's LM head is column-wise: each rank
computes a vocabulary shard of the logits, and a plan that wants replicated logits (PyTorch's
``ColwiseParallel(output_layouts=Replicate())``, Hugging Face Llama's TP+SP plan) all-gathers
them before the cross-entropy. That gather is the largest transfer of the forward (4 MiB per
micro-batch on the bench's Hugging Face Llama, 34-43 ms on 1 Gbit/s) and it ends the forward, so
nothing is left to run under it. The softmax's reductions over the vocabulary can run on the
shards instead, with three all-reduces of one number per token (Megatron's vocab-parallel
cross-entropy, torch's ``loss_parallel``), and the backward's gradient of the logits, which the
gather's backward cuts back to this rank's shard, is computed on the shard only.

Contract
    Input: an aten joint graph. For each all-gather (with its single wait and the chunk + cat of a
    gather along dim ``d``) of a live or fake group, the *region* is everything computed from the
    gathered tensor ``X`` (full size ``V`` along ``d``). It is rewritten when every node of it is:

    ============================ ========================================================
    a reshape                    keeps ``d`` whole (same product of the dims before it)
    pointwise (``Tag.pointwise``, ``alias``, ``_to_copy``; not a random op)
                                 the other operands broadcast along ``d`` (size 1 or
                                 absent), or have the full ``V``: those are sliced to
                                 this rank's part (this rank's part of the result reads
                                 only that part of each operand)
    ``amax`` / ``sum`` over ``d``  the shard's reduction, then an all-reduce (max / sum)
    ``sum`` over dims without ``d`` still a shard
    ``slice`` along another dim    still a shard; along ``d``, all of it: the shard itself
    ``gather`` along ``d``         the indices this rank holds picked, the others 0, then an
                                 all-reduce (sum): the target's logit
    this rank's chunk along ``d`` (``split`` + ``getitem``, or ``slice``: the gather's backward)
                                 the shard itself
    ============================ ========================================================

    and no node of it is a graph output. Otherwise the graph is left as it was. The gather, its
    chunk + cat and the region's old nodes are erased; new nodes get ``meta["val"]``
    (``decompose.emit.Emitter``). Returns the number of gathers rewritten.

    Numerics: ``amax`` and the picked logit are exact; the sum of exponentials is added per
    shard and then across ranks, another order than eager's (equal within float rounding).

Pseudo-code::

    for (issue, wait, X, d) in all-gathers:
        region = nodes reached from X, in graph order, each classified by the table (or: leave)
        local[X] = issue's input (this rank's shard: X's shape with V / group_size along d)
        for n in region: emit n's rule on local[] before n; a reduction or a chunk replaces n
        erase n in region, the chunk + cat, the wait and the issue (all now unread)
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx

from cost_model.comm_nodes import resolve_process_group
from graph_passes._torch_compat import fake_mode_of
from graph_passes.collective_matches import GatheredTensor, find_gathered_tensors
from graph_passes.decompose.emit import Emitter, val
from graph_passes.node_args import as_int, as_ints, as_node
from graph_passes.op_groups import RESHAPES

__all__ = ["shard_gathered_losses"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

#: Pointwise ops without ``Tag.pointwise`` that are still element by element.
_ALSO_POINTWISE = (aten.alias.default, aten._to_copy.default)
#: Reductions and the all-reduce op that completes each across the shards.
_REDUCTIONS = {aten.amax.default: "max", aten.sum.dim_IntList: "sum", aten.sum.default: "sum"}


@dataclasses.dataclass(frozen=True)
class _Rule:
    """How one node of the region is computed from the shards.

    ``kind``: "pointwise", "reshape", "reduce" (over ``d``: all-reduced, replaces the node),
    "same" (the op with its arguments on the shard: a reduction over other dims, a slice along
    another dim), "whole" (a slice of all of ``d``: the shard), "pick" (gather along ``d``: replaces the
    node), "chunk" (this rank's chunk: the shard itself, replaces the node), "split" (the split
    whose ``getitem`` is a chunk: nothing to emit). ``dim``: the shard dim of the node's output
    (for shards), or the dim the rule works on."""

    kind: str
    dim: int


@dataclasses.dataclass(frozen=True)
class _Site:
    gathered: GatheredTensor
    rank: int
    full: int  # V: the gathered tensor's size along the gather dim
    part: int  # V / group size
    rules: dict[torch.fx.Node, _Rule]


def shard_gathered_losses(graph: torch.fx.Graph) -> int:
    """Rewrite every all-gathered tensor whose readers all qualify (module docstring)."""
    rewritten = 0
    for gathered in find_gathered_tensors(graph):
        site = _plan(gathered)
        if site is not None:
            _rewrite(graph, site)
            rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten


# ---------------------------------------------------------------- planning (changes nothing)


def _shape(node: torch.fx.Node) -> list[int] | None:
    v = val(node)
    if not isinstance(v, torch.Tensor) or not all(isinstance(s, int) for s in v.shape):
        return None
    return list(v.shape)


def _plan(gathered: GatheredTensor) -> _Site | None:
    shape = _shape(gathered.gathered)
    group = resolve_process_group(gathered.group_name)
    if shape is None or group is None or gathered.gather_dim >= len(shape):
        return None
    full = shape[gathered.gather_dim]
    if full % gathered.group_size:
        return None
    part = full // gathered.group_size
    rank = int(group.rank())
    dims: dict[torch.fx.Node, int] = {gathered.gathered: gathered.gather_dim}  # shards: their shard dim
    rules: dict[torch.fx.Node, _Rule] = {}
    splits: set[torch.fx.Node] = set()
    for node in _nodes_after(gathered.gathered):
        sharded = [i for i in node.all_input_nodes if i in dims or i in splits]
        if not sharded:
            continue
        if node.op == "output":
            return None
        rule = _classify(node, dims, splits, full, part, rank)
        if rule is None:
            return None
        rules[node] = rule
        if rule.kind in ("pointwise", "reshape", "same", "whole"):
            dims[node] = rule.dim
        elif rule.kind == "split":
            splits.add(node)
    if not rules:
        return None
    return _Site(gathered, rank, full, part, rules)


def _nodes_after(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    """The graph's nodes after ``node``, in order (the region's readers come after what they read)."""
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


def _classify(
    node: torch.fx.Node, dims: dict[torch.fx.Node, int], splits: set[torch.fx.Node], full: int, part: int, rank: int
) -> _Rule | None:
    out = _shape(node) if node.target is not operator.getitem else None
    target = node.target
    if target is operator.getitem:
        split = as_node(node.args[0])
        return _Rule("chunk", dims[as_node(split.args[0])]) if split in splits and node.args[1] == rank else None
    if node.op != "call_function" or any(i in splits for i in node.all_input_nodes):
        return None
    source = as_node(node.args[0]) if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if target in RESHAPES:
        if source not in dims or out is None:
            return None
        d_out = _reshaped_dim(_shape(source) or [], dims[source], out)
        return None if d_out is None else _Rule("reshape", d_out)
    if target == aten.split.Tensor:
        d = dims.get(source) if source is not None else None
        split_dim = _arg(node, 2, "dim", 0)
        if d is None or source is None or _arg(node, 1, "split_size", 0) != part or _norm(split_dim, source) != d:
            return None
        return _Rule("split", d)
    if target == aten.slice.Tensor:
        d = dims.get(source) if source is not None else None
        if d is None or source is None:
            return None
        if _norm(_arg(node, 1, "dim", 0), source) != d:
            return _Rule("same", d)
        start, end, step = _arg(node, 2, "start", 0), _arg(node, 3, "end", full), _arg(node, 4, "step", 1)
        if step != 1:
            return None
        start, end = (min(max(i + full if i < 0 else i, 0), full) for i in (start, end))
        if (start, end) == (0, full):
            return _Rule("whole", d)
        return _Rule("chunk", d) if (start, end) == (rank * part, (rank + 1) * part) else None
    if target in _REDUCTIONS:
        if source not in dims or out is None or any(i in dims for i in node.all_input_nodes[1:]):
            return None
        rank_in = len(_shape(source) or [])
        listed = None if target == aten.sum.default else node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        reduced = [_norm(d, source) for d in as_ints(listed)] if listed is not None else []
        if not reduced:  # sum(x), sum(x, None), sum(x, []): every dim
            reduced = list(range(rank_in))
        d = dims[source]
        if d in reduced:
            return _Rule("reduce", d)
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        return _Rule("same", d if keepdim else d - sum(r < d for r in reduced))
    if target == aten.gather.default:
        index = as_node(node.args[2])
        if source not in dims or index in dims or _norm(as_int(node.args[1]), source) != dims[source]:
            return None
        return _Rule("pick", dims[source])
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:  # a random op's draws on the shard differ from eager's
        return None
    if torch.Tag.pointwise in tags or target in _ALSO_POINTWISE:
        return _pointwise_rule(node, dims, full, out)
    return None


def _arg(node: torch.fx.Node, index: int, name: str, default: int) -> int:
    """An int argument given by position or name; ``default`` where it is absent or None."""
    value = node.args[index] if len(node.args) > index else node.kwargs.get(name)
    return default if value is None else as_int(value)


def _norm(dim: int, node: torch.fx.Node) -> int:
    return dim + len(_shape(node) or []) if dim < 0 else dim


def _reshaped_dim(shape_in: Sequence[int], d: int, shape_out: Sequence[int]) -> int | None:
    """The dim of ``shape_out`` that is ``shape_in``'s dim ``d`` kept whole, or None."""
    before = math.prod(shape_in[:d])
    for d_out in range(len(shape_out)):
        if math.prod(shape_out[:d_out]) == before and shape_out[d_out] == shape_in[d]:
            return d_out
    return None


def _pointwise_rule(
    node: torch.fx.Node, dims: dict[torch.fx.Node, int], full: int, out: list[int] | None
) -> _Rule | None:
    if out is None:
        return None
    d_out: int | None = None
    for operand in node.all_input_nodes:
        if operand in dims:
            aligned = dims[operand] + len(out) - len(_shape(operand) or [])
            if d_out is not None and aligned != d_out:
                return None
            d_out = aligned
    if d_out is None or out[d_out] != full:
        return None
    for operand in node.all_input_nodes:
        if operand in dims:
            continue
        shape = _shape(operand)
        if shape is None:
            return None
        k = d_out - (len(out) - len(shape))
        if k >= 0 and shape[k] not in (1, full):
            return None
    return _Rule("pointwise", d_out)


# ---------------------------------------------------------------- rewriting


def _rewrite(graph: torch.fx.Graph, site: _Site) -> None:
    g = site.gathered
    fake_mode = fake_mode_of([val(n) for n in graph.nodes])
    local: dict[torch.fx.Node, torch.fx.Node] = {g.gathered: g.shard}
    for node, rule in site.rules.items():
        emit = Emitter(graph, node, fake_mode, None)
        if rule.kind == "split":
            continue
        if rule.kind == "chunk":
            source = as_node(node.args[0])
            if node.target is operator.getitem:
                source = as_node(source.args[0])
            node.replace_all_uses_with(local[source])
        elif rule.kind == "reshape":
            shape = list(_shape(node) or [])
            shape[rule.dim] = site.part
            source = local[as_node(node.args[0])]
            if not val(source).is_contiguous():  # a shard's view needs what the whole's had: row-major
                source = emit.call(aten.clone.default, source, memory_format=torch.contiguous_format)
            local[node] = emit.call(node.target, source, shape)
        elif rule.kind == "pointwise":
            local[node] = _emit_pointwise(emit, node, rule.dim, local, site)
        elif rule.kind == "same":
            local[node] = emit.call(node.target, local[as_node(node.args[0])], *node.args[1:], **node.kwargs)
        elif rule.kind == "whole":
            local[node] = local[as_node(node.args[0])]
        else:
            node.replace_all_uses_with(_emit_all_reduced(emit, node, rule, local, site))
    for node in [*reversed(site.rules), g.gathered, *reversed(g.chunking), g.wait, g.issue]:
        if not node.users:
            graph.erase_node(node)


def _emit_pointwise(
    emit: Emitter, node: torch.fx.Node, d: int, local: dict[torch.fx.Node, torch.fx.Node], site: _Site
) -> torch.fx.Node:
    """``node``'s op on the shards; a replicated operand with the full ``V`` is cut to this rank's part."""
    out_rank = len(_shape(node) or [])
    offset = site.rank * site.part

    def operand(a: Any) -> Any:
        if not isinstance(a, torch.fx.Node):
            return a
        if a in local:
            return local[a]
        shape = _shape(a) or []
        k = d - (out_rank - len(shape))
        if k >= 0 and shape[k] == site.full:
            return emit.call(aten.slice.Tensor, a, k, offset, offset + site.part)
        return a

    args = torch.fx.node.map_aggregate(node.args, operand)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, operand)
    return emit.call(node.target, *args, **kwargs)


def _emit_all_reduced(
    emit: Emitter, node: torch.fx.Node, rule: _Rule, local: dict[torch.fx.Node, torch.fx.Node], site: _Site
) -> torch.fx.Node:
    """A reduction over the shard dim (``reduce``) or the pick of one index along it (``pick``):
    this rank's partial result, all-reduced over the group."""
    source = local[as_node(node.args[0])]
    if rule.kind == "reduce":
        partial = emit.call(node.target, source, *node.args[1:], **node.kwargs)
        op = _REDUCTIONS[node.target]  # type: ignore[index]
    else:  # pick: the index's value where this rank holds it, 0 elsewhere
        shifted = emit.call(aten.sub.Tensor, as_node(node.args[2]), site.rank * site.part)
        held = emit.call(
            aten.logical_and.default,
            emit.call(aten.ge.Scalar, shifted, 0),
            emit.call(aten.lt.Scalar, shifted, site.part),
        )
        picked = emit.call(aten.gather.default, source, rule.dim, emit.call(aten.mul.Tensor, shifted, held))
        v = val(picked)
        zero = emit.call(aten.scalar_tensor.default, 0, dtype=v.dtype, layout=torch.strided, device=v.device)
        partial = emit.call(aten.where.self, held, picked, zero)
        op = "sum"
    return emit.call(
        c10d.wait_tensor.default, emit.call(c10d.all_reduce.default, partial, op, site.gathered.group_name)
    )
