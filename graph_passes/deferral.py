"""Deferral: move work that feeds no later transfer (weight gradients) further down a strand.

In a backward pass the input-gradient chain feeds every collective (a layer's reduce-scatter
needs its ``dX``), while a weight gradient ``dW = Xᵀ·dY`` feeds only the graph's output.
DHelix delays such work so that it runs where communication needs compute to hide behind;
the interleave pass offers the deferred order to the Strand Interleaving DP as one more
candidate and lets the simulator (within the memory budget) decide.

Contract
    ``defer_off_chain(nodes, is_transfer, distance) -> list[Node]``
    - ``nodes``: one strand's nodes in a topological order; ``is_transfer(node)`` says which
      are transfer issues (collective / P2P). The strand is cut after each issue into
      segments 0, 1, ... (as ``interleave.strand_segments`` cuts it).
    - *Off-chain* nodes are the non-transfer nodes that no later transfer issue depends on
      (within ``nodes``). Each moves from its segment ``k`` to the end of segment
      ``k + distance``'s compute, i.e. right before that segment's transfer issue (or to the
      strand's end); nodes landing in the same place keep their relative order.
    - Returns a permutation of ``nodes`` that is again a topological order: an off-chain
      node's inputs are on-chain nodes (which keep their places, all earlier) or off-chain
      nodes from the same or an earlier segment (which land no later, in order); its users
      are off-chain too (a user feeding a transfer would make it feed one).
    - ``distance <= 0`` or a strand without transfers: ``nodes`` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx


def off_chain_nodes(nodes: Sequence[torch.fx.Node], is_transfer: Callable[[torch.fx.Node], bool]) -> set[torch.fx.Node]:
    """The non-transfer nodes of ``nodes`` that no transfer issue in ``nodes`` depends on."""
    members = set(nodes)
    feeds_transfer: set[torch.fx.Node] = set()
    stack = [n for n in nodes if is_transfer(n)]
    while stack:
        node = stack.pop()
        for producer in node.all_input_nodes:
            if producer in members and producer not in feeds_transfer:
                feeds_transfer.add(producer)
                stack.append(producer)
    return {n for n in nodes if not is_transfer(n) and n not in feeds_transfer}


def defer_off_chain(
    nodes: Sequence[torch.fx.Node], is_transfer: Callable[[torch.fx.Node], bool], distance: int
) -> list[torch.fx.Node]:
    """``nodes`` with each off-chain node moved ``distance`` segments later; see the module docstring."""
    issues = [i for i, n in enumerate(nodes) if is_transfer(n)]
    if distance <= 0 or not issues:
        return list(nodes)
    off_chain = off_chain_nodes(nodes, is_transfer)
    # deferred[k]: off-chain nodes to place right before the issue that ends segment k
    deferred: dict[int, list[torch.fx.Node]] = {}
    segment = 0
    for node in nodes:
        if node in off_chain:
            deferred.setdefault(min(segment + distance, len(issues)), []).append(node)
        elif is_transfer(node):
            segment += 1
    order: list[torch.fx.Node] = []
    segment = 0
    for node in nodes:
        if node in off_chain:
            continue
        if is_transfer(node):
            order.extend(deferred.pop(segment, ()))
            segment += 1
        order.append(node)
    order.extend(deferred.pop(len(issues), ()))
    assert not deferred and len(order) == len(nodes)
    return order
