"""The models a benchmark runs, by name: what to build, how to feed it, what its loss is.

    reference transformer  ``tiny`` ... ``large``: the Llama-style reference model
                           (``models.llama``), TP+SP or TP (``--parallel``), as written
                           (``"none"``: the data-parallel benchmark), or TP+SP written with
                           functional collectives (``"functional_sp"``,
                           ``testing.sequence_parallel``: no DTensor, so its blocks can be
                           checkpointed under ``torch.compile``; the memory benchmark's
                           ``--checkpoint``)
    MLP block              ``mlp_*``: one TP+SP SwiGLU MLP (all-gather -> w1, w3 -> w2 ->
                           reduce-scatter), its input sequence-sharded and requiring grad, so
                           the backward has the mirror pair
    MoE layer              ``moe_*``: one expert-parallel MoE layer (``testing.moe``: router,
                           all-to-all dispatch, each rank's experts as bmm, all-to-all combine)
    Hugging Face Llama     ``hf_llama_*``: ``transformers.LlamaForCausalLM`` built from a
                           config (random weights, nothing downloaded; the ``hf`` extra) with
                           PyTorch's ``parallelize_module`` TP plan, or TP + sequence
                           parallelism (``--parallel``; ``models.hf_llama``)

Every workload is built from one seed on every rank; each rank gets its own micro-batches. The
names and sizes are ``bench.choices``' tables (``MODEL_SIZES``, ``MLP_SIZES``, ``MOE_SIZES``,
``HF_LLAMA_SIZES``; ``MODEL_NAMES`` all of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from dhelix_compile.bench.choices import (
    HF_LLAMA_SIZES,
    MLP_SIZES,
    MODEL_KV_HEADS,
    MODEL_NAMES,
    MODEL_SIZES,
    MOE_SIZES,
    UNPARALLELIZED_MODELS,
)
from dhelix_compile.models.llama import FeedForward, ModelConfig, Transformer, lm_loss
from dhelix_compile.models.tensor_parallel import parallelize_tp, parallelize_tp_sp

Microbatch = Any
LossFn = Callable[[torch.nn.Module, Microbatch], torch.Tensor]


@dataclasses.dataclass
class Workload:
    """One benchmark model: ``make()`` builds it (same weights on every call and rank),
    ``loss_fn(model, mb)`` is one micro-batch's loss, ``microbatches`` this rank's data."""

    make: Callable[[], torch.nn.Module]
    loss_fn: LossFn
    microbatches: list[Microbatch]
    config: dict[str, str]
    batch: int
    seq_len: int


def build_workload(
    name: str, parallel: str, mesh: Any, world_size: int, microbatches: int, gen: torch.Generator
) -> Workload:
    """The workload ``name`` (``MODEL_NAMES``) on ``mesh``, with ``microbatches`` micro-batches.

    ``parallel``: ``"tp_sp"``, ``"tp"``, ``"none"`` (the model as written, for data parallelism:
    the reference transformer and Hugging Face Llama only, ``UNPARALLELIZED_MODELS``), or
    ``"functional_sp"`` (the reference transformer's TP+SP with functional collectives)."""
    if parallel == "none" and name not in UNPARALLELIZED_MODELS:
        raise ValueError(
            f"benchmark model {name!r} is tensor-parallel by construction; choose from {UNPARALLELIZED_MODELS}"
        )
    if parallel == "functional_sp" and name not in MODEL_SIZES:
        raise ValueError(f"functional_sp is the reference transformer's; choose --model from {', '.join(MODEL_SIZES)}")
    if name in MLP_SIZES:
        return _mlp(name, mesh, world_size, microbatches, gen)
    if name in MOE_SIZES:
        return _moe(name, world_size, microbatches, gen)
    if name in HF_LLAMA_SIZES:
        return _hf_llama(name, parallel, mesh, microbatches, gen)
    if name in MODEL_SIZES and parallel == "functional_sp":
        return _functional_sp(name, world_size, microbatches, gen)
    if name in MODEL_SIZES:
        return _transformer(name, parallel, mesh, world_size, microbatches, gen)
    raise ValueError(f"unknown benchmark model {name!r}; choose from {', '.join(MODEL_NAMES)}")


def _as_strings(config: Any) -> dict[str, str]:
    return {k: str(v) for k, v in dataclasses.asdict(config).items()}


def _regression_loss(model: torch.nn.Module, mb: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean squared error against the micro-batch's random target: a loss that training lowers."""
    return (model(mb[0]) - mb[1]).square().mean()


def model_config(size: str) -> tuple[ModelConfig, int, int]:
    """The reference transformer of ``size`` (``MODEL_SIZES``), its sequence length and batch."""
    dim, heads, layers, ffn, vocab, seq, batch = MODEL_SIZES[size]
    config = ModelConfig(
        dim=dim,
        n_heads=heads,
        n_layers=layers,
        ffn_hidden=ffn,
        vocab_size=vocab,
        max_seq_len=seq,
        n_kv_heads=MODEL_KV_HEADS.get(size),
    )
    return config, seq, batch


def _transformer(
    name: str, parallel: str, mesh: Any, world_size: int, microbatches: int, gen: torch.Generator
) -> Workload:
    config, seq, batch = model_config(name)
    config.validate(world_size)
    vocab = config.vocab_size
    parallelize = {"tp_sp": parallelize_tp_sp, "tp": parallelize_tp, "none": lambda model, _: model}[parallel]

    def make() -> torch.nn.Module:
        return parallelize(Transformer(config), mesh)

    def loss_fn(model: torch.nn.Module, mb: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return lm_loss(model(mb[0]), mb[1])

    data = _token_batches(vocab, batch, seq, microbatches, gen)
    return Workload(make, loss_fn, data, _as_strings(config), batch, seq)


def _token_batches(vocab: int, batch: int, seq: int, microbatches: int, gen: torch.Generator) -> list[Microbatch]:
    """``microbatches`` pairs of token ids and targets, each ``[batch, seq]``."""
    return [tuple(torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(2)) for _ in range(microbatches)]


def _functional_sp(name: str, world_size: int, microbatches: int, gen: torch.Generator) -> Workload:
    from dhelix_compile.testing.sequence_parallel import FunctionalSPTransformer, shard_sequence

    config, seq, batch = model_config(name)
    config.validate(world_size)
    rank = torch.distributed.get_rank()

    def make() -> torch.nn.Module:
        return FunctionalSPTransformer.from_reference(Transformer(config))

    def loss_fn(model: torch.nn.Module, mb: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return lm_loss(model(mb[0]), mb[1], normalizer=batch * seq)  # the ranks' losses sum to the mean

    full = _token_batches(config.vocab_size, batch, seq, microbatches, gen)
    data = [tuple(shard_sequence(t, rank, world_size) for t in mb) for mb in full]
    return Workload(make, loss_fn, data, _as_strings(config), batch, seq)


class MLPBlock(torch.nn.Module):
    """One SwiGLU MLP of the reference model, parallelized as in the TP+SP plan."""

    def __init__(self, dim: int, ffn_hidden: int) -> None:
        super().__init__()
        self.feed_forward = FeedForward(ModelConfig(dim=dim, ffn_hidden=ffn_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(x)


def parallelize_mlp(block: MLPBlock, mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return parallelize_module(block, mesh, plan)


def _mlp(name: str, mesh: Any, world_size: int, microbatches: int, gen: torch.Generator) -> Workload:
    dim, ffn, seq, batch = MLP_SIZES[name]

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return parallelize_mlp(MLPBlock(dim, ffn), mesh)

    # this rank's sequence shard (requiring grad, so the backward has the mirror pair) and a target
    data = [
        (
            torch.randn(batch, seq // world_size, dim, generator=gen).requires_grad_(),
            torch.randn(batch, seq // world_size, dim, generator=gen),
        )
        for _ in range(microbatches)
    ]
    return Workload(make, _regression_loss, data, _as_strings(ModelConfig(dim=dim, ffn_hidden=ffn)), batch, seq)


def _moe(name: str, world_size: int, microbatches: int, gen: torch.Generator) -> Workload:
    from dhelix_compile.testing.moe import ExpertParallelMoE, MoEConfig, ReferenceMoE

    dim, ffn, n_experts, top_k, seq = MOE_SIZES[name]
    config = MoEConfig(dim=dim, ffn_hidden=ffn, n_experts=n_experts, top_k=top_k)
    config.validate(world_size)

    def make() -> torch.nn.Module:
        return ExpertParallelMoE.from_reference(ReferenceMoE(config))

    # this rank's dispatch group of tokens and a target
    data = [(torch.randn(seq, dim, generator=gen), torch.randn(seq, dim, generator=gen)) for _ in range(microbatches)]
    return Workload(make, _regression_loss, data, _as_strings(config), 1, seq)


def _hf_llama(name: str, parallel: str, mesh: Any, microbatches: int, gen: torch.Generator) -> Workload:
    from dhelix_compile.models import hf_llama

    size = HF_LLAMA_SIZES[name]

    def make() -> torch.nn.Module:
        model = hf_llama.build_hf_llama(size)
        if parallel == "none":
            return model
        return hf_llama.parallelize_hf_llama(model, mesh, sequence_parallel=parallel == "tp_sp")

    data = hf_llama.hf_llama_batches(size, microbatches, gen)
    config = hf_llama.HF_LLAMA_SIZES[size]
    return Workload(
        make,
        hf_llama.hf_llama_loss,
        data,
        {k: str(v) for k, v in config.items()},
        int(data[0]["input_ids"].shape[0]),
        int(data[0]["input_ids"].shape[1]),
    )
