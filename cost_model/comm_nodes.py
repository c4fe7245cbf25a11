"""Read a functional-collective / P2P node: which collective, how many bytes, which group.

Contract
--------
``describe_comm(node, default_group_size)`` turns an issue node of
``torch.ops._c10d_functional`` into a :class:`CommCall` with the collective's name in
:mod:`cost_model.collectives` terms, its full-buffer size ``S`` (the nccl-tests
convention documented there) and its group size. The group size comes from, in order:
the op's ``group_size`` argument; the process group named by ``group_name`` when
``torch.distributed`` knows it (a live or fake process group); ``default_group_size``.

Sizes are ``int`` for static shapes and sympy expressions for symbolic ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from cost_model.flops import output_tensors
from cost_model.op_kinds import P2P_OP_NAMES, present_c10d_ops
from cost_model.symbolic import SizeExpr, nbytes_expr, tensors_in

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

#: The functional point-to-point ops by name, read as the table below reads its ops
_P2P_READS: dict[str, tuple[str, str]] = {
    "isend": ("send", "in"),
    "irecv": ("recv", "out"),
    "batch_p2p_ops": ("send", "in"),
}

#: Functional op -> collective name in cost_model.collectives, and whether ``S`` is the
#: size of the input ("in") or of the output ("out").
_COMM_TABLE: dict[object, tuple[str, str]] = {
    c10d.all_reduce: ("all_reduce", "in"),
    c10d.all_reduce_: ("all_reduce", "in"),
    c10d.all_reduce_coalesced: ("all_reduce", "in"),
    c10d.all_reduce_coalesced_: ("all_reduce", "in"),
    c10d.all_gather_into_tensor: ("all_gather", "out"),
    c10d.all_gather_into_tensor_out: ("all_gather", "out"),
    c10d.all_gather_into_tensor_coalesced: ("all_gather", "out"),
    c10d.reduce_scatter_tensor: ("reduce_scatter", "in"),
    c10d.reduce_scatter_tensor_out: ("reduce_scatter", "in"),
    c10d.reduce_scatter_tensor_coalesced: ("reduce_scatter", "in"),
    c10d.all_to_all_single: ("all_to_all", "in"),
    c10d.broadcast: ("broadcast", "in"),
    # functional point-to-point ops: torch 2.13 has them, 2.11 not
    **{op: read for name, read in _P2P_READS.items() for op in present_c10d_ops(name)},
}

#: ``_c10d_functional.batch_p2p_ops`` where this torch has it, looked up once
_BATCH_P2P_OPS = present_c10d_ops("batch_p2p_ops")


@dataclass(frozen=True)
class CommCall:
    """One collective / P2P issue node, read.

    Attributes:
        op: collective name (``"all_gather"``, ``"send"``...).
        nbytes: full-buffer size ``S`` in bytes (int, or sympy expression).
        group_size: ranks taking part (2 for P2P).
        group_name: the op's ``group_name`` argument (None for unknown layouts).
    """

    op: str
    nbytes: SizeExpr
    group_size: int
    group_name: Any


def bound_args(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (positional and keyword)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return dict(node.kwargs)
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
    return out


def resolve_process_group(group: Any) -> Any:
    """The live process group a functional collective's ``group_name`` names (or ``group`` itself).

    ``None`` when torch.distributed does not know it. This is the cost model's one private
    torch API (``_resolve_process_group``); it lives here, not in ``dhelix_compile._torch_compat``,
    so that ``cost_model`` depends on nothing else of dhelix.
    """
    if group is None:
        return None
    if callable(getattr(group, "size", None)):
        return group
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    except Exception:  # noqa: BLE001 - an unknown group name: the caller falls back to its default
        return None


def resolve_group_size(group: Any) -> int | None:
    """Size of a process group given by name (or object), if torch.distributed knows it."""
    resolved = resolve_process_group(group)
    return None if resolved is None else int(resolved.size())


def resolve_group_rank(group: Any) -> int | None:
    """This process's rank inside a process group given by name (or object): the *group* rank
    P2P peers are named by. ``None`` if torch.distributed does not know the group or this
    process is not in it."""
    resolved = resolve_process_group(group)
    if resolved is None:
        return None
    rank = int(resolved.rank())
    return rank if rank >= 0 else None


def _val(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val")
    if isinstance(value, (list, tuple)):
        return [_val(v) for v in value]
    return value


def _bytes_of(value: Any) -> SizeExpr:
    total: SizeExpr = 0
    for t in tensors_in(_val(value)):
        total = total + nbytes_expr(t)
    return total


def is_comm_target(target: object) -> bool:
    """True for issue ops this module can describe."""
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.name in P2P_OP_NAMES:
        return True
    return getattr(target, "overloadpacket", target) in _COMM_TABLE


def describe_comm(node: torch.fx.Node, default_group_size: int | None) -> CommCall:
    """Read a collective / P2P issue node (see module docstring).

    Raises:
        ValueError: the node is not a known issue op, or its group size cannot be found
            and no ``default_group_size`` was given.
    """
    packet = getattr(node.target, "overloadpacket", node.target)
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.name in P2P_OP_NAMES:  # dhelix::exchange(send, to, from, tag, group)
        return CommCall("send", _bytes_of(node.args[0]), 2, node.args[4] if len(node.args) > 4 else None)
    entry = _COMM_TABLE.get(packet)
    if entry is None:
        raise ValueError(f"{node.name}: {node.target} is not a known collective/P2P op")
    op, side = entry
    args = bound_args(node)
    group_name = args.get("group_name")

    if packet in _BATCH_P2P_OPS:
        sent: SizeExpr = 0
        received: SizeExpr = 0
        for kind, tensor in zip(args["op_list"], args["tensors"], strict=True):
            if "send" in str(kind):
                sent = sent + _bytes_of(tensor)
            else:
                received = received + _bytes_of(tensor)
        nbytes: SizeExpr = _max2(sent, received)
        return CommCall("send", nbytes, 2, group_name)

    if side == "out":
        nbytes = 0
        for t in output_tensors(node):
            nbytes = nbytes + nbytes_expr(t)
    else:
        first = args.get("input", args.get("inputs", args.get("tensor")))
        nbytes = _bytes_of(first)

    if op in ("send", "recv"):
        return CommCall(op, nbytes, 2, group_name)
    group_size = args.get("group_size")
    if group_size is None:
        group_size = resolve_group_size(group_name)
    if group_size is None:
        group_size = default_group_size
    if group_size is None:
        raise ValueError(
            f"{node.name}: cannot tell the group size of {node.target} (group "
            f"{group_name!r} is unknown to torch.distributed); pass world_size= to the "
            "estimator"
        )
    return CommCall(op, nbytes, int(group_size), group_name)


def _max2(a: SizeExpr, b: SizeExpr) -> SizeExpr:
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    import sympy

    return sympy.Max(a, b)
