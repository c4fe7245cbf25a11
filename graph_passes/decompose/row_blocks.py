"""A matmul computed block of rows by block of rows: what the all-gather, reduce-scatter and all-reduce sites share.

Contract
    A 2-d ``mm(rows, W)`` / ``addmm(bias, rows, W)`` whose rows are the ``lead`` dims of a
    tensor flattened row-major is split along one of those dims, ``d``, into ``n`` equal blocks;
    ``matmul_on_rows`` emits the matmul on one block (a bias with one row per output row is
    sliced like the rows), ``chunk_rows`` the block itself. ``reduce_per_peer`` emits this rank's
    block of a sum over ranks as per-peer exchanges: the reduce-scatter's algebra, used by the
    reduce-scatter and all-reduce sites. Nothing here changes existing nodes.

Per-peer sum (rank ``r`` of ``n``; ``partial(i, count)`` is block ``i`` of ``count`` of this
rank's summand; block ``j`` of ``n`` is what rank ``j`` keeps)::

    for s in 1..n-1:                                   remote blocks first, each sent when ready
      y[r+s] = partial(rows of r+s)                    (in P pieces: each piece sent when ready)
      p_s = send y[r+s] to r+s, recv from r-s
    y[r] = partial(rows of r)                          local last, under the transfers
    out = y[r] + wait(p_1) + ... + wait(p_{n-1})       (/ n for "avg")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.fx

from graph_passes.decompose.emit import Emitter, val
from graph_passes.decompose.site import SkipSite, transfer_tag
from graph_passes.node_args import as_node

aten = torch.ops.aten

#: ``(lead, d, j, n)``: block ``j`` of ``n`` along dim ``d`` of the ``lead`` dims.
RowChunk = tuple[Sequence[int], int, int, int]


def row_operand(mm: torch.fx.Node) -> torch.fx.Node:
    """The operand holding an ``mm`` / ``addmm``'s rows."""
    return as_node(mm.args[0] if mm.target == aten.mm.default else mm.args[1])


def chunk_rows(e: Emitter, t: torch.fx.Node, lead: Sequence[int], d: int, j: int, n: int) -> torch.fx.Node:
    """Rows of chunk ``j`` of ``n`` along ``d`` of ``t`` (2-d, rows = ``lead`` dims flattened row-major)."""
    rows, cols = val(t).shape
    if d == 0:
        return e.slice(t, 0, j * rows // n, (j + 1) * rows // n)
    size = lead[d] // n
    part = e.slice(e.view(t, [*lead, cols]), d, j * size, (j + 1) * size, contiguous=True)
    return e.view(part, [-1, cols])


def full_bias(mm: torch.fx.Node) -> torch.fx.Node | None:
    """An addmm's bias when it has one value per row (it must then be split like the rows)."""
    if mm.target != aten.addmm.default:
        return None
    bias = val(mm.args[0])
    return as_node(mm.args[0]) if bias.dim() == 2 and bias.shape[0] != 1 else None


def check_bias(mm: torch.fx.Node, d: int) -> None:
    """``SkipSite`` when ``mm``'s per-row bias cannot be sliced along ``d``."""
    bias = full_bias(mm)
    if bias is not None and d != 0 and not val(bias).is_contiguous():
        raise SkipSite("not contiguous", f"the per-row bias of {mm.name} is not contiguous")


def matmul_on_rows(e: Emitter, mm: torch.fx.Node, rows: torch.fx.Node, chunk: RowChunk | None = None) -> torch.fx.Node:
    """``mm``'s op with ``rows`` as its row operand; ``chunk`` splits a per-row bias too."""
    if mm.target == aten.mm.default:
        return e.call(aten.mm.default, rows, mm.args[1])
    bias, _, w = mm.args[:3]
    if full_bias(mm) is not None:
        if chunk is None:
            raise SkipSite("per-row bias", f"{mm.name} has a bias with a row per output row")
        bias = chunk_rows(e, as_node(bias), *chunk)
    return e.call(aten.addmm.default, bias, rows, w, **dict(mm.kwargs))


def reduce_per_peer(
    e: Emitter,
    partial: Callable[[int, int], torch.fx.Node],
    dim: int,
    rank: int,
    n: int,
    pieces: int,
    tag: int,
    group_name: str,
    reduce_op: str,
) -> torch.fx.Node:
    """This rank's block of a sum over ranks, per peer (the module docstring's picture).

    ``partial(i, count)`` is block ``i`` of ``count`` along ``dim`` of this rank's summand. Tags:
    transfers ``0 .. (n-1)*pieces - 1`` of ``tag``.
    """
    flights = []
    for s in range(1, n):
        peer = (rank + s) % n
        flights.append(
            [
                e.exchange(
                    partial(peer * pieces + p, n * pieces),
                    peer,
                    (rank - s) % n,
                    transfer_tag(tag, (s - 1) * pieces + p),
                    group_name,
                )
                for p in range(pieces)
            ]
        )
    total = partial(rank, n)
    for step in flights:
        total = e.call(aten.add.Tensor, total, e.cat([e.wait_exchange(f) for f in step], dim))
    if reduce_op == "avg":
        total = e.call(aten.div.Tensor, total, n)
    return total
