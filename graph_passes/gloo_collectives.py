"""gloo_collectives: all-gathers and reduce-scatters on a gloo group are sent as all-to-alls.

**All-gathers.** torch 2.13's gloo all-gather corrupts the heap when it is in flight while the
rank computes: its worker thread runs ATen ops (flattening, a temporary output, copies into the
result) beside the main thread's, and on 2 CPU cores the process aborts within minutes
(``malloc(): unaligned tcache chunk detected``, ``double free or corruption``, a segfault), with
or without dhelix: a 20-line loop of ``_c10d_functional.all_gather_into_tensor`` with two in
flight over matmuls crashes the same way (BENCHMARKS.md, data parallelism, "The aborts ... were
torch's gloo all-gather"). gloo's all-to-all reads its input and writes its output in place from
gloo's own code (so does its broadcast, which this pass used before; so does
``dhelix::exchange``). The all-to-all sends the shard to every rank and receives every rank's
shard in rank order, which is the all-gather's dim-0 layout, so its output *is* the gathered
tensor: each rank's input is its shard repeated ``n`` times along dim 0 (the chunk to itself is
a local copy), all split sizes are the shard's rows. The link carries the same bytes as the
all-gather's ring, in one collective whose messages to and from every peer are in flight
together: measured on the 1 Gbit/s emulated link (2 ranks, BENCHMARKS.md) it finishes 0.5 MiB
shards in 10.0 ms against 16.7 ms for ``n`` broadcasts, which gloo runs one after another.

**Reduce-scatters.** ProcessGroupGloo reduce-scatters by all-reducing the whole input and
keeping one chunk (``cost_model.collectives``: twice the bytes of a ring reduce-scatter). An
all-to-all of the input sends each peer its chunk and receives this rank's chunk from every
peer: ``(n-1)/n`` of the input on the link, as NCCL's ring; the received ``[n, rows, ...]`` is
summed over the sources after the wait. Measured on loopback (2 ranks, 32 MiB): 37-43 ms
against 57-61 ms; on an emulated link the bytes halve. On 2 ranks the sum is bitwise gloo's (an
addition of two operands); on more it adds in rank order, not in the ring's, and differs in the
last bits.

Contract
    Input: a scheduled graph (after ``reorder``), before ``verify``. Options
    (``ctx.pass_options["gloo_collectives"]``, :class:`GlooCollectiveOptions`): the group names
    to rewrite, which the backend fills with the live gloo groups of the graph (none on NCCL, on
    the fake group, or without a process group: the pass then changes nothing). For each
    collective on a listed group::

        g = all_gather_into_tensor(x, n, group)
            at g:   x_n = dhelix::tile_rows(x, n); g' = all_to_all_single(x_n, [rows] * n, [rows] * n, group)
        r = reduce_scatter_tensor(x, "sum", n, group); w = wait_tensor(r)
            at r:   r' = all_to_all_single(x, [rows] * n, [rows] * n, group)      (rows = x's dim 0 / n)
            at w:   w = wait_tensor(r'); s = dhelix::sum_row_blocks(w, n)         (w's readers read s)

    ``tile_rows`` is ``x.repeat(n, 1, ...)`` and ``sum_row_blocks`` the sum of ``w``'s ``n`` row
    blocks, each one ATen call that Inductor calls as it is (``dhelix_compile.ops.row_blocks``).

    (``rows`` of a gather: a ``sym_size`` node when symbolic.) Waits stay where they were: the
    schedule is the passes', values are equal. A reduce-scatter of another reduce op, with
    symbolic or indivisible rows, or with a reader other than one wait, is left alone (counted).
    :func:`cost_model.profile.running.run_node` sends both the same way when the profiler and
    the bench's ceiling measure them. With ``ctx.estimator``, each all-to-all keeps the price
    the plan gave the collective it replaces (``meta[cost_model.estimator.PLANNED_COST_KEY]``):
    the estimator measured the collective, sent this way, and never the new node itself.

    Counts (``ctx.stats["gloo_collectives"]``): ``all-gathers sent as all-to-alls``,
    ``reduce-scatters sent as all-to-alls``, ``reduce-scatter left: <why>``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx

from cost_model.estimator import PLANNED_COST_KEY, Estimator, NodeCost
from cost_model.op_kinds import SUM_ROW_BLOCKS_OP_NAME, TILE_ROWS_OP_NAME, kind_of
from cost_model.profile.running import why_scatter_stays
from graph_passes._torch_compat import fake_mode_of
from graph_passes.annotate import META_KEY
from graph_passes.context import PassContext
from graph_passes.decompose.emit import Emitter, registered_op, val
from graph_passes.node_args import as_int

__all__ = ["PASS_NAME", "GlooCollectiveOptions", "gloo_collectives_pass"]

PASS_NAME = "gloo_collectives"

_C10D = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class GlooCollectiveOptions:
    """``groups``: the process-group names whose all-gathers and reduce-scatters are sent as all-to-alls."""

    groups: frozenset[str] = frozenset()


def gloo_collectives_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Send the listed groups' all-gathers and reduce-scatters as all-to-alls; see the module docstring."""
    options = ctx.pass_options.get(PASS_NAME, GlooCollectiveOptions())
    if not options.groups:
        return gm
    for node in list(gm.graph.nodes):
        if node.target is _C10D.all_gather_into_tensor.default and str(node.args[2]) in options.groups:
            _send_gather(gm.graph, node, ctx)
        elif node.target is _C10D.reduce_scatter_tensor.default and str(node.args[3]) in options.groups:
            why = why_scatter_stays(node)
            if why is None:
                _send_reduce_scatter(gm.graph, node, ctx)
            else:
                ctx.explain(PASS_NAME, f"reduce-scatter left: {why}", f"{ctx.graph_name}: {node.name}")
    return gm


def _send_gather(graph: torch.fx.Graph, gather: torch.fx.Node, ctx: PassContext) -> None:
    shard, ranks, group = gather.args[0], as_int(gather.args[1]), str(gather.args[2])
    if not isinstance(shard, torch.fx.Node):
        return
    with graph.inserting_before(gather):
        rows = _rows(graph, shard)
        _check_shard(shard)
        repeated = graph.call_function(registered_op(TILE_ROWS_OP_NAME), (shard, ranks))
        sent = graph.call_function(_C10D.all_to_all_single.default, (repeated, [rows] * ranks, [rows] * ranks, group))
    for node in (repeated, sent):
        node.meta.update({k: copy.copy(v) for k, v in gather.meta.items()})
    _annotated_like(repeated, gather)
    if ctx.estimator is not None:
        sent.meta[PLANNED_COST_KEY] = _planned_cost(ctx.estimator, gather, sent)
    gather.replace_all_uses_with(sent)
    graph.erase_node(gather)
    ctx.count(PASS_NAME, "all-gathers sent as all-to-alls")


def _send_reduce_scatter(graph: torch.fx.Graph, scatter: torch.fx.Node, ctx: PassContext) -> None:
    x, ranks, group = scatter.args[0], as_int(scatter.args[2]), str(scatter.args[3])
    assert isinstance(x, torch.fx.Node)
    (wait,) = scatter.users
    fake_mode = fake_mode_of([val(x)])
    strand = scatter.meta.get(META_KEY, {}).get("strand")
    if not val(x).is_contiguous():
        x = Emitter(graph, scatter, fake_mode, strand).call(
            torch.ops.aten.clone.default, x, memory_format=torch.contiguous_format
        )
        _annotated_like(x, scatter)
    rows = int(val(x).shape[0]) // ranks
    sent = Emitter(graph, scatter, fake_mode, strand).call(
        _C10D.all_to_all_single.default, x, [rows] * ranks, [rows] * ranks, group
    )
    sent.meta.update({k: copy.copy(v) for k, v in scatter.meta.items() if k != "val"})
    if ctx.estimator is not None:
        sent.meta[PLANNED_COST_KEY] = _planned_cost(ctx.estimator, scatter, sent)
    readers = list(wait.users)
    wait.args = (sent, *wait.args[1:])
    wait.meta["val"] = val(sent)
    after = Emitter(graph, wait.next, fake_mode, strand)
    total = after.call(registered_op(SUM_ROW_BLOCKS_OP_NAME), wait, ranks)
    for node in after.nodes:
        _annotated_like(node, scatter)
    for reader in readers:
        reader.replace_input_with(wait, total)
    graph.erase_node(scatter)
    ctx.count(PASS_NAME, "reduce-scatters sent as all-to-alls")


def _annotated_like(node: torch.fx.Node, collective: torch.fx.Node) -> None:
    """``node``'s ``meta["dhelix"]``: the collective's (phase, strand), its own kind, no comm id."""
    if META_KEY in collective.meta:
        meta = {k: v for k, v in collective.meta[META_KEY].items() if k != "comm_id"}
        node.meta[META_KEY] = {**meta, "kind": kind_of(node)}


def _rows(graph: torch.fx.Graph, shard: torch.fx.Node) -> int | torch.fx.Node:
    """The shard's dim 0: an int, or a ``sym_size`` node when the graph's shapes are symbolic."""
    value = shard.meta.get("val")
    rows = value.shape[0] if isinstance(value, torch.Tensor) else None
    if isinstance(rows, int):
        return rows
    size = graph.call_function(torch.ops.aten.sym_size.int, (shard, 0))
    if rows is not None:
        size.meta["val"] = rows
    return size


def _check_shard(shard: torch.fx.Node) -> None:
    if not isinstance(shard.meta.get("val"), torch.Tensor):
        raise ValueError(f"{PASS_NAME}: the all-gather's input {shard.name} has no tensor meta['val']")


def _planned_cost(estimator: Estimator, planned: torch.fx.Node, sent: torch.fx.Node) -> NodeCost:
    """``sent`` priced as the plan priced the ``planned`` collective, with ``sent``'s own memory numbers."""
    plan = estimator.node_cost(planned)
    own = estimator.node_cost(sent)
    return dataclasses.replace(
        own,
        time_s=plan.time_s,
        time_expr=plan.time_expr,
        issue_s=plan.issue_s,
        contention_factor=plan.contention_factor,
    )
