"""bucket_collectives: a step's parameter gathers and gradient reductions moved in buckets.

Data parallelism issues one collective per parameter (``data_parallel``: an all-gather per weight
in the forward, a reduce-scatter or all-reduce per gradient in the backward), 21 of each for the
small reference transformer. Every collective pays a fixed cost besides its bytes (a launch and a
rendezvous: about half a millisecond of gloo's time on this machine, tens of microseconds on
NCCL), which is why DDP reduces gradients in 25 MB buckets and FSDP2 gathers a block's
parameters at once. Bucketing trades that cost against issuing later: a bucket starts when its
last input exists and every result is ready when the whole bucket is.

Contract
    Input: an aten partition (or a merged helix graph). Before ``annotate``; after
    ``combine_all_reduces``. Options: ``BucketOptions`` (``ctx.pass_options["bucket_collectives"]``;
    ``cap_mb=0`` turns the pass off).

    Candidates: ``wait_tensor(c(x, ...))`` with ``c`` one of ``all_gather_into_tensor``,
    ``reduce_scatter_tensor``, ``all_reduce``, the issue read by its one wait only, and

    * a *parameter gather*: an all-gather of a graph input (through casts and views only);
    * a *gradient reduction*: a reduce-scatter or all-reduce whose result reaches only the
      graph's output (through casts and views only).

    So no candidate's input depends on another's result, and activations' collectives (tensor
    and sequence parallelism, which ``decompose`` pairs with their matmuls) are left alone.
    Candidates with equal keys (op, group, reduce op, group size, dtype, strand), in graph order, fill
    buckets of at most ``cap_mb`` (a candidate larger than the cap stays alone); a bucket of one
    is left alone. Each bucket becomes one collective of the members' inputs flattened and
    concatenated (a reduce-scatter's as ``(ranks, -1)`` rows, so that each rank's chunk stays
    its own), issued after the last member's input, waited on at once (``reorder`` and
    ``interleave`` place it later); each member's result is a slice of it in the member's shape.
    The graph is then put back into a topological order that keeps every other node's
    relative order (the members' readers move after the bucket's wait). Values are unchanged:
    the same elements are reduced or gathered, in the same places.

    Counts (``ctx.stats["bucket_collectives"]``): ``buckets`` and ``collectives removed`` (also
    recorded, ``ctx.records["bucket_collectives"]["collectives_removed"]``: ``helix`` weighs a
    merged graph of bucketed strands against one of plain strands);
    ``left alone: over the cap`` for a candidate larger than the cap. New nodes get the
    ``phase`` and ``strand`` of the bucket's first member.

Pseudo-code::

    for each key, candidates c1..cn in graph order:
        split into buckets of total bytes <= cap
        for each bucket b (2 or more):
            flat = cat([shape(ci.input) for ci in b])      after the last input
            w = wait(collective(flat))
            ci's result := view(slice(w, ci's part), ci's shape)
    stable topological sort
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.fx

from cost_model.op_kinds import op_name, reshapes_or_casts
from graph_passes._torch_compat import fake_mode_of
from graph_passes.context import PassContext
from graph_passes.decompose.emit import Emitter, val
from graph_passes.node_args import as_int, as_node
from graph_passes.node_order import apply_order, stable_topological_order

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

PASS = "bucket_collectives"
_GATHER, _SCATTER, _REDUCE = (
    c10d.all_gather_into_tensor.default,
    c10d.reduce_scatter_tensor.default,
    c10d.all_reduce.default,
)

__all__ = ["PASS", "BucketOptions", "Candidate", "bucket_collectives_pass", "find_buckets"]


@dataclasses.dataclass(frozen=True)
class BucketOptions:
    """``cap_mb``: the most megabytes one bucket moves (its input's bytes); 0 turns bucketing off."""

    cap_mb: float = 0.0


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One ``wait_tensor(issue)`` that may share a bucket."""

    issue: torch.fx.Node
    wait: torch.fx.Node

    @property
    def input(self) -> torch.fx.Node:
        return as_node(self.issue.args[0])

    @property
    def key(self) -> tuple[object, ...]:
        """Equal keys may share a bucket: the op, its scalar arguments (reduce op, group size,
        group), the input's dtype, and the strand (a merged helix graph's two micro-batches
        keep their own buckets, so that ``interleave`` can still place each strand's)."""
        strand = self.issue.meta.get("dhelix", {}).get("strand")
        return (self.issue.target, *self.issue.args[1:], val(self.input).dtype, strand)

    @property
    def nbytes(self) -> int:
        value = val(self.input)
        return int(value.numel() * value.element_size())


def _from_graph_input(node: torch.fx.Node) -> bool:
    """``node`` is a graph input, or casts and views of one."""
    while node.op != "placeholder":
        if not reshapes_or_casts(node) or len(node.all_input_nodes) != 1:
            return False
        node = node.all_input_nodes[0]
    return True


def _only_to_output(node: torch.fx.Node) -> bool:
    """Every reader of ``node`` is the output, or a cast or view whose readers are."""
    return all(user.op == "output" or (reshapes_or_casts(user) and _only_to_output(user)) for user in node.users)


def _candidate(wait: torch.fx.Node) -> Candidate | None:
    if wait.target != c10d.wait_tensor.default or not wait.args:
        return None
    issue = wait.args[0]
    if not isinstance(issue, torch.fx.Node) or issue.target not in (_GATHER, _SCATTER, _REDUCE):
        return None
    if list(issue.users) != [wait]:
        return None
    source = as_node(issue.args[0])
    value = val(source)
    if not isinstance(value, torch.Tensor) or any(not isinstance(d, int) for d in value.shape):
        return None
    if issue.target == _GATHER:
        return Candidate(issue, wait) if _from_graph_input(source) else None
    if issue.target == _SCATTER and (value.dim() == 0 or value.shape[0] % as_int(issue.args[2])):
        return None
    return Candidate(issue, wait) if _only_to_output(wait) else None


def find_buckets(
    graph: torch.fx.Graph, cap_bytes: int, skipped: list[Candidate] | None = None
) -> list[list[Candidate]]:
    """The buckets of two or more candidates (see the module docstring), in graph order of their
    first member. Changes nothing; candidates over the cap go to ``skipped``."""
    by_key: dict[tuple[object, ...], list[list[Candidate]]] = {}
    filled_bytes: dict[tuple[object, ...], int] = {}  # the last bucket's, by key
    for node in graph.nodes:
        candidate = _candidate(node)
        if candidate is None:
            continue
        if candidate.nbytes > cap_bytes:
            if skipped is not None:
                skipped.append(candidate)
            continue
        buckets = by_key.setdefault(candidate.key, [[]])
        filled = filled_bytes.get(candidate.key, 0)
        if filled + candidate.nbytes > cap_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(candidate)
        filled_bytes[candidate.key] = filled + candidate.nbytes
    found = [bucket for buckets in by_key.values() for bucket in buckets if len(bucket) > 1]
    order = {node: i for i, node in enumerate(graph.nodes)}
    return sorted(found, key=lambda bucket: order[bucket[0].wait])


def _rewrite(graph: torch.fx.Graph, bucket: Sequence[Candidate]) -> None:
    """One collective for ``bucket`` (see the module docstring); leaves the order to the caller."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    anchor = max((c.input for c in bucket), key=order.__getitem__).next
    while anchor.op == "placeholder":
        anchor = anchor.next
    first = bucket[0]
    emit = Emitter(graph, anchor, fake_mode_of([val(c.input) for c in bucket]), None)
    op = first.issue.target
    if op == _SCATTER:
        ranks = as_int(first.issue.args[2])
        parts = [emit.call(aten.reshape.default, c.input, [ranks, -1]) for c in bucket]
        flat = emit.call(aten.reshape.default, emit.cat(parts, 1), [-1])
    else:
        flat = emit.cat([emit.call(aten.reshape.default, c.input, [-1]) for c in bucket], 0)
    done = emit.call(c10d.wait_tensor.default, emit.call(op, flat, *first.issue.args[1:]))
    if op == _GATHER:
        ranks = as_int(first.issue.args[1])
        done = emit.call(aten.view.default, done, [ranks, -1])
    offset = 0
    for candidate in bucket:
        numel = val(candidate.input).numel()
        shape = list(val(candidate.wait).shape)
        if op == _GATHER:  # rank r's row holds its shard of every member: the member is a column block
            part = emit.slice(done, 1, offset, offset + numel)
            result = emit.call(aten.reshape.default, part, shape)
        else:
            share = numel // ranks if op == _SCATTER else numel
            start = offset // ranks if op == _SCATTER else offset
            result = emit.view(emit.slice(done, 0, start, start + share), shape)
        offset += numel
        candidate.wait.replace_all_uses_with(result)
    meta = first.wait.meta.get("dhelix", {})
    for node in emit.nodes:
        node.meta["dhelix"] = {k: meta[k] for k in ("phase", "strand") if k in meta}
    for candidate in bucket:
        graph.erase_node(candidate.wait)
        graph.erase_node(candidate.issue)


def bucket_collectives_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Bucket the parameter gathers and gradient reductions; see the module docstring."""
    options: BucketOptions = ctx.pass_options.get(PASS, BucketOptions())
    if options.cap_mb <= 0:
        return gm
    skipped: list[Candidate] = []
    buckets = find_buckets(gm.graph, int(options.cap_mb * 2**20), skipped)
    if skipped:
        ctx.count(PASS, "left alone: over the cap", len(skipped))
    if not buckets:
        return gm
    for bucket in buckets:
        ctx.explain(
            PASS,
            "buckets",
            f"{ctx.graph_name}: {', '.join(c.issue.name for c in bucket)} in one "
            f"{op_name(bucket[0].issue)} of {sum(c.nbytes for c in bucket) / 2**20:.2f} MB",
        )
        _rewrite(gm.graph, bucket)
    removed = sum(len(b) - 1 for b in buckets)
    ctx.count(PASS, "collectives removed", removed)
    ctx.record(PASS, collectives_removed=float(removed))
    apply_order(gm.graph, stable_topological_order(gm.graph))
    return gm
