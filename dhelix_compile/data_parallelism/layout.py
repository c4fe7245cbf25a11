"""How one parameter is stored under ``data_parallel``, and the tensor its module computes with.

Stored: an ``nn.Parameter`` holding a DTensor on the DP mesh, or on the 2-D ``(dp, tp)`` mesh when
the model is tensor-parallel. Its placement on the DP dim is ``Replicate()`` (``mode="replicate"``)
or, for ``mode="shard"``, ``Shard(d)`` on the first dim ``d`` of the local tile that the DP ranks
split evenly (dim 0 for nearly every weight). Equal shards keep every rank's graph the same (the
shapes too), which the rank-consistency check and profiled costs rely on; FSDP2 pads dim 0
instead. A parameter with no such dim (a 0-dim one, or odd sizes everywhere) is stored
replicated, and ``shard_dim`` says so. For a tensor-parallel parameter ``d`` splits evenly in
*every* TP tile (unevenly sharded by TP, a ``[5, 4]`` weight has ``[3, 4]`` and ``[2, 4]`` tiles:
dim 1), so every rank stores it in the same placements. A rank's DP shard is the one at its
position in the DP group (``dp_mesh.get_local_rank()``), where torch's collectives put tiles,
not at its ``get_coordinate()`` (they differ on a mesh that lists its ranks out of order:
``dhelix_compile.mesh_positions``). On the TP dim it keeps the parameter's own placement
(``Replicate()`` for a plain parameter of a TP model). A DP shard of a dim that TP shards too is a
block of the TP tile, as FSDP2 lays it out (``_StridedShard``), so the forward gathers the TP
tile with one all-gather over the DP ranks.

Computed (``ParamLayout.compute``): the stored local tensor gathered over the DP ranks (or used as
is, when replicated; with ``regather``, the gather is traced annotated ``graph_passes.joint.regather.REGATHER``
and dhelix's capture gathers it again in the backward instead of keeping it) and, for a TP parameter, wrapped back into the DTensor on the TP mesh that
the TP plan's modules expect. The gradient flows back through the same two steps: reduced over
the DP ranks (reduce-scatter or all-reduce, averaged), so ``param.grad`` is a DTensor of the
stored layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from dhelix_compile import _torch_compat as compat
from dhelix_compile.data_parallelism.collectives import gather_shards, replicate_with_reduced_grad
from dhelix_compile.ops.accumulated_grad import accumulator_slot
from graph_passes.joint.regather import REGATHER

if TYPE_CHECKING:
    from dhelix_compile._torch_compat import GroupName

Mode = Literal["shard", "replicate"]

__all__ = ["GradientSync", "Mode", "ParamLayout", "TensorParallelSpec", "shard_dim", "store", "tensor_parallel_tiles"]


@dataclass(frozen=True)
class TensorParallelSpec:
    """The DTensor a tensor-parallel parameter was: its mesh, placements and global shape."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass(eq=False)
class GradientSync:
    """Whether backwards reduce replicated gradients now; one per model, shared by its layouts.

    ``enabled=False`` (``DataParallelInfo.set_requires_gradient_sync``): replicated parameters'
    gradients accumulate locally in ``param.grad``; ``accumulating`` then stays set, and from
    then on a reducing backward reduces ``param.grad`` plus its own gradient (right whether
    ``param.grad`` is local or was reduced already: the mean of ``acc + g_r`` over ranks is
    ``acc + mean(g)`` when ``acc`` is the same on every rank). Read when the forward runs (or is
    traced: Dynamo guards on both fields), so it decides the backward of that forward.
    """

    enabled: bool = True
    accumulating: bool = False


@dataclass(frozen=True)
class ParamLayout:
    """What a module's parameter attribute computes from the stored parameter (see the module doc)."""

    dim: int | None  #: the dim stored as shards over the DP ranks (None: replicated)
    group: GroupName  #: the DP process group's name
    ranks: int  #: DP ranks
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    tensor_parallel: TensorParallelSpec | None
    sync: GradientSync  #: the model's gradient sync switch (replicated parameters only)
    slot: int  #: the stored parameter's ``accumulator_slot``
    regather: bool = False  #: gather again in the backward (``reshard_after_forward``)

    def compute(self, param: torch.Tensor) -> torch.Tensor:
        assert isinstance(param, DTensor), "data_parallel stores every parameter as a DTensor"
        local = param.to_local()
        if self.dim is not None:
            with compat.annotated(REGATHER) if self.regather else contextlib.nullcontext():
                full = gather_shards(local, self.dim, self.group, self.ranks, self.compute_dtype, self.reduce_dtype)
        else:
            full = replicate_with_reduced_grad(
                local,
                self.group,
                self.ranks,
                self.compute_dtype,
                self.reduce_dtype,
                reduce_now=self.sync.enabled,
                accumulated_slot=self.slot if self.sync.accumulating else None,
            )
        tp = self.tensor_parallel
        if tp is None:
            return full
        return DTensor.from_local(full, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride)


def shard_dim(shapes: Sequence[Sequence[int]], ranks: int) -> int | None:
    """The first dim that ``ranks`` ranks split into equal non-empty shards in every one of
    ``shapes`` (one tensor's tiles, all of one rank count), if any."""
    ndim = {len(shape) for shape in shapes}
    if len(ndim) != 1:
        raise ValueError(f"shard_dim needs tiles of one tensor, got shapes {[list(s) for s in shapes]}")
    return next(
        (d for d in range(ndim.pop()) if all(s[d] >= ranks and s[d] % ranks == 0 for s in shapes)),
        None,
    )


def tensor_parallel_tiles(tp: TensorParallelSpec) -> list[tuple[int, ...]]:
    """The shape of every TP rank's tile of a tensor-parallel parameter (torch's DTensor shapes)."""
    n = tp.mesh.size()
    return [compat.local_shape_and_offset(tp.shape, (n,), (i,), tp.placements)[0] for i in range(n)]


def store(
    original: torch.Tensor,
    dp_mesh: DeviceMesh,
    mesh: DeviceMesh,
    mode: Mode,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    sync: GradientSync,
    regather: bool = False,
) -> tuple[nn.Parameter, ParamLayout]:
    """``original`` (a plain tensor or a DTensor on the TP dim of ``mesh``) as stored by ``data_parallel``."""
    tp: TensorParallelSpec | None = None
    if isinstance(original, DTensor):
        tile = original.to_local().detach()
        tp = TensorParallelSpec(
            original.device_mesh, tuple(original.placements), original.shape, tuple(original.stride())
        )
    else:
        tile = original.detach()
    tp_placements: tuple[Placement, ...] = tp.placements if tp else (Replicate(),) * (mesh.ndim - 1)
    shape, stride = (tp.shape, tp.stride) if tp else (tile.shape, tuple(tile.stride()))
    ranks = dp_mesh.size()
    dim = shard_dim(tensor_parallel_tiles(tp) if tp else [tile.shape], ranks) if mode == "shard" else None
    if dim is not None:
        local = tile.chunk(ranks, dim)[dp_mesh.get_local_rank()].clone()
        dp_placement: Placement = Shard(dim)
        tp_splits = [mesh.size(d + 1) for d, p in enumerate(tp_placements) if p == Shard(dim)]
        if tp_splits:
            dp_placement = compat.strided_shard(dim, split_factor=tp_splits[0])
    else:
        local = tile
        dp_placement = Replicate()
    stored = DTensor.from_local(
        local, mesh, (dp_placement, *tp_placements), run_check=False, shape=shape, stride=stride
    )
    param = nn.Parameter(stored, requires_grad=original.requires_grad)
    floating = original.is_floating_point()
    compute_dtype = param_dtype if param_dtype is not None and floating else original.dtype
    layout = ParamLayout(
        dim=dim,
        group=compat.group_name(dp_mesh.get_group()),
        ranks=ranks,
        compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype if reduce_dtype is not None and floating else compute_dtype,  # FSDP2's default
        tensor_parallel=tp,
        sync=sync,
        slot=accumulator_slot(param),
        regather=regather and dim is not None,
    )
    return param, layout
