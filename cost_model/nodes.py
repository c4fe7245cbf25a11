"""Accepting a graph in any of its forms: ``GraphModule``, ``Graph`` or a sequence of nodes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.fx

NodesLike = Iterable[torch.fx.Node] | torch.fx.Graph | torch.fx.GraphModule


def node_list(nodes: NodesLike) -> list[torch.fx.Node]:
    """The nodes, in order, of a ``GraphModule``, a ``Graph`` or an iterable of nodes."""
    if isinstance(nodes, torch.fx.GraphModule):
        return list(nodes.graph.nodes)
    if isinstance(nodes, torch.fx.Graph):
        return list(nodes.nodes)
    return list(nodes)


def call_target(node: torch.fx.Node) -> Callable[..., Any]:
    """What a ``call_function`` node calls.

    fx types ``Node.target`` as a callable or a str (a str names a method, submodule or attribute
    for the other node kinds); running a node needs the callable. Raises ``TypeError`` for a name,
    as calling it would.
    """
    target = node.target
    if isinstance(target, str):
        raise TypeError(f"{node.name}: target {target!r} is a name ({node.op}), not a callable")
    return target
