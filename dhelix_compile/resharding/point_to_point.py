"""Running a plan as point-to-point sends, its two sides at different times.

``move`` runs a plan as broadcasts: every rank of a piece's group calls them in one ``reshard``
call. A pipeline's stage boundary cannot: its source ranks send at their ``SEND_F`` step and
its destination ranks receive at their ``RECV_F`` step, moments torch's schedule places
independently on each rank. Here each side makes its own ``torch.distributed.P2POp`` s, the ops
torch's pipeline runtime batches and waits::

    source rank:       send_ops(plan, rank, local tile, group, tag)      -> isend per (piece, receiver)
    destination rank:  received = Receive(plan, rank, ...); received.ops -> irecv per piece
                       ...wait...; received.fill(destination tile)

Every piece goes from its (load-balanced) sender to each of its receivers: the bytes a broadcast
puts on gloo's links, which sends a broadcast from its root to each receiver. Both sides walk the
plan's pieces in its send order, so the messages between two ranks match in order; ``tag`` keeps
different transfers between the same ranks apart. The two meshes must not share a rank (a
rank's own piece would be a send to itself): :func:`check_disjoint`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dhelix_compile.resharding.plan import ReshardPlan

__all__ = ["Receive", "check_disjoint", "send_ops"]


def check_disjoint(plan: ReshardPlan) -> None:
    """Raise ``ValueError`` when a rank is in both meshes of ``plan``."""
    shared = sorted(set(plan.source.ranks) & set(plan.dest.ranks))
    if shared:
        raise ValueError(
            f"rank(s) {shared} are in both meshes ({list(plan.source.ranks)} -> {list(plan.dest.ranks)}): "
            "a point-to-point move needs disjoint meshes"
        )


def send_ops(plan: ReshardPlan, rank: int, local: torch.Tensor, group: dist.ProcessGroup, tag: int) -> list[dist.P2POp]:
    """The sends of source rank ``rank``, whose tile of the tensor is ``local``."""
    tile = plan.source_tiles.get(rank)
    if tile is None:
        raise ValueError(f"rank {rank} is not in the source mesh {list(plan.source.ranks)}")
    if tuple(local.shape) != tile.shape:
        raise ValueError(f"rank {rank}'s source tile has shape {list(local.shape)}; the plan has {list(tile.shape)}")
    ops: list[dist.P2POp] = []
    for piece in plan.pieces:
        if piece.sender != rank:
            continue
        data = local[piece.box.within(tile)].contiguous()
        ops.extend(dist.P2POp(dist.isend, data, receiver, group, tag) for receiver in piece.receivers)
    return ops


class Receive:
    """Destination rank ``rank``'s receives of one transfer: ``ops`` to post, then ``fill``."""

    def __init__(
        self,
        plan: ReshardPlan,
        rank: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        group: dist.ProcessGroup,
        tag: int,
    ) -> None:
        tile = plan.dest_tiles.get(rank)
        if tile is None:
            raise ValueError(f"rank {rank} is not in the destination mesh {list(plan.dest.ranks)}")
        self.shape = tile.shape
        self._pieces = [
            (piece.box.within(tile), torch.empty(piece.box.shape, dtype=dtype, device=device), piece.sender)
            for piece in plan.pieces
            if rank in piece.receivers
        ]
        self.ops = [dist.P2POp(dist.irecv, buffer, sender, group, tag) for _, buffer, sender in self._pieces]

    def fill(self, out: torch.Tensor) -> None:
        """Write the received pieces into ``out``, this rank's destination tile (after the ops completed)."""
        if tuple(out.shape) != self.shape:
            raise ValueError(f"the destination tile has shape {list(out.shape)}; the plan has {list(self.shape)}")
        with torch.no_grad():
            for index, buffer, _ in self._pieces:
                out[index] = buffer
