"""One micro-batch of the last pipeline stage as two strands of segments, costed analytically.

Contract
--------
``strands(setting, matmul_efficiency=1.0) -> (forward segments, backward segments)``: the
operators of one micro-batch on one tensor-parallel rank of the last pipeline stage (its share
of the layers, plus the output head; plus the embedding when pp = 1), cut into
:class:`ClusterSegment` s -- compute, then the transfer that ends it -- the shape that
:mod:`cost_model.strand_plan` plans over. Deterministic; seconds from the formulas below.

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
    collective  collective_time_s(op, S, group, link): the group's link
                (:meth:`cost_model.cluster.setting.ClusterSetting.group_link`)
    CP ring     (cp - 1) send/recv of the local K and V, overlapped with the attention inside the
                micro-batch as Megatron's ring attention does; what the attention does not cover,
                max(0, ring - attention), is a transfer ending the attention's segment (2x in backward)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cost_model.cluster.setting import ClusterSetting
from cost_model.collectives import collective_time_s
from cost_model.hardware import Device, get_device

BF16_BYTES: int = 2
FP32_BYTES: int = 4

#: FlashAttention's backward costs 2.5x its forward matmul FLOPs (five matmuls -- the score
#: recompute, dV, dP, dQ, dK -- against the forward's two). Dao, FlashAttention-2 (arXiv 2307.08691).
ATTENTION_BACKWARD_RATIO: float = 2.5


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
        flops = attention_flops(
            s.micro_batch_size, self.tokens // s.micro_batch_size, s.seq_len, heads, m.head_dim, causal=True
        )
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


def strands(
    setting: ClusterSetting, matmul_efficiency: float = 1.0
) -> tuple[list[ClusterSegment], list[ClusterSegment]]:
    """(forward, backward) segments of one micro-batch on the last pipeline stage."""
    setting.validate()
    ops = _StageBuilder(setting, matmul_efficiency).stage_ops()
    fwd_items = [(op.name, op.fwd_s, op.fwd_comm) for op in ops if op.fwd_comm is not None or op.fwd_s > 0]
    bwd_items = [(op.name, op.bwd_s, op.bwd_comm) for op in reversed(ops) if op.bwd_comm is not None or op.bwd_s > 0]
    return _cut(fwd_items), _cut(bwd_items)


__all__ = [
    "ATTENTION_BACKWARD_RATIO",
    "BF16_BYTES",
    "FP32_BYTES",
    "ClusterSegment",
    "attention_flops",
    "elementwise_time_s",
    "matmul_time_s",
    "strands",
]
