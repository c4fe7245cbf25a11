"""``data_parallel``: DDP and ZeRO-3 / FSDP whose collectives live in the graph.

    model = dhelix_compile.data_parallel(model, mesh["dp"], mode="shard")   # or mode="replicate"
    step = dhelix_compile.helix(model, loss_fn)          # or torch.compile(model, backend="dhelix")
    losses = step(microbatches); optimizer.step()         # build the optimizer after wrapping

FSDP2's hooks run under ``torch._dynamo.disable`` and DDP splits the graph at its buckets, so a
compile backend never sees their collectives. Here, as torchtitan's SimpleFSDP, every parameter
becomes a DTensor on the DP mesh and each module's parameter attribute gathers it when read:

- ``mode="shard"`` (ZeRO-3 / FSDP): stored as equal shards of the first dim the DP ranks split
  evenly (``layout.py`` says why, not padded as FSDP2 does). Reading ``module.weight`` all-gathers it; the
  backward reduce-scatters the gradient, which stays sharded in ``param.grad``.
- ``mode="replicate"`` (DDP): stored whole (``Replicate()``); the backward all-reduces the gradient.

Gradients are averaged over the DP ranks, as DDP and FSDP2 do. Both collectives are functional
collectives inside ``torch.autograd.Function`` s, so Dynamo traces them: the all-gathers sit in
the forward graph and the reductions in the backward graph, where dhelix's passes, and the second
strand of ``helix``, hide them. In ``helix``, micro-batch i's reduce-scatters share a merged
graph with micro-batch i+1's forward and its all-gathers.

Gradient accumulation: replicated gradients are all-reduced once per step when the runner turns
gradient sync off for all micro-batches but the last
(``model.dhelix_data_parallel.set_requires_gradient_sync``, FSDP2's name; ``helix`` does it
itself). The last backward then all-reduces ``param.grad`` plus its own gradient, inside its
graph, where the passes overlap the all-reduces with its remaining compute. Sharded gradients
are reduce-scattered every micro-batch (they are kept sharded).

Composition with tensor parallelism: apply the TP plan first (``parallelize_module`` over
``mesh["tp"]``), then ``data_parallel`` over ``mesh["dp"]`` of the same 2-D mesh. Parameters
then live on the 2-D ``(dp, tp)`` mesh; a plain parameter of the TP model is ``Replicate()`` on tp.

Composition with pipeline parallelism: wrap each stage's module over ``mesh["dp"]`` of a
``(pp, dp)`` mesh before building its ``PipelineStage`` (on ``mesh["pp"]``'s group). Torch's
schedules run such stages as they are (replicated gradients all-reduced by every backward);
``helix_pipeline`` turns gradient sync on for each stage's last backward only.

What stays as in the unwrapped model: ``named_parameters()`` (names and order; a tied parameter
stays one parameter), ``state_dict()`` keys (values are the DTensors, so
``torch.distributed.checkpoint`` saves and loads them, and its checkpoints load into the unwrapped
model), buffers (untouched), and each rank's own losses. Reading a parameter attribute
(``module.weight``) runs the all-gather, a collective: every DP rank must read it; the stored
parameter is ``module._parameters[name]``.

Gathering again in the backward (``reshard_after_forward``, FSDP2's name): by default a compiled
graph keeps each gathered weight from the forward to the backward (AOTAutograd's partitioner saves
it, or the transpose its matmul's backward reads), which costs one gathered copy of the model's
weights per micro-batch in flight. ``reshard_after_forward=True`` traces the gathers annotated,
and dhelix's capture (``graph_passes.joint.regather``, a joint-graph pass) has the partitioner
recompute them: the backward all-gathers each weight again from the stored shard, as FSDP2 does,
and the passes schedule those gathers like any collective. Only dhelix's backends (``backend="dhelix"``,
``helix``, ``helix_pipeline``) do this; eager code and plain Inductor keep the gathered weights.

Mixed precision as FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` is the dtype floating-point
parameters are gathered and computed in (the root's floating-point inputs are cast to it too);
``reduce_dtype`` the dtype gradients are reduced in (default: ``param_dtype``). Stored parameters
and their gradients keep the model's dtype.

Refused with :class:`DataParallelError`: a mesh that is not a 1-D mesh of this process group
holding this rank, an unknown mode, a ``group_timeout_s`` that is not a number of seconds > 0, a model already wrapped (FSDP2, DDP, or ``data_parallel``),
a model already compiled (``torch.compile(model)`` or ``model.compile()``: wrap first, then
compile; a compiled caller such as ``helix`` traces the module inside ``torch.compile``'s
``OptimizedModule``, not the wrapper, and a ``param_dtype`` input cast registered on the wrapper
would not run), parameters on another device type than the mesh, tensor-parallel parameters on
several meshes or on a mesh that is not the other dim of the DP mesh's root mesh, placements
other than ``Shard``/``Replicate``, and a parameter layout torch does not hold as one tensor
(``mesh_positions.layout_mismatch``; on a mesh that lists its ranks out of order: uneven
tensor-parallel shards, or a 2-D mesh whose TP groups hold ranks at different DP positions, such
as ``[[2, 1], [3, 0]]`` in ``mode="shard"``), where torch's own ``full_tensor()`` would not return
the parameter.

A peer that does not answer: ``data_parallel`` gives the groups of the parameters' mesh (the DP
mesh's, and the TP mesh's where there is one) the timeout ``group_timeout_s`` (``None``, the
default: the default process group's, where theirs is longer; ``group_timeouts``), so that the
collectives of a step run eagerly fail within it too: torch 2.13 makes a ``DeviceMesh``'s
subgroups with 30 minutes on gloo, whatever ``init_process_group``'s ``timeout``. A compiled step
has its groups bounded again by the backend's own ``group_timeout_s``.

Meshes that list their ranks in any order (``DeviceMesh("cpu", [1, 0])``): a rank stores the
shard at its position in the DP group (``dp_mesh.get_local_rank()``), where torch's collectives
(and FSDP2) put it, not the one at its ``get_coordinate()``. torch 2.13 itself is not consistent
there: ``torch.distributed.checkpoint`` writes each shard at its ``get_coordinate()`` offset (a
checkpoint loads back into the same layout, but permuted into an unwrapped model; FSDP2's too),
and DTensor's ``Replicate() -> Shard()`` (in ``redistribute`` and in its ops' sharding) cuts the
chunk at ``get_coordinate()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard
from torch.utils._pytree import tree_map

from dhelix_compile import _torch_compat as compat
from dhelix_compile.data_parallelism.layout import GradientSync, Mode, ParamLayout, store
from dhelix_compile.group_timeouts import bound_group_timeouts
from dhelix_compile.mesh_positions import layout_mismatch, mesh_ranks

__all__ = ["DataParallelError", "DataParallelInfo", "data_parallel", "gradient_sync_on_last"]

_MODES = ("shard", "replicate")
_LAYOUTS = "_dhelix_dp_layouts"


class DataParallelError(ValueError):
    """A model or mesh that ``data_parallel`` cannot wrap; the message says why."""


@dataclass(frozen=True)
class DataParallelInfo:
    """What ``data_parallel`` did to a model (``model.dhelix_data_parallel``)."""

    mode: Mode
    dp_mesh: DeviceMesh
    mesh: DeviceMesh  #: the mesh the parameters live on: ``dp_mesh``, or ``(dp, tp)``
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    gradient_sync: GradientSync
    reshard_after_forward: bool = False

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether the next forwards' backwards reduce the replicated parameters' gradients.

        As FSDP2's method of that name (DDP's ``no_sync``): turn it off for every micro-batch
        but the last, and gradients are all-reduced once per step; the others accumulate
        locally in ``param.grad``. ``helix`` does this itself. Parameters stored as shards
        (``mode="shard"``) reduce-scatter every backward regardless.
        """
        if not isinstance(requires_gradient_sync, bool):
            raise DataParallelError(
                f"set_requires_gradient_sync takes a bool, got {type(requires_gradient_sync).__name__}"
            )
        self.gradient_sync.enabled = requires_gradient_sync
        if not requires_gradient_sync:
            self.gradient_sync.accumulating = True


def data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    mode: Mode = "shard",
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = False,
    group_timeout_s: float | None = None,
) -> nn.Module:
    """Make ``model`` data-parallel over ``dp_mesh`` in place and return it; see the module doc."""
    if not isinstance(reshard_after_forward, bool):
        raise DataParallelError(
            f"data_parallel reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}"
        )
    if group_timeout_s is not None and not (
        isinstance(group_timeout_s, (int, float)) and not isinstance(group_timeout_s, bool) and group_timeout_s > 0
    ):
        raise DataParallelError(
            f"data_parallel group_timeout_s must be a number of seconds > 0, got {group_timeout_s!r}"
        )
    _check_model(model)
    _check_mesh(dp_mesh)
    if mode not in _MODES:
        raise DataParallelError(f"data_parallel mode must be one of {_MODES}, got {mode!r}")
    for what, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise DataParallelError(f"data_parallel {what} must be a floating-point torch.dtype, got {dtype!r}")
    owners = list(_parameter_owners(model))
    if not owners:
        raise DataParallelError(f"data_parallel: {type(model).__name__} has no parameters to make data-parallel")
    for qualified, _, _, param in owners:
        if param.device.type != dp_mesh.device_type:
            raise DataParallelError(
                f"data_parallel: parameter {qualified} is on {param.device.type}, the DP mesh on {dp_mesh.device_type}"
            )
    mesh = _parameter_mesh(dp_mesh, owners)

    sync = GradientSync()
    stored: dict[int, tuple[nn.Parameter, ParamLayout]] = {}  # by the original's id: a tied parameter stays one
    for qualified, _, _, param in owners:  # every layout checked before the model changes
        if id(param) not in stored:
            stored[id(param)] = store(
                param, dp_mesh, mesh, mode, param_dtype, reduce_dtype, sync, regather=reshard_after_forward
            )
            _check_layout(qualified, *stored[id(param)], mesh)
    layouts: dict[nn.Module, dict[str, ParamLayout]] = {}
    for _, module, name, param in owners:
        module._parameters[name], layouts.setdefault(module, {})[name] = stored[id(param)]
    for module, by_name in layouts.items():
        _compute_parameters_on_read(module, by_name)
    vars(model)["dhelix_data_parallel"] = DataParallelInfo(
        mode, dp_mesh, mesh, param_dtype, reduce_dtype, sync, reshard_after_forward
    )
    if param_dtype is not None:
        model.register_forward_pre_hook(_inputs_cast_to(param_dtype), with_kwargs=True)
    bound_group_timeouts([mesh.get_group(dim) for dim in range(mesh.ndim)], group_timeout_s)
    return model


@contextlib.contextmanager
def gradient_sync_on_last(model: nn.Module) -> Iterator[Callable[[bool], None]]:
    """For a runner of micro-batches: yields ``before_forward(last)``, which turns gradient sync
    on for the last micro-batch only (if the user left it on); the user's setting is restored on
    exit. For a model not wrapped by ``data_parallel`` ``before_forward`` does nothing."""
    info: DataParallelInfo | None = vars(model).get("dhelix_data_parallel")
    if info is None:
        yield lambda last: None
        return
    requested = info.gradient_sync.enabled
    try:
        yield lambda last: info.set_requires_gradient_sync(requested and last)
    finally:
        info.gradient_sync.enabled = requested


# ---------------------------------------------------------------------------- checks


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise DataParallelError(f"data_parallel(model, ...) needs a torch.nn.Module, got {type(model).__name__}")
    if compat.compiled_module(model):
        raise DataParallelError(
            "data_parallel: the model is already compiled (torch.compile(model) or model.compile()); call "
            "data_parallel on the uncompiled module first, then compile what it returns (torch.compile, or "
            "pass it to helix or helix_pipeline)"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise DataParallelError(
            "data_parallel: the model is already wrapped by DistributedDataParallel; pass the module itself"
        )
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            where = f"its submodule {name!r}" if name else "the model"
            raise DataParallelError(
                f"data_parallel: {where} is already sharded by FSDP2's fully_shard; use one of the two"
            )
        if hasattr(module, "dhelix_data_parallel") or hasattr(module, _LAYOUTS):
            raise DataParallelError("data_parallel: the model is already wrapped by data_parallel")


def _check_mesh(dp_mesh: DeviceMesh) -> None:
    if not isinstance(dp_mesh, DeviceMesh):
        raise DataParallelError(f"data_parallel needs a DeviceMesh for the DP ranks, got {type(dp_mesh).__name__}")
    if not dist.is_initialized():
        raise DataParallelError("data_parallel needs an initialized default process group (torch.distributed)")
    if dp_mesh.ndim != 1:
        names = dp_mesh.mesh_dim_names or ()
        raise DataParallelError(
            f"data_parallel needs the 1-D data-parallel mesh (e.g. mesh['dp']), got a {dp_mesh.ndim}-D mesh "
            f"{tuple(names) or tuple(dp_mesh.shape)}"
        )
    if dp_mesh.get_coordinate() is None:
        raise DataParallelError(
            f"data_parallel: rank {dist.get_rank()} is not in the DP mesh {dp_mesh.mesh.tolist()}; "
            "every rank that runs the model must be in it"
        )


def _parameter_owners(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """``(qualified name, owning module, attribute name, parameter)`` for every registered parameter
    slot, tied ones included (each slot is rewired to the one stored parameter)."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                yield f"{prefix}.{name}" if prefix else name, module, name, param


def _parameter_mesh(dp_mesh: DeviceMesh, owners: list[tuple[str, nn.Module, str, nn.Parameter]]) -> DeviceMesh:
    """``dp_mesh``, or the 2-D ``(dp, tp)`` mesh when some parameters are DTensors on a TP mesh."""
    tp_meshes: dict[DeviceMesh, str] = {}
    for qualified, _, _, param in owners:
        if not isinstance(param, DTensor):
            continue
        tp_meshes.setdefault(param.device_mesh, qualified)
        bad = [p for p in param.placements if not (type(p) is Shard or isinstance(p, Replicate))]
        if bad:
            raise DataParallelError(
                f"data_parallel: parameter {qualified} has placements {tuple(param.placements)}; "
                "tensor-parallel parameters must be Shard(d) or Replicate()"
            )
    if not tp_meshes:
        return dp_mesh
    if len(tp_meshes) > 1:
        named = ", ".join(f"{q} on {m}" for m, q in tp_meshes.items())
        raise DataParallelError(
            f"data_parallel: parameters are DTensors on several meshes ({named}); expected one TP mesh"
        )
    ((tp_mesh, qualified),) = tp_meshes.items()
    if tp_mesh.ndim != 1:
        raise DataParallelError(
            f"data_parallel: parameter {qualified} is on a {tp_mesh.ndim}-D mesh; expected a 1-D TP mesh"
        )
    if set(tp_mesh.mesh.tolist()) == set(dp_mesh.mesh.tolist()):
        raise DataParallelError(
            f"data_parallel: the DP mesh {dp_mesh} is the mesh of the tensor-parallel parameters "
            f"({qualified}); pass the other dim of the 2-D mesh (mesh['dp'])"
        )
    try:
        return compat.concatenate_meshes([dp_mesh, tp_mesh])
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DataParallelError(
            f"data_parallel: the DP mesh {dp_mesh} and the TP mesh {tp_mesh} of {qualified} are not two dims of "
            f"one mesh (build both from one init_device_mesh(..., mesh_dim_names=('dp', 'tp'))): {exc}"
        ) from None


def _check_layout(qualified: str, param: nn.Parameter, layout: ParamLayout, mesh: DeviceMesh) -> None:
    """Refuse a stored parameter whose layout torch does not hold as one tensor on ``mesh``
    (``mesh_positions.layout_mismatch``: a mesh listing its ranks out of order, with uneven
    tensor-parallel shards or groups across a sharded dim's positions). Its DP shard of a dim TP
    shards too (``_StridedShard``) is checked as the ``Shard`` it is for the groups' positions."""
    assert isinstance(param, DTensor), "data_parallel stores every parameter as a DTensor"
    placements = tuple(param.placements)
    dp = Replicate() if layout.dim is None else Shard(layout.dim)
    ranks, shape = mesh_ranks(mesh), tuple(mesh.mesh.shape)
    for checked in dict.fromkeys([(dp, *placements[1:]), placements]):
        mismatch = layout_mismatch(tuple(param.shape), shape, ranks, checked)
        if mismatch is not None:
            raise DataParallelError(
                f"data_parallel cannot store parameter {qualified} as {list(placements)} (the DP dim first): {mismatch}"
            )


# ---------------------------------------------------------------------------- modules


_classes: dict[tuple[type, tuple[str, ...]], type] = {}


def _compute_parameters_on_read(module: nn.Module, layouts: dict[str, ParamLayout]) -> None:
    """Give ``module`` a class whose ``layouts`` attributes are properties computing the parameter
    (gathered, as its forward uses it) from the stored one (``module._parameters[name]``)."""
    setattr(module, _LAYOUTS, layouts)
    names = tuple(sorted(layouts))
    base = type(module)
    key = (base, names)
    if key not in _classes:
        props: dict[str, Any] = {name: property(_computed(name)) for name in names}
        _classes[key] = type(f"DataParallel{base.__name__}", (base,), props)
    module.__class__ = _classes[key]


def _computed(name: str) -> Any:
    def get(module: nn.Module) -> torch.Tensor | None:
        param = module._parameters[name]
        if param is None:
            return None
        layout: ParamLayout = getattr(module, _LAYOUTS)[name]
        return layout.compute(param)

    get.__name__ = name
    return get


def _inputs_cast_to(dtype: torch.dtype) -> Any:
    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook
