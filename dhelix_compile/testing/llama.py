"""The reference transformer: :mod:`dhelix_compile.models.llama`'s, re-exported for the tests."""

from __future__ import annotations

from dhelix_compile.models.llama import (
    Attention,
    FeedForward,
    ModelConfig,
    RMSNorm,
    Transformer,
    TransformerBlock,
    apply_rotary,
    causal_attention,
    init_weights_,
    lm_loss,
    rotary_tables,
)

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
