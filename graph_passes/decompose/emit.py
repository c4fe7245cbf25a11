"""IR emission: :class:`Emitter` inserts a rewrite's nodes into the graph, each with its ``meta["val"]``.

Contract
    ``Emitter(graph, anchor, fake_mode, strand)`` inserts every node it makes right before
    ``anchor``, in call order, and remembers them (``nodes``) so that a rewrite that is not
    committed can be erased again. Each new node gets ``meta["val"]`` by running its op on the
    operands' ``meta["val"]`` under ``fake_mode`` (the graph's fake mode:
    ``graph_passes._torch_compat.fake_mode_of``), and ``meta["dhelix"] = {"strand": strand}``
    when a strand is given (``annotate`` fills in the rest). The emitter never reorders or
    erases existing nodes.

Transfers are ``dhelix::exchange(send, to_peer, from_peer, tag, group_name) -> [send_done,
received]``, emitted by its registered name (``torch.ops.dhelix.exchange.default``; importing
``dhelix_compile`` registers it, ``cost_model.op_kinds.P2P_OP_NAMES`` classifies it as P2P):
graph_passes imports nothing of the backend. Peers are *group* ranks; each exchange is
followed by a ``wait_tensor`` on both of its outputs (``wait_exchange``; the send's wait has
no reader, it completes the send).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx

from graph_passes._torch_compat import OpOverload

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

#: The P2P op's schema name (``namespace::name``); ``cost_model.op_kinds.P2P_OP_NAMES`` names it too.
EXCHANGE_OP_NAME = "dhelix::exchange"


def registered_op(qualified_name: str) -> OpOverload:
    """The default overload of the custom op ``namespace::name``; a ``RuntimeError`` that says
    what to import when nothing registered it."""
    namespace, _, name = qualified_name.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError) as exc:
        raise RuntimeError(
            f"the custom op {qualified_name} is not registered: dhelix's passes emit it by name, and "
            f"importing dhelix_compile (dhelix_compile.ops) registers it"
        ) from exc


def exchange_op() -> OpOverload:
    """``torch.ops.dhelix.exchange.default``, looked up when a rewrite first needs it."""
    return registered_op(EXCHANGE_OP_NAME)


def val(node: Any) -> Any:
    """A node's ``meta["val"]`` (a fake tensor); anything else as it is."""
    if isinstance(node, torch.fx.Node):
        return node.meta.get("val")
    return node


class Emitter:
    """Inserts new nodes before ``anchor``, each with ``meta["val"]`` (run under the fake mode)."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake_mode: Any, strand: int | None) -> None:
        self.graph, self.anchor, self.fake_mode, self.strand = graph, anchor, fake_mode, strand
        self.nodes: list[torch.fx.Node] = []

    def call(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        vargs = torch.fx.node.map_aggregate(args, val)
        vkwargs = torch.fx.node.map_aggregate(kwargs, val)
        if target is operator.getitem:
            node.meta["val"] = vargs[0][vargs[1]]
        else:
            with self.fake_mode:
                node.meta["val"] = target(*vargs, **vkwargs)
        if self.strand is not None:
            node.meta["dhelix"] = {"strand": self.strand}
        self.nodes.append(node)
        return node

    def view(self, node: torch.fx.Node, shape: Sequence[int]) -> torch.fx.Node:
        if list(val(node).shape) == list(shape):
            return node
        return self.call(aten.view.default, node, list(shape))

    def slice(self, node: torch.fx.Node, dim: int, start: int, end: int, *, contiguous: bool = False) -> torch.fx.Node:
        size = val(node).shape[dim]
        out = node if (start, end) == (0, size) else self.call(aten.slice.Tensor, node, dim, start, end)
        if contiguous and not val(out).is_contiguous():
            out = self.call(aten.clone.default, out, memory_format=torch.contiguous_format)
        return out

    def cat(self, parts: Sequence[torch.fx.Node], dim: int) -> torch.fx.Node:
        return parts[0] if len(parts) == 1 else self.call(aten.cat.default, list(parts), dim)

    def sum(self, parts: Iterable[torch.fx.Node]) -> torch.fx.Node:
        """``parts[0] + parts[1] + ...``, added left to right. A generator is drawn one part at a
        time, so each part's nodes are emitted right before the addition that reads them."""
        it = iter(parts)
        total = next(it, None)
        if total is None:
            raise ValueError("Emitter.sum needs at least one part")
        for part in it:
            total = self.call(aten.add.Tensor, total, part)
        return total

    def exchange(self, send: torch.fx.Node, to_peer: int, from_peer: int, tag: int, group_name: str) -> torch.fx.Node:
        """Send ``send`` to ``to_peer`` and receive a tensor of its shape from ``from_peer``."""
        return self.call(exchange_op(), send, to_peer, from_peer, tag, group_name)

    def wait_exchange(self, p2p: torch.fx.Node) -> torch.fx.Node:
        """Wait for both halves of an exchange; return the received tensor."""
        self.call(c10d.wait_tensor.default, self.call(operator.getitem, p2p, 0))
        return self.call(c10d.wait_tensor.default, self.call(operator.getitem, p2p, 1))
