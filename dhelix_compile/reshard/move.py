"""Running a plan: every rank issues the broadcasts it is part of, then fills its destination tile.

    rank in both meshes, sender of piece a, receiver of piece b:
        a: broadcast(local[a's slice]) on a's group          (functional, asynchronous)
        b: broadcast(empty of b's shape) on b's group
        out[b's slice] = wait(b)                              (its own pieces: copied, no link)

The broadcasts are ``_c10d_functional.broadcast``: asynchronous in eager (every piece is issued
before the first wait, so all links run at once) and traced by Dynamo as functional collectives,
so a compiled graph's passes can overlap them with compute. Only the ranks of a piece's group
call its broadcast; every rank walks the same piece list in the same order, so the groups'
collectives match.

Differentiable: the backward moves the gradient the other way, by the reverse plan.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from dhelix_compile.reshard.groups import broadcast_groups
from dhelix_compile.reshard.plan import ReshardPlan

__all__ = ["Issued", "issue", "move"]


class Issued:
    """A rank's broadcasts of one plan, issued and not yet waited."""

    def __init__(self, local: torch.Tensor, plan: ReshardPlan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        groups = broadcast_groups(plan, rank)
        self.local = local
        self.received: list[tuple[int, torch.Tensor]] = []  # (piece index, its data)
        self.sends: list[torch.Tensor] = []
        for i, piece in enumerate(plan.pieces):
            if rank not in piece.group or piece.is_local:
                continue
            group = groups[piece.group]
            if rank == piece.sender:
                data = local[piece.box.within(piece.source_tile)].contiguous()
            else:
                data = local.new_empty(piece.box.shape)
            result = funcol.broadcast(data, piece.group.index(piece.sender), group)
            if rank in piece.receivers:
                self.received.append((i, result))
            else:
                self.sends.append(result)

    def wait(self) -> torch.Tensor:
        """This rank's destination tile (an empty tensor on a rank outside the destination mesh)."""
        plan, rank = self.plan, self.rank
        tile = plan.dest_tiles.get(rank)
        if tile is None:  # what DTensor.from_local makes of any tensor on a rank outside the mesh
            out = self.local.new_empty((0,))
        else:
            out = self.local.new_empty(tile.shape)
            for piece in plan.pieces:
                if piece.is_local and piece.sender == rank:
                    out[piece.box.within(tile)] = self.local[piece.box.within(piece.source_tile)]
        for i, data in self.received:
            assert tile is not None
            out[plan.pieces[i].box.within(tile)] = funcol.wait_tensor(data)
        for data in self.sends:
            funcol.wait_tensor(data)
        return out


def issue(local: torch.Tensor, plan: ReshardPlan, rank: int) -> Issued:
    return Issued(local, plan, rank)


class _Move(torch.autograd.Function):
    """``local`` (this rank's source tile) to this rank's destination tile; backward the reverse."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, plan: ReshardPlan, back: ReshardPlan, rank: int, issued: Issued | None
    ) -> torch.Tensor:
        ctx.back, ctx.rank, ctx.local_shape = back, rank, local.shape
        return (issued if issued is not None else Issued(local, plan, rank)).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        local_grad = Issued(grad.contiguous(), ctx.back, ctx.rank).wait()
        if ctx.rank not in ctx.back.dest_tiles:  # outside the source mesh: its empty placeholder's shape
            local_grad = local_grad.new_zeros(ctx.local_shape)
        return local_grad, None, None, None, None


def move(
    local: torch.Tensor, plan: ReshardPlan, back: ReshardPlan, rank: int, issued: Issued | None = None
) -> torch.Tensor:
    """This rank's destination tile of ``plan`` (differentiable; ``issued``: its broadcasts, already issued)."""
    return _Move.apply(local, plan, back, rank, issued)
