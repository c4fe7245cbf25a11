"""gloo_gathers: an all-gather on a gloo group is sent as one all-to-all of its shard repeated.

torch 2.13's gloo all-gather corrupts the heap when it is in flight while the rank computes: its
worker thread runs ATen ops (flattening, a temporary output, copies into the result) beside the
main thread's, and on 2 CPU cores the process aborts within minutes (``malloc(): unaligned
tcache chunk detected``, ``double free or corruption``, a segfault), with or without dhelix: a
20-line loop of ``_c10d_functional.all_gather_into_tensor`` with two in flight over matmuls
crashes the same way (BENCHMARKS.md, data parallelism, "The aborts ... were torch's gloo
all-gather"). gloo's all-to-all reads its input and writes its output in place from gloo's own
code (so does its broadcast, which this pass used before; so does ``dhelix::exchange``).

The all-to-all sends the shard to every rank and receives every rank's shard in rank order,
which is the all-gather's dim-0 layout, so its output *is* the gathered tensor: each rank's
input is its shard repeated ``n`` times along dim 0 (the chunk to itself is a local copy), all
split sizes are the shard's rows. The link carries the same bytes as the all-gather's ring, in
one collective whose messages to and from every peer are in flight together: measured on the
1 Gbit/s emulated link (2 ranks, BENCHMARKS.md) it finishes 0.5 MiB shards in 10.0 ms against
16.7 ms for ``n`` broadcasts, which gloo runs one after another.

Contract
    Input: a scheduled graph (after ``reorder``), before ``verify``. Options
    (``ctx.pass_options["gloo_gathers"]``, :class:`GlooGatherOptions`): the group names to
    rewrite, which the backend fills with the live gloo groups of the graph (none on NCCL, on
    the fake group, or without a process group: the pass then changes nothing). For each
    ``g = all_gather_into_tensor(x, n, group)`` with ``group`` listed::

        at g:   x_n = repeat(x, [n, 1, ...]); g' = all_to_all_single(x_n, [rows] * n, [rows] * n, group)

    where ``rows`` is ``x``'s dim 0 (a ``sym_size`` node when symbolic). The all-gather's waits
    wait ``g'`` where they waited ``g``: the schedule stays as the passes made it, and values are
    equal. :func:`cost_model.profile.running.run_node` sends it the same way when the profiler
    and the bench's ceiling measure it. With ``ctx.estimator``, ``g'`` keeps the price the plan
    gave the all-gather (``meta[cost_model.estimator.PLANNED_COST_KEY]``): the estimator
    measured the all-gather, sent this way, and never ``g'`` itself.

    Counts (``ctx.stats["gloo_gathers"]``): ``all-gathers sent as all-to-alls``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx

from cost_model.estimator import PLANNED_COST_KEY, Estimator, NodeCost
from graph_passes.annotate import META_KEY
from graph_passes.context import PassContext

__all__ = ["GlooGatherOptions", "gloo_gathers_pass"]

_C10D = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class GlooGatherOptions:
    """``groups``: the process-group names whose all-gathers are sent as all-to-alls."""

    groups: frozenset[str] = frozenset()


def gloo_gathers_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Send the listed groups' all-gathers as all-to-alls; see the module docstring."""
    options = ctx.pass_options.get("gloo_gathers", GlooGatherOptions())
    if not options.groups:
        return gm
    graph = gm.graph
    for gather in list(graph.nodes):
        if gather.target is not _C10D.all_gather_into_tensor.default:
            continue
        shard, ranks, group = gather.args[0], int(gather.args[1]), str(gather.args[2])
        if group not in options.groups or not isinstance(shard, torch.fx.Node):
            continue
        repeats = _repeats(shard, ranks)
        with graph.inserting_before(gather):
            rows = _rows(graph, shard)
            repeated = graph.call_function(torch.ops.aten.repeat.default, (shard, repeats))
            sent = graph.call_function(
                _C10D.all_to_all_single.default, (repeated, [rows] * ranks, [rows] * ranks, group)
            )
        for node in (repeated, sent):
            node.meta.update({k: copy.copy(v) for k, v in gather.meta.items()})
        if META_KEY in repeated.meta:
            repeated.meta[META_KEY] = {k: v for k, v in repeated.meta[META_KEY].items() if k != "comm_id"}
            repeated.meta[META_KEY]["kind"] = "compute"
        if ctx.estimator is not None:
            sent.meta[PLANNED_COST_KEY] = _planned_cost(ctx.estimator, gather, sent)
        gather.replace_all_uses_with(sent)
        graph.erase_node(gather)
        ctx.count("gloo_gathers", "all-gathers sent as all-to-alls")
    return gm


def _rows(graph: torch.fx.Graph, shard: torch.fx.Node) -> int | torch.fx.Node:
    """The shard's dim 0: an int, or a ``sym_size`` node when the graph's shapes are symbolic."""
    val = shard.meta.get("val")
    rows = val.shape[0] if isinstance(val, torch.Tensor) else None
    if isinstance(rows, int):
        return rows
    size = graph.call_function(torch.ops.aten.sym_size.int, (shard, 0))
    if rows is not None:
        size.meta["val"] = rows
    return size


def _repeats(shard: torch.fx.Node, ranks: int) -> list[int]:
    """``repeat``'s argument: ``ranks`` copies along dim 0, one along every other dim."""
    val = shard.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"gloo_gathers: the all-gather's input {shard.name} has no tensor meta['val']")
    return [ranks] + [1] * (val.dim() - 1)


def _planned_cost(estimator: Estimator, gather: torch.fx.Node, sent: torch.fx.Node) -> NodeCost:
    """``sent`` priced as the plan priced ``gather``, with ``sent``'s own memory numbers."""
    planned = estimator.node_cost(gather)
    own = estimator.node_cost(sent)
    return dataclasses.replace(
        own,
        time_s=planned.time_s,
        time_expr=planned.time_expr,
        issue_s=planned.issue_s,
        contention_factor=planned.contention_factor,
    )
