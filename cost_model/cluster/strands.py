"""One micro-batch of the last pipeline stage as two strands of segments, costed analytically.

Contract
--------
``strands(setting, matmul_efficiency=1.0, attention_efficiency=None) -> (forward segments, backward
segments)``: the
operators of one micro-batch on one tensor-parallel rank of the last pipeline stage (its share
of the layers, plus the output head; plus the embedding when pp = 1), cut into
:class:`ClusterSegment` s -- compute, then the transfer that ends it -- the shape that
:mod:`cost_model.strand_plan` plans over. Deterministic; seconds from the formulas below.
``stage_transfers(setting) -> (receive, send)``: the stage's own transfers of one micro-batch
over the PP link (pp > 1), the receive of its input and the send of that input's gradient.

One layer, one micro-batch, one TP rank (T = micro_batch_size * seq_len / cp tokens; Megatron-LM
tensor + sequence parallelism, which the DHelix authors' launch scripts use: ``--sequence-parallel``)::

    forward   [norm] AG | [QKV mm, rope, attention (+CP ring), out mm] RS | [add, norm] AG |
              [FC1 mm, act, FC2 mm] RS | ...                                  (AG/RS: T*h*e bytes)
    backward  the same operators in reverse: a forward AG becomes an RS of the gradient and a forward
              RS an AG; matmuls cost dgrad + wgrad (2x), attention 2.5x (FlashAttention's backward
              recomputes the scores), elementwise ops 2x their forward bytes

e = the setting's element bytes (2 for bf16). Without SP (Megatron's f and g operators) the
forward all-reduces the row-parallel outputs (where SP reduce-scatters) and gathers nothing; the
backward all-reduces the gradient of each column-parallel input (where SP reduce-scatters) and
nothing at the row-parallel outputs::

    forward   [norm, QKV mm, rope, attention, out mm] AR | [add, norm, FC1 mm, act, FC2 mm] AR | ...
    backward  ... | [FC2, act, FC1] AR | [norm, out mm, attention, rope, QKV] AR | ...

With ``projection_reduces="per_projection"`` (PyTorch's TP plan: q, k, v and gate, up are
separate column-parallel linears) the backward all-reduces each projection's input gradient
after that projection's backward, and only their sum waits::

    backward  ... [attention, rope, v] AR | [k] AR | [q] AR | [norm, ...       (k, q: no wait)

The output head: ``loss="vocab_parallel"`` is Megatron's vocab-parallel cross-entropy on the
rank's logits shard, three all-reduces of T float32 (max, target logit, sum of exponentials);
``loss="gathered_logits"`` all-gathers the logits (T*V*e bytes) and computes the loss on all of
them on every rank (its backward slices the rank's shard out: no transfer). With
``ends="replicated"`` (the TP plan on the decoder layers only) the embedding and the head are
whole on every rank: no embedding all-reduce, all V logits computed on each rank (T*V*h), no
transfer for the loss either way.

Grouped-query attention (``ModelShape.kv_heads``): the K and V projections are ``h x kv_dim``
each, rope touches Q and K, the CP ring carries K and V of ``kv_dim``; attention FLOPs count the
query heads.

ZeRO-3 (``dp_mode="shard"``, tp = pp = 1): the same operators in parameter groups -- the embedding,
each layer (its norms and its seven matrices), the head (final norm, output) -- and one all-gather
per parameter (its full bytes) before its group's forward, one reduce-scatter of its gradient after
its group's backward, over the DP group. Each transfer is a segment of its own with no compute;
the weight gradients are what the reduce-scatters send, so none can be deferred under them::

    as_traced    AG emb (wait) | [embedding] | AG attention norm (wait) | AG wq (wait) | ... | [layer 0] | ...
                 backward: [head] RS output grad (wait) | RS final norm grad (wait) | [layer 3] ...
    prefetched   AG emb | AG layer 0's nine (after emb's landed) | [embedding] | AG layer 1's (after
                 layer 0's landed) | [layer 0] | ... ; backward: [head] RS | RS | [layer 3] RS ... (no
                 wait: the step's end waits for them)

One MoE layer (``family="moe"``: T tokens, E experts of FFN f, top-k, C slots per expert, E/dp
experts on this rank; the bench's ``moe_*``, ``testing.moe``): the tokens travel to their experts'
ranks and back by all-to-all over the DP group (E*C*h*e bytes each). Neither the tokens nor the
routing masks need a gradient, so the backward sends only the combine's::

    forward   [router, routing, dispatch matmul] A2A | [experts: 3 matmuls each] A2A | [combine, loss]
    backward  [loss, combine (the gates' gradient: a weight gradient)] A2A | [experts, router]

Costs (``cost_model.hardware`` tables, ``cost_model.collectives`` alpha-beta models)::

    matmul      launch + max(2mnk / (peak * matmul_efficiency), bytes / mem_bw)
                (backward: dgrad + wgrad, each the forward's time; the wgrad is the segment's
                ``weight_grad_s``, work no later operator of the backward reads)
    attention   launch + 4 * b * s_q * s_kv * heads/tp * head_dim * (1/2 causal) / (peak * attn_eff)
                (attn_eff: ``attention_efficiency``, the matmul efficiency where not given)
    elementwise launch + bytes / mem_bw
    collective  collective_time_s(op, S, group, link): the group's link
                (:meth:`cost_model.cluster.setting.ClusterSetting.group_link`)
    CP ring     (cp - 1) send/recv of the local K and V, overlapped with the attention inside the
                micro-batch as Megatron's ring attention does; what the attention does not cover,
                max(0, ring - attention), is a transfer ending the attention's segment (2x in backward)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from cost_model.cluster.setting import ClusterSetting
from cost_model.collectives import collective_bytes_on_wire, collective_time_s
from cost_model.hardware import Device, Link, get_device

BF16_BYTES: int = 2
FP32_BYTES: int = 4

#: FlashAttention's backward costs 2.5x its forward matmul FLOPs (five matmuls -- the score
#: recompute, dV, dP, dQ, dK -- against the forward's two). Dao, FlashAttention-2 (arXiv 2307.08691).
ATTENTION_BACKWARD_RATIO: float = 2.5

#: Loss statistics the vocab-parallel cross-entropy all-reduces, one float32 per token each:
#: the max logit, the target's logit, the sum of exponentials (Megatron-LM's
#: ``_VocabParallelCrossEntropy``; dhelix's ``graph_passes.joint.vocab_parallel_loss``).
LOSS_STAT_REDUCES: tuple[str, ...] = ("max", "target logit", "sum exp")

_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class ClusterSegment:
    """A run of one strand: compute, then (at most) one collective whose time is ``comm_s``."""

    ops: tuple[str, ...]
    compute_s: float
    comm_s: float
    collective: str | None
    wire_bytes: float = 0.0
    """Bytes this rank sends for the collective (``cost_model.collectives.collective_bytes_on_wire``)."""
    weight_grad_s: float = 0.0
    """Of ``compute_s``, weight gradients: no later operator of the strand reads them, so a
    schedule may run them under the segment's own transfer (or later)."""
    waits: bool = True
    """Whether the segment's first operator reads the strand's latest transfer (False: in
    PyTorch's TP plan, a projection's backward after another projection's input-gradient
    all-reduce; only their sum waits)."""


def _rank_tokens(setting: ClusterSetting) -> tuple[int, int]:
    """T, this CP rank's tokens of a micro-batch, and the tokens its TP rank holds between TP
    regions (T / tp under SP, where the norms and the stage boundary run on sequence shards)."""
    p = setting.parallel
    tokens = setting.micro_batch_size * setting.seq_len // p.cp
    return tokens, tokens // p.tp if p.sequence_parallel and p.tp > 1 else tokens


def stage_transfers(setting: ClusterSetting) -> tuple[ClusterSegment, ClusterSegment]:
    """The last pipeline stage's transfers of one micro-batch over the PP link: the receive of
    its input (the hidden states its TP rank holds) and the send of that input's gradient. The
    receive is a transfer with no time or bytes of its own here: an emulated receive runs on the
    inbound queue, and the bench's own T_comm and bytes are the outbound queue's."""
    nbytes = _rank_tokens(setting)[1] * setting.model.hidden * setting.dtype_bytes
    send = _collective("send", "stage input gradient", nbytes, 2, setting.pp_link)
    return (
        ClusterSegment(("receive",), 0.0, 0.0, "recv (stage input)"),
        ClusterSegment(("send",), 0.0, send.seconds, send.label, send.wire_bytes),
    )


@dataclass(frozen=True)
class _Transfer:
    label: str
    seconds: float
    wire_bytes: float


def _collective(op: str, label: str, nbytes: float, group: int, link: Link) -> _Transfer:
    """``op`` of ``nbytes`` over a group of ``group`` ranks on ``link``, labelled ``"<op> (<label>)"``."""
    return _Transfer(
        f"{op} ({label})",
        collective_time_s(op, nbytes, group, link),
        float(collective_bytes_on_wire(op, nbytes, group)),
    )


@dataclass(frozen=True)
class _Op:
    """One operator of the forward, with the cost of its backward counterpart.

    Compute ops have ``fwd_s`` / ``bwd_s`` (of which ``bwd_weight_s`` is the weight gradient);
    transfers have a :class:`_Transfer` for the forward and the backward (``None`` where that
    direction issues nothing). ``bwd_waits``: whether the backward of this op reads the
    backward's latest transfer.
    """

    name: str
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    bwd_weight_s: float = 0.0
    fwd_comm: _Transfer | None = None
    bwd_comm: _Transfer | None = None
    bwd_waits: bool = True


def matmul_time_s(
    m: int, n: int, k: int, device: Device, efficiency: float = 1.0, dtype: torch.dtype = torch.bfloat16
) -> float:
    """Roofline time of an ``[m, k] @ [k, n]`` matmul in ``dtype`` (bf16 by default)."""
    flops = 2.0 * m * n * k
    nbytes = dtype.itemsize * (m * k + k * n + m * n)
    peak = device.flops_per_s(dtype) * efficiency
    return device.launch_overhead_s + max(flops / peak, nbytes / device.mem_bandwidth_bytes_per_s)


def elementwise_time_s(nbytes: float, device: Device) -> float:
    """Memory-bound time of an operator that moves ``nbytes``."""
    return device.launch_overhead_s + nbytes / device.mem_bandwidth_bytes_per_s


def attention_flops(batch: int, q_len: int, kv_len: int, heads: int, head_dim: int, *, causal: bool) -> float:
    """Forward FLOPs of softmax(Q K^T) V: two matmuls, halved by a causal mask (query heads;
    grouped-query attention shares K and V between them but computes as many scores)."""
    return 4.0 * batch * q_len * kv_len * heads * head_dim * (0.5 if causal else 1.0)


class _StageBuilder:
    """The last pipeline stage's operators for one micro-batch on one TP rank (module docstring)."""

    def __init__(self, setting: ClusterSetting, matmul_efficiency: float, attention_efficiency: float) -> None:
        self.s = setting
        self.dev = get_device(setting.device)
        self.eff = matmul_efficiency
        self.attention_eff = attention_efficiency
        self.dtype = _DTYPES[setting.dtype]
        self.e = setting.dtype_bytes
        p = setting.parallel
        self.tp = p.tp
        self.sp = p.sequence_parallel and p.tp > 1
        self.per_projection = not self.sp and setting.projection_reduces == "per_projection"
        self.tokens, self.norm_tokens = _rank_tokens(setting)

    def _mm(self, name: str, m: int, n: int, k: int, *, bwd_waits: bool = True) -> _Op:
        t = matmul_time_s(m, n, k, self.dev, self.eff, self.dtype)
        # dgrad + wgrad: two matmuls of the same size; the wgrad feeds no later operator
        return _Op(name, fwd_s=t, bwd_s=2 * t, bwd_weight_s=t, bwd_waits=bwd_waits)

    def _elementwise(self, name: str, nbytes: float) -> _Op:
        return _Op(name, fwd_s=elementwise_time_s(nbytes, self.dev), bwd_s=elementwise_time_s(2 * nbytes, self.dev))

    def _transfer(self, op: str, label: str, nbytes: float) -> _Transfer | None:
        """A TP collective; None where the TP group is one rank (nothing is issued)."""
        return None if self.tp == 1 else _collective(op, label, nbytes, self.tp, self.s.tp_link)

    def _activation_bytes(self) -> float:
        return float(self.tokens * self.s.model.hidden * self.e)

    def _enter(self, name: str) -> _Op:
        """Entering a TP region (a column-parallel input): with SP an all-gather, whose backward
        reduce-scatters the gradient; without, nothing forward and an all-reduce of the gradient."""
        nbytes = self._activation_bytes()
        if self.sp:
            return _Op(
                name,
                fwd_comm=self._transfer("all_gather", name, nbytes),
                bwd_comm=self._transfer("reduce_scatter", f"{name} grad", nbytes),
            )
        return _Op(name, bwd_comm=self._transfer("all_reduce", f"{name} grad", nbytes))

    def _exit(self, name: str) -> _Op:
        """Leaving a TP region (a row-parallel output): with SP a reduce-scatter, whose backward
        all-gathers the gradient; without, an all-reduce whose backward is the identity."""
        nbytes = self._activation_bytes()
        if self.sp:
            return _Op(
                name,
                fwd_comm=self._transfer("reduce_scatter", name, nbytes),
                bwd_comm=self._transfer("all_gather", f"{name} grad", nbytes),
            )
        return _Op(name, fwd_comm=self._transfer("all_reduce", name, nbytes))

    def _projections(self, name: str, widths: Sequence[tuple[str, int]]) -> list[_Op]:
        """Column-parallel projections of one input: one matmul and one input-gradient reduction
        (``fused``, or with SP), or each its own with its own all-reduce (``per_projection``)."""
        T, h, tp = self.tokens, self.s.model.hidden, self.tp
        if not self.per_projection:
            fused = "+".join(label for label, _ in widths)
            return [self._enter(f"{name}"), self._mm(fused, T, sum(w for _, w in widths) // tp, h)]
        ops: list[_Op] = []
        # forward order; the backward runs them in reverse: the last projection's backward first,
        # then its all-reduce; the earlier projections' backwards read none of those reduces
        for i, (label, width) in enumerate(widths):
            ops.append(self._enter(f"{name}: {label}"))
            ops.append(self._mm(label, T, width // tp, h, bwd_waits=i == len(widths) - 1))
        return ops

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
        peak = self.dev.flops_per_s(self.dtype) * self.attention_eff
        fwd = self.dev.launch_overhead_s + flops / peak
        bwd = self.dev.launch_overhead_s + ATTENTION_BACKWARD_RATIO * flops / peak
        ops = [_Op("attention", fwd_s=fwd, bwd_s=bwd)]
        if p.cp > 1:
            kv_bytes = 2.0 * self.tokens * (m.kv_dim // p.tp) * self.e
            ring = (p.cp - 1) * collective_time_s("send", kv_bytes, 2, s.cp_link)
            wire = (p.cp - 1) * float(collective_bytes_on_wire("send", kv_bytes, 2))
            # in the backward this op comes *before* the attention: the grads' ring ends it there
            ops.append(
                _Op(
                    "cp ring",
                    fwd_comm=_Transfer("send/recv (cp ring, uncovered)", max(0.0, ring - fwd), wire),
                    bwd_comm=_Transfer("send/recv (cp ring grad, uncovered)", max(0.0, 2 * ring - bwd), 2 * wire),
                )
            )
        return ops

    def layer(self) -> list[_Op]:
        m, T, tp, e = self.s.model, self.tokens, self.tp, self.e
        h, f = m.hidden, m.ffn_hidden
        # residual add (read 2, write 1) + norm (read 1, write 1)
        norm = self._elementwise("add+norm", 5 * self.norm_tokens * h * e)
        ops: list[_Op] = [norm]
        ops.extend(self._projections("attn-in", (("q", h), ("k", m.kv_dim), ("v", m.kv_dim))))
        if m.family == "llama":
            ops.append(self._elementwise("rope", 2 * T * (h + m.kv_dim) // tp * e))  # q and k, read + write
        ops.extend(self._attention())
        ops.append(self._mm("attn out", T, h, h // tp))
        ops.append(self._exit("attn-out"))
        ops.append(norm)
        fc1 = (("gate", f), ("up", f)) if m.family == "llama" else (("fc1", f),)
        ops.extend(self._projections("mlp-in", fc1))
        act_bytes = (3 if m.family == "llama" else 2) * T * (f // tp) * e
        ops.append(self._elementwise("swiglu" if m.family == "llama" else "gelu", act_bytes))
        ops.append(self._mm("fc2", T, h, f // tp))
        ops.append(self._exit("mlp-out"))
        return ops

    def embedding(self) -> list[_Op]:
        """Vocab-parallel embedding (first stage): a row gather, then the partial sums reduced
        (replicated: the gather alone). Its backward is the embedding table's gradient (a weight
        gradient)."""
        t_fwd = elementwise_time_s(2 * self.tokens * self.s.model.hidden * self.e, self.dev)
        t_bwd = elementwise_time_s(4 * self.tokens * self.s.model.hidden * self.e, self.dev)
        lookup = _Op("embedding", fwd_s=t_fwd, bwd_s=t_bwd, bwd_weight_s=t_bwd)
        if self.s.ends == "replicated":
            return [lookup]
        return [lookup, self._exit("embedding-out")]

    def head(self) -> list[_Op]:
        """Final norm, vocab-parallel logits, the loss (module docstring: ``loss``, ``ends``)."""
        m, T, tp = self.s.model, self.tokens, self.tp
        ops = [self._elementwise("final norm", 4 * self.norm_tokens * m.hidden * self.e)]
        if self.s.ends == "replicated":  # every rank all the logits, nothing sent either way
            ops.append(self._mm("logits", T, m.vocab, m.hidden))
            ops.append(self._elementwise("cross-entropy", 3 * T * m.vocab * FP32_BYTES))
            return ops
        ops.extend(self._projections("head-in", (("logits", m.vocab),)))
        if self.s.loss == "gathered_logits":
            logits_bytes = float(T * m.vocab * self.e)
            ops.append(_Op("logits gather", fwd_comm=self._transfer("all_gather", "logits", logits_bytes)))
            ops.append(self._elementwise("cross-entropy", 3 * T * m.vocab * FP32_BYTES))
            return ops
        ops.append(self._elementwise("cross-entropy", 3 * T * (m.vocab // tp) * FP32_BYTES))
        for stat in LOSS_STAT_REDUCES:
            ops.append(_Op(f"loss {stat}", fwd_comm=self._transfer("all_reduce", f"loss {stat}", T * FP32_BYTES)))
        ops.append(self._elementwise("loss", 3 * T * FP32_BYTES))
        return ops

    def moe_layer(self) -> list[_Op]:
        """One expert-parallel MoE layer (``ModelShape.family == "moe"``; module docstring)."""
        m, e = self.s.model, self.e
        ep = self.s.parallel.dp
        tokens, d, f, experts = self.tokens, m.hidden, m.ffn_hidden, m.experts
        capacity = m.expert_capacity(tokens)
        slots = experts * capacity  # rows of the dispatched buffer, [E * C, D]
        local, rows = experts // ep, ep * capacity  # this rank's experts, their tokens each
        mm = self._mm_s
        # routing: softmax, top-k, each token's slot ([T, k, E, C] float32 masks, a few passes over them)
        route_bytes = FP32_BYTES * (5 * tokens * m.top_k * slots + 2 * tokens * slots)
        router = _Op(
            "router",
            fwd_s=mm(tokens, experts, d, torch.float32) + elementwise_time_s(route_bytes, self.dev),
            bwd_s=mm(experts, d, tokens, torch.float32) + elementwise_time_s(2 * route_bytes, self.dev),
        )
        router = dataclasses.replace(router, bwd_weight_s=router.bwd_s)  # nothing later reads it
        buffer = float(slots * d * e)
        expert_fwd = local * (2 * mm(rows, f, d) + mm(rows, d, f)) + elementwise_time_s(
            3 * local * rows * f * e + 4 * buffer, self.dev
        )
        expert_wgrad = local * (2 * mm(d, f, rows) + mm(f, d, rows))
        expert_bwd = expert_wgrad + local * mm(rows, f, d) + elementwise_time_s(5 * local * rows * f * e, self.dev)
        combine_grad = mm(tokens, slots, d)  # the gates' gradient: only the router's backward reads it
        return [
            router,
            _Op("dispatch", fwd_s=mm(slots, d, tokens)),  # no backward: the tokens and masks need no gradient
            _Op("dispatch all-to-all", fwd_comm=self._a2a("dispatch", buffer)),
            _Op("experts", fwd_s=expert_fwd, bwd_s=expert_bwd, bwd_weight_s=expert_wgrad),
            _Op(
                "combine all-to-all", fwd_comm=self._a2a("combine", buffer), bwd_comm=self._a2a("combine grad", buffer)
            ),
            _Op(
                "combine",
                fwd_s=mm(tokens, d, slots),
                bwd_s=mm(slots, d, tokens) + combine_grad,
                bwd_weight_s=combine_grad,
            ),
            self._elementwise("loss", 3 * tokens * d * e),
        ]

    def _mm_s(self, m: int, n: int, k: int, dtype: torch.dtype | None = None) -> float:
        return matmul_time_s(m, n, k, self.dev, self.eff, self.dtype if dtype is None else dtype)

    def _a2a(self, label: str, nbytes: float) -> _Transfer:
        """An all-to-all of ``nbytes`` over the DP group (the MoE layer's expert parallelism)."""
        return _collective("all_to_all", label, nbytes, self.s.parallel.dp, self.s.dp_link)

    def parameter_groups(self) -> list[_Group]:
        """The stage's operators by the parameters they read, in forward order (tp = pp = 1):
        the embedding, each layer, the head; each parameter's elements (module docstring)."""
        m = self.s.model
        h, kv, f, v = m.hidden, m.kv_dim, m.ffn_hidden, m.vocab
        layer = (
            ("attention norm", h),
            ("wq", h * h),
            ("wk", h * kv),
            ("wv", h * kv),
            ("wo", h * h),
            ("ffn norm", h),
            ("w1", h * f),
            ("w2", f * h),
            ("w3", h * f),
        )
        groups = [_Group("embedding", self.embedding(), (("embedding", v * h),))]
        groups += [_Group(f"layer {i}", self.layer(), layer) for i in range(m.layers)]
        groups.append(_Group("head", self.head(), (("final norm", h), ("output", v * h))))
        return groups

    def stage_ops(self) -> list[_Op]:
        p = self.s.parallel
        layers = self.s.model.layers // p.pp
        ops = self.embedding() if p.pp == 1 else []
        for _ in range(layers):
            ops.extend(self.layer())
        ops.extend(self.head())
        return ops


@dataclass(frozen=True)
class _Group:
    """Operators that read the same parameters, and those parameters' elements."""

    name: str
    ops: list[_Op]
    params: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class _Item:
    name: str
    seconds: float
    weight_s: float
    waits: bool
    transfer: _Transfer | None


def _cut(items: Sequence[_Item]) -> list[ClusterSegment]:
    """Items in program order -> segments ending at each transfer."""
    segments: list[ClusterSegment] = []
    names: list[str] = []
    compute = weight = 0.0
    waits = True
    for item in items:
        if item.transfer is None:
            if not names:
                waits = item.waits
            names.append(item.name)
            compute += item.seconds
            weight += item.weight_s
            continue
        t = item.transfer
        segments.append(ClusterSegment(tuple(names), compute, t.seconds, t.label, t.wire_bytes, weight, waits))
        names, compute, weight, waits = [], 0.0, 0.0, True
    if names:
        segments.append(ClusterSegment(tuple(names), compute, 0.0, None, 0.0, weight, waits))
    return segments


def strands(
    setting: ClusterSetting, matmul_efficiency: float = 1.0, attention_efficiency: float | None = None
) -> tuple[list[ClusterSegment], list[ClusterSegment]]:
    """(forward, backward) segments of one micro-batch on the last pipeline stage.

    ``attention_efficiency``: achieved share of peak for attention (None: ``matmul_efficiency``)."""
    setting.validate()
    attention = matmul_efficiency if attention_efficiency is None else attention_efficiency
    if not 0.0 < attention <= 1.0:
        raise ValueError(f"attention_efficiency must be in (0, 1], got {attention}")
    builder = _StageBuilder(setting, matmul_efficiency, attention)
    if setting.dp_mode == "shard" and setting.sharded_order == "fsdp2":
        return _fsdp2(setting, builder.parameter_groups())
    if setting.dp_mode == "shard":
        return _sharded(setting, builder.parameter_groups())
    ops = builder.moe_layer() if setting.model.family == "moe" else builder.stage_ops()
    fwd = [_Item(op.name, op.fwd_s, 0.0, True, op.fwd_comm) for op in ops if op.fwd_comm is not None or op.fwd_s > 0]
    bwd = [
        _Item(op.name, op.bwd_s, op.bwd_weight_s, op.bwd_waits, op.bwd_comm)
        for op in reversed(ops)
        if op.bwd_comm is not None or op.bwd_s > 0
    ]
    return _cut(fwd), _cut(bwd)


def _dp_transfer(setting: ClusterSetting, op: str, label: str, elements: float, waits: bool = True) -> ClusterSegment:
    """A segment of no compute that issues one collective of ``elements`` over the DP group."""
    t = _collective(op, label, elements * setting.dtype_bytes, setting.parallel.dp, setting.dp_link)
    return ClusterSegment((), 0.0, t.seconds, t.label, t.wire_bytes, 0.0, waits)


def _group_compute(group: _Group, phase: Literal["fwd", "bwd"]) -> tuple[tuple[str, ...], float]:
    """The names of a group's operators that compute in ``phase`` (in its order) and their time."""
    ops = group.ops if phase == "fwd" else list(reversed(group.ops))
    seconds = [op.fwd_s if phase == "fwd" else op.bwd_s for op in ops]
    return tuple(op.name for op, t in zip(ops, seconds, strict=True) if t > 0), math.fsum(seconds)


def _sharded(setting: ClusterSetting, groups: Sequence[_Group]) -> tuple[list[ClusterSegment], list[ClusterSegment]]:
    """ZeRO-3's strands (module docstring): a transfer per parameter, each alone in a segment of no
    compute, around each group's compute."""
    traced = setting.sharded_order == "as_traced"

    def gathers(group: _Group, waits_first: bool) -> list[ClusterSegment]:
        return [
            _dp_transfer(setting, "all_gather", name, n, traced or (waits_first and i == 0))
            for i, (name, n) in enumerate(group.params)
        ]

    fwd: list[ClusterSegment] = [] if traced else gathers(groups[0], False)
    for k, group in enumerate(groups):
        names, compute = _group_compute(group, "fwd")
        if traced:
            fwd += gathers(group, True)
        elif k + 1 < len(groups):  # the next group's gathers, issued once this group's have landed
            fwd += gathers(groups[k + 1], True)
        else:
            fwd.append(ClusterSegment((), 0.0, 0.0, None))  # waits for the last group's gathers
        fwd.append(ClusterSegment(names, compute, 0.0, None, waits=traced))
    bwd: list[ClusterSegment] = []
    for group in reversed(groups):
        names, compute = _group_compute(group, "bwd")
        # the last parameter read in the forward has its gradient first
        first, *rest = (
            _dp_transfer(setting, "reduce_scatter", f"{name} grad", n, traced) for name, n in reversed(group.params)
        )
        # the group's backward reads no transfer; its weight gradients are what the reduce-scatters send
        bwd.append(dataclasses.replace(first, ops=names, compute_s=compute))
        bwd += rest
    return fwd, bwd


def _fsdp2(setting: ClusterSetting, groups: Sequence[_Group]) -> tuple[list[ClusterSegment], list[ClusterSegment]]:
    """FSDP2's strands (``ClusterSetting.sharded_order``): a transfer per unit, every one waited
    where it is issued. The units: each layer, and the root (the first and last groups: the
    embedding, the final norm and the head), which is not gathered again in the backward."""
    root, *layers, last = groups

    def unit(op: str, label: str, params: Sequence[tuple[str, int]]) -> ClusterSegment:
        return _dp_transfer(setting, op, label, math.fsum(n for _, n in params))

    def computing(group: _Group, phase: Literal["fwd", "bwd"]) -> ClusterSegment:
        names, seconds = _group_compute(group, phase)
        return ClusterSegment(names, seconds, 0.0, None)

    def reducing(group: _Group, label: str, params: Sequence[tuple[str, int]]) -> ClusterSegment:
        """The group's backward, then the reduce-scatter of its gradients."""
        names, seconds = _group_compute(group, "bwd")
        return dataclasses.replace(unit("reduce_scatter", label, params), ops=names, compute_s=seconds)

    root_params = root.params + last.params
    fwd = [unit("all_gather", "root", root_params), computing(root, "fwd")]
    for layer in layers:
        fwd += [unit("all_gather", layer.name, layer.params), computing(layer, "fwd")]
    fwd.append(computing(last, "fwd"))
    bwd = [computing(last, "bwd")]
    for layer in reversed(layers):
        bwd += [unit("all_gather", layer.name, layer.params), reducing(layer, f"{layer.name} grad", layer.params)]
    bwd.append(reducing(root, "root grad", root_params))
    return fwd, bwd


__all__ = [
    "ATTENTION_BACKWARD_RATIO",
    "BF16_BYTES",
    "FP32_BYTES",
    "LOSS_STAT_REDUCES",
    "ClusterSegment",
    "attention_flops",
    "elementwise_time_s",
    "matmul_time_s",
    "strands",
]
