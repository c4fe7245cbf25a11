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
* an SDPA kernel whose formula refuses fewer key/value heads than query heads (grouped-query
  attention on torch 2.11): the same formula with those heads broadcast to the query's;
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


def _is_tensor_meta(value: Any) -> bool:
    return type(value).__name__ == "TensorMetadata"


def _shape_of(value: Any) -> tuple[SizeExpr, ...]:
    """Shape of a FakeTensor or TensorMetadata as :data:`SizeExpr` (never guards)."""
    if isinstance(value, torch.Tensor):
        return shape_exprs(value)
    return tuple(size_expr(s) for s in value.shape)


def _shapes(value: Any, raw: bool) -> Any:
    """Replace tensors (and FX nodes holding them) in a nest of args by their shapes.

    ``raw`` formulas (``register_flop_formula(..., get_raw=True)``) read ``t.shape``
    themselves, so tensors become :class:`_ShapeOnly`; the others get shape tuples.
    """
    value = _val(value)
    if isinstance(value, torch.Tensor) or _is_tensor_meta(value):
        shape = _shape_of(value)
        return _ShapeOnly(shape) if raw else shape
    if isinstance(value, torch.SymInt):
        return size_expr(value)
    if isinstance(value, list):
        return [_shapes(v, raw) for v in value]
    if isinstance(value, tuple):
        return tuple(_shapes(v, raw) for v in value)
    return value


def _at_hints(value: Any, hints: dict[sympy.Symbol, int]) -> Any:
    """:func:`_shapes` output with every symbolic size replaced by its hint."""
    if isinstance(value, sympy.Basic):
        return evaluate_int(value, hints)
    if isinstance(value, _ShapeOnly):
        return _ShapeOnly(tuple(_at_hints(s, hints) for s in value.shape))
    if isinstance(value, list):
        return [_at_hints(v, hints) for v in value]
    if isinstance(value, tuple):
        return tuple(_at_hints(v, hints) for v in value)
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
    for s in _shape_of(value):
        total = total * s
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
        return max(values)
    return sympy.Max(*values)


def _simplify(value: Any) -> SizeExpr:
    if isinstance(value, sympy.Basic):
        value = sympy.expand(value)
        return int(value) if isinstance(value, sympy.Integer) else value
    return int(value)


def _formula_flops(node: torch.fx.Node, hints: dict[sympy.Symbol, int] | None) -> SizeExpr | None:
    """FLOPs from the registry or :data:`EXTRA_FLOP_FORMULAS` (None if neither has the op).

    With ``hints``, sizes are made concrete first.
    """
    packet = _packet(node.target)
    formula = flop_counter.flop_registry.get(packet)
    extra = EXTRA_FLOP_FORMULAS.get(packet)
    if formula is None and extra is None:
        return None
    raw = formula is not None and not hasattr(formula, "__wrapped__")  # not shape_wrapper'd
    args = _shapes(node.args, raw)
    kwargs = {k: _shapes(v, raw) for k, v in node.kwargs.items()}
    out = _shapes(node, raw)
    if hints is not None:
        args, out = _at_hints(args, hints), _at_hints(out, hints)
        kwargs = {k: _at_hints(v, hints) for k, v in kwargs.items()}
    if formula is not None:
        return _simplify(formula(*args, out_val=out, **kwargs))
    assert extra is not None
    return _simplify(extra(args, out))


_FORMULA_ERRORS = (TypeError, AssertionError, ValueError, IndexError, AttributeError)

#: SDPA kernels by where their query, key and value start in the args (the backward ones take
#: the output's gradient first), for :func:`_grouped_query_sdpa_flops`.
_SDPA_QKV_AT: dict[object, int] = {
    **dict.fromkeys(
        (
            aten.scaled_dot_product_attention,
            aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_efficient_attention,
            aten._scaled_dot_product_cudnn_attention,
            aten._scaled_dot_product_flash_attention_for_cpu,
        ),
        0,
    ),
    **dict.fromkeys(
        (
            aten._scaled_dot_product_flash_attention_backward,
            aten._scaled_dot_product_efficient_attention_backward,
            aten._scaled_dot_product_cudnn_attention_backward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward,
        ),
        1,
    ),
}


def _grouped_query_sdpa_flops(node: torch.fx.Node) -> SizeExpr | None:
    """An SDPA kernel's FLOPs with the key's and value's heads broadcast to the query's.

    Grouped-query attention hands the kernel fewer key/value heads than query heads (Llama 3's
    8 against 32), and torch 2.11's formulas assert equal heads: their failure would price the
    attention as an elementwise op (an H200 measured it 12-20x slower than that). None for other ops.
    """
    at = _SDPA_QKV_AT.get(_packet(node.target))
    if at is None:
        return None
    hints = size_hints([node, *node.all_input_nodes])
    shapes = [tuple(evaluate_int(size, hints) for size in _shape_of(_val(a))) for a in node.args[: at + 3]]
    query = shapes[at]
    key, value = ((*shape[:-3], query[-3], *shape[-2:]) for shape in shapes[at + 1 : at + 3])
    if at == 0:
        return flop_counter.sdpa_flop_count(query, key, value)
    return flop_counter.sdpa_backward_flop_count(shapes[0], query, key, value)


def op_flops(node: torch.fx.Node) -> SizeExpr:
    """FLOPs of one compute node (see module docstring). Non-compute nodes: 0.

    A formula that cannot take symbolic sizes is evaluated at the size hints; one that
    fails even there (e.g. a nested-tensor layout it does not expect) falls back to the
    elementwise rule rather than failing the caller.
    """
    if kind_of(node) != "compute":
        return 0
    try:
        flops = _formula_flops(node, None)
    except _FORMULA_ERRORS:
        try:
            flops = _formula_flops(node, size_hints([node, *node.all_input_nodes]))
        except _FORMULA_ERRORS:
            flops = _grouped_query_sdpa_flops(node)
    if flops is not None:
        return flops
    packet = _packet(node.target)
    if packet in GATHER_OPS or packet in ALLOCATION_OPS:
        return 0
    sizes = [_numel(t) for t in (*input_tensors(node), *output_tensors(node))]
    return _max(sizes)


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


__all__ = [
    "ALLOCATION_OPS",
    "EXTRA_FLOP_FORMULAS",
    "GATHER_OPS",
    "input_tensors",
    "op_bytes",
    "op_flops",
    "output_bytes_expr",
    "output_tensors",
]
