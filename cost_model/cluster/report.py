"""The step model's predictions as markdown: one section per setting, one summary table (``dhelix simulate``).

Contract
--------
* :func:`format_prediction` -- one setting: its description and links, a table of both schedules
  (step in ms, MFU, TFLOP/s/GPU, speedup) beside the paper's numbers, where a micro-batch's and a
  step's time goes, the paper's source and :meth:`ClusterPrediction.explain_gap`;
* :func:`format_summary` -- every setting in one table (MFU of both schedules, predicted and
  paper speedups, the paper's MFU).

Text only: every number comes from the :class:`~cost_model.cluster.step_model.ClusterPrediction`,
written with :mod:`cost_model.units` (milliseconds, percent, ``1.31x``); "n/a" / "not found"
where the paper gives nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.cluster.step_model import ClusterPrediction
from cost_model.units import format_ms, format_pct, format_ratio


def _pct(x: float | None) -> str:
    return format_pct(x, none="n/a")


def format_prediction(pred: ClusterPrediction) -> str:
    """One setting as a markdown section: a table of both schedules, the paper's number, the gap."""
    s = pred.setting
    peak_tflops = s.peak_bf16_tflops
    paper = s.paper

    def paper_mfu(tflops: float | None) -> str:
        return "n/a" if tflops is None else f"{tflops:.1f} ({_pct(tflops / peak_tflops)})"

    paper_speedup = format_ratio(paper.speedup, none="not found")
    seq, dh, parts = pred.sequential, pred.dhelix, pred.sequential.parts_s
    p = s.parallel
    links = ", ".join(
        f"{kind} {link.name}"
        for kind, degree, link in (
            ("TP", p.tp, s.tp_link),
            ("CP", p.cp, s.cp_link),
            ("DP", p.dp, s.dp_link),
            ("PP", p.pp, s.pp_link),
        )
        if degree > 1
    )
    per_microbatch = (
        f"forward {format_ms(pred.fwd_compute_s)} ms compute + {format_ms(pred.fwd_comm_s)} ms comm, "
        f"backward {format_ms(pred.bwd_compute_s)} + {format_ms(pred.bwd_comm_s)} ms; merged pair "
        f"{format_ms(pred.pair_s)} ms ({pred.paired_segments} of {pred.fwd_segments}/{pred.bwd_segments} "
        "segments paired)"
    )
    per_step = (
        f"DP sync {format_ms(parts['dp sync'])} ms, bubble {format_ms(parts['pipeline bubble'])} ms, "
        f"PP p2p {format_ms(parts['pipeline p2p'])} ms"
    )
    lines = [
        f"### {s.name}",
        "",
        f"{s.describe()}.",
        f"Links: {links}. Assumed: {', '.join(s.assumed) or 'nothing'}. Model shape: {s.model.source}.",
        "",
        "| schedule | step (ms) | MFU | TFLOP/s/GPU | speedup | paper TFLOP/s/GPU (MFU) | paper speedup |",
        "|---|---:|---:|---:|---:|---:|---:|",
        (
            f"| {seq.name} | {format_ms(seq.step_s)} | {_pct(seq.mfu)} | {seq.tflops_per_gpu:.1f} | 1.00x | "
            f"Megatron-LM {paper_mfu(paper.megatron_tflops_per_gpu)} | 1.00x |"
        ),
        (
            f"| {dh.name} | {format_ms(dh.step_s)} | {_pct(dh.mfu)} | {dh.tflops_per_gpu:.1f} | "
            f"{format_ratio(pred.speedup)} | DHelix {paper_mfu(paper.dhelix_tflops_per_gpu)} | {paper_speedup} |"
        ),
        *_folded_rows(pred),
        "",
        f"Per micro-batch: {per_microbatch}; per step: {per_step}.",
        *_folded_line(pred),
        f"Paper source: {paper.source}.",
        f"Gap: {pred.explain_gap()}",
        "",
    ]
    return "\n".join(lines)


def _folded_rows(pred: ClusterPrediction) -> list[str]:
    if not pred.folded:
        return []
    return [
        f"| {sched.name} | {format_ms(sched.step_s)} | {_pct(sched.mfu)} | {sched.tflops_per_gpu:.1f} | "
        f"{format_ratio(pred.sequential.step_s / sched.step_s)} | | |"
        for sched, _ in pred.folded.values()
    ]


def _folded_line(pred: ClusterPrediction) -> list[str]:
    if not pred.folded:
        return []
    described = "; ".join(
        f"{name}: step {format_ms(run.step_s)} ms = busiest rank {format_ms(run.busy_s)} ms + bubble "
        f"{format_ms(run.bubble_s)} ms, {run.pairs} of {run.actions} actions merged pairs"
        for name, (_, run) in pred.folded.items()
    )
    return [
        "Folded pipeline (two chunks of half the layers per rank, V layout, simulated action by action by "
        f"cost_model.cluster.folded_pipeline; + DP sync): {described}."
    ]


def format_summary(preds: Sequence[ClusterPrediction]) -> str:
    """All settings in one markdown table."""
    lines = [
        "| setting | degrees | seq MFU | dhelix MFU | predicted speedup | paper speedup | paper MFU (Megatron -> DHelix) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for pred in preds:
        s = pred.setting
        peak = s.peak_bf16_tflops
        paper = s.paper
        if paper.megatron_tflops_per_gpu is not None and paper.dhelix_tflops_per_gpu is not None:
            paper_mfu = f"{_pct(paper.megatron_tflops_per_gpu / peak)} -> {_pct(paper.dhelix_tflops_per_gpu / peak)}"
        else:
            paper_mfu = "not found"
        lines.append(
            f"| {s.name} | {s.parallel.label()} | {_pct(pred.sequential.mfu)} | {_pct(pred.dhelix.mfu)} | "
            f"{format_ratio(pred.speedup)} | {format_ratio(paper.speedup, none='not found')} | {paper_mfu} |"
        )
    return "\n".join(lines) + "\n"


__all__ = ["format_prediction", "format_summary"]
