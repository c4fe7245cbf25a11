"""The step model's predictions as markdown: one section per setting, one summary table (``dhelix simulate``).

Contract
--------
* :func:`format_prediction` -- one setting: its description and links, a table of both schedules
  (step in ms, MFU, TFLOP/s/GPU, speedup) beside the paper's numbers, where a micro-batch's and a
  step's time goes, the paper's source and :meth:`ClusterPrediction.explain_gap`;
* :func:`format_summary` -- every setting in one table (MFU of both schedules, predicted and
  paper speedups, the paper's MFU).
* :func:`format_variant_predictions` -- an emulated setting's bench variants, predicted
  (:mod:`cost_model.cluster.emulated`); :func:`format_bench_comparison` -- the same beside a
  recorded bench run, with the ratios, which numbers are measured and which predictions are claimed.

Text only: every number comes from the :class:`~cost_model.cluster.step_model.ClusterPrediction`,
written with :mod:`cost_model.units` (milliseconds, percent, ``1.31x``); "n/a" / "not found"
where the paper gives nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.cluster.emulated import (
    HOST_BOUND_SHARE,
    TOLERANCE,
    BenchComparison,
    VariantComparison,
    VariantPrediction,
)
from cost_model.cluster.setting import ClusterSetting
from cost_model.cluster.step_model import (
    ATTENTION_EFFICIENCY_SOURCE,
    MATMUL_EFFICIENCY_SOURCE,
    ClusterPrediction,
)
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


def _link_line(setting: ClusterSetting) -> str:
    link = setting.tp_link
    return (
        f"Link: {link.name} ({link.bandwidth_bytes_per_s / 1e9:g} GB/s per direction, alpha "
        f"{link.latency_s * 1e6:g} us), one queue per direction shared by every group, as the emulator's."
    )


def _model_line(matmul_efficiency: float, attention_efficiency: float, contention: float | None) -> str:
    return (
        f"Analytic: the variant's order on one compute stream and the link (cost_model.cluster.emulated), "
        f"matmuls at {matmul_efficiency:g} of peak ({MATMUL_EFFICIENCY_SOURCE}), attention at "
        f"{attention_efficiency:g} ({ATTENTION_EFFICIENCY_SOURCE}), elementwise ops at the datasheet's "
        f"memory bandwidth (assumed), compute beside a transfer {contention or 1.0:g}x slower (measured on the "
        "emulator), transfers by the link model (the emulator's own); nothing of the host."
    )


def format_variant_predictions(
    setting: ClusterSetting,
    preds: Sequence[VariantPrediction],
    matmul_efficiency: float,
    attention_efficiency: float,
) -> str:
    """An emulated setting's bench variants, predicted (no measurement)."""
    lines = [
        f"### {setting.name}",
        "",
        f"{setting.describe()}. {_link_line(setting)}",
        _model_line(matmul_efficiency, attention_efficiency, setting.contention_factor),
        "",
        "| variant | program | step (ms) | own compute (ms) | own comm (ms) | MB sent/step | transfers/step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in preds:
        lines.append(
            f"| {p.variant} | {p.program.describe(setting)} | {format_ms(p.step_s)} | {format_ms(p.compute_s)} | "
            f"{format_ms(p.comm_s)} | {p.wire_bytes / 1e6:.0f} | {p.transfers} |"
        )
    return "\n".join([*lines, ""])


def _claim(row: VariantComparison) -> str:
    if not row.measured_inputs_claimed:
        return "none: per-peer steps"
    within = abs(row.measured_inputs_ratio - 1.0) <= TOLERANCE
    claims = [f"measured inputs{'' if within else ' (MISSED)'}"]
    if row.analytic_claimed:
        claims.append("analytic" if abs(row.analytic_ratio - 1.0) <= TOLERANCE else "analytic (MISSED)")
    return ", ".join(claims)


def _row_notes(row: VariantComparison) -> list[str]:
    notes = list(row.notes)
    p = row.per_peer
    if p is not None:
        replaced = ", ".join(f"{n} {op}" for op, n in p.replaced.items())
        notes.append(
            f"decompose='auto' issued {replaced} a step as per-peer steps ({p.sends} sends, {p.recvs} receives; "
            f"graph_passes.decompose), which the model does not choose: same bytes, link time with them "
            f"{format_ms(p.comm_s)} ms (measured {format_ms(row.measured.t_comm_s)}); their overlap with the "
            "matmul beside them is not modeled, so neither prediction is claimed"
        )
    return notes


def format_bench_comparison(comparison: BenchComparison, source: str = "") -> str:
    """Predicted beside measured, one row per modeled variant (markdown)."""
    s, record = comparison.setting, comparison.record
    inputs = (
        "max(measured host time, analytic): the host issues the step ahead of the GPU, a wait does not block it"
        if record.on_cuda
        else "the analytic order with each segment's compute scaled so that a step's sums to the measured "
        "t_compute (on CPU the compute is the host's own, and a wait blocks it)"
    )
    lines = [
        f"### {s.name}" + (f" against {source}" if source else ""),
        "",
        f"{s.describe()}. {_link_line(s)}",
        f"Measured (the bench run on {record.device}, {record.dtype}): step, host, own compute (link free), "
        "own comm (its transfers' link time), bytes and transfers per step.",
        _model_line(comparison.matmul_efficiency, comparison.attention_efficiency, s.contention_factor),
        f"Measured inputs: {inputs}.",
        f"Claimed within {format_pct(TOLERANCE, 0)}: the measured-inputs prediction; the analytic one on CUDA where "
        f"the step is not host-bound (host below {format_pct(HOST_BOUND_SHARE, 0)} of the step).",
        "",
        "| variant | program | measured step (ms) | host (ms) | analytic (ms) | analytic / measured | "
        "measured inputs (ms) | / measured | claimed | MB sent/step (predicted / measured) | "
        "transfers | own comm (ms) | own compute (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for row in comparison.rows:
        a, m = row.analytic, row.measured
        lines.append(
            f"| {row.variant} | {a.program.describe(s)} | {format_ms(m.step_s)} | {format_ms(m.host_s)}"
            f"{' (host-bound)' if row.host_bound else ''} | {format_ms(a.step_s)} | {format_ratio(row.analytic_ratio)} | "
            f"{format_ms(row.measured_inputs_s)} | {format_ratio(row.measured_inputs_ratio)} | {_claim(row)} | "
            f"{a.wire_bytes / 1e6:.0f} / {m.wire_bytes / 1e6:.0f} | {a.transfers} / {m.transfers} | "
            f"{format_ms(a.comm_s)} / {format_ms(m.t_comm_s)} | {format_ms(a.compute_s)} / {format_ms(m.t_compute_s)} |"
        )
    notes = [f"- {row.variant}: {note}." for row in comparison.rows for note in _row_notes(row)]
    if notes:
        lines += ["", *notes]
    if comparison.not_modeled:
        lines += ["", f"Not modeled (no program model): {', '.join(comparison.not_modeled)}."]
    return "\n".join([*lines, ""])


__all__ = ["format_bench_comparison", "format_prediction", "format_summary", "format_variant_predictions"]
