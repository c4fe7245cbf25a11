"""What ``dhelix bench`` and ``dhelix demo`` can be asked to run, by name: the variants, the pipeline
schedules, the data-parallel modes, and the models with their sizes.

Plain data, no torch: the command line builds its parsers from these (``dhelix bench --help``
lists them) without loading torch. The modules that build and run each thing take its names
from here: ``variants`` and ``steps`` (step variants), ``pipeline_parallel`` and ``testing.pipeline_checks``
(pipeline variants, schedules), ``data_parallel`` (its variants and modes), ``workloads``
(the models).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

# --------------------------------------------------------------------------- variants

#: The single-strand variants (``variants.compile_variant``; its docstring says what each is).
VARIANTS: tuple[str, ...] = (
    "eager",
    "inductor",
    "inductor_overlap",
    "dhelix",
    "dhelix_decompose",
    "dhelix_decompose_pieces",
    "dhelix_decompose_chain",
    "dhelix_eager",
)
#: Run only when named: diagnostics and ablations.
NOT_BY_DEFAULT: tuple[str, ...] = ("dhelix_decompose_pieces", "dhelix_decompose_chain", "dhelix_eager")

HELIX_VARIANTS: dict[str, dict[str, Any]] = {"helix": {}, "helix_decompose": {"decompose": "per_peer"}}
"""helix variants (``steps.step_function``): the options each adds to the user's dhelix options."""

#: Every variant of a training step (``--variants``).
STEP_VARIANTS: tuple[str, ...] = (*VARIANTS, *HELIX_VARIANTS)


def compiled_by_dhelix(variant: str) -> bool:
    """Whether the bench variant ``variant`` (bracketed options allowed) is compiled by dhelix
    (``dhelix*``, ``helix*``): its plan prices the live link, and its dumps hold a predicted step."""
    return variant.split("[", 1)[0].startswith(("dhelix", "helix"))


#: The pipeline benchmark's variants (``--pipeline``; ``bench.pipeline_parallel``).
PIPELINE_VARIANTS: tuple[str, ...] = ("pipeline_eager", "pipeline_inductor", "helix_pipeline")
#: torch.distributed.pipelining schedules the pipeline benchmark builds (``testing.pipeline_checks.build_schedule``).
ScheduleKind = Literal["1f1b", "interleaved_1f1b", "dualpipev"]
SCHEDULE_KINDS: tuple[str, ...] = get_args(ScheduleKind)

#: The data-parallel benchmark's variants (``--data-parallel``; ``bench.data_parallel``).
DATA_PARALLEL_VARIANTS: tuple[str, ...] = ("torch_eager", "torch_inductor", "eager", "inductor", "dhelix", "helix")
DATA_PARALLEL_MODES: tuple[str, ...] = ("shard", "replicate")

# --------------------------------------------------------------------------- models

#: Reference-transformer sizes by name: (dim, n_heads, n_layers, ffn_hidden, vocab, seq_len, batch)
MODEL_SIZES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (64, 4, 2, 128, 128, 32, 2),
    "small": (256, 8, 4, 768, 512, 128, 4),
    "medium": (512, 8, 4, 1536, 1024, 256, 4),
    "large": (1024, 16, 4, 2816, 2048, 256, 4),
    # Llama-3-8B's layer shape (hidden 4096, 32 heads, 8 KV heads, SwiGLU 14336) in a short
    # stack with a small vocabulary: the layers dominate, as in the real model.
    "llama3_8b": (4096, 32, 2, 14336, 4096, 256, 1),
    "llama3_8b_gpu": (4096, 32, 2, 14336, 8192, 4096, 1),
}
#: Key/value heads of the sizes with grouped-query attention (the others: one per query head).
MODEL_KV_HEADS: dict[str, int] = {"llama3_8b": 8, "llama3_8b_gpu": 8}

#: MLP-block sizes by name: (dim, ffn_hidden, seq_len, batch)
MLP_SIZES: dict[str, tuple[int, int, int, int]] = {
    "mlp_small": (256, 768, 128, 4),
    "mlp_medium": (512, 1536, 256, 4),
    "mlp_large": (1024, 2816, 256, 4),
}

#: MoE-layer sizes by name: (dim, ffn_hidden, n_experts, top_k, tokens per rank)
MOE_SIZES: dict[str, tuple[int, int, int, Literal[1, 2], int]] = {
    "moe_small": (256, 512, 4, 2, 256),
    "moe_medium": (512, 1024, 4, 2, 256),
}

#: Hugging Face Llama workloads: bench name -> ``models.hf_llama`` size
HF_LLAMA_SIZES: dict[str, str] = {"hf_llama_tiny": "tiny", "hf_llama": "bench"}

MODEL_NAMES: tuple[str, ...] = (*MODEL_SIZES, *MLP_SIZES, *MOE_SIZES, *HF_LLAMA_SIZES)
#: The models that also run unparallelized (``parallel="none"``: the data-parallel benchmark).
UNPARALLELIZED_MODELS: tuple[str, ...] = (*MODEL_SIZES, *HF_LLAMA_SIZES)
