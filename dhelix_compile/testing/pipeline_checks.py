"""Pipeline-parallel checks: the reference transformer cut into stage chunks, torch's schedule run
eagerly against the same schedule through ``helix_pipeline``.

Contract
--------
* ``TransformerChunk(model, first, last, layers)``: the embedding (first chunk only), a run of
  blocks, and the final norm and head (last chunk only) of a :class:`~dhelix_compile.models.llama.Transformer`,
  sharing nothing with it (deep copies). ``chunks(model, n)`` cuts a model into ``n`` such chunks,
  the blocks spread as evenly as possible.
* ``stage_layout(kind, pp)``: the stage indices rank ``r`` holds under a schedule: one stage
  (``Schedule1F1B``), two looped (``ScheduleInterleaved1F1B``: ``r`` and ``r + pp``) or two folded
  (``ScheduleDualPipeV``: ``r`` and ``2 pp - 1 - r``).
* ``check_pipeline(rank, world_size, kind, n_microbatches, model="reference", tp=1, **options)``
  runs on a process group of ``world_size`` ranks, a ``(pp, tp)`` mesh with ``pp = world_size / tp``:
  with ``tp > 1`` every stage chunk is parallelized with PyTorch's TP plan over its row of the mesh
  (``parallelize_stage_tp``: ``models.tensor_parallel.tp_plan``; ``hf_llama.tp_layer_plan`` for
  ``model="hf_llama"``, a Hugging Face ``LlamaForCausalLM`` cut into ``hf_llama.HFLlamaChunk``s)
  and the stages talk over the mesh's pp groups. The same
  seeded model and batch, torch's schedule eager and ``helix_pipeline(schedule, **options)``, two steps each
  (gradients accumulate across steps as torch leaves them), and returns a list of mismatches
  (empty when the losses of the last stage and every parameter gradient agree) and the
  compile counts. With ``dp=2`` (``tp`` 1) the mesh is ``(pp, dp)``: each DP rank its own
  batches, every stage chunk wrapped by ``data_parallel(chunk, mesh["dp"], dp_mode)``, and the
  reference is the plain chunks' eager run with gradients averaged over DP (full tensors
  compared); torch's own schedule over the wrapped chunks is checked too unless
  ``with_torch_schedule=False``.
* ``model="torch_modules"`` (``torch_module_chunks(n)``): stage modules that are torch's own
  classes, whose forwards Dynamo's skipfiles hold: the first an ``nn.Sequential`` of an
  embedding, a flatten (one row per token), a ReLU and a linear layer, the last an ``nn.Sequential`` of a linear layer, a tanh
  and the head, the ones between bare ``nn.Linear``s (one stage: the first and last in one
  ``nn.Sequential``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from dhelix_compile.bench.choices import ScheduleKind
from dhelix_compile.models.llama import ModelConfig, Transformer, lm_loss
from dhelix_compile.testing.helix_checks import full_grads, local_grads

DataParallelMode = Literal["shard", "replicate"]

__all__ = [
    "ScheduleKind",
    "TransformerChunk",
    "build_schedule",
    "check_pipeline",
    "chunks",
    "parallelize_stage_tp",
    "stage_layout",
    "torch_module_chunks",
]


class TransformerChunk(nn.Module):
    """A contiguous piece of the reference transformer (see the module docstring)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, model: Transformer, *, first: bool, last: bool, layers: range) -> None:
        super().__init__()
        self.tok_embeddings = copy.deepcopy(model.tok_embeddings) if first else None
        self.layers = nn.ModuleList(copy.deepcopy(model.layers[i]) for i in layers)
        self.norm = copy.deepcopy(model.norm) if last else None
        self.output = copy.deepcopy(model.output) if last else None
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        seqlen = h.shape[1]
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        for layer in self.layers:
            h = layer(h, cos, sin)
        if self.norm is not None and self.output is not None:
            h = self.output(self.norm(h))
        return h


def chunks(model: Transformer, n: int) -> list[TransformerChunk]:
    """``model`` cut into ``n`` chunks of consecutive blocks (the first also embeds, the last also projects)."""
    n_layers = len(model.layers)
    if not 1 <= n <= n_layers:
        raise ValueError(f"cannot cut {n_layers} blocks into {n} chunks")
    bounds = [round(k * n_layers / n) for k in range(n + 1)]
    return [
        TransformerChunk(model, first=k == 0, last=k == n - 1, layers=range(bounds[k], bounds[k + 1])) for k in range(n)
    ]


def stage_layout(kind: ScheduleKind, pp: int, rank: int) -> list[int]:
    """The stage indices rank ``rank`` holds (see the module docstring)."""
    if kind == "1f1b":
        return [rank]
    if kind == "interleaved_1f1b":
        return [rank, rank + pp]
    return [rank, 2 * pp - 1 - rank]


def build_schedule(kind: ScheduleKind, stages: list[Any], n_microbatches: int, loss_fn: Any) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B

    if kind == "1f1b":
        return Schedule1F1B(stages[0], n_microbatches, loss_fn=loss_fn)
    if kind == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    return ScheduleDualPipeV(stages, n_microbatches, loss_fn=loss_fn)


def parallelize_stage_tp(chunk: nn.Module, mesh: Any) -> None:
    """A stage chunk's blocks parallelized with the model's TP plan (the Hugging Face chunk's
    embedding and head stay replicated, as in ``hf_llama.parallelize_hf_llama``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from dhelix_compile.models.tensor_parallel import tp_plan

    layers: Any = chunk.layers
    if isinstance(chunk, TransformerChunk):
        top, block = tp_plan()
        parallelize_module(
            chunk, mesh, {name: style for name, style in top.items() if getattr(chunk, name) is not None}
        )
    else:
        from dhelix_compile.models.hf_llama import tp_layer_plan

        block = tp_layer_plan()
    for layer in layers:
        parallelize_module(layer, mesh, block)


PipelineModel = Literal["reference", "hf_llama", "torch_modules"]


#: The vocabulary of ``torch_module_chunks``' embedding and head.
TORCH_MODULES_VOCAB = 64


def torch_module_chunks(
    n: int, *, vocab_size: int = TORCH_MODULES_VOCAB, dim: int = 32, seed: int = 0
) -> list[nn.Module]:
    """``n`` stage modules of torch's own classes (see the module docstring), seeded."""
    if n < 1:
        raise ValueError(f"cannot make {n} stage modules")
    pieces: list[nn.Module] = []
    for k in range(n):
        # tokens flattened to one row each: a linear layer's 3-D output is a view, which torch's
        # DualPipeV (its split backward detaches stage outputs in place) refuses
        layers: list[nn.Module] = [nn.Embedding(vocab_size, dim), nn.Flatten(0, 1), nn.ReLU()] if k == 0 else []
        layers.append(nn.Linear(dim, dim))
        if k == n - 1:
            layers += [nn.Tanh(), nn.Linear(dim, vocab_size)]
        pieces.append(nn.Sequential(*layers) if len(layers) > 1 else layers[0])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in nn.ModuleList(pieces).parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return pieces


def _model_chunks(model: PipelineModel, n_layers: int, seq_len: int) -> tuple[Callable[[int], list[nn.Module]], int]:
    """``(make_chunks, vocab_size)``: ``make_chunks(n)`` cuts a fresh seeded model into ``n`` stage chunks."""
    if model == "torch_modules":
        return torch_module_chunks, TORCH_MODULES_VOCAB
    if model == "hf_llama":
        from dhelix_compile.models.hf_llama import HF_LLAMA_SIZES, build_hf_llama, hf_llama_chunks

        if seq_len > HF_LLAMA_SIZES["tiny"]["seq_len"]:
            raise ValueError(f"the Hugging Face chunks take at most {HF_LLAMA_SIZES['tiny']['seq_len']} tokens")

        def hf(n: int) -> list[nn.Module]:
            return list(hf_llama_chunks(build_hf_llama("tiny", n_layers=n_layers), n))

        return hf, HF_LLAMA_SIZES["tiny"]["vocab_size"]
    config = ModelConfig(n_layers=n_layers, max_seq_len=seq_len)

    def reference(n: int) -> list[nn.Module]:
        return list(chunks(Transformer(config), n))

    return reference, config.vocab_size


def _run(
    kind: ScheduleKind,
    rank: int,
    mesh: Any,
    n_microbatches: int,
    make_chunks: Callable[[int], list[nn.Module]],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    helix_options: dict[str, Any] | None,
    dp_mode: DataParallelMode | None,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | None]]:
    """One rank's losses and gradients; with ``dp_mode``, the gradients of the chunks wrapped by
    ``data_parallel`` over ``mesh["dp"]`` (full tensors), else the plain chunks' (local tensors)."""
    from torch.distributed.pipelining import PipelineStage

    pp = mesh["pp"].size() if mesh is not None else dist.get_world_size()
    group = mesh["pp"].get_group() if mesh is not None else None
    layout = stage_layout(kind, pp, mesh["pp"].get_local_rank() if mesh is not None else rank)
    num_stages = pp * len(layout)
    pieces = make_chunks(num_stages)
    modules = {index: pieces[index] for index in layout}
    for module in modules.values():
        if _size(mesh, "tp") > 1:
            parallelize_stage_tp(module, mesh["tp"])
        if dp_mode is not None:
            from dhelix_compile import data_parallel

            data_parallel(module, mesh["dp"], dp_mode)
    stages = [PipelineStage(modules[i], i, num_stages, torch.device("cpu"), group=group) for i in layout]
    schedule = build_schedule(kind, stages, n_microbatches, lm_loss)
    if helix_options is not None:
        from dhelix_compile import helix_pipeline

        schedule = helix_pipeline(schedule, **helix_options)
    holds_first, holds_last = 0 in layout, num_stages - 1 in layout
    losses: list[torch.Tensor] = []
    for tokens, targets in batches:
        step_losses: list[torch.Tensor] = []
        args = (tokens,) if holds_first else ()
        schedule.step(*args, target=targets if holds_last else None, losses=step_losses if holds_last else None)
        losses.extend(loss.detach() for loss in step_losses)
    grads = {
        f"stage{index}.{name}": g
        for index, module in modules.items()
        for name, g in (full_grads(module) if dp_mode is not None else local_grads(module)).items()
    }
    return losses, grads


def _size(mesh: Any, dim: str) -> int:
    return 1 if mesh is None or dim not in (mesh.mesh_dim_names or ()) else int(mesh[dim].size())


def _mesh(world_size: int, tp: int, dp: int) -> Any:
    """``None`` (the default group is the pipeline's) or the ``(pp, dp, tp)`` mesh, dims of size 1 left out."""
    if world_size % (tp * dp):
        raise ValueError(f"world_size {world_size} is not a multiple of dp={dp} x tp={tp}")
    if tp == dp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    dims = [("pp", world_size // (tp * dp)), ("dp", dp), ("tp", tp)]
    kept = [(name, size) for name, size in dims if size > 1 or name == "pp"]
    return init_device_mesh("cpu", tuple(s for _, s in kept), mesh_dim_names=tuple(n for n, _ in kept))


def _dp_average(grads: dict[str, torch.Tensor | None], mesh: Any) -> dict[str, torch.Tensor | None]:
    """Gradients averaged over the DP ranks, as DDP and FSDP2 leave them."""
    if _size(mesh, "dp") == 1:
        return grads
    group, ranks = mesh["dp"].get_group(), mesh["dp"].size()
    for grad in grads.values():
        if grad is not None:
            dist.all_reduce(grad, group=group)
            grad /= ranks
    return grads


def check_pipeline(
    rank: int,
    world_size: int,
    kind: ScheduleKind,
    n_microbatches: int,
    *,
    model: PipelineModel = "reference",
    tp: int = 1,
    dp: int = 1,
    dp_mode: DataParallelMode = "shard",
    with_torch_schedule: bool = True,
    steps: int = 2,
    batch: int = 8,
    seq_len: int = 8,
    n_layers: int = 4,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    **options: Any,
) -> list[str]:
    """Mismatches between torch's schedule eager and through helix_pipeline (module docstring)."""
    if dp > 1 and tp > 1:
        raise ValueError("check_pipeline: dp and tp together need a (pp, dp, tp) mesh of 8 ranks; not checked here")
    mesh = _mesh(world_size, tp, dp)
    make_chunks, vocab_size = _model_chunks(model, n_layers, seq_len)
    gen = torch.Generator().manual_seed(1234 + (mesh["dp"].get_local_rank() if dp > 1 else 0))
    batches = [
        (
            torch.randint(0, vocab_size, (batch, seq_len), generator=gen),
            torch.randint(0, vocab_size, (batch, seq_len), generator=gen),
        )
        for _ in range(steps)
    ]
    want_losses, want_grads = _run(kind, rank, mesh, n_microbatches, make_chunks, batches, None, None)
    want_grads = _dp_average(want_grads, mesh)
    mode = dp_mode if dp > 1 else None
    # with data parallelism, torch's own schedule over the data_parallel chunks is checked too
    # (unless with_torch_schedule=False)
    with_torch = mode is not None and with_torch_schedule
    runs = {"torch's schedule": None, "helix_pipeline": options} if with_torch else {"helix_pipeline": options}
    return [
        f"{run}: {problem}"
        for run, run_options in runs.items()
        for problem in _mismatches(
            rank,
            (want_losses, want_grads),
            _run(kind, rank, mesh, n_microbatches, make_chunks, batches, run_options, mode),
            rtol,
            atol,
        )
    ]


def _mismatches(
    rank: int,
    want: tuple[list[torch.Tensor], dict[str, torch.Tensor | None]],
    got: tuple[list[torch.Tensor], dict[str, torch.Tensor | None]],
    rtol: float,
    atol: float,
) -> list[str]:
    (want_losses, want_grads), (got_losses, got_grads) = want, got
    problems: list[str] = []
    if len(got_losses) != len(want_losses):
        problems.append(f"rank {rank}: {len(got_losses)} losses, eager has {len(want_losses)}")
    for k, (got_loss, want_loss) in enumerate(zip(got_losses, want_losses, strict=False)):
        if not torch.allclose(got_loss, want_loss, rtol=rtol, atol=atol):
            problems.append(f"rank {rank}: loss {k}: {got_loss.item():.6g} vs eager {want_loss.item():.6g}")
    for name, want_grad in want_grads.items():
        got_grad = got_grads[name]
        if got_grad is None or want_grad is None:
            if (got_grad is None) != (want_grad is None):
                problems.append(f"rank {rank}: {name}: grad {'missing' if got_grad is None else 'unexpected'}")
        elif not torch.allclose(got_grad, want_grad, rtol=rtol, atol=atol):
            problems.append(f"rank {rank}: {name}: max |diff| {(got_grad - want_grad).abs().max().item():.3g}")
    return problems


def check_pipelines(
    rank: int, world_size: int, kinds: list[ScheduleKind], n_microbatches: int, **options: Any
) -> dict[str, list[str]]:
    """:func:`check_pipeline` for several schedules in one process group (one spawn)."""
    return {kind: check_pipeline(rank, world_size, kind, n_microbatches, **options) for kind in kinds}


class _DropoutChunk(nn.Module):
    """A stage module that draws random numbers without a dropout module (found at compile)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.proj(x), p=0.5, training=True)


def helix_pipeline_errors(rank: int, world_size: int) -> dict[str, str]:
    """What ``helix_pipeline`` says to bad input, one process group of ``world_size`` = 1 ranks:
    case -> the error's type and message ("no error" when none was raised)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from dhelix_compile import helix_pipeline

    def stage(module: nn.Module) -> Any:
        return PipelineStage(module, 0, 1, torch.device("cpu"))

    def linear() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8))

    def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    compiled = linear()
    compiled.compile()
    dropout = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))
    cases: dict[str, Any] = {
        "gpipe": lambda: helix_pipeline(ScheduleGPipe(stage(linear()), 2, loss_fn=mse)),
        "not a schedule": lambda: helix_pipeline(linear()),
        "compiled stage": lambda: helix_pipeline(Schedule1F1B(stage(compiled), 2, loss_fn=mse)),
        "dropout module": lambda: helix_pipeline(Schedule1F1B(stage(dropout), 2, loss_fn=mse)),
        "profile": lambda: helix_pipeline(Schedule1F1B(stage(linear()), 2, loss_fn=mse), cost_model="profile"),
        "unknown option": lambda: helix_pipeline(Schedule1F1B(stage(linear()), 2, loss_fn=mse), no_such_option=1),
        "batch smaller than the micro-batch count": lambda: helix_pipeline(
            Schedule1F1B(stage(linear()), 4, loss_fn=mse), codegen="eager"
        ).step(torch.randn(3, 8), target=torch.randn(3, 8)),
        "eager 1F1B order on another schedule": lambda: helix_pipeline(
            ScheduleGPipe(stage(linear()), 2, loss_fn=mse), order="eager_1f1b"
        ),
        "unknown order": lambda: helix_pipeline(Schedule1F1B(stage(linear()), 2, loss_fn=mse), order="zigzag"),
        "uneven micro-batches": lambda: helix_pipeline(
            Schedule1F1B(stage(linear()), 2, loss_fn=mse), codegen="eager"
        ).step(torch.randn(5, 8), target=torch.randn(5, 8)),
        "random op": lambda: helix_pipeline(Schedule1F1B(stage(_DropoutChunk()), 2, loss_fn=mse), codegen="eager").step(
            torch.randn(4, 8), target=torch.randn(4, 8)
        ),
    }
    said: dict[str, str] = {}
    for name, run in cases.items():
        try:
            run()
            said[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads what was raised
            said[name] = f"{type(exc).__name__}: {exc}"
    return said
