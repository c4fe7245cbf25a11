"""DTensors across stage boundaries, moved by a resharding plan (any layout on either side).

torch's pipelining moves a DTensor activation by sending each rank's local tile to the rank of
the next stage at the same pipeline position, and rebuilds it there with the layout the
receiving stage declared. When the two stages declare different layouts (a stage ending in
``Replicate()`` and the next taking ``Shard(1)``; ``Shard(1)`` into ``Shard(2)``; meshes of
other shapes), torch sends tiles of the wrong shape (an error) or, where the sizes happen to
match, silently the wrong values. The same happens on the way back whenever a gradient comes out
of the backward in other placements than declared (``Partial()`` or ``Replicate()`` for a
``Shard(1)`` input): gloo aborts on the size mismatch.

``helix_pipeline`` moves every DTensor whose two sides are declared in the stages' static
metadata (``PipelineStage``'s ``input_args`` / ``output_args`` / ``input_grads`` /
``output_grads`` given as DTensors, the metadata torch's static mode needs anyway) with
``dhelix_compile.resharding``: the plan says which slice of which source tile each destination
rank needs, and which source replica sends it (load balanced); the pieces travel as
point-to-point sends in torch's own ``SEND_F`` / ``RECV_F`` steps
(``resharding.point_to_point``), and the gradient goes back the same way at ``SEND_B`` /
``RECV_B`` by the reverse plan. What a stage hands over in other placements than it declared (a
``Partial()`` gradient among them) is redistributed on its own mesh first. Two stages on one
rank (the middle of a V-schedule) share a mesh: their boundary is a ``redistribute`` on it
(on a mesh listed out of order, the tensor gathered whole and this rank's tile cut out, as below).
Tensors declared as plain tensors, and pipelines without static metadata, keep torch's sends.

A stage mesh may list its ranks in any order (stage 1 on ``[3, 2]``): the plan gives each rank
the tile torch's collectives put there (``mesh_positions``: rank 2 holds tile 0), not the one at
its ``get_coordinate()``, which torch's own pairing of pipeline ranks would send it. There a
tensor handed over in other placements than declared is gathered whole and this rank's tile cut
out by the plan, not redistributed by torch: torch 2.13's ``Replicate() -> Shard()`` keeps the
chunk at ``get_coordinate()``. Layouts torch itself does not hold as one tensor on such a mesh
(uneven shards on a dim listed out of order) are refused with a ``HelixError`` naming the mesh
when ``helix_pipeline`` is called.

Every rank learns the other stages' declarations once, when ``helix_pipeline`` is called (an
``all_gather_object`` on the pipeline's process group), and plans every boundary it takes part
in; the process group of a boundary's two meshes is created once, by its members.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate

from dhelix_compile import _torch_compat as compat
from dhelix_compile.helix_runtime.strand_handoff import HelixError
from dhelix_compile.mesh_positions import collective_positions, mesh_ranks
from dhelix_compile.pipeline_runtime.stage_transfers import Receiving, SendOps, StageTransfers
from dhelix_compile.resharding import layout_of, plan_move
from dhelix_compile.resharding.groups import member_group
from dhelix_compile.resharding.plan import Box, MeshLayout, ReshardPlan
from dhelix_compile.resharding.point_to_point import Receive, check_disjoint, send_ops

__all__ = ["Declared", "Transfer", "install_boundaries", "plan_boundaries"]


@dataclass(frozen=True)
class Declared:
    """One declared DTensor of a stage, as every rank can read it (no mesh object)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    layout: MeshLayout

    def describe(self) -> str:
        return (
            f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')} on mesh {list(self.layout.ranks)} "
            f"shaped {list(self.layout.mesh_shape)} {list(self.layout.placements)}"
        )


#: Per stage: its declarations by kind (``compat.STAGE_METADATA_KINDS``), ``None`` where a
#: position holds a plain tensor or a kind was not given.
StageDeclarations = dict[str, tuple[Declared | None, ...] | None]


@dataclass(frozen=True)
class Transfer:
    """One tensor across one boundary in one direction: from ``source`` (stage ``from_stage``'s
    output, or stage ``from_stage``'s input gradient) to ``dest``, with its plan."""

    from_stage: int
    to_stage: int
    index: int  # the output's position (forward) or the input's (backward)
    backward: bool
    source: Declared
    dest: Declared
    plan: ReshardPlan
    tag: int = 0  # its position in the pipeline's transfers (every rank lists them alike): keeps
    # the messages of different transfers between two ranks apart


def declarations(stage: Any) -> StageDeclarations:
    """What ``stage`` declares, in the plain form every rank can plan with."""

    def plain(d: compat.DeclaredDTensor | None) -> Declared | None:
        if d is None:
            return None
        return Declared(d.shape, d.dtype, d.mesh.device_type, layout_of(d.mesh, d.placements))

    return {
        kind: None if found is None else tuple(plain(d) for d in found)
        for kind, found in compat.stage_declarations(stage).items()
    }


def plan_boundaries(declared: dict[int, StageDeclarations]) -> list[Transfer]:
    """The transfers of every DTensor between consecutive stages that both sides declare, forward
    and backward, from every stage's declarations; pure."""
    transfers = []
    for stage in sorted(declared):
        following = declared.get(stage + 1)
        if following is None:
            continue
        outputs, inputs = declared[stage].get("outputs"), following.get("inputs")
        if outputs is None or inputs is None:
            continue
        if len(outputs) != len(inputs):
            raise HelixError(
                f"stage {stage} declares {len(outputs)} outputs and stage {stage + 1} {len(inputs)} inputs"
            )
        for index, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
            if out is None or inp is None:
                continue
            transfers.append(_transfer(stage, stage + 1, index, out, inp, backward=False))
            back = _declared_at(following, "input_grads", index), _declared_at(declared[stage], "output_grads", index)
            if back[0] is None or back[1] is None:
                raise HelixError(
                    f"stage {stage}'s output {index} changes layout on its way to stage {stage + 1} "
                    f"({out.describe()} -> {inp.describe()}): declare its gradient as a DTensor on both sides "
                    f"(stage {stage + 1}'s input_grads and stage {stage}'s output_grads), where it moves back"
                )
            transfers.append(_transfer(stage + 1, stage, index, back[0], back[1], backward=True))
    return [dataclasses.replace(t, tag=position) for position, t in enumerate(transfers)]


def _declared_at(declared: StageDeclarations, kind: str, index: int) -> Declared | None:
    found = declared.get(kind)
    return None if found is None or index >= len(found) else found[index]


def _transfer(
    from_stage: int, to_stage: int, index: int, source: Declared, dest: Declared, *, backward: bool
) -> Transfer:
    what = f"stage {from_stage}'s {'input gradient' if backward else 'output'} {index} to stage {to_stage}"
    if source.shape != dest.shape or source.dtype != dest.dtype:
        raise HelixError(f"{what}: declared as {source.describe()} on one side and {dest.describe()} on the other")
    if source.device_type != dest.device_type:
        raise HelixError(f"{what}: the meshes are on {source.device_type} and {dest.device_type}")
    if dest.layout.has_partial:
        raise HelixError(
            f"{what}: the receiving side declares {dest.describe()}; a received tensor holds values, "
            "declare Shard(d) or Replicate() there"
        )
    try:
        plan = plan_move(source.shape, source.dtype.itemsize, source.layout, dest.layout)
    except ValueError as exc:
        raise HelixError(f"{what}: {exc}") from exc
    return Transfer(from_stage, to_stage, index, backward, source, dest, plan)


def install_boundaries(stages: list[Any]) -> list[Transfer]:
    """Find the boundaries of the pipeline of ``stages`` (this rank's) that change layout and
    install their transfers on the stages; returns them (every rank of the pipeline calls this)."""
    if not stages:
        return []
    group = compat.stage_group(stages[0])
    mine = {stage.stage_index: declarations(stage) for stage in stages}
    gathered: list[dict[int, StageDeclarations]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(gathered, mine, group=group)
    declared = {index: found for per_rank in gathered for index, found in per_rank.items()}
    transfers = plan_boundaries(declared)
    if not transfers:
        return []
    rank = dist.get_rank()
    local = {stage.stage_index: stage for stage in stages}
    groups = _groups(transfers, local, rank)
    for stage in stages:
        _install(stage, transfers, local, groups, rank)
    return transfers


def _groups(transfers: list[Transfer], local: dict[int, Any], rank: int) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The process group of each cross-rank transfer's two meshes that ``rank`` is in, created in
    the transfers' order (every member walks the same list)."""
    groups = {}
    for t in transfers:
        if t.from_stage in local and t.to_stage in local:
            continue  # one rank holds both stages: no message
        ranks = tuple(sorted({*t.source.layout.ranks, *t.dest.layout.ranks}))
        if rank in ranks and ranks not in groups:
            try:
                check_disjoint(t.plan)
            except ValueError as exc:
                raise HelixError(f"stage {t.from_stage} -> stage {t.to_stage}: {exc}") from exc
            groups[ranks] = member_group(ranks)
    return groups


def _install(
    stage: Any,
    transfers: list[Transfer],
    local: dict[int, Any],
    groups: dict[tuple[int, ...], dist.ProcessGroup],
    rank: int,
) -> None:
    index = stage.stage_index
    sends: dict[bool, dict[int, SendOps]] = {False: {}, True: {}}
    receives: dict[bool, dict[int, Receiving]] = {False: {}, True: {}}
    converts: dict[bool, dict[int, Callable[[Any], Any]]] = {False: {}, True: {}}
    for t in transfers:
        same_rank = t.from_stage in local and t.to_stage in local
        if same_rank and t.to_stage == index:
            converts[t.backward][t.index] = _redistribute(t, local[index])
        elif not same_rank and t.from_stage == index:
            sends[t.backward][t.index] = _sender(t, rank, groups, stage.device)
        elif not same_rank and t.to_stage == index:
            receives[t.backward][t.index] = _Receiver(t, rank, groups, stage.device)
    StageTransfers(stage).install(
        send_outputs=sends[False],
        recv_inputs=receives[False],
        send_input_grads=sends[True],
        recv_output_grads=receives[True],
        local_inputs=converts[False],
        local_output_grads=converts[True],
    )


def _group_of(t: Transfer, groups: dict[tuple[int, ...], dist.ProcessGroup]) -> dist.ProcessGroup:
    return groups[tuple(sorted({*t.source.layout.ranks, *t.dest.layout.ranks}))]


def _as_source(t: Transfer, tensor: Any, device: Any) -> torch.Tensor:
    """This rank's tile of ``tensor`` in the plan's source layout (a missing gradient is zeros;
    any other placements, a ``Partial()`` among them, redistributed on the source mesh)."""
    tile = t.plan.source_tiles[dist.get_rank()]
    if tensor is None:
        return torch.zeros(tile.shape, dtype=t.source.dtype, device=device)
    if not isinstance(tensor, DTensor):
        raise HelixError(
            f"stage {t.from_stage}'s {'input gradient' if t.backward else 'output'} {t.index} is a "
            f"{type(tensor).__name__}; it was declared as a DTensor ({t.source.describe()})"
        )
    if tuple(tensor.placements) == t.plan.source.placements:
        return tensor.to_local().detach()
    mesh = tensor.device_mesh
    if not _listed_out_of_order(mesh):
        return tensor.redistribute(mesh, t.plan.source.placements).to_local().detach()
    # torch 2.13's Replicate() -> Shard(d) keeps the chunk at the rank's get_coordinate(), not at
    # its place in the dim's group, where the plan (and torch's own all-gathers) read its tile
    # (on [1, 0], distribute_tensor(t, [Replicate()]).redistribute([Shard(0)]).full_tensor() swaps
    # the halves): gathered whole instead, and this rank's tile cut out
    whole = tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local().detach()
    return whole[tile.within(Box((0,) * whole.ndim, tuple(whole.shape)))]


def _listed_out_of_order(mesh: DeviceMesh) -> bool:
    """Whether a rank of ``mesh`` is at another tile position than its listed coordinate
    (``mesh_positions``); the same answer on every rank."""
    ranks = mesh_ranks(mesh)
    positions = collective_positions(tuple(mesh.mesh.shape), ranks)
    listed = itertools.product(*(range(n) for n in mesh.mesh.shape))
    return any(positions[rank] != coordinate for rank, coordinate in zip(ranks, listed, strict=True))


def _sender(t: Transfer, rank: int, groups: dict[tuple[int, ...], dist.ProcessGroup], device: Any) -> SendOps:
    group = _group_of(t, groups)

    def send(microbatch: int, tensor: Any) -> list[Any]:
        return send_ops(t.plan, rank, _as_source(t, tensor, device), group, t.tag)

    return send


class _Receiver:
    """One transfer's receives on this rank: posted per micro-batch, written into torch's buffer."""

    def __init__(self, t: Transfer, rank: int, groups: dict[tuple[int, ...], dist.ProcessGroup], device: Any) -> None:
        self.transfer, self.rank, self.group, self.device = t, rank, _group_of(t, groups), device
        self.pending: dict[int, Receive] = {}

    def ops(self, microbatch: int) -> list[Any]:
        t = self.transfer
        received = Receive(t.plan, self.rank, dtype=t.dest.dtype, device=self.device, group=self.group, tag=t.tag)
        self.pending[microbatch] = received
        return list(received.ops)

    def fill(self, microbatch: int, buffer: torch.Tensor) -> None:
        received = self.pending.pop(microbatch, None)
        if received is None:
            raise HelixError(
                f"stage {self.transfer.to_stage} reads micro-batch {microbatch}'s "
                f"{'output gradient' if self.transfer.backward else 'input'} {self.transfer.index} before receiving it"
            )
        received.fill(buffer)


def _redistribute(t: Transfer, stage: Any) -> Callable[[Any], Any]:
    """Two stages on this rank: the tensor redistributed on their shared mesh."""
    if t.source.layout.ranks != t.dest.layout.ranks:
        raise HelixError(
            f"stages {t.from_stage} and {t.to_stage} run on this rank but declare different meshes "
            f"({t.source.describe()} -> {t.dest.describe()}): stages on one rank share their mesh"
        )

    def convert(tensor: Any) -> Any:
        if not isinstance(tensor, DTensor) or tuple(tensor.placements) == t.dest.layout.placements:
            return tensor
        mesh = tensor.device_mesh
        if not _listed_out_of_order(mesh):
            return tensor.redistribute(mesh, t.dest.layout.placements)
        # torch 2.13's Replicate() -> Shard(d) would keep the chunk at get_coordinate() (as in
        # _as_source): gathered whole instead, and this rank's tile of the plan's destination cut out
        whole = tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        tile = t.plan.dest_tiles[dist.get_rank()]
        local = whole[tile.within(Box((0,) * whole.ndim, tuple(whole.shape)))].contiguous()
        return DTensor.from_local(
            local, mesh, t.dest.layout.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )

    return convert
