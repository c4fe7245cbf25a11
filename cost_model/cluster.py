"""cluster: predicted training steps for cluster settings we cannot run (``dhelix simulate``).

A pure cost model: no process group, no FX graph. One pipeline stage's share of a decoder-only
transformer is written down as two *strands* (the forward and the backward of one micro-batch on one
tensor-parallel rank), each a sequence of segments -- compute, then the collective that ends it --
exactly the shape that :mod:`cost_model.strand_plan` plans over (as the interleave pass does on FX graphs). Two schedules are costed:

* **sequential** (Megatron-like): every segment's compute, then its collective, nothing overlapped;
* **dhelix**: the forward of micro-batch i+1 and the backward of micro-batch i merged and aligned by
  the Strand Interleaving DP of :mod:`cost_model.strand_plan` (``plan_pairs`` / ``pair_time``, with a
  contention factor); the first forward and the last backward run alone.

Contract
    ``simulate_setting(setting, contention_factor=None, matmul_efficiency=1.0) -> ClusterPrediction``;
    deterministic; every number in seconds, bytes or FLOPs, with the formula below. A setting whose
    degrees do not divide the model (heads % tp, layers % pp, ...) raises ``ValueError`` naming it;
    an unknown setting name raises :class:`UnknownSettingError` listing the valid ones.

One layer, one micro-batch, one TP rank (T = micro_batch_size * seq_len / cp tokens; Megatron-LM
tensor + sequence parallelism, which the DHelix authors' launch scripts use: ``--sequence-parallel``)::

    forward   [norm] AG | [QKV mm, rope, attention (+CP ring), out mm] RS | [add, norm] AG |
              [FC1 mm, act, FC2 mm] RS | ...                                  (AG/RS: T*h*2 bytes)
    backward  the same operators in reverse: a forward AG becomes an RS of the gradient and a forward
              RS an AG; matmuls cost dgrad + wgrad (2x), attention 2.5x (FlashAttention's backward
              recomputes the scores), elementwise ops 2x their forward bytes
    without SP: no AG, the RS become all-reduces

Costs (``cost_model.hardware`` tables, ``cost_model.collectives`` alpha-beta models)::

    matmul      launch + max(2mnk / (peak_bf16 * matmul_efficiency), bytes / mem_bw)
    attention   launch + 4 * b * s_q * s_kv * heads/tp * head_dim * (1/2 causal) / (peak * eff)
    elementwise launch + bytes / mem_bw
    collective  collective_time_s(op, S, group, link): link = intra-node link if the group fits in a
                node (stride * size <= gpus_per_node, Megatron's rank order tp < cp < dp < pp), else
                the inter-node link (one NIC per GPU assumed)
    CP ring     (cp - 1) send/recv of the local K and V, overlapped with the attention inside the
                micro-batch as Megatron's ring attention does; what the attention does not cover,
                max(0, ring - attention), is a transfer ending the attention's segment (2x in backward)

Step (m micro-batches per pipeline and step, p stages, the slowest stage = the last one, which also
holds the output head)::

    F, B       = sum of (compute + comm) over the forward / backward segments (nothing overlapped)
    M          = plan_pairs(F segments, B segments) -- one merged pair (a forward and a backward)
    sequential = (m + p - 1) * (F + B)                + P2P + DP          (1F1B: bubble (p-1)(F+B))
    dhelix     = F + (m - 1) * M + B + (p - 1)(F + B) + P2P + DP          (m = 1: the sequential step)
    P2P        = (m + p - 1) * 2 sends of one stage boundary's activation (T*h*2/tp bytes), p > 1
    DP         = reduce-scatter + all-gather of the stage's bf16 gradients / parameters over the
                 dp*cp group, after the last backward; *not* overlapped in either schedule (the
                 authors' scripts do not pass Megatron's --overlap-grad-reduce/--overlap-param-gather)

MFU uses Megatron-LM's model-FLOPs count (Narayanan et al., SC'21, appendix; no recompute)::

    model FLOPs / step = 3 * (2 * N_tok * (L * P_layer + h * V) + 4 * N_tok * s * h * L)
    P_layer = 4h^2 + (3 if SwiGLU else 2) * h * ffn     N_tok = dp * m * micro_batch_size * s
    MFU = model FLOPs / (step_s * gpus * peak_bf16)

Attention counts as non-causal there (Megatron's convention, assumed to be how the paper's TFLOP/s/GPU
were counted) while the time model runs causal attention at half those FLOPs, so for long sequences
the MFU reads higher than the share of peak the executed FLOPs use.

Left out (both schedules): optimizer step, embedding-gradient sync between first and last stage,
activation recompute, kernel inefficiency beyond ``matmul_efficiency``, Megatron's own async overlap
of backward TP communication, NIC sharing between GPUs of a node.

The DP is :mod:`cost_model.strand_plan`, the same one the interleave pass runs on FX graphs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from cost_model.collectives import collective_time_s
from cost_model.hardware import Device, Link, get_device, get_link
from cost_model.strand_plan import Segment, formula_cost, plan_pairs

aten = torch.ops.aten

BF16_BYTES: int = 2
FP32_BYTES: int = 4

#: FlashAttention's backward costs 2.5x its forward matmul FLOPs (five matmuls -- the score
#: recompute, dV, dP, dQ, dK -- against the forward's two). Dao, FlashAttention-2 (arXiv 2307.08691).
ATTENTION_BACKWARD_RATIO: float = 2.5

Family = Literal["llama", "gpt"]


class UnknownSettingError(KeyError):
    """An unknown cluster setting name; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (multi-head attention, no GQA)."""

    name: str
    """Display name, e.g. ``"Llama-8B"``."""
    family: Family
    """``"llama"``: RMSNorm, SwiGLU MLP (three matrices), RoPE; ``"gpt"``: LayerNorm, GeLU MLP (two)."""
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    vocab: int
    source: str
    """Where the shape comes from ("assumed: ..." when the paper does not give it)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.family == "llama" else 2

    def layer_matmul_params(self) -> int:
        """Weights of one layer's matmuls: QKV + output projection + MLP (norms and biases left out)."""
        return 4 * self.hidden * self.hidden + self.mlp_matrices * self.hidden * self.ffn_hidden

    def params(self) -> int:
        """All matmul weights plus one (tied) embedding table."""
        return self.layers * self.layer_matmul_params() + self.vocab * self.hidden


@dataclass(frozen=True)
class Parallelism:
    """Parallel degrees; ranks are ordered tp (fastest), cp, dp, pp as in Megatron-LM."""

    dp: int
    tp: int
    pp: int = 1
    cp: int = 1
    sequence_parallel: bool = True
    """Megatron-LM sequence parallelism: TP all-gather / reduce-scatter instead of all-reduce."""

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        parts = [f"DP{self.dp}", f"TP{self.tp}"]
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        parts.append(f"PP{self.pp}")
        return " ".join(parts) + (" +SP" if self.sequence_parallel and self.tp > 1 else "")


@dataclass(frozen=True)
class PaperReport:
    """What the DHelix authors report for a setting (``None`` where nothing was found)."""

    speedup: float | None
    """DHelix (DHeLLaM) throughput / Megatron-LM throughput, as labelled in the figure."""
    megatron_tflops_per_gpu: float | None
    dhelix_tflops_per_gpu: float | None
    source: str


@dataclass(frozen=True)
class ClusterSetting:
    """One cluster configuration to predict."""

    name: str
    """CLI name, e.g. ``"a40-llama-8b"``."""
    model: ModelShape
    parallel: Parallelism
    seq_len: int
    micro_batch_size: int
    micro_batches: int
    """Micro-batches per pipeline per step (global batch = dp * micro_batches * micro_batch_size)."""
    device: str
    gpus_per_node: int
    intra_node_link: str
    inter_node_link: str
    paper: PaperReport
    assumed: tuple[str, ...] = ()
    """Fields the paper does not give (chosen here; printed as "assumed")."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that does not fit the model or cluster."""
        p, m = self.parallel, self.model
        for name in ("dp", "tp", "pp", "cp"):
            if getattr(p, name) < 1:
                raise ValueError(f"{self.name}: {name} must be >= 1, got {getattr(p, name)}")
        if m.hidden % m.heads:
            raise ValueError(f"{self.name}: hidden {m.hidden} is not a multiple of heads {m.heads}")
        if m.heads % p.tp:
            raise ValueError(f"{self.name}: {m.heads} heads do not split over tp={p.tp}")
        if m.ffn_hidden % p.tp:
            raise ValueError(f"{self.name}: ffn_hidden {m.ffn_hidden} does not split over tp={p.tp}")
        if m.layers % p.pp:
            raise ValueError(f"{self.name}: {m.layers} layers do not split into pp={p.pp} stages")
        if self.seq_len % (p.cp * (p.tp if p.sequence_parallel else 1)):
            raise ValueError(f"{self.name}: seq_len {self.seq_len} does not split over cp*tp")
        if self.micro_batch_size < 1 or self.micro_batches < 1:
            raise ValueError(f"{self.name}: micro_batch_size and micro_batches must be >= 1")
        if self.gpus_per_node < 1:
            raise ValueError(f"{self.name}: gpus_per_node must be >= 1")
        get_device(self.device)
        get_link(self.intra_node_link)
        get_link(self.inter_node_link)

    def group_link(self, stride: int, size: int) -> Link:
        """The link a group of ``size`` ranks ``stride`` apart runs over (see module docstring)."""
        if stride * size <= self.gpus_per_node:
            return get_link(self.intra_node_link)
        return get_link(self.inter_node_link)

    @property
    def tp_link(self) -> Link:
        return self.group_link(1, self.parallel.tp)

    @property
    def cp_link(self) -> Link:
        return self.group_link(self.parallel.tp, self.parallel.cp)

    @property
    def dp_link(self) -> Link:
        """Gradient sync runs over the dp x cp ranks of one (tp, pp) position."""
        return self.group_link(self.parallel.tp, self.parallel.cp * self.parallel.dp)

    @property
    def pp_link(self) -> Link:
        p = self.parallel
        return self.group_link(p.tp * p.cp * p.dp, 2)

    def describe(self) -> str:
        m, p = self.model, self.parallel
        nodes = math.ceil(p.gpus / self.gpus_per_node)
        return (
            f"{m.name} ({m.params() / 1e9:.1f}B: {m.layers} layers, hidden {m.hidden}, {m.heads} heads, "
            f"FFN {m.ffn_hidden}, vocab {m.vocab}) on {p.gpus}x {self.device} ({nodes} nodes x "
            f"{self.gpus_per_node}, {self.intra_node_link} / {self.inter_node_link}); {p.label()}; "
            f"seq {self.seq_len}, micro-batch {self.micro_batch_size}, {self.micro_batches} micro-batches "
            f"per step"
        )


# --------------------------------------------------------------------------- strands


@dataclass(frozen=True)
class ClusterSegment:
    """A run of one strand: compute, then (at most) one collective whose time is ``comm_s``."""

    ops: tuple[str, ...]
    compute_s: float
    comm_s: float
    collective: str | None


@dataclass(frozen=True)
class _Op:
    """One operator of the forward, with the cost of its backward counterpart.

    Compute ops have ``fwd_s`` / ``bwd_s``; transfers have ``(label, seconds)`` for the forward and
    the backward (``None`` where that direction issues nothing).
    """

    name: str
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    fwd_comm: tuple[str, float] | None = None
    bwd_comm: tuple[str, float] | None = None


def matmul_time_s(m: int, n: int, k: int, device: Device, efficiency: float = 1.0) -> float:
    """Roofline time of an ``[m, k] @ [k, n]`` bf16 matmul."""
    flops = 2.0 * m * n * k
    nbytes = BF16_BYTES * (m * k + k * n + m * n)
    peak = device.flops_per_s(torch.bfloat16) * efficiency
    return device.launch_overhead_s + max(flops / peak, nbytes / device.mem_bandwidth_bytes_per_s)


def elementwise_time_s(nbytes: float, device: Device) -> float:
    """Memory-bound time of an operator that moves ``nbytes``."""
    return device.launch_overhead_s + nbytes / device.mem_bandwidth_bytes_per_s


def attention_flops(batch: int, q_len: int, kv_len: int, heads: int, head_dim: int, *, causal: bool) -> float:
    """Forward FLOPs of softmax(Q K^T) V: two matmuls, halved by a causal mask."""
    return 4.0 * batch * q_len * kv_len * heads * head_dim * (0.5 if causal else 1.0)


_BACKWARD_OF = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_reduce": "all_reduce"}


class _StageBuilder:
    """The last pipeline stage's operators for one micro-batch on one TP rank (module docstring)."""

    def __init__(self, setting: ClusterSetting, matmul_efficiency: float) -> None:
        self.s = setting
        self.dev = get_device(setting.device)
        self.eff = matmul_efficiency
        p = setting.parallel
        self.tp = p.tp
        self.sp = p.sequence_parallel and p.tp > 1
        self.tokens = setting.micro_batch_size * setting.seq_len // p.cp  # T: this CP rank's tokens
        self.norm_tokens = self.tokens // p.tp if self.sp else self.tokens

    def _mm(self, name: str, m: int, n: int, k: int) -> _Op:
        t = matmul_time_s(m, n, k, self.dev, self.eff)
        return _Op(name, fwd_s=t, bwd_s=2 * t)  # dgrad + wgrad: two matmuls of the same size

    def _elementwise(self, name: str, nbytes: float) -> _Op:
        return _Op(name, fwd_s=elementwise_time_s(nbytes, self.dev), bwd_s=elementwise_time_s(2 * nbytes, self.dev))

    def _tp_collective(self, name: str, fwd_op: str) -> _Op:
        nbytes = float(self.tokens * self.s.model.hidden * BF16_BYTES)
        link = self.s.tp_link
        bwd_op = _BACKWARD_OF[fwd_op]
        return _Op(
            name,
            fwd_comm=(f"{fwd_op} ({name})", collective_time_s(fwd_op, nbytes, self.tp, link)),
            bwd_comm=(f"{bwd_op} ({name} grad)", collective_time_s(bwd_op, nbytes, self.tp, link)),
        )

    def _gather(self, name: str) -> list[_Op]:
        """Entering a TP region: an all-gather with SP, nothing without (the input is replicated)."""
        return [self._tp_collective(name, "all_gather")] if self.sp else []

    def _reduce(self, name: str) -> _Op:
        return self._tp_collective(name, "reduce_scatter" if self.sp else "all_reduce")

    def _attention(self) -> list[_Op]:
        """Attention; with CP, the K/V ring's remainder that the attention itself does not cover.

        Megatron's ring attention overlaps each of the (cp - 1) K/V hops with the attention of the
        chunk already received, so a micro-batch waits ``max(0, ring - attention)``: a transfer
        that the other strand's compute may hide (DHelix pairs the ring-attention operators too).
        In the backward the ring carries K/V again and their gradients (2x).
        """
        s, m, p = self.s, self.s.model, self.s.parallel
        heads = m.heads // p.tp
        flops = attention_flops(s.micro_batch_size, self.tokens // s.micro_batch_size, s.seq_len, heads, m.head_dim, causal=True)
        peak = self.dev.flops_per_s(torch.bfloat16) * self.eff
        fwd = self.dev.launch_overhead_s + flops / peak
        bwd = self.dev.launch_overhead_s + ATTENTION_BACKWARD_RATIO * flops / peak
        ops = [_Op("attention", fwd_s=fwd, bwd_s=bwd)]
        if p.cp > 1:
            kv_bytes = 2.0 * self.tokens * (m.hidden // p.tp) * BF16_BYTES
            ring = (p.cp - 1) * collective_time_s("send", kv_bytes, 2, s.cp_link)
            # in the backward this op comes *before* the attention: the grads' ring ends it there
            ops.append(
                _Op(
                    "cp ring",
                    fwd_comm=("send/recv (cp ring, uncovered)", max(0.0, ring - fwd)),
                    bwd_comm=("send/recv (cp ring grad, uncovered)", max(0.0, 2 * ring - bwd)),
                )
            )
        return ops

    def layer(self) -> list[_Op]:
        m, T, tp = self.s.model, self.tokens, self.tp
        h, f = m.hidden, m.ffn_hidden
        act = T * h * BF16_BYTES
        # residual add (read 2, write 1) + norm (read 1, write 1)
        norm = self._elementwise("add+norm", 5 * self.norm_tokens * h * BF16_BYTES)
        ops: list[_Op] = [norm, *self._gather("all_gather attn-in")]
        ops.append(self._mm("qkv", T, 3 * h // tp, h))
        if m.family == "llama":
            ops.append(self._elementwise("rope", 4 * act // tp))  # q and k, read + write
        ops.extend(self._attention())
        ops.append(self._mm("attn out", T, h, h // tp))
        ops.append(self._reduce("reduce attn-out"))
        ops.append(dataclasses.replace(norm))
        ops.extend(self._gather("all_gather mlp-in"))
        fc1_out = (2 if m.family == "llama" else 1) * f // tp
        ops.append(self._mm("fc1", T, fc1_out, h))
        act_bytes = (3 if m.family == "llama" else 2) * T * (f // tp) * BF16_BYTES
        ops.append(self._elementwise("swiglu" if m.family == "llama" else "gelu", act_bytes))
        ops.append(self._mm("fc2", T, h, f // tp))
        ops.append(self._reduce("reduce mlp-out"))
        return ops

    def embedding(self) -> list[_Op]:
        """Vocab-parallel embedding (first stage): a row gather, then the partial sums reduced."""
        lookup = self._elementwise("embedding", 2 * self.tokens * self.s.model.hidden * BF16_BYTES)
        return [lookup, self._reduce("reduce embedding")]

    def head(self) -> list[_Op]:
        """Final norm, vocab-parallel logits and cross-entropy (last stage)."""
        m, T, tp = self.s.model, self.tokens, self.tp
        ops = [self._elementwise("final norm", 4 * self.norm_tokens * m.hidden * BF16_BYTES)]
        ops.extend(self._gather("all_gather head-in"))
        ops.append(self._mm("logits", T, m.vocab // tp, m.hidden))
        ops.append(self._elementwise("cross-entropy", 3 * T * (m.vocab // tp) * FP32_BYTES))
        # vocab-parallel cross-entropy: all-reduce of the max, the sum of exps and the target logit
        loss_s = collective_time_s("all_reduce", 3.0 * T * FP32_BYTES, self.tp, self.s.tp_link)
        ops.append(_Op("loss stats", fwd_comm=("all_reduce (loss stats)", loss_s)))
        return ops

    def stage_ops(self) -> list[_Op]:
        p = self.s.parallel
        layers = self.s.model.layers // p.pp
        ops = self.embedding() if p.pp == 1 else []
        for _ in range(layers):
            ops.extend(self.layer())
        ops.extend(self.head())
        return ops


def _cut(items: Sequence[tuple[str, float, tuple[str, float] | None]]) -> list[ClusterSegment]:
    """Items (name, compute seconds, transfer or None) -> segments ending at each transfer."""
    segments: list[ClusterSegment] = []
    names: list[str] = []
    compute = 0.0
    for name, seconds, comm in items:
        if comm is None:
            names.append(name)
            compute += seconds
            continue
        label, comm_s = comm
        segments.append(ClusterSegment(tuple(names), compute, comm_s, label))
        names, compute = [], 0.0
    if names:
        segments.append(ClusterSegment(tuple(names), compute, 0.0, None))
    return segments


def strands(setting: ClusterSetting, matmul_efficiency: float = 1.0) -> tuple[list[ClusterSegment], list[ClusterSegment]]:
    """(forward, backward) segments of one micro-batch on the last pipeline stage."""
    setting.validate()
    ops = _StageBuilder(setting, matmul_efficiency).stage_ops()
    fwd_items = [(op.name, op.fwd_s, op.fwd_comm) for op in ops if op.fwd_comm is not None or op.fwd_s > 0]
    bwd_items = [
        (op.name, op.bwd_s, op.bwd_comm) for op in reversed(ops) if op.bwd_comm is not None or op.bwd_s > 0
    ]
    return _cut(fwd_items), _cut(bwd_items)


# --------------------------------------------------------------------------- schedules


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
            f"{kinds} comm is {comm_share:.0%} of a sequential micro-batch (alpha-beta, {s.tp_link.name} for TP); "
            f"the plan hides {self.hidden_share:.0%} of it at contention {self.contention_factor:.2f}"
        )
        paper = s.paper.speedup
        if paper is None:
            return head + "; no paper number to compare with."
        mfu = ""
        if s.paper.megatron_tflops_per_gpu is not None:
            peak_tflops = get_device(s.device).flops_per_s(torch.bfloat16) / 1e12
            paper_mfu = s.paper.megatron_tflops_per_gpu / peak_tflops
            mfu = f" (Megatron MFU: paper {paper_mfu:.0%}, model {self.sequential.mfu:.0%})"
        if self.speedup > paper * 1.03:
            return head + (
                f"; predicted {self.speedup:.2f}x > paper {paper:.2f}x: the model's pairs overlap perfectly but "
                "for the contention factor (no other interference between the strands' kernels, and no rule "
                "against pairing two communication segments, which the authors' search/search.py forbids), its "
                "baseline exposes backward TP communication that Megatron partly overlaps, and its Megatron step "
                f"is faster than measured{mfu}: roofline kernels and peak link rates."
            )
        if self.speedup < paper / 1.03:
            return head + (
                f"; predicted {self.speedup:.2f}x < paper {paper:.2f}x: its Megatron step is faster than "
                f"measured{mfu} -- the real kernels and links leave more time that a second strand can fill -- "
                "and DP/PP traffic, which DHelix may also overlap, stays exposed in both schedules here."
            )
        return head + f"; predicted {self.speedup:.2f}x is within 3% of the paper's {paper:.2f}x{mfu}."

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
    m, p = setting.model, setting.parallel
    params = (m.layers // p.pp * m.layer_matmul_params() + m.hidden * m.vocab) / p.tp
    nbytes = params * BF16_BYTES
    group = p.dp * p.cp
    link = setting.dp_link
    return collective_time_s("reduce_scatter", nbytes, group, link) + collective_time_s("all_gather", nbytes, group, link)


def _p2p_s(setting: ClusterSetting) -> float:
    p = setting.parallel
    if p.pp == 1:
        return 0.0
    tokens = setting.micro_batch_size * setting.seq_len // p.cp
    nbytes = tokens * setting.model.hidden * BF16_BYTES / p.tp  # Megatron sends the TP-scattered tensor
    return 2 * collective_time_s("send", nbytes, 2, setting.pp_link)


def simulate_setting(
    setting: ClusterSetting, *, contention_factor: float | None = None, matmul_efficiency: float = 1.0
) -> ClusterPrediction:
    """Predict the sequential and the dhelix step of ``setting`` (module docstring).

    ``contention_factor``: compute slowdown while a transfer of the other strand is in flight
    (default: the device's, ``cost_model.hardware``). ``matmul_efficiency``: achieved share of the
    peak bf16 rate for matmuls and attention (1.0 = roofline).
    """

    setting.validate()
    device = get_device(setting.device)
    factor = device.contention_factor if contention_factor is None else float(contention_factor)
    if factor < 1.0:
        raise ValueError(f"contention factor must be >= 1.0, got {factor}")
    if not 0.0 < matmul_efficiency <= 1.0:
        raise ValueError(f"matmul_efficiency must be in (0, 1], got {matmul_efficiency}")
    fwd, bwd = strands(setting, matmul_efficiency)
    as_segments = [
        [Segment(strand=k, nodes=(), compute_s=c.compute_s, comm_s=c.comm_s, live_after_bytes=0, peak_bytes=0) for c in side]
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

    return ClusterPrediction(
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


# --------------------------------------------------------------------------- the paper's settings

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
        ModelShape("Llama-8B", "llama", 32, 4096, 32, 14336, _LLAMA_VOCAB,
                   "assumed: Llama-3-8B shape without GQA (7.9B with a 32k vocab)"),
        ModelShape("Llama-25B", "llama", 40, 7168, 56, 19200, _LLAMA_VOCAB,
                   "assumed: no published shape; hidden 7168 / 56 heads (divisible by tp 8), FFN ~8/3 h"),
        ModelShape("Llama-39B", "llama", 48, 8192, 64, 22016, _LLAMA_VOCAB,
                   "assumed: Megatron-LM's 39.1B (48 x 8192, 64 heads) with a Llama SwiGLU MLP (FFN of LLaMA-65B)"),
        ModelShape("Llama-66B", "llama", 80, 8192, 64, 22016, _LLAMA_VOCAB,
                   "assumed: LLaMA-65B shape (Touvron et al. 2023: 80 x 8192, 64 heads, FFN 22016)"),
        ModelShape("GPT-6.7B", "gpt", 32, 4096, 32, 16384, _GPT_VOCAB,
                   "GPT-3 6.7B (Brown et al. 2020, Table 2.1: 32 x 4096, 32 heads)"),
        ModelShape("GPT-18B", "gpt", 40, 6144, 48, 24576, _GPT_VOCAB,
                   "assumed: Megatron-LM's 18.4B (Narayanan et al. 2021, Table 1: 40 x 6144, 48 heads)"),
        ModelShape("GPT-30B", "gpt", 48, 7168, 56, 28672, _GPT_VOCAB,
                   "assumed: OPT-30B shape (Zhang et al. 2022: 48 x 7168, 56 heads)"),
    )
}

_A40_ASSUMED = (
    "model shape", "seq_len", "micro_batch_size", "micro_batches", "gpus_per_node 8",
    "intra-node link pcie4", "inter-node link ib_hdr",
)


def _a40(name: str, model: str, dp: int, tp: int, pp: int, cp: int, seq: int, speedup: float,
         megatron: float, dhelix: float) -> ClusterSetting:
    return ClusterSetting(
        name=name, model=MODELS[model], parallel=Parallelism(dp=dp, tp=tp, pp=pp, cp=cp),
        seq_len=seq, micro_batch_size=1, micro_batches=8, device="a40", gpus_per_node=8,
        intra_node_link="pcie4", inter_node_link="ib_hdr",
        paper=PaperReport(speedup, megatron, dhelix, _FIG_A40), assumed=_A40_ASSUMED,
    )


def _a800(name: str, seq: int, dp: int, cp: int, speedup: float, megatron: float, dhelix: float) -> ClusterSetting:
    return ClusterSetting(
        name=name, model=MODELS["llama-66b"], parallel=Parallelism(dp=dp, tp=8, pp=2, cp=cp),
        seq_len=seq, micro_batch_size=1, micro_batches=8, device="a800", gpus_per_node=8,
        intra_node_link="nvlink3_a800", inter_node_link="ib_hdr",
        paper=PaperReport(speedup, megatron, dhelix, _FIG_A800),
        assumed=("model shape", "micro_batch_size", "micro_batches", "gpus_per_node 8", "inter-node link ib_hdr"),
    )


def _h100(name: str, dp: int, tp: int) -> ClusterSetting:
    return ClusterSetting(
        name=name, model=MODELS["llama-39b"], parallel=Parallelism(dp=dp, tp=tp),
        seq_len=4096, micro_batch_size=1, micro_batches=8, device="h100_sxm", gpus_per_node=8,
        intra_node_link="nvlink4", inter_node_link="ib_ndr",
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
    """A setting by name; :class:`UnknownSettingError` lists the valid names."""
    if name not in SETTINGS:
        valid = ", ".join(SETTINGS)
        raise UnknownSettingError(f"unknown setting {name!r}; valid settings: {valid} (or 'all')")
    return SETTINGS[name]


def simulate_settings(
    names: Sequence[str] | None = None, *, contention_factor: float | None = None, matmul_efficiency: float = 1.0
) -> list[ClusterPrediction]:
    """:func:`simulate_setting` for each name (all settings when ``names`` is None), in order."""
    chosen = list(SETTINGS) if names is None else list(names)
    return [
        simulate_setting(get_setting(n), contention_factor=contention_factor, matmul_efficiency=matmul_efficiency)
        for n in chosen
    ]


# --------------------------------------------------------------------------- report


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def format_prediction(pred: ClusterPrediction) -> str:
    """One setting as a markdown section: a table of both schedules, the paper's number, the gap."""
    s = pred.setting
    device = get_device(s.device)
    peak_tflops = device.flops_per_s(torch.bfloat16) / 1e12
    paper = s.paper

    def paper_mfu(tflops: float | None) -> str:
        return "n/a" if tflops is None else f"{tflops:.1f} ({_pct(tflops / peak_tflops)})"

    paper_speedup = "not found" if paper.speedup is None else f"{paper.speedup:.2f}x"
    seq, dh, parts = pred.sequential, pred.dhelix, pred.sequential.parts_s
    p = s.parallel
    links = ", ".join(
        f"{kind} {link.name}"
        for kind, degree, link in (("TP", p.tp, s.tp_link), ("CP", p.cp, s.cp_link), ("DP", p.dp, s.dp_link),
                                   ("PP", p.pp, s.pp_link))
        if degree > 1
    )
    per_microbatch = (
        f"forward {1e3 * pred.fwd_compute_s:.1f} ms compute + {1e3 * pred.fwd_comm_s:.1f} ms comm, "
        f"backward {1e3 * pred.bwd_compute_s:.1f} + {1e3 * pred.bwd_comm_s:.1f} ms; merged pair "
        f"{1e3 * pred.pair_s:.1f} ms ({pred.paired_segments} of {pred.fwd_segments}/{pred.bwd_segments} "
        "segments paired)"
    )
    per_step = (
        f"DP sync {1e3 * parts['dp sync']:.1f} ms, bubble {1e3 * parts['pipeline bubble']:.1f} ms, "
        f"PP p2p {1e3 * parts['pipeline p2p']:.1f} ms"
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
            f"| {seq.name} | {1e3 * seq.step_s:.1f} | {_pct(seq.mfu)} | {seq.tflops_per_gpu:.1f} | 1.00x | "
            f"Megatron-LM {paper_mfu(paper.megatron_tflops_per_gpu)} | 1.00x |"
        ),
        (
            f"| {dh.name} | {1e3 * dh.step_s:.1f} | {_pct(dh.mfu)} | {dh.tflops_per_gpu:.1f} | "
            f"{pred.speedup:.2f}x | DHelix {paper_mfu(paper.dhelix_tflops_per_gpu)} | {paper_speedup} |"
        ),
        "",
        f"Per micro-batch: {per_microbatch}; per step: {per_step}.",
        f"Paper source: {paper.source}.",
        f"Gap: {pred.explain_gap()}",
        "",
    ]
    return "\n".join(lines)


def format_summary(preds: Sequence[ClusterPrediction]) -> str:
    """All settings in one markdown table."""
    lines = [
        "| setting | degrees | seq MFU | dhelix MFU | predicted speedup | paper speedup | paper MFU (Megatron -> DHelix) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for pred in preds:
        s = pred.setting
        peak = get_device(s.device).flops_per_s(torch.bfloat16) / 1e12
        paper = s.paper
        if paper.megatron_tflops_per_gpu is not None and paper.dhelix_tflops_per_gpu is not None:
            paper_mfu = f"{_pct(paper.megatron_tflops_per_gpu / peak)} -> {_pct(paper.dhelix_tflops_per_gpu / peak)}"
        else:
            paper_mfu = "not found"
        lines.append(
            f"| {s.name} | {s.parallel.label()} | {_pct(pred.sequential.mfu)} | {_pct(pred.dhelix.mfu)} | "
            f"{pred.speedup:.2f}x | {'not found' if paper.speedup is None else f'{paper.speedup:.2f}x'} | {paper_mfu} |"
        )
    return "\n".join(lines) + "\n"


__all__ = [
    "MODELS",
    "PAPER_SUMMARY",
    "SETTINGS",
    "ClusterPrediction",
    "ClusterSegment",
    "ClusterSetting",
    "ModelShape",
    "PaperReport",
    "Parallelism",
    "SchedulePrediction",
    "UnknownSettingError",
    "attention_flops",
    "elementwise_time_s",
    "format_prediction",
    "format_summary",
    "get_setting",
    "matmul_time_s",
    "model_flops_per_step",
    "simulate_setting",
    "simulate_settings",
    "strands",
]
