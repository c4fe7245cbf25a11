"""broadcast_gathers: an all-gather on a gloo group becomes one broadcast per rank, then a cat.

torch 2.13's gloo all-gather corrupts the heap when it is in flight while the rank computes: its
worker thread runs ATen ops (flattening, a temporary output, copies into the result) beside the
main thread's, and on 2 CPU cores the process aborts within minutes (``malloc(): unaligned
tcache chunk detected``, ``double free or corruption``, a segfault), with or without dhelix: a
20-line loop of ``_c10d_functional.all_gather_into_tensor`` with two in flight over matmuls
crashes the same way (BENCHMARKS.md, data parallelism, "The aborts ... were torch's gloo
all-gather"). A gloo broadcast writes its tensor in place from gloo's own code, and the same loop
with each all-gather sent as broadcasts ran clean. Every rank
sends its shard and receives the others' shards once, as in the all-gather's ring, so the link
carries the same bytes; the collective moves as ``n`` messages instead of one.

Contract
    Input: a scheduled graph (after ``reorder``), before ``verify``. Options
    (``ctx.pass_options["broadcast_gathers"]``, :class:`BroadcastGatherOptions`): the group names
    to rewrite, which the backend fills with the live gloo groups of the graph (none on NCCL, on
    the fake group, or without a process group: the pass then changes nothing). For each
    ``w = wait_tensor(g)``, ``g = all_gather_into_tensor(x, n, group)`` with ``group`` listed::

        at g:   b_r = broadcast(x, r, group)            for r in 0..n-1   (issued where g was)
        at w:   c_r = wait_tensor(b_r); w' = cat(c_0..c_{n-1}, dim 0)    (waited where w was)

    The schedule stays as the passes made it (issue and wait positions unchanged); values are
    equal (rank r's shard is rows ``r`` of the gathered tensor, as all-gather's dim-0 layout).
    With ``ctx.estimator``, the broadcasts keep the price the plan gave the all-gather
    (``meta[cost_model.estimator.PLANNED_COST_KEY]``: the first carries its transfer time, issue
    and contention, the others none, so they end together), because the estimator measured the
    all-gather (``cost_model.profile.running`` sends it as broadcasts too) and never these nodes:
    priced as broadcasts of their own, the final graph's predicted timeline put a 2 MiB gather
    on the 1 Gbit/s link at 0.9 ms where the plan had it, and the run took, about 23 ms.

    Counts (``ctx.stats["broadcast_gathers"]``): ``all-gathers sent as broadcasts``.
"""

from __future__ import annotations

import copy
import dataclasses

import sympy
import torch
import torch.fx

from cost_model.estimator import PLANNED_COST_KEY, Estimator
from cost_model.op_kinds import kind_of
from graph_passes.context import PassContext

__all__ = ["BroadcastGatherOptions", "broadcast_gathers_pass"]

_C10D = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class BroadcastGatherOptions:
    """``groups``: the process-group names whose all-gathers are sent as broadcasts."""

    groups: frozenset[str] = frozenset()


def broadcast_gathers_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Send the listed groups' all-gathers as broadcasts; see the module docstring."""
    options = ctx.pass_options.get("broadcast_gathers", BroadcastGatherOptions())
    if not options.groups:
        return gm
    graph = gm.graph
    for gather in list(graph.nodes):
        if gather.target is not _C10D.all_gather_into_tensor.default:
            continue
        shard, ranks, group = gather.args[0], int(gather.args[1]), str(gather.args[2])
        waits = [user for user in gather.users if kind_of(user) == "wait"]
        if group not in options.groups or len(waits) != len(gather.users) or len(waits) != 1:
            continue
        (wait,) = waits
        with graph.inserting_before(gather):
            casts = [graph.call_function(_C10D.broadcast.default, (shard, r, group)) for r in range(ranks)]
        with graph.inserting_before(wait):
            received = [graph.call_function(_C10D.wait_tensor.default, (b,)) for b in casts]
            gathered = graph.call_function(torch.ops.aten.cat.default, (received, 0))
        for node, source in (*((b, gather) for b in casts), *((c, wait) for c in received)):
            node.meta.update({k: copy.copy(v) for k, v in source.meta.items() if k != "val"})
            if "val" in shard.meta:
                node.meta["val"] = shard.meta["val"]
        gathered.meta.update({k: copy.copy(v) for k, v in wait.meta.items()})
        if ctx.estimator is not None:
            _keep_planned_cost(ctx.estimator, gather, casts)
        wait.replace_all_uses_with(gathered)
        graph.erase_node(wait)
        graph.erase_node(gather)
        ctx.count("broadcast_gathers", "all-gathers sent as broadcasts")
    return gm


def _keep_planned_cost(estimator: Estimator, gather: torch.fx.Node, casts: list[torch.fx.Node]) -> None:
    """Price the broadcasts as the plan priced ``gather`` (module docstring): each keeps its own
    memory numbers; the first takes the gather's transfer time, issue and contention."""
    planned = estimator.node_cost(gather)
    for index, cast in enumerate(casts):
        own = estimator.node_cost(cast)
        time_s, issue_s = (planned.time_s, planned.issue_s) if index == 0 else (0.0, 0.0)
        cast.meta[PLANNED_COST_KEY] = dataclasses.replace(
            own,
            time_s=time_s,
            time_expr=sympy.Float(time_s),
            issue_s=issue_s,
            contention_factor=planned.contention_factor,
        )
