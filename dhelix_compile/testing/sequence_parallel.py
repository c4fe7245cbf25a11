"""The reference transformer, Megatron-SP style, written by hand with functional collectives.

Contract
--------
``FunctionalSPTransformer.from_reference(ref, group)`` builds, on each rank of ``group`` (size
tp), a model whose parameters are plain ``nn.Parameter`` shards of ``ref``'s, with the same
names (so ``sharding.assert_matches_reference`` compares them directly):

* column-parallel ``wq, wk, wv, w1, w3``: ``weight.chunk(tp, 0)[rank]`` (heads split: rank r
  holds heads ``[r * H/tp, (r + 1) * H/tp)``), row-parallel ``wo, w2``: ``chunk(tp, 1)[rank]``;
* replicated: ``tok_embeddings``, every RMSNorm weight, ``output``.

``forward(tokens_local[B, S/tp]) -> logits_local[B, S/tp, V]``: rank r gets and returns the r-th
contiguous chunk of the sequence (``shard_sequence``). Inside, the residual stream is
sequence-first ``[S/tp, B, D]`` as in Megatron, so every collective acts on dim 0::

    x[S/tp,B,D] -> norm -> all_gather(dim 0) -> [S,B,D] -> wq/wk/wv (local heads) -> attention
                -> wo (partial sums) -> reduce_scatter(dim 0, sum) -> [S/tp,B,D] -> + x
    h           -> norm -> all_gather -> w1, w3 -> silu(.)*(.) -> w2 -> reduce_scatter -> + h

The collectives are ``torch.distributed._functional_collectives.all_gather_single`` and
``reduce_scatter_single`` (the non-deprecated names of ``all_gather_tensor(_autograd)`` and
``reduce_scatter_tensor(_autograd)`` in torch 2.13); their ops carry autograd formulas
(all-gather <-> reduce-scatter), so the model is differentiable and dynamo captures them as
``_c10d_functional`` ops + ``wait_tensor``.

Gradient convention: each rank's loss covers its sequence shard (``lm_loss(..., normalizer=B*S)``)
and the ranks' losses sum to the reference loss. Sharded weights then get their exact gradient
slices; replicated parameters get partial gradients, summed by
``sync_replicated_grads(model, model.replicated_parameter_names())``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from dhelix_compile.models.llama import (
    ModelConfig,
    RMSNorm,
    Transformer,
    causal_attention,
    rotary_tables,
)
from dhelix_compile.testing.sharding import copy_shards_from

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "FunctionalSPAttention",
    "FunctionalSPBlock",
    "FunctionalSPFeedForward",
    "FunctionalSPTransformer",
    "shard_sequence",
]

_COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3")
_ROW_PARALLEL = ("wo", "w2")


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """The ``rank``-th contiguous chunk of ``x`` along the sequence dim (even split required)."""
    if x.shape[dim] % world_size:
        raise ValueError(f"sequence length {x.shape[dim]} not divisible by {world_size}")
    return x.chunk(world_size, dim)[rank].contiguous()


def _group_name(group: dist.ProcessGroup | None) -> GroupName:
    pg = group or dist.group.WORLD
    assert pg is not None, "torch.distributed is initialized"
    return pg.group_name


class FunctionalSPAttention(nn.Module):
    """Attention on one rank's heads: all-gather in, reduce-scatter out."""

    def __init__(self, config: ModelConfig, tp: int, group_name: GroupName) -> None:
        super().__init__()
        local_width = config.dim // tp
        self.head_dim = config.head_dim
        self.group_name = group_name
        self.wq = nn.Linear(config.dim, local_width, bias=False)
        self.wk = nn.Linear(config.dim, local_width, bias=False)
        self.wv = nn.Linear(config.dim, local_width, bias=False)
        self.wo = nn.Linear(local_width, config.dim, bias=False)

    def forward(self, x_local: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = funcol.all_gather_single(x_local, 0, self.group_name)  # [S, B, D]
        seqlen, bsz, _ = x.shape
        # [S, B, D] -> [S, B, H_local, hd] -> [B, S, H_local, hd]
        xq = self.wq(x).view(seqlen, bsz, -1, self.head_dim).transpose(0, 1)
        xk = self.wk(x).view(seqlen, bsz, -1, self.head_dim).transpose(0, 1)
        xv = self.wv(x).view(seqlen, bsz, -1, self.head_dim).transpose(0, 1)
        attn = causal_attention(xq, xk, xv, cos, sin).transpose(0, 1)  # [S, B, H_local * hd]
        partial = self.wo(attn)  # [S, B, D], this rank's heads' share of the sum
        return funcol.reduce_scatter_single(partial, "sum", 0, self.group_name)


class FunctionalSPFeedForward(nn.Module):
    """SwiGLU on one rank's hidden columns: all-gather in, reduce-scatter out."""

    def __init__(self, config: ModelConfig, tp: int, group_name: GroupName) -> None:
        super().__init__()
        local_hidden = config.ffn_hidden // tp
        self.group_name = group_name
        self.w1 = nn.Linear(config.dim, local_hidden, bias=False)
        self.w2 = nn.Linear(local_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, local_hidden, bias=False)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        x = funcol.all_gather_single(x_local, 0, self.group_name)
        partial = self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))
        return funcol.reduce_scatter_single(partial, "sum", 0, self.group_name)


class FunctionalSPBlock(nn.Module):
    """Pre-norm block on a sequence shard ``[S/tp, B, D]``; norms are local (replicated weights)."""

    def __init__(self, config: ModelConfig, tp: int, group_name: GroupName) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = FunctionalSPAttention(config, tp, group_name)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FunctionalSPFeedForward(config, tp, group_name)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class FunctionalSPTransformer(nn.Module):
    """Sequence-sharded tokens in, sequence-sharded logits out; see the module docstring."""

    rope_cos: torch.Tensor  # buffers (register_buffer)
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.tp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        config.validate(self.tp)
        self.config = config
        name = _group_name(group)
        with torch.random.fork_rng(devices=[]):  # weights come from from_reference
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(FunctionalSPBlock(config, self.tp, name) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.to(config.dtype)

    @classmethod
    @torch.no_grad()
    def from_reference(cls, reference: Transformer, group: dist.ProcessGroup | None = None) -> FunctionalSPTransformer:
        """This rank's shards of ``reference``'s weights (``reference`` is left untouched)."""
        model = cls(reference.config, group)
        copy_shards_from(model, reference, model.rank, model.tp)
        return model

    def shard_dims(self) -> dict[str, int | None]:
        """``{parameter name: dim it is split on, or None if replicated}``."""
        dims: dict[str, int | None] = {}
        for name, _ in self.named_parameters():
            module_name = name.rsplit(".", 2)[-2]
            if module_name in _COLUMN_PARALLEL:
                dims[name] = 0
            elif module_name in _ROW_PARALLEL:
                dims[name] = 1
            else:
                dims[name] = None
        return dims

    def replicated_parameter_names(self) -> list[str]:
        """Parameters whose gradients are partial per rank (sum them over the group)."""
        return [name for name, dim in self.shard_dims().items() if dim is None]

    def forward(self, tokens_local: torch.Tensor) -> torch.Tensor:
        seqlen = tokens_local.shape[1] * self.tp
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens_local).transpose(0, 1).contiguous()  # [S/tp, B, D]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).transpose(0, 1)  # [B, S/tp, V]
