"""Models and helpers for testing dhelix (and for users checking their own setups).

* ``multirank``          ``run_on_ranks(fn, world_size, ...)``: spawn gloo ranks, collect results,
                         fail with the failing ranks' tracebacks, never hang.
* ``sequence_parallel``  ``FunctionalSPTransformer``: Megatron-SP with functional collectives.
* ``moe``                ``ReferenceMoE``, ``ExpertParallelMoE`` (static-split all-to-all).
* ``pipeline_checks``    the reference transformer cut into stage chunks; torch's pipeline
                         schedules eager against ``helix_pipeline`` (PP, PP x TP).
* ``sharding``           map local shards and gradients to slices of the reference's.
* ``checks``             rank-side checks of each parallel model (eager, compiled) vs reference.
* ``compare``            single-process numerics of a compiled model against eager.
* ``toy_models``         small single-process models.

The reference models these check (the Llama-style ``Transformer``, its TP and TP+SP plans,
Hugging Face Llama) are public: :mod:`dhelix_compile.models`.

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
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
