"""Tensor parallelism for the reference ``Transformer`` with PyTorch's own DTensor plans.

Contract
--------
Both functions parallelize ``model`` in place over a 1-D ``DeviceMesh`` (every rank must call
them with an identical model: ``Transformer(config)`` is deterministic) and return it. The
parallel model keeps the reference's interface: ``tokens[B, S]`` (the same on every rank) ->
full ``logits[B, S, V]`` (replicated), and its loss and gradients equal the single-process
model's: a sharded parameter's local gradient is the matching slice of the reference gradient,
a replicated one's is the whole reference gradient.

``parallelize_tp`` — Megatron TP (Shoeybi et al. 2019)::

    tok_embeddings  RowwiseParallel (vocab-sharded)       out: all-reduce      -> Replicate
    wq, wk, wv      ColwiseParallel (heads split)         local heads n_heads / tp
    wo              RowwiseParallel                       out: all-reduce      -> Replicate
    w1, w3          ColwiseParallel
    w2              RowwiseParallel                       out: all-reduce      -> Replicate
    norms           replicated plain parameters (inputs are replicated, so are their grads)
    output          ColwiseParallel (vocab-sharded)       out: all-gather      -> Replicate
    backward: the Replicate -> Partial boundary at each column-parallel input all-reduces dX.

``parallelize_tp_sp`` — TP + sequence parallel (Korthikanti et al. 2022), torchtitan's Llama plan::

    tok_embeddings  RowwiseParallel, out Shard(1)         reduce-scatter (residual [B, S/tp, D])
    *_norm, norm    SequenceParallel (Shard(1) in/out)    norm weights: Replicate DTensors
    attention       PrepareModuleInput Shard(1)->Replicate all-gather (x only; cos/sin untouched)
    wq, wk, wv      ColwiseParallel
    wo              RowwiseParallel, out Shard(1)         reduce-scatter
    feed_forward    PrepareModuleInput Shard(1)->Replicate all-gather
    w1, w3 / w2     ColwiseParallel / RowwiseParallel out Shard(1)  reduce-scatter
    output          ColwiseParallel, in Shard(1), out Replicate     all-gather (S), all-gather (V)

The sharded dims must divide evenly (``ModelConfig.validate(world_size)``), so the local shard of
a ``Shard(d)`` parameter on mesh coordinate r is ``full.chunk(tp, d)[r]``.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from dhelix_compile.models.llama import Transformer

__all__ = ["parallelize_tp", "parallelize_tp_sp", "tp_plan", "tp_sp_plan"]


def _check(model: Transformer, mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        raise ValueError(f"expected a 1-D tensor-parallel mesh, got {mesh.ndim}-D {mesh}")
    model.config.validate(mesh.size())


def tp_plan() -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """``(top-level plan, per-block plan)`` for Megatron TP."""
    top: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }
    return top, block


def tp_sp_plan() -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """``(top-level plan, per-block plan)`` for TP + sequence parallel (torchtitan's Llama)."""
    top: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    block: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return top, block


def _apply(
    model: Transformer,
    mesh: DeviceMesh,
    plans: tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]],
) -> Transformer:
    _check(model, mesh)
    top, block = plans
    parallelize_module(model, mesh, top)
    for layer in model.layers:
        parallelize_module(layer, mesh, block)
    return model


def parallelize_tp(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """Megatron tensor parallelism (all-reduce after row-parallel layers); in place."""
    return _apply(model, mesh, tp_plan())


def parallelize_tp_sp(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """Tensor + sequence parallelism (all-gather / reduce-scatter); in place."""
    return _apply(model, mesh, tp_sp_plan())
