"""Rank consistency: every rank must issue the same collectives in the same order.

If two ranks of a group disagree (different graphs after a rank-dependent branch, or
different schedules after different cost estimates), the job deadlocks at the first
mismatched collective, or, worse, runs: collectives of equal shapes issued in another order on
each rank exchange each other's tensors, and the results are silently wrong (the measured
``device="cpu"`` planned with each rank's own numbers did that to a merged helix graph).
dhelix checks before any code runs:

    for each process group a scheduled graph communicates on:
        signature = [(op, shapes, dtypes) of each collective on that group, in graph order]
        publish  dhelix/consistency/<group>/<n>/<rank>  = signature      (c10d store, outside the graph)
        wait for the other ranks of the group (consistency_timeout_s, or the group's timeout
            where shorter: group_timeouts.graph_wait_s)
        first difference -> RankMismatchError naming the collective and both ranks' versions
        a rank that never publishes (stuck, or dead: the store sees no death) -> RankMismatchError
            naming it (never a hang)
        where both ranks hold the same graph (the same named collectives on every group, in
        any order): the sequences again with each collective's node name, which tells
        same-shape collectives apart (every rank traced the same code and ran the same passes,
        which name the nodes they make in the order they make them). Ranks whose graphs
        differ by design (a resharding's groups, pipeline stages) compare shapes only.

``n`` counts the checks on each group in this process; ranks of one group compile the same
graphs in the same order, so it matches across them. The check runs only when
``torch.distributed`` is initialized and the graph holds collectives. The decompose pass's
``dhelix::exchange`` is compared with them: every rank of the group calls it in the same per-peer
step, and on gloo it is an all-to-all (``dhelix_compile.ops.exchange``). Other P2P transfers
(``isend``/``irecv``) pair different ops on the two peers and are not compared here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.fx

from cost_model.op_kinds import kind_of, op_name
from dhelix_compile import _torch_compat as compat
from dhelix_compile.ops.exchange import P2P_EXCHANGE

log = logging.getLogger("dhelix")

_checks_per_group: dict[str, int] = {}


class RankMismatchError(RuntimeError):
    """Ranks of one process group would issue different collectives: the job would deadlock."""


def _describe(value: object) -> str:
    val = getattr(value, "meta", {}).get("val") if isinstance(value, torch.fx.Node) else value
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
    if isinstance(val, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in val) + "]"
    return repr(val)


def _group_name_of(node: torch.fx.Node) -> str | None:
    """The ``group_name`` argument of a functional collective (always its last positional arg)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for index, argument in enumerate(schema.arguments):
        if argument.name == "group_name":
            value = node.args[index] if index < len(node.args) else node.kwargs.get("group_name")
            return str(value)
    return None


def collective_groups(gm: torch.fx.GraphModule) -> list[str]:
    """The names of the process groups ``gm``'s collectives and exchanges run on, in first use order."""
    groups: dict[str, None] = {}
    for node in gm.graph.nodes:
        if kind_of(node) == "collective" or node.target is P2P_EXCHANGE:
            group = _group_name_of(node)
            if group is not None:
                groups.setdefault(group)
    return list(groups)


def collective_signatures(gm: torch.fx.GraphModule, *, named: bool = False) -> dict[str, list[str]]:
    """Per group name, the collectives of ``gm`` on it, in order, as comparable strings
    (``named``: each with its node's name)."""
    per_group: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if not (kind_of(node) == "collective" or node.target is P2P_EXCHANGE):
            continue
        group = _group_name_of(node)
        if group is None:
            continue
        op = op_name(node, qualified=True).removeprefix("_c10d_functional.")
        inputs = ", ".join(_describe(a) for a in node.args if isinstance(a, (torch.fx.Node, list, tuple)))
        signature = f"{op}({inputs}) -> {_describe(node)}"
        per_group.setdefault(group, []).append(f"{node.name} = {signature}" if named else signature)
    return per_group


def check_rank_consistency(gm: torch.fx.GraphModule, graph_name: str, timeout_s: float) -> None:
    """Compare this graph's collective sequence with every other rank of each of its groups."""
    if not compat.real_process_group_initialized():
        return
    signatures = collective_signatures(gm)
    if not signatures:
        return
    named = collective_signatures(gm, named=True)
    everything = sorted(f"{group}: {sig}" for group, sigs in named.items() for sig in sigs)
    store = compat.default_store()
    me = dist.get_rank()
    for group, sequence in signatures.items():
        count = _checks_per_group.get(group, 0)
        _checks_per_group[group] = count + 1
        prefix = f"dhelix/consistency/{group}/{count}"
        mine = {"graph": graph_name, "collectives": sequence, "named": named[group], "everything": everything}
        store.set(f"{prefix}/{me}", json.dumps(mine))
        ranks = compat.group_ranks(group)
        others = {r: _wait_for(store, f"{prefix}/{r}", r, group, graph_name, timeout_s) for r in ranks if r != me}
        for rank, theirs in sorted(others.items()):
            _compare(sequence, theirs, me, rank, group, graph_name)
            if theirs["everything"] == everything:  # the same graph on both ranks: the same order too
                _compare(named[group], {**theirs, "collectives": theirs["named"]}, me, rank, group, graph_name)
    log.info("%s: collective sequence agrees across ranks (%d group(s))", graph_name, len(signatures))


def _wait_for(store: dist.Store, key: str, rank: int, group: str, graph_name: str, timeout_s: float) -> dict:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception as exc:  # the store raises on timeout (DistStoreError / RuntimeError)
        raise RankMismatchError(
            f"{graph_name}: rank {rank} of process group '{group}' did not publish its collective "
            f"sequence within {timeout_s:g} s — it is compiling a different graph, is stuck or died; "
            f"the job would deadlock at this graph's first collective"
        ) from exc
    return json.loads(store.get(key))


def _compare(mine: Sequence[str], theirs: dict, me: int, rank: int, group: str, graph_name: str) -> None:
    other = theirs["collectives"]
    for index in range(max(len(mine), len(other))):
        a = mine[index] if index < len(mine) else "<none>"
        b = other[index] if index < len(other) else "<none>"
        if a != b:
            raise RankMismatchError(
                f"{graph_name}: collective #{index} on process group '{group}' differs between ranks "
                f"(the job would deadlock, or exchange the wrong tensors where only the names differ):"
                f"\n  rank {me}: {a}\n  rank {rank}: {b}  (its graph: {theirs['graph']})"
            )
