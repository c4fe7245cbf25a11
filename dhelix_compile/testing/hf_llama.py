"""The Hugging Face Llama builder and its plans: :mod:`dhelix_compile.models.hf_llama`'s, re-exported for the tests."""

from __future__ import annotations

from dhelix_compile.models.hf_llama import (
    HF_LLAMA_SIZES,
    HFLlamaChunk,
    build_hf_llama,
    hf_llama_batches,
    hf_llama_chunks,
    hf_llama_loss,
    parallelize_hf_llama,
    tp_layer_plan,
)

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
