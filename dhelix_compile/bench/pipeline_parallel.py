"""The pipeline-parallel benchmark workload: torch's schedule as users run it, beside helix_pipeline.

    dhelix bench --model small --pipeline dualpipev --microbatches 8 --rate 1gbit

The reference transformer of ``--model`` is cut into stage chunks (``testing.pipeline_checks.chunks``)
laid out over the ranks as the schedule wants them (``testing.pipeline_checks.stage_layout``: DualPipeV
folds four chunks over two ranks, ``r`` and ``2 pp - 1 - r``); a step is one ``schedule.step``
over ``microbatches`` micro-batches of the model's batch each. Given a ``("pp", "tp")`` device
mesh, the stages talk over its pp groups and every stage chunk is tensor-parallel over its tp row
with the reference transformer's TP plan (``testing.pipeline_checks.parallelize_stage_tp``): PP x TP,
as the emulated bench runs it (``bench.emulated``). Variants:

    pipeline_eager      torch's schedule over the stage modules as written
    pipeline_inductor   the same with every stage module compiled by Inductor (``module.compile()``)
    helix_pipeline      ``dhelix_compile.helix_pipeline(schedule, **options)``: compiled stages,
                        and F of one stage merged with B of another where the schedule pairs them

Every stage is built with static shapes (``input_args``/``output_args``), so torch exchanges no
shape metadata: the same workload runs on the fake process group (``T_compute``: P2P returns at
once), on the emulated process group (a receive writes ones) and on the link. ``transfers`` are the
step's P2P transfers as the layout declares them: per micro-batch, each activation crossing ranks
and its gradient coming back; ``P2PReplay`` sends them one after another (``dhelix bench --rate
auto`` times it to pick the link's rate). Each variant's own ``T_comm`` on the gloo bench is the
sends and receives its step made, recorded at the process group (``bench.worker``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dhelix_compile import _torch_compat as compat
from dhelix_compile.bench.choices import PIPELINE_VARIANTS, SCHEDULE_KINDS, ScheduleKind
from dhelix_compile.models.llama import Transformer, lm_loss
from dhelix_compile.testing.pipeline_checks import build_schedule, chunks, parallelize_stage_tp, stage_layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclasses.dataclass
class PipelineWorkload:
    """One rank's part of a pipeline benchmark: ``step_function(variant, options)`` builds the
    stages afresh and returns a step; ``transfers`` are the P2P transfers of one step."""

    kind: ScheduleKind
    step_function: Callable[[str, Mapping[str, Any]], PipelineStep]
    transfers: list[Transfer]
    config: dict[str, str]
    batch: int
    seq_len: int


@dataclasses.dataclass(frozen=True)
class PipelineStep:
    """One training step of a variant (called), and the stage modules it trains on this rank."""

    run: Callable[[], None]
    modules: list[torch.nn.Module]

    def __call__(self) -> None:
        self.run()

    def gradient_sum(self) -> float:
        return sum(float(p.grad.sum()) for m in self.modules for p in m.parameters() if p.grad is not None)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One tensor of ``shape`` sent from rank ``src`` to rank ``dst``."""

    src: int
    dst: int
    shape: tuple[int, ...]


def build_pipeline(
    kind: str,
    size: str,
    rank: int,
    world_size: int,
    microbatches: int,
    gen: torch.Generator,
    mesh: DeviceMesh | None = None,
) -> PipelineWorkload:
    """The reference transformer ``size`` (``choices.MODEL_SIZES``) as a ``kind`` pipeline over
    ``world_size`` ranks (one stage group), ``microbatches`` micro-batches of its batch per step.

    ``mesh``: a ``("pp", "tp")`` device mesh; the stages then talk over its pp group and each
    stage chunk is tensor-parallel over its tp group, and ``rank`` and ``world_size`` are this
    rank's place in the pp dimension and its size (the ranks of ``transfers`` are pp ranks)."""
    from dhelix_compile.bench.workloads import model_config

    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; choose from {', '.join(SCHEDULE_KINDS)}")
    schedule_kind: ScheduleKind = kind  # type: ignore[assignment]  # checked above
    config, seq, batch = model_config(size)
    layout = stage_layout(schedule_kind, world_size, rank)
    num_stages = world_size * len(layout)
    if config.n_layers < num_stages:
        config = dataclasses.replace(config, n_layers=num_stages)
    tokens = torch.randint(0, config.vocab_size, (batch * microbatches, seq), generator=gen)
    targets = torch.randint(0, config.vocab_size, (batch * microbatches, seq), generator=gen)
    hidden = (batch, seq, config.dim)

    def example(stage: int, output: bool) -> torch.Tensor:
        """A stage's input or output of one micro-batch; requiring grad where a gradient flows back
        (torch derives the gradients' shapes from these, and none where grad is not required)."""
        if not output and stage == 0:
            return torch.zeros(batch, seq, dtype=torch.long)
        if output and stage == num_stages - 1:
            return torch.empty(batch, seq, config.vocab_size, requires_grad=True)
        return torch.empty(hidden, requires_grad=True)

    def step_function(variant: str, options: Mapping[str, Any]) -> PipelineStep:
        from torch.distributed.pipelining import PipelineStage

        if variant not in PIPELINE_VARIANTS:
            raise ValueError(f"unknown pipeline variant {variant!r}; choose from {', '.join(PIPELINE_VARIANTS)}")
        torch.manual_seed(0)
        pieces = chunks(Transformer(config), num_stages)
        modules: list[torch.nn.Module] = [pieces[i] for i in layout]
        if mesh is not None:
            for module in modules:
                parallelize_stage_tp(module, mesh["tp"])
        if variant == "pipeline_inductor":
            for module in modules:
                module.compile(backend="inductor", fullgraph=True, dynamic=False)
        stages = [
            PipelineStage(
                module,
                i,
                num_stages,
                torch.device("cpu"),
                group=None if mesh is None else mesh["pp"].get_group(),
                input_args=example(i, False),
                output_args=example(i, True),
            )
            for module, i in zip(modules, layout, strict=True)
        ]
        compat.trust_static_stage_shapes(stages)  # every stage's shapes are given, on every rank
        schedule = build_schedule(schedule_kind, stages, microbatches, lm_loss)
        if variant == "helix_pipeline":
            from dhelix_compile import helix_pipeline

            schedule = helix_pipeline(schedule, **options)
        args = (tokens,) if 0 in layout else ()
        target = targets if num_stages - 1 in layout else None

        # Inductor's stages under a schedule that splits backwards (DualPipeV: I, then W with the
        # graph retained) compile without donated buffers, as torch's error message advises
        compiling = compat.without_donated_buffers if variant == "pipeline_inductor" else contextlib.nullcontext

        def step() -> None:
            for module in modules:
                module.zero_grad(set_to_none=True)
            with compiling():
                schedule.step(*args, target=target)

        return PipelineStep(step, modules)

    owner = {stage: r for r in range(world_size) for stage in stage_layout(schedule_kind, world_size, r)}
    per_microbatch = [
        transfer
        for stage in range(num_stages - 1)
        if owner[stage] != owner[stage + 1]
        for transfer in (
            Transfer(owner[stage], owner[stage + 1], hidden),
            Transfer(owner[stage + 1], owner[stage], hidden),
        )
    ]
    described = {k: str(v) for k, v in dataclasses.asdict(config).items()}
    described.update(schedule=kind, stages=str(num_stages))
    return PipelineWorkload(schedule_kind, step_function, per_microbatch * microbatches, described, batch, seq)


class P2PReplay:
    """``transfers`` on the live process group, each issued and waited for before the next
    (called: ``T_comm``); ``issue(i)`` and ``wait(handles)`` split one, as ``CollectiveReplay``'s."""

    def __init__(self, transfers: list[Transfer], rank: int) -> None:
        self.rank = rank
        self.transfers = [t for t in transfers if rank in (t.src, t.dst)]
        self.buffers = [torch.zeros(t.shape) for t in self.transfers]

    def __len__(self) -> int:
        return len(self.transfers)

    def issue(self, i: int) -> list[Any]:
        transfer, buffer = self.transfers[i], self.buffers[i]
        if transfer.src == self.rank:
            return [dist.isend(buffer, transfer.dst)]
        return [dist.irecv(buffer, transfer.src)]

    @staticmethod
    def wait(handles: list[Any]) -> None:
        for work in handles:
            work.wait()

    def __call__(self) -> None:
        for i in range(len(self)):
            self.wait(self.issue(i))


def run_pipeline_variants(
    rank: int,
    world_size: int,
    kind: str,
    size: str,
    microbatches: int,
    variants: list[str],
    steps: int = 2,
    options: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Each variant's step ``steps`` times, then the P2P replay, on a live process group (the
    workload's check, run by ``testing.multirank``); returns the sum of this rank's gradients,
    per variant (variants of one seed compute the same gradients). ``options``: helix_pipeline's."""
    pipeline = build_pipeline(kind, size, rank, world_size, microbatches, torch.Generator().manual_seed(0))
    sums = {}
    for variant in variants:
        step = pipeline.step_function(variant, options or {})
        for _ in range(steps):
            step()
        sums[variant] = step.gradient_sum()
    P2PReplay(pipeline.transfers, rank)()
    return sums
