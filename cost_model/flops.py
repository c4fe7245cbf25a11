"""FLOPs and bytes moved by one aten op, as (possibly symbolic) sizes.

Contract
--------
``op_flops(node)`` and ``op_bytes(node)`` read shapes from ``node.meta["val"]`` of the node
and its inputs and return an ``int`` (static shapes) or a sympy expression of the graph's
size symbols. They never guard on a SymInt.

FLOPs (multiply and add count as two):

* ops in ``torch.utils.flop_counter.flop_registry`` -- mm, addmm, bmm, baddbmm,
  convolution / convolution_backward, the SDPA / flash / efficient attention forward and
  backward kernels, _scaled_mm -- use PyTorch's own formulas, fed with sympy shapes
  (e.g. mm ``[m,k] @ [k,n]``: ``2*m*n*k``);
* a few ops it lacks: ``linear`` (``2 * numel(out) * k``), the CPU flash-attention
  kernels ``_scaled_dot_product_flash_attention_for_cpu[_backward]`` and the
  pre-dispatch ``scaled_dot_product_attention`` (same formulas as the registry's SDPA);
* gathers (embedding, index_select, gather, index) and allocations: 0;
* everything else (elementwise, reductions, copies): one FLOP per element of the largest
  tensor read or written.

Bytes (roofline memory traffic):

* views, metadata ops, allocations (empty*): 0 -- they move no data;
* gathers: ``indices + 2 * output`` (rows read = rows written), not the whole table;
* everything else: every distinct tensor input read once + every output written once.

If a registry formula cannot run on symbolic shapes (it compares sizes with ``<``), it is
evaluated at the size hints instead and the result is a constant.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch.utils import flop_counter

from cost_model.op_kinds import kind_of
from cost_model.symbolic import (
    SizeExpr,
    evaluate_int,
    nbytes_expr,
    numel_expr,
    shape_exprs,
    size_expr,
    size_hints,
    tensors_in,
)

aten = torch.ops.aten


def _packet(target: object) -> object:
    return getattr(target, "overloadpacket", target)


class _ShapeOnly:
    """Stands in for a tensor in the raw (``get_raw=True``) flop formulas: only ``.shape``."""

    def __init__(self, shape: tuple[SizeExpr, ...]) -> None:
        self.shape = shape

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]


def _linear_flops(w: tuple[SizeExpr, ...], out: tuple[SizeExpr, ...]) -> SizeExpr:
    k = w[-1]
    total: SizeExpr = 2 * k
    for s in out:
        total = total * s
    return total


def _sdpa_forward(args: Sequence[Any], out: Any) -> SizeExpr:
    q, k, v = args[0], args[1], args[2]
    return flop_counter.sdpa_flop_count(q, k, v)


def _sdpa_backward(args: Sequence[Any], out: Any) -> SizeExpr:
    grad_out, q, k, v = args[0], args[1], args[2], args[3]
    return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)


#: FLOP formulas for ops that ``flop_counter.flop_registry`` does not cover. Each takes
#: the node's args with tensors replaced by their shapes, and the output shape(s).
EXTRA_FLOP_FORMULAS: dict[object, Callable[[Sequence[Any], Any], SizeExpr]] = {
    aten.linear: lambda args, out: _linear_flops(args[1], out),
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
    aten.scaled_dot_product_attention: _sdpa_forward,
}

#: Ops that read only the rows they gather: bytes = indices + 2 * output.
GATHER_OPS: tuple[object, ...] = (
    aten.embedding,
    aten.index_select,
    aten.gather,
    aten.index,
)

#: Ops that only allocate (contents undefined): no FLOPs, no traffic.
ALLOCATION_OPS: tuple[object, ...] = (
    aten.empty,
    aten.empty_strided,
    aten.empty_like,
    aten.new_empty,
    aten.new_empty_strided,
)


def _val(node_or_value: Any) -> Any:
    if isinstance(node_or_value, torch.fx.Node):
        return node_or_value.meta.get("val", node_or_value.meta.get("tensor_meta"))
    return node_or_value


def _meta_to_shape(value: Any) -> Any:
    """Replace tensors (and FX nodes holding them) by sympy shape tuples, recursively."""
    value = _val(value)
    if isinstance(value, torch.Tensor):
        return shape_exprs(value)
    if _is_tensor_meta(value):
        return tuple(_size(s) for s in value.shape)
    if isinstance(value, torch.SymInt):
        return size_expr(value)
    if isinstance(value, list):
        return [_meta_to_shape(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_meta_to_shape(v) for v in value)
    return value


def _is_tensor_meta(value: Any) -> bool:
    return type(value).__name__ == "TensorMetadata"


def _size(s: Any) -> SizeExpr:
    return size_expr(s)


def _wrap_raw(value: Any) -> Any:
    if isinstance(value, tuple) and all(isinstance(s, (int, sympy.Basic)) for s in value):
        return _ShapeOnly(value)
    if isinstance(value, list):
        return [_wrap_raw(v) for v in value]
    return value


def _node_tensors(value: Any) -> list[Any]:
    """Tensor-like values (FakeTensor or TensorMetadata) in a node's val."""
    if _is_tensor_meta(value):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(_is_tensor_meta(v) for v in value):
        return list(value)
    return tensors_in(value)


def _numel(value: Any) -> SizeExpr:
    if isinstance(value, torch.Tensor):
        return numel_expr(value)
    total: SizeExpr = 1
    for s in value.shape:
        total = total * _size(s)
    return total


def _nbytes(value: Any) -> SizeExpr:
    if isinstance(value, torch.Tensor):
        return nbytes_expr(value)
    return _numel(value) * value.dtype.itemsize


def output_tensors(node: torch.fx.Node) -> list[Any]:
    """The tensors a node produces (from ``meta["val"]``, or ``meta["tensor_meta"]``)."""
    return _node_tensors(_val(node))


def input_tensors(node: torch.fx.Node) -> list[Any]:
    """Tensor values read by a node: one per distinct input node, in argument order."""
    out: list[Any] = []
    for inp in node.all_input_nodes:  # distinct, ordered by first appearance
        out.extend(_node_tensors(_val(inp)))
    return out


def _sum(values: Sequence[SizeExpr]) -> SizeExpr:
    total: SizeExpr = 0
    for v in values:
        total = total + v
    return total


def _max(values: Sequence[SizeExpr]) -> SizeExpr:
    if not values:
        return 0
    if all(isinstance(v, int) for v in values):
        return max(values)  # type: ignore[type-var]
    return sympy.Max(*values)


def _registry_flops(node: torch.fx.Node, formula: Callable[..., Any]) -> SizeExpr:
    raw = not hasattr(formula, "__wrapped__")
    args = _meta_to_shape(node.args)
    kwargs = {k: _meta_to_shape(v) for k, v in node.kwargs.items()}
    out = _meta_to_shape(node)
    if raw:
        args = _wrap_raw(list(args))
        kwargs = {k: _wrap_raw(v) for k, v in kwargs.items()}
        out = _wrap_raw(out)
    return formula(*args, out_val=out, **kwargs)


def op_flops(node: torch.fx.Node) -> SizeExpr:
    """FLOPs of one compute node (see module docstring). Non-compute nodes: 0."""
    if kind_of(node) != "compute":
        return 0
    packet = _packet(node.target)
    formula = flop_counter.flop_registry.get(packet)
    try:
        if formula is not None:
            return _simplify(_registry_flops(node, formula))
        extra = EXTRA_FLOP_FORMULAS.get(packet)
        if extra is not None:
            return _simplify(extra(_meta_to_shape(node.args), _meta_to_shape(node)))
    except (TypeError, AssertionError, ValueError, IndexError):
        return _flops_at_hints(node, formula, EXTRA_FLOP_FORMULAS.get(packet))
    if packet in GATHER_OPS or packet in ALLOCATION_OPS:
        return 0
    sizes = [_numel(t) for t in (*input_tensors(node), *output_tensors(node))]
    return _max(sizes)


def _simplify(value: Any) -> SizeExpr:
    if isinstance(value, sympy.Basic):
        value = sympy.expand(value)
        return int(value) if isinstance(value, sympy.Integer) else value
    return int(value)


def _flops_at_hints(
    node: torch.fx.Node,
    formula: Callable[..., Any] | None,
    extra: Callable[[Sequence[Any], Any], SizeExpr] | None,
) -> SizeExpr:
    """Evaluate a formula that needs concrete sizes at the graph's size hints."""
    hints = size_hints([node, *node.all_input_nodes])

    def concrete(value: Any) -> Any:
        if isinstance(value, sympy.Basic):
            return evaluate_int(value, hints)
        if isinstance(value, _ShapeOnly):
            return _ShapeOnly(tuple(concrete(s) for s in value.shape))
        if isinstance(value, list):
            return [concrete(v) for v in value]
        if isinstance(value, tuple):
            return tuple(concrete(v) for v in value)
        if isinstance(value, dict):
            return {k: concrete(v) for k, v in value.items()}
        return value

    args = concrete(_meta_to_shape(node.args))
    kwargs = concrete({k: _meta_to_shape(v) for k, v in node.kwargs.items()})
    out = concrete(_meta_to_shape(node))
    if formula is not None:
        if not hasattr(formula, "__wrapped__"):
            args = _wrap_raw(list(args))
            kwargs = {k: _wrap_raw(v) for k, v in kwargs.items()}
            out = _wrap_raw(out)
        return int(formula(*args, out_val=out, **kwargs))
    assert extra is not None
    return int(extra(args, out))


def op_bytes(node: torch.fx.Node) -> SizeExpr:
    """Bytes a compute node reads and writes (see module docstring). Others: 0."""
    if kind_of(node) != "compute":
        return 0
    packet = _packet(node.target)
    if packet in ALLOCATION_OPS:
        return 0
    outputs = [_nbytes(t) for t in output_tensors(node)]
    if packet in GATHER_OPS:
        index_bytes = [_nbytes(t) for t in input_tensors(node)[1:]]  # all but the table
        return _sum(index_bytes) + 2 * _sum(outputs)
    inputs = [_nbytes(t) for t in input_tensors(node)]
    return _sum(inputs) + _sum(outputs)


def output_bytes_expr(node: torch.fx.Node) -> SizeExpr:
    """Bytes of every tensor a node produces (dense size of its ``meta["val"]``)."""
    return _sum([_nbytes(t) for t in output_tensors(node)])


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


__all__ = [
    "ALLOCATION_OPS",
    "EXTRA_FLOP_FORMULAS",
    "GATHER_OPS",
    "input_tensors",
    "is_getitem",
    "op_bytes",
    "op_flops",
    "output_bytes_expr",
    "output_tensors",
]
