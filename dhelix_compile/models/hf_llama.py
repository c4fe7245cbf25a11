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

__all__ = [
    "HF_LLAMA_SIZES",
    "HFLlamaChunk",
    "build_hf_llama",
    "hf_llama_batches",
    "hf_llama_chunks",
    "hf_llama_loss",
    "parallelize_hf_llama",
    "tp_layer_plan",
]

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


def build_hf_llama(size: str, seed: int = 0, n_layers: int | None = None) -> torch.nn.Module:
    """``LlamaForCausalLM`` of ``size`` (``HF_LLAMA_SIZES``), random weights from ``seed``, no
    dropout; ``n_layers`` decoder layers instead of the size's."""
    transformers = _transformers()
    fields = {k: v for k, v in HF_LLAMA_SIZES[size].items() if k not in ("seq_len", "batch")}
    if n_layers is not None:
        fields["num_hidden_layers"] = n_layers
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


def tp_layer_plan() -> dict[str, Any]:
    """The TP (Megatron) plan of one decoder layer: q/k/v and gate/up column-wise, o and down row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


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
        for layer in layers:
            parallelize_module(layer, mesh, tp_layer_plan())
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


class HFLlamaChunk(torch.nn.Module):
    """A pipeline stage of a ``LlamaForCausalLM``: the token embedding (first chunk only), decoder
    layers ``layers``, and the final norm and LM head (last chunk only), copied from ``model``.
    Its forward is ``LlamaModel.forward``'s for those pieces: positions ``0 .. seq - 1``, Hugging
    Face's causal mask and rotary embedding; the last chunk returns logits."""

    def __init__(self, model: torch.nn.Module, *, first: bool, last: bool, layers: range) -> None:
        super().__init__()
        import copy

        decoder: Any = model.model  # LlamaForCausalLM's LlamaModel
        self.config = decoder.config
        self.embed_tokens = copy.deepcopy(decoder.embed_tokens) if first else None
        self.layers = torch.nn.ModuleList(copy.deepcopy(decoder.layers[i]) for i in layers)
        self.rotary_emb = copy.deepcopy(decoder.rotary_emb)
        self.norm = copy.deepcopy(decoder.norm) if last else None
        self.lm_head: Any = copy.deepcopy(model.lm_head) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids
        )
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids)
        if self.norm is not None and self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def hf_llama_chunks(model: torch.nn.Module, n: int) -> list[HFLlamaChunk]:
    """``model`` (a ``LlamaForCausalLM``) cut into ``n`` stage chunks of consecutive decoder layers."""
    n_layers = len(model.model.layers)  # type: ignore[union-attr,arg-type]
    if not 1 <= n <= n_layers:
        raise ValueError(f"cannot cut {n_layers} decoder layers into {n} chunks")
    bounds = [round(k * n_layers / n) for k in range(n + 1)]
    return [
        HFLlamaChunk(model, first=k == 0, last=k == n - 1, layers=range(bounds[k], bounds[k + 1])) for k in range(n)
    ]


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
