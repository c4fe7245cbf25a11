"""annotate: tag every node with ``node.meta["dhelix"]`` — what it is, which phase, which strand.

Contract
    After this pass every node ``n`` of the graph has ``n.meta["dhelix"]``, a dict with:

    ``kind``     compute / collective / wait / p2p / view / other  (``cost_model.op_kinds``)
    ``phase``    fwd / bwd / inference; kept if already set (a merged helix graph holds
                 both), else ``ctx.phase``
    ``strand``   int; kept if already set (helix tags strands before), else ``ctx.strand``
    ``comm_id``  on collective, p2p and wait nodes only: issues and the waits that complete
                 them share one id, numbered 0, 1, ... in graph order

    The graph itself is not changed. Running the pass twice gives the same meta.

    Counts (``ctx.stats["annotate"]``): one per node under its kind (``compute``, ``wait``...),
    and ``wait without a collective issue`` (detail in ``ctx.notes``: which wait).

Pseudo-code::

    for n in graph order:
        meta = {kind: kind_of(n), phase: n's phase or ctx.phase, strand: n's strand or ctx.strand}
        if kind in (collective, p2p): meta.comm_id = next id
        if kind == wait:              meta.comm_id = comm_id of issue_of(n)

Picture (an all-gather issued, compute in between, then its wait)::

    x ──► all_gather_into_tensor ──► wait_tensor ──► mm
          collective #0               wait #0        compute
"""

from __future__ import annotations

import operator

import torch.fx

from cost_model.op_kinds import is_comm, kind_of
from graph_passes.context import PassContext

META_KEY = "dhelix"


def strand_of(node: torch.fx.Node) -> int | None:
    """The strand ``node`` is tagged with (``meta["dhelix"]["strand"]``; a merged graph's F is 0,
    its B 1), or None when untagged."""
    strand = node.meta.get(META_KEY, {}).get("strand")
    return None if strand is None else int(strand)


def issue_of(wait: torch.fx.Node) -> torch.fx.Node | None:
    """The collective/P2P node a ``wait_tensor`` completes, looking through ``getitem``.

    Coalesced collectives and ``batch_p2p_ops`` return lists; their waits take
    ``getitem(issue, i)``. Returns ``None`` if the wait's input is not an issue node.
    """
    source = wait.args[0] if wait.args else None
    if isinstance(source, torch.fx.Node) and source.target is operator.getitem:
        source = source.args[0]
    if isinstance(source, torch.fx.Node) and is_comm(kind_of(source)):
        return source
    return None


def annotate_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Tag every node; see the module docstring."""
    comm_ids: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        kind = kind_of(node)
        previous = node.meta.get(META_KEY, {})
        meta: dict[str, object] = {
            "kind": kind,
            "phase": previous.get("phase", ctx.phase),
            "strand": previous.get("strand", ctx.strand),
        }
        if is_comm(kind):
            comm_ids[node] = len(comm_ids)
            meta["comm_id"] = comm_ids[node]
        elif kind == "wait":
            issue = issue_of(node)
            if issue is not None:
                meta["comm_id"] = comm_ids[issue]
            else:
                ctx.explain(
                    "annotate",
                    "wait without a collective issue",
                    f"{ctx.graph_name}: {node.name} reads {node.args[:1]}",
                )
        node.meta[META_KEY] = meta
        ctx.count("annotate", kind)
    return gm
