"""What a measurement is keyed by: the signature of a compute op or a collective.

Contract
--------
Two nodes with the same signature cost the same, so one measurement serves both (and, for
compute ops, every later process through the disk cache). A signature is a string::

    compute      "<op> | <args> | <kwargs> | -> <output>"
    collective   "<op> | <arg>=<value>;... | group_size=<n> | backend=<name>"

``<op>`` is :func:`cost_model.op_kinds.op_name` ``(qualified=True)`` (``aten.mm.default``), so a
collective's signature starts with ``_c10d_functional.`` (:func:`is_collective_signature`).
Tensors are written ``T([shape], [stride], dtype)`` at the size hints; other values by ``repr``.

Every rank of an SPMD graph must get the same signatures, or the ranks would measure different
lists (and the measurements' collectives would hang):

* a bare Python int / float argument of a compute op is written as its type: offsets and fill
  values differ by rank, the cost does not (the output's shape keeps apart the ops whose scalar,
  a dim, changes the result);
* a ``cat``'s parts are written in sorted order: their order does not change its cost, and
  per-peer rewrites cat the same parts in an order that depends on the rank;
* a collective's group is written by size and backend, never by its name.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx

from cost_model.comm_nodes import bound_args, describe_comm, resolve_group_size
from cost_model.op_kinds import op_name
from cost_model.rank_agreement import backend_name
from cost_model.symbolic import concretize, hinted_shape, hinted_stride, size_hints

aten = torch.ops.aten

_COLLECTIVE_PREFIX = "_c10d_functional."


def compute_signature(node: torch.fx.Node) -> str:
    """The signature of a compute node (module docstring)."""
    hints = size_hints([node, *node.all_input_nodes])
    args_sig = ",".join(_scalar_free_sig(a, hints) for a in node.args)
    if node.target is aten.cat.default and isinstance(node.args[0], (list, tuple)):
        parts = ",".join(sorted(_arg_sig(p, hints) for p in node.args[0]))
        args_sig = ",".join([f"[{parts}]", *(_scalar_free_sig(a, hints) for a in node.args[1:])])
    kwargs_sig = ",".join(f"{k}={_scalar_free_sig(v, hints)}" for k, v in sorted(node.kwargs.items()))
    out = node.meta.get("val")
    out_sig = tensor_signature(out, hints) if isinstance(out, torch.Tensor) else ""
    return f"{op_name(node, qualified=True)}|{args_sig}|{kwargs_sig}|->{out_sig}"


def collective_signature(node: torch.fx.Node, group: Any) -> str:
    """The signature of a collective issue node run on the live process group ``group``."""
    hints = size_hints([node, *node.all_input_nodes])
    call = describe_comm(node, resolve_group_size(group))
    parts = [f"{k}={_arg_sig(v, hints)}" for k, v in bound_args(node).items() if k not in ("group_name", "group_size")]
    return (
        f"{op_name(node, qualified=True)}|{';'.join(parts)}|group_size={call.group_size}|backend={backend_name(group)}"
    )


def is_collective_signature(sig: str) -> bool:
    """Whether ``sig`` is a collective's (those are never cached on disk: they depend on the link)."""
    return sig.startswith(_COLLECTIVE_PREFIX)


def tensor_signature(val: torch.Tensor, hints: dict[sympy.Symbol, int]) -> str:
    """``T([shape], [stride], dtype)`` of a tensor value at the size hints."""
    shape = hinted_shape(val, hints)
    stride = hinted_stride(val, hints)
    dtype = str(val.dtype).removeprefix("torch.")
    return f"T({list(shape)},{list(stride)},{dtype})"


def p2p_signature(node: torch.fx.Node, group: Any) -> str:
    """The signature of a P2P transfer node (``dhelix::exchange``) on the live group ``group``.

    Its peers, tag and group name are left out: they differ from rank to rank (the name too,
    where ranks exchange within different groups of one mesh dimension) while the transfer's
    shapes, and so its time, do not -- every rank names its own transfer of a per-peer step
    alike. The group is written by size and backend, as a collective's.
    """
    hints = size_hints([node, *node.all_input_nodes])
    sent = ",".join(_arg_sig(a, hints) for a in node.args if isinstance(a, torch.fx.Node))
    return f"p2p:{op_name(node, qualified=True)}|{sent}|group_size={resolve_group_size(group)}|backend={backend_name(group)}"


def _arg_sig(value: Any, hints: dict[sympy.Symbol, int]) -> str:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return tensor_signature(val, hints)
        return repr(concretize(val, hints))
    if isinstance(value, (list, tuple)):
        inner = ",".join(_arg_sig(v, hints) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(concretize(value, hints))


def _scalar_free_sig(value: Any, hints: dict[sympy.Symbol, int]) -> str:
    """``_arg_sig``, except a bare int/float argument is written as its type."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value).__name__
    return _arg_sig(value, hints)


__all__ = ["collective_signature", "compute_signature", "is_collective_signature", "tensor_signature"]
