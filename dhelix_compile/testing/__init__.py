"""Models and helpers for testing dhelix (and for users checking their own setups).

* ``multirank``          ``run_on_ranks(fn, world_size, ...)``: spawn gloo ranks, collect results,
                         fail with the failing ranks' tracebacks, never hang.
* ``llama``              the single-process Llama-style reference ``Transformer``, ``lm_loss``
                         (``dhelix_compile.models.llama``'s, re-exported).
* ``tensor_parallel``    ``parallelize_tp`` / ``parallelize_tp_sp``: DTensor plans (``models``').
* ``sequence_parallel``  ``FunctionalSPTransformer``: Megatron-SP with functional collectives.
* ``moe``                ``ReferenceMoE``, ``ExpertParallelMoE`` (static-split all-to-all).
* ``hf_llama``           a Hugging Face ``LlamaForCausalLM`` from a config (the ``hf`` extra),
                         parallelized with PyTorch's TP or TP+SP plan (``models``').
* ``pipeline_checks``    the reference transformer cut into stage chunks; torch's pipeline
                         schedules eager against ``helix_pipeline`` (PP, PP x TP).
* ``sharding``           map local shards and gradients to slices of the reference's.
* ``checks``             rank-side checks of each parallel model (eager, compiled) vs reference.
* ``compare``            single-process numerics of a compiled model against eager.
* ``toy_models``         small single-process models.

The names below are imported lazily (PEP 562), so ``import dhelix_compile.testing.compare``
does not pull in DTensor or the parallel models.
"""

from __future__ import annotations

from cost_model.lazy_exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "MODEL_KINDS": "checks",
    "CheckConfig": "checks",
    "ModelKind": "checks",
    "build_case": "checks",
    "check_against_reference": "checks",
    "check_all": "checks",
    "ModelConfig": "llama",
    "Transformer": "llama",
    "lm_loss": "llama",
    "ExpertParallelMoE": "moe",
    "MoEConfig": "moe",
    "ReferenceMoE": "moe",
    "MultiRankError": "multirank",
    "MultiRankTimeout": "multirank",
    "RankFailure": "multirank",
    "run_on_ranks": "multirank",
    "FunctionalSPTransformer": "sequence_parallel",
    "shard_sequence": "sequence_parallel",
    "assert_matches_reference": "sharding",
    "local_grad": "sharding",
    "reference_slice": "sharding",
    "shard_dims": "sharding",
    "sync_replicated_grads": "sharding",
    "parallelize_tp": "tensor_parallel",
    "parallelize_tp_sp": "tensor_parallel",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
