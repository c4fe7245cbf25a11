"""Rank functions for pipelines whose stage boundary changes layout, for ``run_on_ranks`` (4 ranks).

A two-stage model on a ``(pp=2, tp=2)`` mesh: stage 0 on ranks [0, 1], stage 1 on ranks [2, 3]
(or as ``mesh_ranks`` lists them: ``[[0, 1], [3, 2]]`` puts stage 1 on ``[3, 2]``, where rank 3
holds tile 1 of a ``Shard`` as torch's collectives place it, though it is listed first), each
stage's tensors DTensors on its own ``tp`` mesh::

    stage 0:  h = tanh(x @ W0)       W0 column-sharded; h handed over in ``placements_out``
    stage 1:  y = (h @ W1)            h taken in ``placements_in``; y gathered; loss = mse(y, target)

``replicated_first``: stage 0's ``W0`` and ``h`` are replicated and ``h`` handed over as it is,
whatever stage 0 declares (the boundary redistributes it). On a mesh listed out of order stage 1
holds ``W1`` as ``Shard(0)`` where it takes ``Shard(2)``: torch 2.13's own ``Shard(2) @
Replicate()`` cuts ``W1``'s rows at each rank's ``get_coordinate()`` there, not where its
collectives put ``h``'s tiles, and computes a wrong product (on ``[1, 0]``,
``(distribute_tensor(h, [Shard(2)]) @ distribute_tensor(w, [Replicate()])).full_tensor()`` is not
``h @ w``).

Every stage declares its tensors (torch's static metadata: ``input_args``, ``output_args``,
``input_grads``, ``output_grads``), and the two sides of the boundary declare different layouts
where the case says so. The result is compared with the same model run eagerly on full tensors on
every rank: the losses (last stage) and each weight's full gradient (torch's ``full_tensor()``).
A boundary ``helix_pipeline`` refuses (a ``HelixError`` when it is called) is reported as
``"<case>: refused: <message>"``.

``check_folded_boundary(rank, 4, cases, mesh_ranks=None, **helix_options)``: four stages under
``ScheduleDualPipeV`` on the same ``(pp, tp)`` mesh, stage ``k`` on pp position ``k`` for ``k < 2``
and ``3 - k`` after (stages 1 and 2 on one rank: the boundary ``helix_pipeline`` converts on its
mesh, not sends)::

    stage k < 3:  h' = tanh(h @ W_k)     h taken in ``Shard(2)`` (W_k ``Shard(0)``: the product
                                          reduced into the stage's output placements) or
                                          ``Replicate()`` (W_k ``Shard(1)`` for a ``Shard(2)``
                                          output, else ``Replicate()``)
    stage 3:      y = h @ W_3            W_3 ``Shard(0)`` or ``Replicate()`` as above; y gathered;
                                          loss = mse(y, target)

Each case ``(out, in)`` is stage 1's output and stage 2's input placements (``"R"`` or ``"S2"``):
stage 0 hands stage 1 ``Shard(2)``, and stage 2 hands stage 3 what stage 1 handed stage 2. Every
redistribution in the stages, forward and backward, is one torch places as its collectives do on
any mesh (a reduction, or an all-gather in the backward); the boundary between stages 1 and 2 is
the one ``Replicate() <-> Shard(2)`` move. The losses (stage 3) and every weight's full gradient are compared with the same model run
eagerly on full tensors; returns what differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

__all__ = ["BOUNDARY_PLACEMENTS", "check_boundary_cases", "check_folded_boundary"]

_MB, _SEQ, _HIDDEN, _N_MICROBATCHES = 2, 5, 6, 4  # 5 rows over 2 ranks: uneven shards

#: The layouts either side of the boundary may declare, by name.
BOUNDARY_PLACEMENTS: dict[str, Placement] = {"S1": Shard(1), "S2": Shard(2), "R": Replicate()}


class _First(nn.Module):
    """``h = tanh(x @ W0)``, ``W0`` column-sharded, handed over in ``placements_out``;
    ``replicated``: ``W0`` and ``h`` replicated, ``h`` handed over as it is (``Replicate()``,
    whatever the stage declares: the boundary redistributes it)."""

    def __init__(
        self, w0: torch.Tensor, mesh: DeviceMesh, placements_out: Sequence[Placement], replicated: bool = False
    ) -> None:
        super().__init__()
        self.w = nn.Parameter(distribute_tensor(w0, mesh, [Replicate() if replicated else Shard(1)]))
        self.mesh, self.placements_out, self.replicated = mesh, tuple(placements_out), replicated

    def forward(self, x: torch.Tensor) -> DTensor:
        h = torch.tanh(DTensor.from_local(x, self.mesh, [Replicate()], run_check=False) @ self.w)
        assert isinstance(h, DTensor)
        return h if self.replicated else h.redistribute(self.mesh, self.placements_out)


class _Last(nn.Module):
    """``y = h @ W1`` on DTensors, ``W1`` in ``w_placements`` (``Replicate()`` unless told)."""

    def __init__(self, w1: torch.Tensor, mesh: DeviceMesh, w_placements: Sequence[Placement] = (Replicate(),)) -> None:
        super().__init__()
        self.w = nn.Parameter(distribute_tensor(w1, mesh, list(w_placements)))

    def forward(self, h: DTensor) -> torch.Tensor:
        y = h @ self.w
        assert isinstance(y, DTensor)
        return y.full_tensor()


def _listed_out_of_order(mesh: DeviceMesh) -> bool:
    listed = [int(r) for r in mesh.mesh.flatten().tolist()]
    return listed != sorted(listed)


def _mse(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def _data(steps: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(11)
    w0, w1 = torch.randn(_HIDDEN, _HIDDEN, generator=gen) / 3, torch.randn(_HIDDEN, _HIDDEN, generator=gen) / 3
    batch = (_MB * _N_MICROBATCHES, _SEQ, _HIDDEN)
    return w0, w1, [(torch.randn(batch, generator=gen), torch.randn(batch, generator=gen)) for _ in range(steps)]


def _declared(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """A DTensor of ``shape`` on ``mesh`` to declare a stage's metadata with (no communication)."""
    return distribute_tensor(torch.zeros(shape), mesh, list(placements), src_data_rank=None)


def _eager(
    w0: torch.Tensor, w1: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses per micro-batch and the last step's gradients as torch's schedules give them (summed
    over its micro-batches, scaled by the micro-batch count)."""
    p0, p1 = w0.clone().requires_grad_(), w1.clone().requires_grad_()
    losses = []
    for x, target in batches:
        p0.grad = p1.grad = None  # each step's own gradients, as the pipeline's zero_grad between steps
        for xs, ts in zip(x.chunk(_N_MICROBATCHES), target.chunk(_N_MICROBATCHES), strict=True):
            loss = _mse(torch.tanh(xs @ p0) @ p1, ts)
            (loss / _N_MICROBATCHES).backward()
            losses.append(loss.detach())
    assert p0.grad is not None and p1.grad is not None
    return losses, {"w0": p0.grad, "w1": p1.grad}


def _run_case(
    rank: int,
    mesh: DeviceMesh,
    out_name: str,
    in_name: str,
    steps: int,
    helix_options: dict[str, Any] | None,
    replicated_first: bool = False,
) -> list[str]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from dhelix_compile import helix_pipeline
    from dhelix_compile.helix_runtime.strand_handoff import HelixError

    w0, w1, batches = _data(steps)
    tp, stage_index = mesh["tp"], mesh["pp"].get_local_rank()
    shape = (_MB, _SEQ, _HIDDEN)
    placements_out, placements_in = [BOUNDARY_PLACEMENTS[out_name]], [BOUNDARY_PLACEMENTS[in_name]]
    module: nn.Module
    declared: dict[str, Any]
    if stage_index == 0:
        module = _First(w0, tp, placements_out, replicated=replicated_first)
        declared = {
            "input_args": torch.zeros(shape),
            "input_grads": (None,),
            "output_args": _declared(shape, tp, placements_out).requires_grad_(),
            "output_grads": _declared(shape, tp, placements_out),
        }
    else:
        # on a mesh listed out of order, torch's Shard(2) @ Replicate() is wrong (module docstring)
        row_sharded = _listed_out_of_order(tp) and in_name == "S2"
        module = _Last(w1, tp, [Shard(0)] if row_sharded else [Replicate()])
        declared = {
            "input_args": _declared(shape, tp, placements_in).requires_grad_(),
            "input_grads": _declared(shape, tp, placements_in),
            "output_args": torch.zeros(shape, requires_grad=True),
            "output_grads": (None,),
        }
    stage = PipelineStage(module, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group(), **declared)
    schedule = Schedule1F1B(stage, _N_MICROBATCHES, loss_fn=_mse)
    if helix_options is not None:
        try:
            schedule = helix_pipeline(schedule, **helix_options)
        except HelixError as exc:  # every rank plans every boundary alike: all refuse
            return [f"{out_name}->{in_name}: refused: {exc}"]
    losses: list[torch.Tensor] = []
    for x, target in batches:
        module.zero_grad(set_to_none=True)
        if stage_index == 0:
            schedule.step(x)
        else:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=target, losses=step_losses)
            losses.extend(loss.detach() for loss in step_losses)
    want_losses, want_grads = _eager(w0, w1, batches)
    case = f"{out_name}->{in_name}"
    problems = []
    grad = module.w.grad
    name = "w0" if stage_index == 0 else "w1"
    if not isinstance(grad, DTensor):
        return [f"{case}: stage {stage_index}'s weight has no DTensor gradient ({type(grad).__name__})"]
    full = grad.full_tensor()
    if not torch.allclose(full, want_grads[name], rtol=1e-4, atol=1e-6):
        problems.append(f"{case}: {name} gradient off by {(full - want_grads[name]).abs().max().item():.3g}")
    if stage_index == 1:
        got = torch.stack(losses) if losses else torch.empty(0)
        if got.shape != (len(want_losses),) or not torch.allclose(got, torch.stack(want_losses), rtol=1e-4):
            problems.append(f"{case}: losses {got.tolist()} != eager {[w.item() for w in want_losses]}")
    return problems


def check_boundary_cases(
    rank: int,
    world_size: int,
    cases: Sequence[tuple[str, str]],
    steps: int = 2,
    torch_only: bool = False,
    mesh_ranks: Sequence[Sequence[int]] | None = None,
    replicated_first: bool = False,
    **helix_options: Any,
) -> list[str]:
    """Run every ``(placements_out, placements_in)`` case (names of :data:`BOUNDARY_PLACEMENTS`)
    through ``helix_pipeline`` (``torch_only``: torch's schedule as is) on the ``(pp, tp)`` mesh
    listing ``mesh_ranks`` (ascending if not given); ``replicated_first``: stage 0 computes and
    hands over its output replicated, declared in ``placements_out`` all the same. Returns what
    differs from eager (empty when all agree)."""
    if world_size != 4:
        raise ValueError(f"check_boundary_cases runs on 4 ranks (pp=2 x tp=2); got {world_size}")
    if mesh_ranks is None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    else:
        mesh = DeviceMesh("cpu", [list(row) for row in mesh_ranks], mesh_dim_names=("pp", "tp"))
    problems = []
    for out_name, in_name in cases:
        torch._dynamo.reset()  # every case compiles the same forwards again, for other layouts
        helix = None if torch_only else helix_options
        problems.extend(_run_case(rank, mesh, out_name, in_name, steps, helix, replicated_first))
        dist.barrier()
    return problems


# ------------------------------------------------------------------- folded (V-schedule) boundary


class _Folded(nn.Module):
    """Stage ``k`` of :func:`check_folded_boundary`: ``tanh(h @ W)`` in ``placements_out`` (the
    last stage: ``(h @ W).full_tensor()``)."""

    def __init__(
        self, w: torch.Tensor, mesh: DeviceMesh, placements_in: Placement, placements_out: Placement | None
    ) -> None:
        super().__init__()
        # no Shard(2) -> Replicate() inside a stage: its backward (Replicate() -> Shard(2)) keeps
        # the chunk at get_coordinate() on a mesh listed out of order (torch 2.13)
        if placements_in == Shard(2):
            placement: Placement = Shard(0)  # the product Partial(), reduced into the output
        else:
            placement = Shard(1) if placements_out == Shard(2) else Replicate()
        self.w = nn.Parameter(distribute_tensor(w, mesh, [placement]))
        self.mesh, self.placements_out = mesh, placements_out

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not isinstance(h, DTensor):
            h = DTensor.from_local(h, self.mesh, [Replicate()], run_check=False)
        z = h @ self.w  # Replicate() @ Shard(1): Shard(2); Shard(2) @ Shard(0): Partial()
        assert isinstance(z, DTensor)
        if self.placements_out is None:
            return z.full_tensor()
        return torch.tanh(z.redistribute(self.mesh, [self.placements_out]))


def _folded_declared(
    shape: tuple[int, ...], mesh: DeviceMesh, placement: Placement | None, requires_grad: bool = False
) -> torch.Tensor:
    """A stage's declared tensor: a DTensor in ``placement``, or a plain tensor (``None``)."""
    declared = torch.zeros(shape) if placement is None else _declared(shape, mesh, [placement])
    return declared.requires_grad_(requires_grad)


def _folded_eager(
    weights: list[torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Losses per micro-batch and the last step's gradients of ``weights``, as torch's schedules
    give them (summed over its micro-batches, scaled by the micro-batch count)."""
    params = [w.clone().requires_grad_() for w in weights]
    losses = []
    for x, target in batches:
        for p in params:
            p.grad = None
        for xs, ts in zip(x.chunk(_N_MICROBATCHES), target.chunk(_N_MICROBATCHES), strict=True):
            h = xs
            for p in params[:-1]:
                h = torch.tanh(h @ p)
            loss = _mse(h @ params[-1], ts)
            (loss / _N_MICROBATCHES).backward()
            losses.append(loss.detach())
    return losses, [p.grad for p in params if p.grad is not None]


def check_folded_boundary(
    rank: int,
    world_size: int,
    cases: Sequence[tuple[str, str]],
    steps: int = 2,
    mesh_ranks: Sequence[Sequence[int]] | None = None,
    **helix_options: Any,
) -> list[str]:
    """Run every ``(out, in)`` case of the folded pipeline (module docstring) through
    ``helix_pipeline`` on the ``(pp, tp)`` mesh listing ``mesh_ranks`` (ascending if not given);
    returns what differs from eager (empty when all agree)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    from dhelix_compile import helix_pipeline

    if world_size != 4:
        raise ValueError(f"check_folded_boundary runs on 4 ranks (pp=2 x tp=2); got {world_size}")
    if mesh_ranks is None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    else:
        mesh = DeviceMesh("cpu", [list(row) for row in mesh_ranks], mesh_dim_names=("pp", "tp"))
    tp, position = mesh["tp"], mesh["pp"].get_local_rank()
    gen = torch.Generator().manual_seed(12)
    weights = [torch.randn(_HIDDEN, _HIDDEN, generator=gen) / 3 for _ in range(4)]
    batch = (_MB * _N_MICROBATCHES, _SEQ, _HIDDEN)
    batches = [(torch.randn(batch, generator=gen), torch.randn(batch, generator=gen)) for _ in range(steps)]
    shape = (_MB, _SEQ, _HIDDEN)
    want_losses, want_grads = _folded_eager(weights, batches)
    problems = []
    for out_name, in_name in cases:
        torch._dynamo.reset()  # every case compiles the same forwards again, for other layouts
        case = f"{out_name}->{in_name}"
        handed = BOUNDARY_PLACEMENTS[out_name]
        # stage k's input and output placements (None: a plain tensor)
        inputs: list[Placement | None] = [None, Shard(2), BOUNDARY_PLACEMENTS[in_name], handed]
        outputs: list[Placement | None] = [Shard(2), handed, handed, None]
        stages: list[Any] = []
        for k in (position, 3 - position):
            module = _Folded(weights[k], tp, inputs[k] or Replicate(), outputs[k])
            stages.append(
                PipelineStage(
                    module,
                    k,
                    4,
                    torch.device("cpu"),
                    group=mesh["pp"].get_group(),
                    input_args=_folded_declared(shape, tp, inputs[k], requires_grad=k > 0),
                    output_args=_folded_declared(shape, tp, outputs[k], requires_grad=True),
                    input_grads=_folded_declared(shape, tp, inputs[k]) if inputs[k] is not None else (None,),
                    output_grads=_folded_declared(shape, tp, outputs[k]) if outputs[k] is not None else (None,),
                )
            )
        schedule = helix_pipeline(ScheduleDualPipeV(stages, _N_MICROBATCHES, loss_fn=_mse), **helix_options)
        losses: list[torch.Tensor] = []
        for x, target in batches:
            for stage in stages:
                stage.submod.zero_grad(set_to_none=True)
            step_losses: list[torch.Tensor] = []
            schedule.step(x, target=target, losses=step_losses)
            losses.extend(loss.detach() for loss in step_losses)
        for stage in stages:
            grad = stage.submod.w.grad
            want = want_grads[stage.stage_index]
            if not isinstance(grad, DTensor):
                problems.append(f"{case}: stage {stage.stage_index}'s weight has no DTensor gradient")
            elif not torch.allclose(full := grad.full_tensor(), want, rtol=1e-4, atol=1e-6):
                off = (full - want).abs().max().item()
                problems.append(f"{case}: stage {stage.stage_index}'s weight gradient off by {off:.3g}")
        if position == 0:  # stage 3 computes the losses
            got = torch.stack(losses) if losses else torch.empty(0)
            if got.shape != (len(want_losses),) or not torch.allclose(got, torch.stack(want_losses), rtol=1e-4):
                problems.append(f"{case}: losses {got.tolist()} != eager {[w.item() for w in want_losses]}")
        dist.barrier()
    return problems
