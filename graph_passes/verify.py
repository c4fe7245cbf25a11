"""verify: the graph is still a valid program — the last pass, after every rewrite.

Contract
    Raises :class:`VerifyError` (naming the offending node) unless:

    1. ``gm.graph.lint()`` passes (well-formed; every node's inputs are defined before it:
       a valid topological order);
    2. every collective / P2P issue is completed by at least one ``wait_tensor``, and every
       output of a multi-output issue (coalesced collectives, ``batch_p2p_ops``) that is used
       is waited on before anything else reads it (reading only its shape, ``sym_size``, is no read);
    3. every ``wait_tensor`` completes an issue node (directly or through ``getitem``) that
       comes before it.

    It changes nothing. It does not need ``annotate`` to have run.

Pseudo-code::

    lint(graph)
    for n in graph order:
        if n is an issue:  require some user chain n [-> getitem] -> wait_tensor
        if n is a wait:    require issue_of(n) is not None
"""

from __future__ import annotations

import operator

import torch.fx

from cost_model.op_kinds import is_comm, kind_of, reads_only_shape
from graph_passes.annotate import issue_of
from graph_passes.context import PassContext


class VerifyError(AssertionError):
    """The graph broke an invariant of ``graph_passes/README.md``."""


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Users of an issue node, looking through ``getitem`` for multi-output issues."""
    readers: list[torch.fx.Node] = []
    for user in node.users:
        if user.target is operator.getitem:
            readers.extend(user.users)
        else:
            readers.append(user)
    return readers


def verify_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Check the invariants; see the module docstring."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        kind = kind_of(node)
        if is_comm(kind):
            readers = _readers(node)
            if not any(kind_of(r) == "wait" for r in readers):
                raise VerifyError(f"{ctx.graph_name}: {kind} '{node.name}' ({node.target}) has no wait_tensor")
            unwaited = [r.name for r in readers if kind_of(r) != "wait" and not reads_only_shape(r)]
            if unwaited:
                raise VerifyError(
                    f"{ctx.graph_name}: {kind} '{node.name}' is read by {unwaited} before its wait_tensor"
                )
            ctx.count("verify", "collective issue with wait")
        elif kind == "wait" and issue_of(node) is None:
            raise VerifyError(f"{ctx.graph_name}: wait_tensor '{node.name}' completes no collective issue")
    return gm
