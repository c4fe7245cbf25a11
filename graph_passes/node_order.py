"""Put a graph's nodes into a given order (the last step of every scheduling pass)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch.fx


def apply_order(graph: torch.fx.Graph, body: Sequence[torch.fx.Node]) -> int:
    """Move the non-placeholder, non-output nodes of ``graph`` into the order ``body``.

    ``body`` must hold exactly those nodes, in a topological order (the caller's job;
    ``graph.lint()`` checks it afterwards). Placeholders stay first, the output last.
    Returns how many positions changed.
    """
    nodes = list(graph.nodes)
    head = [n for n in nodes if n.op == "placeholder"]
    old_body = [n for n in nodes if n.op not in ("placeholder", "output")]
    if len(old_body) != len(body) or set(old_body) != set(body):
        raise ValueError("apply_order: the new order must hold exactly the graph's body nodes")
    moved = sum(1 for a, b in zip(old_body, body) if a is not b)
    previous = head[-1] if head else None
    for node in body:
        if previous is None:
            first = next(iter(graph.nodes))
            if first is not node:
                first.prepend(node)
        else:
            previous.append(node)
        previous = node
    return moved


def stable_topological_order(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's body nodes (no placeholders, no output) in a topological order that keeps
    each node's place where its inputs allow (Kahn's algorithm, earliest original position first)."""
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    position = {node: i for i, node in enumerate(body)}
    missing = {node: sum(1 for source in node.all_input_nodes if source in position) for node in body}
    ready = [position[node] for node in body if missing[node] == 0]
    heapq.heapify(ready)
    ordered: list[torch.fx.Node] = []
    while ready:
        node = body[heapq.heappop(ready)]
        ordered.append(node)
        for user in node.users:
            if user in missing:
                missing[user] -= 1
                if missing[user] == 0:
                    heapq.heappush(ready, position[user])
    if len(ordered) != len(body):
        raise ValueError("stable_topological_order: the graph has a cycle")
    return ordered
