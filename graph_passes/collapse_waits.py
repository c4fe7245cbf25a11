"""collapse_waits: a ``wait_tensor`` of a tensor already waited on is the tensor itself.

A functional collective waits on itself when it is traced: ``funcol.all_reduce(x, ...)`` under
Dynamo or AOTAutograd returns ``wait_tensor(all_reduce(x))``, where eager code gets an
``AsyncCollectiveTensor``. Code written for eager often waits explicitly as well
(``funcol.wait_tensor(funcol.all_reduce(x, ...))``, the documented pattern), so the captured graph
holds ``wait_tensor(wait_tensor(all_reduce(x)))``. The outer wait completes no collective: it
returns its input, and every later pass (annotate's ``comm_id``, reorder, interleave, verify)
assumes a wait reads an issue. This pass, the first, replaces each such wait by its input.

Contract
    Input: an aten graph. Before ``annotate``. Every ``wait_tensor`` whose input is the output of
    another ``wait_tensor`` is erased and its readers read that input; chains of any length
    collapse to the first wait. Nothing else changes: the graph stays functional (``wait_tensor``
    is the identity on a completed tensor) and its order valid.

    Counts (``ctx.stats["collapse_waits"]``): ``waits of waited tensors removed``.

Pseudo-code::

    for w in graph order:
        if w is wait_tensor(v) and v is a wait_tensor:
            replace w by v; erase w
"""

from __future__ import annotations

import torch.fx

from cost_model.op_kinds import kind_of
from graph_passes.context import PassContext

__all__ = ["collapse_waits_pass"]


def collapse_waits_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Erase the waits of waited tensors; see the module docstring."""
    for node in list(gm.graph.nodes):
        if kind_of(node) != "wait" or not node.args:
            continue
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and kind_of(source) == "wait":
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
            ctx.count("collapse_waits", "waits of waited tensors removed")
    return gm
