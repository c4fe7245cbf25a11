"""A Hugging Face ``LlamaForCausalLM`` built from a config, parallelized the way a user would.

Nothing is downloaded: the weights are random, seeded, the same on every rank. ``transformers``
is the optional extra ``hf`` (``pip install -e '.[hf]'``); importing this module does not need it,
building a model does.

``parallelize_hf_llama(model, mesh, sequence_parallel=...)`` applies PyTorch's own
``parallelize_module`` plan:

* TP (Megatron): q/k/v and gate/up column-wise, o and down row-wise: per layer two
  all-reduces in the forward. Embedding, norms and the LM head stay replicated.
* TP + SP (torchtitan's Llama plan, written for Hugging Face's module names): the embedding
  row-wise into a sequence-sharded output, norms ``SequenceParallel``, attention and MLP inputs
  all-gathered along the sequence (``PrepareModuleInput``; attention takes ``hidden_states`` as a
  keyword), o and down row-wise into sequence shards (reduce-scatters), the LM head column-wise
  from sequence shards to replicated logits. Activations between the blocks stay DTensors, so
  Hugging Face sees the global sequence length when it builds the causal mask and positions.
"""

from __future__ import annotations

from typing import Any

import torch

#: Config sizes by name (``transformers.LlamaConfig`` fields) plus ``batch`` and ``seq_len``.
HF_LLAMA_SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 128,
        "seq_len": 32,
        "batch": 2,
    },
    "bench": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 2048,
        "seq_len": 256,
        "batch": 2,
    },
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "the Hugging Face workloads need transformers: pip install 'dhelix[hf]' (or pip install -e '.[hf]')"
        ) from exc
    return transformers


def build_hf_llama(size: str, seed: int = 0) -> torch.nn.Module:
    """``LlamaForCausalLM`` of ``size`` (``HF_LLAMA_SIZES``), random weights from ``seed``, no dropout."""
    transformers = _transformers()
    fields = {k: v for k, v in HF_LLAMA_SIZES[size].items() if k not in ("seq_len", "batch")}
    config = transformers.LlamaConfig(
        **fields,
        max_position_embeddings=HF_LLAMA_SIZES[size]["seq_len"],
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


def parallelize_hf_llama(model: torch.nn.Module, mesh: Any, *, sequence_parallel: bool) -> torch.nn.Module:
    """``model`` parallelized over ``mesh`` in place (see the module docstring); returns it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    layers: Any = model.model.layers  # type: ignore[union-attr]  # LlamaForCausalLM's decoder stack
    if not sequence_parallel:
        layer_plan: dict[str, Any] = {
            **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in layers:
            parallelize_module(layer, mesh, layer_plan)
        return model
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    layer_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for layer in layers:
        parallelize_module(layer, mesh, layer_plan)
    return model


def hf_llama_batches(size: str, n: int, generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """``n`` micro-batches ``{"input_ids", "labels"}`` of random tokens for ``size``."""
    spec = HF_LLAMA_SIZES[size]
    shape = (spec["batch"], spec["seq_len"])
    return [
        {
            "input_ids": torch.randint(0, spec["vocab_size"], shape, generator=generator),
            "labels": torch.randint(0, spec["vocab_size"], shape, generator=generator),
        }
        for _ in range(n)
    ]


def hf_llama_loss(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal-LM loss Hugging Face computes from ``labels`` (shifted inside the model)."""
    return model(**mb).loss
