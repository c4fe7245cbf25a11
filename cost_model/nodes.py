"""Accepting a graph in any of its forms: ``GraphModule``, ``Graph`` or a sequence of nodes."""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx

NodesLike = Iterable[torch.fx.Node] | torch.fx.Graph | torch.fx.GraphModule


def node_list(nodes: NodesLike) -> list[torch.fx.Node]:
    """The nodes, in order, of a ``GraphModule``, a ``Graph`` or an iterable of nodes."""
    if isinstance(nodes, torch.fx.GraphModule):
        return list(nodes.graph.nodes)
    if isinstance(nodes, torch.fx.Graph):
        return list(nodes.nodes)
    return list(nodes)
