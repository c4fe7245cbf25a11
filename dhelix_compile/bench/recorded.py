"""A recorded emulated bench result as a cost-model cluster setting (``dhelix simulate --from-bench``).

``dhelix bench --link emulated:<link>,ranks=N --out FILE`` records every variant's step beside
its own compute, communication, bytes and host time (``bench.emulated``). :func:`setting_from_bench`
reads such a file and builds the :class:`~cost_model.cluster.setting.ClusterSetting` it ran -- the
model's shape, TP or TP + SP over the ranks, the recorded link, device, dtype and micro-batches --
so that ``cost_model.cluster.emulated.compare_bench`` can set the predictions beside the
measurements. A ZeRO-3 run (``--data-parallel shard``) is the reference transformer unparallelized
under ``data_parallel(mode="shard")`` over the ranks (``ClusterSetting.dp_mode``); an MoE layer
(``moe_*``) has its experts split over the ranks (``ModelShape.family="moe"``); a 1F1B pipeline
(``--pipeline 1f1b``, PP x TP) is the last stage's program, which the bench's rank runs. The shapes live
here because ``cost_model`` knows no benchmark:

    reference transformer  ``bench.choices.MODEL_SIZES`` (with ``MODEL_KV_HEADS``)
    Hugging Face Llama     ``bench.choices.HF_LLAMA_SIZES`` -> ``models.hf_llama.HF_LLAMA_SIZES``
                           (its config fields). The same Llama block under PyTorch's TP plan (q/k/v,
                           gate/up column-wise, o, down row-wise: ``models.hf_llama``). Its TP plan
                           covers the decoder layers only: the embedding, final norm and LM head are
                           replicated (``ClusterSetting.ends="replicated"``: no embedding all-reduce,
                           no logits gather, every rank computes all the logits). Its TP + SP plan is
                           the reference's: the embedding row-wise into sequence shards (a
                           reduce-scatter), the LM head column-wise from sequence shards to
                           replicated logits (an all-gather of its input, one of the logits).

Contract
--------
``setting_from_bench(data) -> (ClusterSetting, BenchRecord)``; ``load_bench(path)`` reads the
file first. ``ValueError`` names what it cannot model: a workload other than the reference
transformer, Hugging Face Llama and the MoE layer, a replicated data-parallel run, a pipeline
schedule other than 1F1B or a rank off its last stage,
a device without a ``cost_model.hardware`` entry, a link whose name the cost model holds with
other numbers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from cost_model.cluster.emulated import (
    BenchRecord,
    device_entry,
    emulated_setting,
    emulated_setting_name,
    recorded_link,
)
from cost_model.cluster.setting import ClusterSetting, Ends, ModelShape
from dhelix_compile.bench.choices import HF_LLAMA_SIZES, MODEL_KV_HEADS, MODEL_SIZES, MOE_SIZES

_SEQUENCE_PARALLEL: dict[str, bool] = {"tp": False, "tp_sp": True}
#: The bench's ``parallel`` field of a ZeRO-3 run (``dhelix bench --data-parallel shard``).
ZERO3 = "data-parallel shard"
#: ... and of an emulated pipeline run (``dhelix bench --pipeline <kind> --link emulated:...``).
_PIPELINE = re.compile(r"^pipeline (?P<kind>\w+), PP=(?P<pp>\d+) x TP=(?P<tp>\d+)$")


def bench_model_shape(name: str) -> tuple[ModelShape, int, int]:
    """The bench model ``name`` (``MODEL_SIZES``, ``HF_LLAMA_SIZES`` or ``MOE_SIZES``) as a
    ModelShape, its sequence length (an MoE layer's: its tokens per rank) and batch."""
    if name in HF_LLAMA_SIZES:
        return _hf_llama_shape(name)
    if name in MOE_SIZES:
        dim, ffn, experts, top_k, tokens = MOE_SIZES[name]
        source = f"the bench's {name} (dhelix_compile.bench.choices.MOE_SIZES)"
        return ModelShape(name, "moe", 1, dim, 1, ffn, 0, source, experts=experts, top_k=top_k), tokens, 1
    if name not in MODEL_SIZES:
        known = ", ".join((*MODEL_SIZES, *HF_LLAMA_SIZES, *MOE_SIZES))
        raise ValueError(f"bench model {name!r} has no cluster model; the modeled sizes: {known}")
    dim, heads, layers, ffn, vocab, seq, batch = MODEL_SIZES[name]
    source = f"the bench's {name} (dhelix_compile.bench.choices.MODEL_SIZES)"
    return (
        ModelShape(name, "llama", layers, dim, heads, ffn, vocab, source, kv_heads=MODEL_KV_HEADS.get(name)),
        seq,
        batch,
    )


def _hf_llama_shape(name: str) -> tuple[ModelShape, int, int]:
    from dhelix_compile.models.hf_llama import HF_LLAMA_SIZES as CONFIGS

    c = CONFIGS[HF_LLAMA_SIZES[name]]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    shape = ModelShape(
        name,
        "llama",
        c["num_hidden_layers"],
        c["hidden_size"],
        heads,
        c["intermediate_size"],
        c["vocab_size"],
        f"the bench's {name} (dhelix_compile.models.hf_llama.HF_LLAMA_SIZES[{HF_LLAMA_SIZES[name]!r}])",
        kv_heads=None if kv_heads == heads else kv_heads,
    )
    return shape, c["seq_len"], c["batch"]


def _ends(model: str, parallel: str) -> Ends:
    """Hugging Face Llama's TP plan leaves the embedding and LM head out (module docstring)."""
    return "replicated" if model in HF_LLAMA_SIZES and parallel == "tp" else "vocab_parallel"


def setting_from_bench(data: Mapping[str, Any]) -> tuple[ClusterSetting, BenchRecord]:
    """The setting a recorded emulated bench run ran, and the record (module docstring)."""
    record = BenchRecord.from_json(data)
    pipeline = _PIPELINE.match(record.parallel)
    if record.parallel not in _SEQUENCE_PARALLEL and record.parallel != ZERO3 and pipeline is None:
        raise ValueError(
            f"bench run {record.parallel!r}: only tensor-parallel runs (tp, tp_sp), ZeRO-3 ({ZERO3}) and "
            "pipelines are modeled"
        )
    pp = _pipeline_stages(pipeline, data.get("rank"))
    if record.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"bench dtype {record.dtype!r}: bfloat16 or float32 are modeled")
    dtype: Literal["bfloat16", "float32"] = "bfloat16" if record.dtype == "bfloat16" else "float32"
    model, seq, batch = bench_model_shape(record.model)
    link = recorded_link(record)
    device = device_entry(record.device)
    moe = model.family == "moe"
    if record.parallel == ZERO3:
        parallel = "dp_shard"
    elif moe:
        parallel = "ep"
    elif pp > 1:
        parallel = f"pp{pp}-tp{record.ranks // pp}-ranks"
    else:
        parallel = record.parallel
    name = emulated_setting_name(device, record.model, parallel, record.ranks, str(data["emulated"]["link"]))
    setting = emulated_setting(
        name,
        model,
        link=link,
        ranks=record.ranks,
        seq_len=seq,
        micro_batch_size=batch,
        micro_batches=record.microbatches,
        device=device,
        dtype=dtype,
        sequence_parallel=not moe and _SEQUENCE_PARALLEL.get(record.parallel, False),
        ends=_ends(record.model, record.parallel),
        dp_mode="shard" if record.parallel == ZERO3 else "replicate",
        pp=pp,
    )
    return setting, record


def _pipeline_stages(pipeline: re.Match[str] | None, rank: object) -> int:
    """The stages of a recorded pipeline run (1: not a pipeline); ``ValueError`` where the run
    is one the cluster model does not hold: a schedule other than 1F1B, or a rank off the last
    stage (the model is the last stage's program)."""
    if pipeline is None:
        return 1
    pp, tp = int(pipeline["pp"]), int(pipeline["tp"])
    if pipeline["kind"] != "1f1b":
        raise ValueError(f"bench run 'pipeline {pipeline['kind']}': of the pipelines, only 1f1b is modeled")
    if not isinstance(rank, int) or rank // tp != pp - 1:
        raise ValueError(f"bench run of a pipeline as rank {rank}: only a rank of the last stage is modeled")
    return pp


def load_bench(path: str | Path) -> tuple[ClusterSetting, BenchRecord]:
    """:func:`setting_from_bench` of the JSON file at ``path``."""
    return setting_from_bench(json.loads(Path(path).read_text()))


__all__ = ["bench_model_shape", "load_bench", "setting_from_bench"]
