"""What kind of work an FX node does: compute, a collective issue, a wait, P2P, a view.

This table is the single source of truth for node classification. The cost model uses it
to decide which resource (compute stream or a communication channel) a node occupies; the
``annotate`` pass in ``graph_passes`` copies it into ``node.meta["dhelix"]``. It knows
nothing of passes.

Functional collectives (``torch.ops._c10d_functional``) are split in two nodes::

    t = all_gather_into_tensor(x, group_size, group_name)   # kind "collective": issue
    y = wait_tensor(t)                                      # kind "wait": completion

The issue node returns a tensor whose contents are undefined until its ``wait_tensor``;
everything between the two may run while the transfer is in flight.

:func:`op_name` is the one way to name an op (logs, dumps, pictures, the profiler's groups).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

NodeKind = Literal["compute", "collective", "wait", "p2p", "view", "other"]

#: Collective issue ops (OpOverloadPacket); the matching wait is ``wait_tensor``.
COLLECTIVE_OPS: tuple[torch._ops.OpOverloadPacket, ...] = (
    c10d.all_reduce,
    c10d.all_reduce_,
    c10d.all_reduce_coalesced,
    c10d.all_reduce_coalesced_,
    c10d.all_gather_into_tensor,
    c10d.all_gather_into_tensor_out,
    c10d.all_gather_into_tensor_coalesced,
    c10d.reduce_scatter_tensor,
    c10d.reduce_scatter_tensor_out,
    c10d.reduce_scatter_tensor_coalesced,
    c10d.all_to_all_single,
    c10d.broadcast,
)


def present_c10d_ops(*names: str) -> tuple[torch._ops.OpOverloadPacket, ...]:
    """The ``_c10d_functional`` ops of ``names`` this torch defines (torch 2.11 has no functional
    point-to-point ops; a graph of it cannot hold them)."""
    return tuple(getattr(c10d, name) for name in names if hasattr(c10d, name))


#: Point-to-point issue ops; they are waited on with ``wait_tensor`` too.
P2P_OPS: tuple[torch._ops.OpOverloadPacket, ...] = present_c10d_ops("isend", "irecv", "batch_p2p_ops")

#: P2P issue ops defined outside torch, by schema name (``dhelix::exchange``: a send and a
#: receive in one op, defined in ``dhelix_compile.ops.exchange``; named here so that the cost
#: model needs nothing of dhelix). Completed with ``wait_tensor`` on each output.
P2P_OP_NAMES: tuple[str, ...] = ("dhelix::exchange",)

#: Compute ops defined outside torch that are pure functions of their inputs, by schema name
#: (``dhelix_compile.ops.row_blocks``: the copies around a gloo collective sent as an all-to-all):
#: the profiler runs and times them as it does torch's own ops.
TILE_ROWS_OP_NAME = "dhelix::tile_rows"
SUM_ROW_BLOCKS_OP_NAME = "dhelix::sum_row_blocks"
PURE_OP_NAMES: tuple[str, ...] = (TILE_ROWS_OP_NAME, SUM_ROW_BLOCKS_OP_NAME)

WAIT_OPS: tuple[torch._ops.OpOverloadPacket, ...] = (c10d.wait_tensor,)

#: Ops that read a tensor's shape, strides or offset, never its data: they may read a collective's
#: output before its wait (a graph traced with dynamic shapes does).
SHAPE_READS: tuple[torch._ops.OpOverloadPacket, ...] = (
    aten.sym_size,
    aten.sym_stride,
    aten.sym_numel,
    aten.sym_storage_offset,
)

#: Ops that never move data: metadata changes and aliasing views. Costed as free.
VIEW_OPS: tuple[torch._ops.OpOverloadPacket, ...] = (
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten.expand,
    aten.permute,
    aten.t,
    aten.transpose,
    aten.squeeze,
    aten.unsqueeze,
    aten.slice,
    aten.select,
    aten.split,
    aten.split_with_sizes,
    aten.unbind,
    aten.as_strided,
    aten.alias,
    aten.detach,
    aten.view_as_real,
    aten.view_as_complex,
    aten.unflatten,
    aten.flatten,
    aten.narrow,
    *SHAPE_READS,
)


#: Dtype conversions: no layout change, but a copy (``kind_of`` calls them compute).
CAST_OPS: tuple[torch._ops.OpOverload, ...] = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def reshapes_or_casts(node: torch.fx.Node) -> bool:
    """Whether ``node`` only views or casts its input: what a value keeps being through a chain
    of them (a parameter through its transpose and dtype cast, a gradient on its way out)."""
    return node.op == "call_function" and (kind_of(node) == "view" or node.target in CAST_OPS)


def reads_only_shape(node: torch.fx.Node) -> bool:
    """Whether ``node`` reads only the shape (strides, offset) of its input (``SHAPE_READS``)."""
    return node.op == "call_function" and _packet(node.target) in SHAPE_READS


def _packet(target: object) -> object:
    """The OpOverloadPacket of an OpOverload; anything else is returned unchanged."""
    return getattr(target, "overloadpacket", target)


_KIND_BY_PACKET: dict[object, NodeKind] = {
    **{op: "collective" for op in COLLECTIVE_OPS},
    **{op: "p2p" for op in P2P_OPS},
    **{op: "wait" for op in WAIT_OPS},
    **{op: "view" for op in VIEW_OPS},
}


def kind_of(node: torch.fx.Node) -> NodeKind:
    """Classify one FX node.

    ``placeholder``/``output``/``get_attr`` nodes and Python-level ``operator.getitem``
    are ``"other"`` (free, no resource). Unknown ``call_function`` targets are
    ``"compute"``: it is always safe to assume a node occupies the compute stream.
    """
    if node.op != "call_function":
        return "other"
    target = node.target
    kind = _KIND_BY_PACKET.get(_packet(target))
    if kind is not None:
        return kind
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.name in P2P_OP_NAMES:
        return "p2p"
    if getattr(target, "__module__", None) == "_operator":
        return "view" if op_name(target) == "getitem" else "other"
    return "compute"


def op_name(node_or_target: torch.fx.Node | object, *, qualified: bool = False) -> str:
    """The name of the op a node calls (or of a call target): no namespace, no overload.

    * an aten overload or its packet, ``aten.add.Tensor`` / ``aten.add``: ``"add"``;
    * a functional collective, ``_c10d_functional.all_gather_into_tensor.default``:
      ``"all_gather_into_tensor"`` (its wait: ``"wait_tensor"``);
    * an op defined outside torch, ``dhelix::exchange``: ``"exchange"``;
    * ``operator.getitem`` and other Python functions: their ``__name__`` (``"getitem"``);
    * a placeholder, get_attr or output node: ``node.op`` (``"placeholder"``);
    * a call_method / call_module node: the method name / the module's path.

    ``qualified=True`` gives ``str(target)`` for call targets instead: for torch ops namespace,
    name and overload (``"aten.add.Tensor"``, which tells it from ``aten.add.Scalar``); the
    profiler groups and signs its measurements by it.
    """
    if isinstance(node_or_target, torch.fx.Node):
        if node_or_target.op in ("placeholder", "get_attr", "output"):
            return node_or_target.op
        target: object = node_or_target.target
    else:
        target = node_or_target
    if isinstance(target, str):
        return target
    if qualified:
        return str(target)
    name = getattr(_packet(target), "__name__", None)
    return name if isinstance(name, str) else str(target)


def is_comm(kind: NodeKind) -> bool:
    """True for nodes that issue a transfer (collective or P2P)."""
    return kind in ("collective", "p2p")
