"""cluster: predicted training steps for cluster settings we cannot run (``dhelix simulate``).

A pure cost model -- no process group, no FX graph -- of the DHelix paper's settings: one pipeline
stage of a decoder-only transformer as two strands of segments, costed from the hardware tables,
and its step with and without the Strand Interleaving DP (:mod:`cost_model.strand_plan`, the same
DP the interleave pass runs on FX graphs)::

    setting          what a setting is: ModelShape, Parallelism, PaperReport, ClusterSetting
                     (validation, which link each group runs over)
    strands          one micro-batch of the last stage as forward / backward segments:
                     roofline matmuls and attention, alpha-beta TP / CP collectives
    step_model       simulate_setting: the sequential and the dhelix step, MFU, the gap to the paper
    paper_settings   the paper's settings and model shapes (SETTINGS, MODELS), get_setting,
                     simulate_settings
    emulated         the emulated cluster's bench step per variant (inductor, dhelix, helix):
                     predicted, and beside a recorded ``dhelix bench --link emulated:...`` run
                     (``dhelix simulate --from-bench``); EMULATED_SETTINGS
    report           format_prediction / format_summary / format_bench_comparison: the markdown
                     ``dhelix simulate`` prints

Contract
--------
``simulate_setting(setting, contention_factor=None, matmul_efficiency=MEASURED_MATMUL_EFFICIENCY) -> ClusterPrediction``
is deterministic; every number is in seconds, bytes or FLOPs, each module's docstring has its
formulas. A setting whose degrees do not divide the model raises ``ValueError`` naming it; an
unknown setting name raises :class:`UnknownSettingError` listing the valid ones.
"""

from __future__ import annotations

from cost_model.cluster.emulated import (
    EMULATED_SETTINGS,
    BenchComparison,
    BenchRecord,
    VariantPrediction,
    compare_bench,
    predict_variant,
)
from cost_model.cluster.paper_settings import (
    MODELS,
    PAPER_SUMMARY,
    SETTINGS,
    UnknownSettingError,
    get_setting,
    simulate_settings,
)
from cost_model.cluster.report import (
    format_bench_comparison,
    format_prediction,
    format_summary,
    format_variant_predictions,
)
from cost_model.cluster.setting import ClusterSetting, ModelShape, PaperReport, Parallelism
from cost_model.cluster.step_model import (
    ATTENTION_EFFICIENCY_SOURCE,
    MATMUL_EFFICIENCY_SOURCE,
    MEASURED_ATTENTION_EFFICIENCY,
    MEASURED_MATMUL_EFFICIENCY,
    ClusterPrediction,
    SchedulePrediction,
    model_flops_per_step,
    simulate_setting,
)
from cost_model.cluster.strands import ClusterSegment, attention_flops, elementwise_time_s, matmul_time_s, strands

__all__ = [
    "ATTENTION_EFFICIENCY_SOURCE",
    "EMULATED_SETTINGS",
    "MATMUL_EFFICIENCY_SOURCE",
    "MEASURED_ATTENTION_EFFICIENCY",
    "MEASURED_MATMUL_EFFICIENCY",
    "MODELS",
    "PAPER_SUMMARY",
    "SETTINGS",
    "BenchComparison",
    "BenchRecord",
    "ClusterPrediction",
    "ClusterSegment",
    "ClusterSetting",
    "ModelShape",
    "PaperReport",
    "Parallelism",
    "SchedulePrediction",
    "UnknownSettingError",
    "VariantPrediction",
    "attention_flops",
    "compare_bench",
    "elementwise_time_s",
    "format_bench_comparison",
    "format_prediction",
    "format_summary",
    "format_variant_predictions",
    "get_setting",
    "matmul_time_s",
    "model_flops_per_step",
    "predict_variant",
    "simulate_setting",
    "simulate_settings",
    "strands",
]
