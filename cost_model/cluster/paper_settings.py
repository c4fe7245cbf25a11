"""The DHelix paper's cluster settings: the catalogue ``dhelix simulate`` predicts, with the paper's numbers.

Contract
--------
* :data:`SETTINGS` -- name -> :class:`~cost_model.cluster.setting.ClusterSetting`, in the order
  ``dhelix simulate`` prints them: twelve A40 settings (4k and, with CP, 16k tokens), two A800
  Llama-66B settings (16k, 32k), two H100 settings the paper only mentions.
* :data:`MODELS` -- the model shapes by lower-case name; where the paper gives no shape, the
  one chosen here says so (``source`` starts with "assumed").
* Each setting's ``paper`` holds the speedup and TFLOP/s/GPU the authors report and where they
  were read; ``assumed`` lists the fields chosen here. :data:`PAPER_SUMMARY` is printed with
  the results.
* :func:`get_setting` also finds the emulated settings (``cluster.emulated``) and raises
  :class:`UnknownSettingError` listing the valid names;
  :func:`simulate_settings` predicts several (all by default), in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.cluster.emulated import EMULATED_SETTINGS
from cost_model.cluster.setting import ClusterSetting, ModelShape, PaperReport, Parallelism
from cost_model.cluster.step_model import MEASURED_MATMUL_EFFICIENCY, ClusterPrediction, simulate_setting


class UnknownSettingError(KeyError):
    """An unknown cluster setting name; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


_REPO = "github.com/DHeLlam-502/dhellam @ 90073960fb52cf0265c130af4d93edd9b627aeb2"
_FIG_A40 = (
    f"{_REPO}, README A40 figure docs/task.3D.4D.svg: the 'DHeLLaM' bar's label = speedup over "
    "Megatron-LM; TFLOP/s/GPU read from the SVG's bar heights"
)
_FIG_A800 = (
    f"{_REPO}, README A800 figure docs/task.A800.MoE.CP.svg, panel (a) Llama-66B: the 'DHeLLaM' bar's "
    "label = speedup over Megatron-LM; TFLOP/s/GPU read from the SVG's bar heights"
)
_H100_NOTE = (
    "arXiv 2411.15871v1 abstract: on H100 'the faster network reduces DHelix's profit margin' and makes "
    "cross-node TP 'promising'; no H100 setting or number found (only the abstract could be read)"
)
#: The abstracts' ranges and where the per-setting numbers come from, printed with the results.
PAPER_SUMMARY: str = (
    "DHelix, arXiv 2411.15871v1 (Wang, Ruan et al., 'Hiding Communication Cost in Distributed LLM Training "
    "via Micro-batch Co-execution', https://arxiv.org/abs/2411.15871), abstract: 12-40% (up to 58% MFU) on 64 A40s and 2-29% (up to 71% MFU) "
    "on 64 A800s over state-of-the-art methods; the later version (DHeLlam, ICCD 2025, abstract at "
    "https://irep.mbzuai.ac.ae/items/548449c8-3cd9-469b-a416-7d0dc547b07b) reports 12-40% (up to 58% MFU) on A40 and 5-24% (up to 64% MFU) on A800. The "
    "per-setting numbers below are the bar labels and heights of the figures in the authors' repository "
    f"README ({_REPO}), which match the later version (A40 up to 86.3 TFLOP/s = 58% of 149.7; A800 "
    "199.7 TFLOP/s = 64% of 312); the parallel degrees are the figures' labels, in the order the A800 "
    "panel spells out (dp, tp, cp, pp); the arXiv full text could not be read here"
)

_LLAMA_VOCAB = 32000  # Llama-2 tokenizer, as in the authors' script/run.sh (--vocab-size 32000)
_GPT_VOCAB = 50257  # GPT-2 BPE

MODELS: dict[str, ModelShape] = {
    shape.name.lower(): shape
    for shape in (
        ModelShape(
            "Llama-8B",
            "llama",
            32,
            4096,
            32,
            14336,
            _LLAMA_VOCAB,
            "assumed: Llama-3-8B shape without GQA (7.9B with a 32k vocab)",
        ),
        ModelShape(
            "Llama-25B",
            "llama",
            40,
            7168,
            56,
            19200,
            _LLAMA_VOCAB,
            "assumed: no published shape; hidden 7168 / 56 heads (divisible by tp 8), FFN ~8/3 h",
        ),
        ModelShape(
            "Llama-39B",
            "llama",
            48,
            8192,
            64,
            22016,
            _LLAMA_VOCAB,
            "assumed: Megatron-LM's 39.1B (48 x 8192, 64 heads) with a Llama SwiGLU MLP (FFN of LLaMA-65B)",
        ),
        ModelShape(
            "Llama-66B",
            "llama",
            80,
            8192,
            64,
            22016,
            _LLAMA_VOCAB,
            "assumed: LLaMA-65B shape (Touvron et al. 2023: 80 x 8192, 64 heads, FFN 22016)",
        ),
        ModelShape(
            "GPT-6.7B",
            "gpt",
            32,
            4096,
            32,
            16384,
            _GPT_VOCAB,
            "GPT-3 6.7B (Brown et al. 2020, Table 2.1: 32 x 4096, 32 heads)",
        ),
        ModelShape(
            "GPT-18B",
            "gpt",
            40,
            6144,
            48,
            24576,
            _GPT_VOCAB,
            "assumed: Megatron-LM's 18.4B (Narayanan et al. 2021, Table 1: 40 x 6144, 48 heads)",
        ),
        ModelShape(
            "GPT-30B",
            "gpt",
            48,
            7168,
            56,
            28672,
            _GPT_VOCAB,
            "assumed: OPT-30B shape (Zhang et al. 2022: 48 x 7168, 56 heads)",
        ),
    )
}

_A40_ASSUMED = (
    "model shape",
    "seq_len",
    "micro_batch_size",
    "micro_batches",
    "gpus_per_node 8",
    "intra-node link pcie4",
    "inter-node link ib_hdr",
)


def _a40(
    name: str, model: str, dp: int, tp: int, pp: int, cp: int, seq: int, speedup: float, megatron: float, dhelix: float
) -> ClusterSetting:
    return ClusterSetting(
        name=name,
        model=MODELS[model],
        parallel=Parallelism(dp=dp, tp=tp, pp=pp, cp=cp),
        seq_len=seq,
        micro_batch_size=1,
        micro_batches=8,
        device="a40",
        gpus_per_node=8,
        intra_node_link="pcie4",
        inter_node_link="ib_hdr",
        paper=PaperReport(speedup, megatron, dhelix, _FIG_A40),
        assumed=_A40_ASSUMED,
    )


def _a800(name: str, seq: int, dp: int, cp: int, speedup: float, megatron: float, dhelix: float) -> ClusterSetting:
    return ClusterSetting(
        name=name,
        model=MODELS["llama-66b"],
        parallel=Parallelism(dp=dp, tp=8, pp=2, cp=cp),
        seq_len=seq,
        micro_batch_size=1,
        micro_batches=8,
        device="a800",
        gpus_per_node=8,
        intra_node_link="nvlink3_a800",
        inter_node_link="ib_hdr",
        paper=PaperReport(speedup, megatron, dhelix, _FIG_A800),
        assumed=("model shape", "micro_batch_size", "micro_batches", "gpus_per_node 8", "inter-node link ib_hdr"),
    )


def _h100(name: str, dp: int, tp: int) -> ClusterSetting:
    return ClusterSetting(
        name=name,
        model=MODELS["llama-39b"],
        parallel=Parallelism(dp=dp, tp=tp),
        seq_len=4096,
        micro_batch_size=1,
        micro_batches=8,
        device="h100_sxm",
        gpus_per_node=8,
        intra_node_link="nvlink4",
        inter_node_link="ib_ndr",
        paper=PaperReport(None, None, None, _H100_NOTE),
        assumed=("whole setting (model, degrees, seq_len, batch)", "gpus_per_node 8", "inter-node link ib_ndr"),
    )


#: Parallel degrees and speedups: the figures' (DP, TP, PP) / (DP, TP, CP, PP) labels (order as
#: spelled out in the A800 panel, "dp2,tp8,cp2,pp2"). TFLOP/s/GPU: SVG bar heights (axis 0/50/100).
SETTINGS: dict[str, ClusterSetting] = {
    s.name: s
    for s in (
        _a40("a40-llama-8b", "llama-8b", 16, 4, 1, 1, 4096, 1.31, 64.4, 84.1),
        _a40("a40-llama-25b", "llama-25b", 8, 8, 1, 1, 4096, 1.40, 53.9, 75.7),
        _a40("a40-llama-39b", "llama-39b", 4, 8, 2, 1, 4096, 1.27, 68.1, 86.3),
        _a40("a40-gpt-6.7b", "gpt-6.7b", 16, 4, 1, 1, 4096, 1.26, 61.6, 77.4),
        _a40("a40-gpt-18b", "gpt-18b", 8, 8, 1, 1, 4096, 1.40, 40.6, 56.9),
        _a40("a40-gpt-30b", "gpt-30b", 4, 8, 2, 1, 4096, 1.36, 57.8, 78.6),
        _a40("a40-long-llama-8b", "llama-8b", 8, 4, 1, 2, 16384, 1.30, 59.8, 78.0),
        _a40("a40-long-llama-25b", "llama-25b", 4, 8, 1, 2, 16384, 1.30, 38.4, 50.0),
        _a40("a40-long-llama-39b", "llama-39b", 2, 8, 2, 2, 16384, 1.39, 51.9, 72.0),
        _a40("a40-long-gpt-6.7b", "gpt-6.7b", 8, 4, 1, 2, 16384, 1.31, 57.3, 75.1),
        _a40("a40-long-gpt-18b", "gpt-18b", 4, 8, 1, 2, 16384, 1.22, 28.4, 34.6),
        _a40("a40-long-gpt-30b", "gpt-30b", 2, 8, 2, 2, 16384, 1.23, 41.9, 51.4),
        _a800("a800-llama-66b-16k", 16384, 2, 2, 1.07, 186.0, 199.7),
        _a800("a800-llama-66b-32k", 32768, 1, 4, 1.24, 160.9, 199.7),
        _h100("h100-llama-39b-tp8", 8, 8),
        _h100("h100-llama-39b-tp16", 4, 16),
    )
}


def get_setting(name: str) -> ClusterSetting:
    """A setting by name (the paper's, or an emulated one: ``cluster.emulated.EMULATED_SETTINGS``);
    :class:`UnknownSettingError` lists the valid names."""
    if name in EMULATED_SETTINGS:
        return EMULATED_SETTINGS[name]
    if name not in SETTINGS:
        valid = ", ".join([*SETTINGS, *EMULATED_SETTINGS])
        raise UnknownSettingError(f"unknown setting {name!r}; valid settings: {valid} (or 'all')")
    return SETTINGS[name]


def simulate_settings(
    names: Sequence[str] | None = None,
    *,
    contention_factor: float | None = None,
    matmul_efficiency: float = MEASURED_MATMUL_EFFICIENCY,
) -> list[ClusterPrediction]:
    """:func:`simulate_setting` for each name (all settings when ``names`` is None), in order."""
    chosen = list(SETTINGS) if names is None else list(names)
    return [
        simulate_setting(get_setting(n), contention_factor=contention_factor, matmul_efficiency=matmul_efficiency)
        for n in chosen
    ]


__all__ = ["MODELS", "PAPER_SUMMARY", "SETTINGS", "UnknownSettingError", "get_setting", "simulate_settings"]
