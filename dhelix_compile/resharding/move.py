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

A rank runs its ``RankSteps``: the plan cut down to what this rank does, as plain tuples of ints
(and the groups), made once per plan: Dynamo reads them as constants while tracing.

Differentiable: the backward moves the gradient the other way, by the reverse plan's steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dhelix_compile.resharding.plan import Box, ReshardPlan

__all__ = ["Broadcast", "Issued", "RankSteps", "move", "rank_steps"]

#: A box inside a tile, as ``(start, stop)`` per dimension.
Index = tuple[tuple[int, int], ...]


class Broadcast(NamedTuple):
    """One broadcast this rank takes part in: it sends ``send`` (its slice of the local tile) when
    it is the root, and writes the result to ``recv`` of its destination tile when it receives."""

    group: dist.ProcessGroup
    root: int  # the sender's rank in ``group``
    shape: tuple[int, ...]
    send: Index | None
    recv: Index | None


class RankSteps(NamedTuple):
    """What one rank does for one plan."""

    out_shape: tuple[int, ...] | None  # its destination tile; None outside the destination mesh
    copies: tuple[tuple[Index, Index], ...]  # (source index, destination index): pieces it keeps
    broadcasts: tuple[Broadcast, ...]  # in the plan's send order


def rank_steps(plan: ReshardPlan, rank: int, groups: dict[tuple[int, ...], dist.ProcessGroup]) -> RankSteps:
    """``plan`` as ``rank`` runs it; ``groups``: the process group of each of its broadcast groups."""
    tile = plan.dest_tiles.get(rank)
    copies, broadcasts = [], []
    for piece in plan.pieces:
        if rank not in piece.group:
            continue
        send = _index(piece.box, piece.source_tile) if rank == piece.sender else None
        recv = _index(piece.box, piece.dest_tile) if rank in piece.receivers else None
        if piece.is_local:
            assert send is not None and recv is not None
            copies.append((send, recv))
        else:
            root = piece.group.index(piece.sender)
            broadcasts.append(Broadcast(groups[piece.group], root, piece.box.shape, send, recv))
    return RankSteps(None if tile is None else tile.shape, tuple(copies), tuple(broadcasts))


def _index(box: Box, tile: Box) -> Index:
    return tuple((s.start, s.stop) for s in box.within(tile))


def _slices(index: Index) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in index)


class Issued:
    """A rank's broadcasts of one plan, issued and not yet waited."""

    def __init__(self, local: torch.Tensor, steps: RankSteps) -> None:
        self.local, self.steps = local, steps
        self.received: list[tuple[Index, torch.Tensor]] = []
        self.sends: list[torch.Tensor] = []
        for b in steps.broadcasts:
            if b.send is not None:
                data = local[_slices(b.send)].contiguous()
            else:  # tied to ``local``: a traced backward's receive must not move up into the forward
                data = _after(local.new_empty(b.shape), local)
            result = funcol.broadcast(data, b.root, b.group)
            if b.recv is not None:
                self.received.append((b.recv, result))
            else:
                self.sends.append(result)

    def wait(self) -> torch.Tensor:
        """This rank's destination tile (an empty tensor on a rank outside the destination mesh)."""
        steps, local = self.steps, self.local
        if steps.out_shape is None:  # what DTensor.from_local makes of any tensor on a rank outside the mesh
            out = local.new_empty((0,))
        else:
            out = local.new_empty(steps.out_shape)
        for send, recv in steps.copies:
            out[_slices(recv)] = local[_slices(send)]
        for recv, data in self.received:
            out[_slices(recv)] = funcol.wait_tensor(data)
        self.sends = [funcol.wait_tensor(data) for data in self.sends]
        return out


class _Move(torch.autograd.Function):
    """``local`` (this rank's source tile) to this rank's destination tile; backward the reverse."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, steps: RankSteps, back: RankSteps, issued: Issued | None
    ) -> torch.Tensor:
        ctx.back, ctx.local_shape = back, local.shape
        issued = issued if issued is not None else Issued(local, steps)
        out = issued.wait()
        # The output depends on the sends' completions: Dynamo drops a broadcast whose result
        # nobody reads (on the sender only, and its receivers would wait forever).
        for done in issued.sends:
            out = _after(out, done)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        back = Issued(grad.contiguous(), ctx.back)
        local_grad = back.wait()
        if ctx.back.out_shape is None:  # outside the source mesh: its empty placeholder's shape
            local_grad = local_grad.new_zeros(ctx.local_shape)
        for done in back.sends:  # the same for the backward's sends: tie them to the gradient
            local_grad = _after(local_grad, done)
        return local_grad, None, None, None


def move(local: torch.Tensor, steps: RankSteps, back: RankSteps, issued: Issued | None = None) -> torch.Tensor:
    """This rank's destination tile (differentiable: ``back``, the reverse plan's steps, moves the
    gradient); ``issued``: its broadcasts, already issued."""
    return _Move.apply(local, steps, back, issued)


def _after(tensor: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    """``tensor``, made to depend on ``done`` in a traced graph (the partitioner and dead-code
    elimination see an edge): the sum of zero elements of ``done`` added, so no value changes.
    Eager code needs no such edge and skips the add."""
    if not torch.compiler.is_compiling():
        return tensor
    return tensor + done.flatten()[:0].sum().to(tensor.dtype)
