"""Symbolic sizes: tensor shapes as sympy expressions, and their concrete hints.

Contract
--------
A graph traced with dynamic shapes carries ``SymInt`` sizes in ``node.meta["val"]``.
The cost model never guards on them: every size becomes a sympy expression of the
graph's size symbols (``s0``, ``s1``, ...; unbacked ``u0`` ...), costs are built as
sympy expressions of those symbols, and a number is obtained by substituting each
symbol's *hint* (the value it had when the graph was traced)::

    shape_exprs(val)          (s0, 4096)           -- sympy, never guards
    numel_expr(val)           4096*s0
    size_hints(nodes)         {s0: 2048}           -- from the ShapeEnv
    evaluate(expr, hints)     8388608.0

Static sizes stay Python ``int`` so the common, fully static case does no sympy work.
Unbacked symbols (data-dependent sizes) have no recorded value; they are hinted with
``UNBACKED_FALLBACK_HINT`` (the same default Inductor uses,
``torch._inductor.config.unbacked_symint_fallback``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import sympy
import torch
import torch.fx

aten = torch.ops.aten

#: Hint for a size symbol that has no recorded value (unbacked SymInt). Same default as
#: ``torch._inductor.config.unbacked_symint_fallback``.
UNBACKED_FALLBACK_HINT: int = 8192

#: A size: a Python int when static, a sympy expression when symbolic.
SizeExpr: TypeAlias = int | sympy.Expr


def size_expr(size: int | torch.SymInt) -> SizeExpr:
    """One size as ``int`` (static) or sympy expression (``SymInt``), without guarding."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if isinstance(expr, sympy.Integer) else expr
    return int(size)


def shape_exprs(val: torch.Tensor) -> tuple[SizeExpr, ...]:
    """A tensor's shape as a tuple of :data:`SizeExpr`."""
    return tuple(size_expr(s) for s in val.shape)


def numel_expr(val: torch.Tensor) -> SizeExpr:
    """Number of elements: the product of :func:`shape_exprs`."""
    total: SizeExpr = 1
    for s in shape_exprs(val):
        total = total * s
    return total


def nbytes_expr(val: torch.Tensor) -> SizeExpr:
    """Bytes of a dense tensor of ``val``'s shape and dtype: ``numel * itemsize``."""
    return numel_expr(val) * val.dtype.itemsize


def is_symbolic(expr: object) -> bool:
    """True when ``expr`` is a sympy expression with free symbols."""
    return isinstance(expr, sympy.Basic) and bool(expr.free_symbols)


def to_sympy(value: SizeExpr | float) -> sympy.Expr:
    """Wrap a number (or pass through an expression) as a sympy expression."""
    if isinstance(value, sympy.Basic):
        return value
    if isinstance(value, int):
        return sympy.Integer(value)
    return sympy.Float(value)


def _shape_env_of(value: Any) -> Any | None:
    """The ShapeEnv behind a FakeTensor / SymInt (or a nest of them), if any."""
    if isinstance(value, torch.SymInt):
        return value.node.shape_env
    if isinstance(value, torch.Tensor):
        mode = getattr(value, "fake_mode", None)
        env = getattr(mode, "shape_env", None)
        if env is not None:
            return env
        for s in value.shape:
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
        return None
    if isinstance(value, (list, tuple)):
        for item in value:
            env = _shape_env_of(item)
            if env is not None:
                return env
    return None


def shape_env_of_nodes(nodes: Iterable[torch.fx.Node]) -> Any | None:
    """The first ShapeEnv found in ``node.meta["val"]`` of ``nodes`` (None when static)."""
    for node in nodes:
        env = _shape_env_of(node.meta.get("val"))
        if env is not None:
            return env
    return None


def symbol_hint(symbol: sympy.Symbol, shape_env: Any | None) -> int:
    """The concrete value a size symbol had at trace time (fallback for unbacked ones)."""
    if shape_env is None:
        return UNBACKED_FALLBACK_HINT
    return int(shape_env.optimization_hint(symbol, fallback=UNBACKED_FALLBACK_HINT))


def size_hints(nodes: Iterable[torch.fx.Node] | torch.fx.Graph) -> dict[sympy.Symbol, int]:
    """Hints for every size symbol that appears in the nodes' ``meta["val"]`` shapes.

    The dict is ordered by first appearance (deterministic).
    """
    node_list = list(nodes.nodes if isinstance(nodes, torch.fx.Graph) else nodes)
    env = shape_env_of_nodes(node_list)
    hints: dict[sympy.Symbol, int] = {}
    for node in node_list:
        for val in _tensors_in(node.meta.get("val")):
            for s in shape_exprs(val):
                if isinstance(s, sympy.Basic):
                    for sym in sorted(s.free_symbols, key=str):
                        if sym not in hints:
                            hints[sym] = symbol_hint(sym, env)
    return hints


def evaluate(expr: SizeExpr | float | sympy.Expr, hints: Mapping[sympy.Symbol, int]) -> float:
    """The value of a cost expression with every symbol replaced by its hint.

    Symbols missing from ``hints`` get :data:`UNBACKED_FALLBACK_HINT`.
    """
    if not isinstance(expr, sympy.Basic):
        return float(expr)
    if not expr.free_symbols:
        return float(expr)
    subs = {sym: hints.get(sym, UNBACKED_FALLBACK_HINT) for sym in expr.free_symbols}
    return float(expr.xreplace(subs))


def evaluate_int(expr: SizeExpr, hints: Mapping[sympy.Symbol, int]) -> int:
    """:func:`evaluate` for integer quantities (sizes, FLOPs, bytes)."""
    if isinstance(expr, int):
        return expr
    return round(evaluate(expr, hints))


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors in a ``meta["val"]`` (a tensor, or a nest of lists/tuples of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out: list[torch.Tensor] = []
        for item in value:
            out.extend(_tensors_in(item))
        return out
    return []


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Public alias of the tensor flattener used across the cost model."""
    return _tensors_in(value)


def hinted_shape(val: torch.Tensor, hints: Mapping[sympy.Symbol, int]) -> tuple[int, ...]:
    """A tensor's shape with every symbolic size replaced by its hint."""
    return tuple(evaluate_int(s, hints) for s in shape_exprs(val))


def hinted_stride(val: torch.Tensor, hints: Mapping[sympy.Symbol, int]) -> tuple[int, ...]:
    """A tensor's strides with every symbolic stride replaced by its hint."""
    return tuple(evaluate_int(size_expr(s), hints) for s in val.stride())


def concretize(value: Any, hints: Mapping[sympy.Symbol, int]) -> Any:
    """Replace SymInt/SymFloat/SymBool in a nest of args by their hinted values."""
    if isinstance(value, torch.SymInt):
        return evaluate_int(size_expr(value), hints)
    if isinstance(value, torch.SymFloat):
        return evaluate(value.node.expr, hints)
    if isinstance(value, torch.SymBool):
        return bool(evaluate(value.node.expr, hints))
    if isinstance(value, list):
        return [concretize(v, hints) for v in value]
    if isinstance(value, tuple):
        return tuple(concretize(v, hints) for v in value)
    return value


def free_symbols_sorted(exprs: Sequence[sympy.Expr]) -> list[sympy.Symbol]:
    """All free symbols of ``exprs``, sorted by name (deterministic)."""
    syms: set[sympy.Symbol] = set()
    for e in exprs:
        if isinstance(e, sympy.Basic):
            syms |= e.free_symbols
    return sorted(syms, key=str)
