"""The step model: a setting's training step, sequential and with the dhelix plan (``dhelix simulate``).

A pure cost model: no process group, no FX graph. One pipeline stage's share of a decoder-only
transformer is two *strands* (:mod:`cost_model.cluster.strands`: the forward and the backward of
one micro-batch on one tensor-parallel rank), each a sequence of segments. Two schedules are costed:

* **sequential** (Megatron-like): every segment's compute, then its collective, nothing overlapped;
* **dhelix**: the forward of micro-batch i+1 and the backward of micro-batch i merged and aligned by
  the Strand Interleaving DP of :mod:`cost_model.strand_plan` (``plan_pairs`` / ``pair_time``,
  with a contention factor) -- the DP the interleave pass runs on FX graphs; the first forward and
  the last backward run alone.

Contract
--------
``simulate_setting(setting, contention_factor=None, matmul_efficiency=MEASURED_MATMUL_EFFICIENCY) -> ClusterPrediction``;
deterministic; every number in seconds, bytes or FLOPs, with the formulas below. A setting that
does not validate raises ``ValueError`` naming the field; a contention factor < 1 or a matmul
efficiency outside (0, 1] raises ``ValueError``.

Step (m micro-batches per pipeline and step, p stages, the slowest stage = the last one, which also
holds the output head)::

    F, B       = sum of (compute + comm) over the forward / backward segments (nothing overlapped)
    M          = plan_pairs(F segments, B segments) -- one merged pair (a forward and a backward)
    sequential = (m + p - 1) * (F + B)                + P2P + DP          (1F1B: bubble (p-1)(F+B))
    dhelix     = F + (m - 1) * M + B + (p - 1)(F + B) + P2P + DP          (m = 1: the sequential step)
    folded     p > 1: the folded (V-shaped) pipeline, two chunks of half the layers per rank, simulated
               action by action (``folded_pipeline``: the bubble and the P2P waits from the
               dependencies), its actions one after another and with a ready forward and backward
               merged into one pair of half the stage's M; + DP
    P2P        = (m + p - 1) * 2 sends of one stage boundary's activation (T*h*2/tp bytes), p > 1
    DP         = reduce-scatter + all-gather of the stage's bf16 gradients / parameters over the
                 dp*cp group, after the last backward; *not* overlapped in either schedule (the
                 authors' scripts do not pass Megatron's --overlap-grad-reduce/--overlap-param-gather);
                 0 with ``dp_mode="shard"``, whose gathers and reduce-scatters are in the strands

MFU uses Megatron-LM's model-FLOPs count (Narayanan et al., SC'21, appendix; no recompute)::

    model FLOPs / step = 3 * (2 * N_tok * (L * P_layer + h * V) + 4 * N_tok * s * h * L)
    P_layer = 4h^2 + (3 if SwiGLU else 2) * h * ffn     N_tok = dp * m * micro_batch_size * s
    MFU = model FLOPs / (step_s * gpus * peak_bf16)

Attention counts as non-causal there (Megatron's convention, assumed to be how the paper's TFLOP/s/GPU
were counted) while the time model runs causal attention at half those FLOPs, so for long sequences
the MFU reads higher than the share of peak the executed FLOPs use.

Left out (both schedules): optimizer step, embedding-gradient sync between first and last stage,
activation recompute, kernel inefficiency beyond ``matmul_efficiency``, Megatron's own async overlap
of backward TP communication, NIC sharing between GPUs of a node. :meth:`ClusterPrediction.explain_gap`
says, per setting, what that means against the paper's number.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from cost_model.cluster.folded_pipeline import ChunkCosts, FoldedRun, simulate_folded
from cost_model.cluster.setting import ClusterSetting
from cost_model.cluster.strands import BF16_BYTES, strands
from cost_model.collectives import collective_time_s
from cost_model.hardware import get_device
from cost_model.strand_plan import Segment, formula_cost, plan_pairs
from cost_model.units import format_pct, format_ratio

#: Achieved share of the datasheet's dense bf16 FLOP/s for a transformer layer's matmuls,
#: measured: 0.76 on an NVIDIA H200 (torch 2.11, cuBLAS), the 21 matmuls of a Llama-3-8B decoder
#: layer as one rank of 2-way TP holds it (hidden 4096, MLP 7168, 4096 tokens, bf16), forward and
#: backward, CUDA events over 10 back-to-back calls each: 3.654 ms measured against 2.792 ms at
#: 989.5 TFLOP/s (BENCHMARKS.md, "The cost model against the H200's kernels", 2026-11-27). The
#: default of ``simulate_setting``; for GPUs other than the H200 it is an assumption.
MEASURED_MATMUL_EFFICIENCY: float = 0.76
MATMUL_EFFICIENCY_SOURCE: str = (
    "measured on an H200 (Llama-3-8B TP2 layer matmuls, bf16, 2026-11-27); assumed for other GPUs"
)
#: Achieved share of the datasheet's dense bf16 FLOP/s for causal attention, measured on the same
#: H200 run: cuDNN SDPA forward + backward of that layer (16 query heads of 128, 4 key/value heads,
#: 4096 tokens) took 0.613 ms for 3.5 x 68.7 GFLOP (the causal half of
#: :func:`~cost_model.cluster.strands.attention_flops`, backward 2.5x): 392 TFLOP/s = 0.40 of
#: 989.5 (BENCHMARKS.md, "The cost model against the H200's kernels", 2026-11-27). Used for the
#: emulated H200 settings (``cluster.emulated``); ``simulate_setting`` prices attention at the matmul
#: efficiency unless given one.
MEASURED_ATTENTION_EFFICIENCY: float = 0.40
ATTENTION_EFFICIENCY_SOURCE: str = "measured on an H200 (cuDNN SDPA fwd + bwd, Llama-3-8B TP2 layer, 2026-11-27)"


@dataclass(frozen=True)
class SchedulePrediction:
    """One schedule's predicted step."""

    name: str
    step_s: float
    mfu: float
    tflops_per_gpu: float
    parts_s: Mapping[str, float] = field(hash=False)
    """Where the step goes: micro-batches, bubble, pipeline P2P, data-parallel sync (seconds)."""


@dataclass(frozen=True)
class ClusterPrediction:
    """Both schedules for one setting, with the pieces they are built from."""

    setting: ClusterSetting
    contention_factor: float
    matmul_efficiency: float
    sequential: SchedulePrediction
    dhelix: SchedulePrediction
    model_flops_per_step: float
    fwd_compute_s: float
    fwd_comm_s: float
    bwd_compute_s: float
    bwd_comm_s: float
    pair_s: float
    """One merged pair (forward of one micro-batch + backward of another) under the DP's plan."""
    paired_segments: int
    fwd_segments: int
    bwd_segments: int
    folded: Mapping[str, tuple[SchedulePrediction, FoldedRun]] | None = field(default=None, hash=False)
    """With pp > 1: the folded pipeline (``folded_pipeline``), its actions one after another
    ("folded") and with the pairs merged ("folded dhelix"), each with its simulated run."""

    @property
    def speedup(self) -> float:
        return self.sequential.step_s / self.dhelix.step_s

    @property
    def exposed_comm_per_step_s(self) -> float:
        """Communication of the strands (TP/SP, uncovered CP ring) the sequential step exposes: all of it."""
        return self.setting.micro_batches * (self.fwd_comm_s + self.bwd_comm_s)

    @property
    def hidden_share(self) -> float:
        """Share of that communication the dhelix plan hides (net of contention)."""
        exposed = self.exposed_comm_per_step_s
        return (self.sequential.step_s - self.dhelix.step_s) / exposed if exposed > 0 else 0.0

    def explain_gap(self) -> str:
        """One line: what the model includes and leaves out, against the paper's number."""
        s = self.setting
        comm = self.fwd_comm_s + self.bwd_comm_s
        comm_share = comm / (comm + self.fwd_compute_s + self.bwd_compute_s)
        kinds = "TP/SP + uncovered CP-ring" if s.parallel.cp > 1 else "TP/SP"
        head = (
            f"{kinds} comm is {format_pct(comm_share, 0)} of a sequential micro-batch (alpha-beta, {s.tp_link.name} for TP); "
            f"the plan hides {format_pct(self.hidden_share, 0)} of it at contention {self.contention_factor:.2f}"
        )
        paper = s.paper.speedup
        if paper is None:
            return head + "; no paper number to compare with."
        mfu = ""
        if s.paper.megatron_tflops_per_gpu is not None:
            paper_mfu = s.paper.megatron_tflops_per_gpu / s.peak_bf16_tflops
            mfu = f" (Megatron MFU: paper {format_pct(paper_mfu, 0)}, model {format_pct(self.sequential.mfu, 0)})"
        if self.speedup > paper * 1.03:
            return head + (
                f"; predicted {format_ratio(self.speedup)} > paper {format_ratio(paper)}: the model's pairs overlap perfectly but "
                "for the contention factor (no other interference between the strands' kernels, and no rule "
                "against pairing two communication segments, which the authors' search/search.py forbids), its "
                "baseline exposes backward TP communication that Megatron partly overlaps, and its Megatron step "
                f"is faster than measured{mfu}: roofline kernels and peak link rates."
            )
        if self.speedup < paper / 1.03:
            return head + (
                f"; predicted {format_ratio(self.speedup)} < paper {format_ratio(paper)}: its Megatron step is faster than "
                f"measured{mfu} -- the real kernels and links leave more time that a second strand can fill -- "
                "and DP/PP traffic, which DHelix may also overlap, stays exposed in both schedules here."
            )
        return (
            head + f"; predicted {format_ratio(self.speedup)} is within 3% of the paper's {format_ratio(paper)}{mfu}."
        )

    def to_dict(self) -> dict[str, Any]:
        s = self.setting
        return {
            "setting": s.name,
            "description": s.describe(),
            "assumed": list(s.assumed),
            "links": {"tp": s.tp_link.name, "cp": s.cp_link.name, "dp": s.dp_link.name, "pp": s.pp_link.name},
            "contention_factor": self.contention_factor,
            "matmul_efficiency": self.matmul_efficiency,
            "model_flops_per_step": self.model_flops_per_step,
            "per_microbatch_s": {
                "fwd_compute": self.fwd_compute_s,
                "fwd_comm": self.fwd_comm_s,
                "bwd_compute": self.bwd_compute_s,
                "bwd_comm": self.bwd_comm_s,
                "merged_pair": self.pair_s,
            },
            "segments": {"fwd": self.fwd_segments, "bwd": self.bwd_segments, "paired": self.paired_segments},
            "sequential": _schedule_dict(self.sequential),
            "dhelix": _schedule_dict(self.dhelix),
            "folded": {
                name: {**_schedule_dict(pred), **dataclasses.asdict(run)} for name, (pred, run) in self.folded.items()
            }
            if self.folded
            else None,
            "predicted_speedup": self.speedup,
            "paper": dataclasses.asdict(s.paper),
            "gap": self.explain_gap(),
        }


def _schedule_dict(p: SchedulePrediction) -> dict[str, Any]:
    return {"step_s": p.step_s, "mfu": p.mfu, "tflops_per_gpu": p.tflops_per_gpu, "parts_s": dict(p.parts_s)}


def model_flops_per_step(setting: ClusterSetting) -> float:
    """Megatron-LM's model FLOPs of one step (module docstring)."""
    m, p = setting.model, setting.parallel
    tokens = p.dp * setting.micro_batches * setting.micro_batch_size * setting.seq_len
    matmul = 2.0 * tokens * (m.layers * m.layer_matmul_params() + m.hidden * m.vocab)
    attention = 4.0 * tokens * setting.seq_len * m.hidden * m.layers
    return 3.0 * (matmul + attention)


def _dp_sync_s(setting: ClusterSetting) -> float:
    if setting.dp_mode == "shard":  # reduce-scattered in each backward: the strands hold it
        return 0.0
    m, p = setting.model, setting.parallel
    params = (m.layers // p.pp * m.layer_matmul_params() + m.hidden * m.vocab) / p.tp
    nbytes = params * BF16_BYTES
    group = p.dp * p.cp
    link = setting.dp_link
    return collective_time_s("reduce_scatter", nbytes, group, link) + collective_time_s(
        "all_gather", nbytes, group, link
    )


def _p2p_s(setting: ClusterSetting) -> float:
    p = setting.parallel
    if p.pp == 1:
        return 0.0
    tokens = setting.micro_batch_size * setting.seq_len // p.cp
    nbytes = tokens * setting.model.hidden * setting.dtype_bytes / p.tp  # Megatron sends the TP-scattered tensor
    return 2 * collective_time_s("send", nbytes, 2, setting.pp_link)


def simulate_setting(
    setting: ClusterSetting,
    *,
    contention_factor: float | None = None,
    matmul_efficiency: float = MEASURED_MATMUL_EFFICIENCY,
    attention_efficiency: float | None = None,
) -> ClusterPrediction:
    """Predict the sequential and the dhelix step of ``setting`` (module docstring).

    ``contention_factor``: compute slowdown while a transfer of the other strand is in flight
    (default: the setting's, else the device's, ``cost_model.hardware``). ``matmul_efficiency``: achieved share of the
    peak bf16 rate for matmuls (1.0 = roofline); ``attention_efficiency`` the same for attention
    (None: the matmul efficiency).
    """

    setting.validate()
    device = get_device(setting.device)
    if contention_factor is not None:
        factor = float(contention_factor)
    else:
        factor = device.contention_factor if setting.contention_factor is None else setting.contention_factor
    if factor < 1.0:
        raise ValueError(f"contention factor must be >= 1.0, got {factor}")
    if not 0.0 < matmul_efficiency <= 1.0:
        raise ValueError(f"matmul_efficiency must be in (0, 1], got {matmul_efficiency}")
    fwd, bwd = strands(setting, matmul_efficiency, attention_efficiency)
    as_segments = [
        [
            Segment(strand=k, nodes=(), compute_s=c.compute_s, comm_s=c.comm_s, live_after_bytes=0, peak_bytes=0)
            for c in side
        ]
        for k, side in enumerate((fwd, bwd))
    ]
    path, pair_s = plan_pairs(as_segments[0], as_segments[1], cost=formula_cost(as_segments[0], as_segments[1], factor))
    f_s = math.fsum(c.compute_s + c.comm_s for c in fwd)
    b_s = math.fsum(c.compute_s + c.comm_s for c in bwd)
    p, m = setting.parallel.pp, setting.micro_batches
    p2p = (m + p - 1) * _p2p_s(setting)
    dp = _dp_sync_s(setting)
    bubble = (p - 1) * (f_s + b_s)
    seq_parts = {"micro-batches": m * (f_s + b_s), "pipeline bubble": bubble, "pipeline p2p": p2p, "dp sync": dp}
    dh_micro = f_s + b_s if m == 1 else f_s + (m - 1) * pair_s + b_s
    dh_parts = {"micro-batches": dh_micro, "pipeline bubble": bubble, "pipeline p2p": p2p, "dp sync": dp}
    flops = model_flops_per_step(setting)
    gpus = setting.parallel.gpus
    peak = device.flops_per_s(torch.bfloat16)

    def prediction(name: str, parts: dict[str, float]) -> SchedulePrediction:
        step = math.fsum(parts.values())
        return SchedulePrediction(name, step, flops / (step * gpus * peak), flops / (step * gpus) / 1e12, parts)

    folded = None
    if p > 1:  # two chunks of half the stage's layers per rank, costed action by action
        chunk = ChunkCosts(f_s / 2, b_s / 2, pair_s / 2, _p2p_s(setting) / 2)
        folded = {}
        for name, merge in (("folded", False), ("folded dhelix", True)):
            run = simulate_folded(p, m, chunk, merge=merge)
            parts = {"micro-batches": run.busy_s, "pipeline bubble": run.bubble_s, "pipeline p2p": 0.0, "dp sync": dp}
            folded[name] = (prediction(f"{name} ({run.pairs} pairs merged)" if merge else name, parts), run)
    return ClusterPrediction(
        folded=folded,
        setting=setting,
        contention_factor=factor,
        matmul_efficiency=matmul_efficiency,
        sequential=prediction("sequential (Megatron-like)", seq_parts),
        dhelix=prediction("dhelix plan", dh_parts),
        model_flops_per_step=flops,
        fwd_compute_s=math.fsum(c.compute_s for c in fwd),
        fwd_comm_s=math.fsum(c.comm_s for c in fwd),
        bwd_compute_s=math.fsum(c.compute_s for c in bwd),
        bwd_comm_s=math.fsum(c.comm_s for c in bwd),
        pair_s=pair_s,
        paired_segments=sum(1 for i, j in path if i is not None and j is not None),
        fwd_segments=len(fwd),
        bwd_segments=len(bwd),
    )


__all__ = [
    "ATTENTION_EFFICIENCY_SOURCE",
    "MATMUL_EFFICIENCY_SOURCE",
    "MEASURED_ATTENTION_EFFICIENCY",
    "MEASURED_MATMUL_EFFICIENCY",
    "ClusterPrediction",
    "SchedulePrediction",
    "model_flops_per_step",
    "simulate_setting",
]
