"""Reference models to train with dhelix, and the parallel plans that fit them.

* ``llama``            ``Transformer(ModelConfig(...))``: a Llama-style transformer with torchtitan's
                       module names, deterministic from ``config.seed``; ``lm_loss``.
* ``tensor_parallel``  ``parallelize_tp`` / ``parallelize_tp_sp``: PyTorch's DTensor plans (Megatron
                       TP; TP + sequence parallel, torchtitan's Llama plan) for that transformer.
* ``hf_llama``         ``build_hf_llama(size)``: a Hugging Face ``LlamaForCausalLM`` from a config,
                       random seeded weights (the ``hf`` extra); ``parallelize_hf_llama`` with
                       PyTorch's TP or TP+SP plan; ``hf_llama_chunks`` cuts it into pipeline stages.
* ``gpt``              ``GPT``: a tiny single-process GPT (the quick start's).

``examples/`` build their models from here. The names below are imported lazily (PEP 562), so
``import dhelix_compile.models`` pulls in neither DTensor nor ``transformers``.
"""

from __future__ import annotations

from cost_model.lazy_exports import lazy_exports

_EXPORTS: dict[str, str] = {
    "GPT": "gpt",
    "HFLlamaChunk": "hf_llama",
    "build_hf_llama": "hf_llama",
    "hf_llama_batches": "hf_llama",
    "hf_llama_chunks": "hf_llama",
    "hf_llama_loss": "hf_llama",
    "parallelize_hf_llama": "hf_llama",
    "ModelConfig": "llama",
    "Transformer": "llama",
    "lm_loss": "llama",
    "parallelize_tp": "tensor_parallel",
    "parallelize_tp_sp": "tensor_parallel",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
