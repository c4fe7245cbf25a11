"""A small Llama-style transformer: the single-process reference for the parallel models.

Contract
--------
* ``Transformer(config)`` is deterministic: its weights depend only on ``config.seed`` (a private
  ``torch.Generator``, so the global RNG is neither used nor disturbed), and it is built in
  float32 and then cast to ``config.dtype``.
* ``Transformer.forward(tokens[B, S]) -> logits[B, S, vocab]``; ``lm_loss`` is the usual
  next-token cross entropy (the caller shifts targets; tests just draw random targets).
* Module names follow torchtitan's Llama (``tok_embeddings``, ``layers.<i>.attention.wq`` ...,
  ``feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``, ``norm``, ``output``) so that
  torchtitan-style tensor-parallel plans apply unchanged (see ``tensor_parallel.py``).
* Attention never hard-codes the number of heads: it infers them from the projection's output
  width (``view(B, S, -1, head_dim)``), so the same module runs on a column shard holding
  ``n_heads / world_size`` heads.

Block (pre-norm)::

    h   = x + wo(attn(rope(wq(n1(x))), rope(wk(n1(x))), wv(n1(x))))      n1 = attention_norm
    out = h + w2(silu(w1(n2(h))) * w3(n2(h)))                            n2 = ffn_norm
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Attention",
    "FeedForward",
    "ModelConfig",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_rotary",
    "causal_attention",
    "init_weights_",
    "lm_loss",
    "rotary_tables",
]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of the reference transformer; defaults are test-sized."""

    dim: int = 32
    """Model (residual stream) width."""
    n_heads: int = 4
    """Attention heads; ``dim`` must be divisible by it, and it by the tensor-parallel degree."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: one per query head."""
    ffn_hidden: int = 64
    """SwiGLU hidden width (columns of w1/w3, rows of w2)."""
    vocab_size: int = 64
    """Embedding rows and output-head columns."""
    max_seq_len: int = 16
    """Longest sequence; the rotary tables are built for this many positions."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    dtype: torch.dtype = torch.float32
    """Parameter dtype (weights are drawn in float32, then cast)."""
    seed: int = 0
    """Seed of the weight initialisation."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def validate(self, world_size: int = 1) -> None:
        """Raise ``ValueError`` if the shapes cannot be split evenly over ``world_size`` ranks."""
        problems: list[str] = []
        if self.dim % self.n_heads:
            problems.append(f"dim={self.dim} not divisible by n_heads={self.n_heads}")
        elif self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.kv_heads:
            problems.append(f"n_heads={self.n_heads} not divisible by n_kv_heads={self.kv_heads}")
        for field in ("n_heads", "kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            value = getattr(self, field)
            if value % world_size:
                problems.append(f"{field}={value} not divisible by world_size={world_size}")
        if problems:
            raise ValueError("ModelConfig: " + "; ".join(problems))


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight``, computed in float32.

    Written with elementwise ops and a last-dim mean (not ``F.rms_norm``) so that DTensor's
    ``SequenceParallel`` (input sharded on the sequence dim) needs no special sharding rule.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[max_seq_len, head_dim // 2]`` float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[B, S, H, head_dim]`` (half-split pairing); ``cos``/``sin`` are ``[S, hd/2]``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


def causal_attention(
    xq: torch.Tensor,
    xk: torch.Tensor,
    xv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Rotary + causal SDPA on ``[B, S, H, hd]`` projections; returns ``[B, S, H * hd]``.

    ``H`` is whatever the projections hold (all heads, or one rank's share of them).
    """
    bsz, seqlen, n_heads, head_dim = xq.shape
    q = apply_rotary(xq, cos, sin).transpose(1, 2)
    k = apply_rotary(xk, cos, sin).transpose(1, 2)
    v = xv.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(bsz, seqlen, n_heads * head_dim)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings, grouped-query when ``n_kv_heads`` is set
    (no KV cache)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.queries_per_kv = config.n_heads // config.kv_heads
        kv_dim = config.kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1: the local head count, n_heads on one process, n_heads / tp on a column shard.
        xq = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if self.queries_per_kv > 1:  # each key/value head serves queries_per_kv query heads
            xk = xk.repeat_interleave(self.queries_per_kv, dim=2)
            xv = xv.repeat_interleave(self.queries_per_kv, dim=2)
        return self.wo(causal_attention(xq, xk, xv, cos, sin))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm attention + SwiGLU block with residual connections."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token embedding, ``n_layers`` blocks, final RMSNorm, untied output head -> logits."""

    rope_cos: torch.Tensor  # buffers (register_buffer)
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        with torch.random.fork_rng(devices=[]):  # default inits must not touch the global RNG
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_weights_(self, config.seed)
        self.to(config.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


@torch.no_grad()
def init_weights_(module: nn.Module, seed: int) -> None:
    """Deterministic init in ``named_parameters`` order from a private generator.

    Linear/expert weights ~ N(0, 1/fan_in) (fan_in: the last dim of an ``[out, in]`` Linear
    weight, the middle dim of stacked ``[E, in, out]`` expert weights), embeddings ~ N(0, 1),
    norm weights ~ 1 + N(0, 0.1^2) (not all ones, so a wrongly reduced norm-weight gradient
    cannot hide behind symmetry).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        draw = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * draw
        elif name.endswith("tok_embeddings.weight"):
            value = draw
        else:
            fan_in = param.shape[-1] if param.dim() == 2 else param.shape[-2]
            value = draw / math.sqrt(fan_in)
        param.copy_(value)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, normalizer: int | None = None) -> torch.Tensor:
    """Cross entropy of ``logits[..., V]`` against ``targets[...]`` in float32.

    ``normalizer=None``: mean over the tokens given. ``normalizer=n``: sum / n, for a rank that
    holds a shard of the tokens (the ranks' losses then sum to the full-sequence mean).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_targets = targets.reshape(-1)
    if normalizer is None:
        return F.cross_entropy(flat_logits, flat_targets)
    return F.cross_entropy(flat_logits, flat_targets, reduction="sum") / normalizer
