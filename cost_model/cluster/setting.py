"""What a cluster setting is: a transformer's shape, the parallel degrees, the cluster, the paper's number.

Contract
--------
A :class:`ClusterSetting` is one configuration ``dhelix simulate`` predicts: a decoder-only
transformer (:class:`ModelShape`), its :class:`Parallelism` degrees, sequence and batch sizes,
the device and links by their ``cost_model.hardware`` names, and what the DHelix paper reports
for it (:class:`PaperReport`). ``validate()`` raises ``ValueError`` naming the first field that
does not fit (heads % tp, heads % kv_heads, kv_heads % tp, layers % pp, seq_len % (cp * tp with
SP), degrees < 1, ...) or an unknown device or link (``UnknownHardwareError``).

Besides the shape and the degrees, a setting says how the program is written where that changes
what is sent: ``projection_reduces`` (without SP, one all-reduce of a layer input's gradient, as
Megatron's fused QKV and gate/up projections need, or one per projection, as PyTorch's TP plan
on separate q, k, v, gate and up issues) and ``loss`` (Megatron's vocab-parallel cross-entropy,
or the logits all-gathered and the loss computed on all of them, as PyTorch's
``ColwiseParallel(output_layouts=Replicate())`` head does), and ``ends``: the embedding and the
LM head split over the vocabulary (Megatron's, and the TP + SP plans'), or left out of the TP
plan and replicated on every rank (PyTorch's TP plan applied to the decoder layers only).

Ranks are ordered tp (fastest), cp, dp, pp, as in Megatron-LM; a group of ``size`` ranks
``stride`` apart stays inside a node when ``stride * size <= gpus_per_node`` and runs over the
intra-node link, else over the inter-node link (one NIC per GPU assumed)::

    TP group   stride 1,            size tp
    CP group   stride tp,           size cp
    DP sync    stride tp,           size cp * dp     (gradients over the dp x cp ranks)
    PP p2p     stride tp * cp * dp, size 2

The paper's settings are :mod:`cost_model.cluster.paper_settings`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from cost_model.hardware import Link, get_device, get_link

Family = Literal["llama", "gpt", "moe"]
ProjectionReduces = Literal["fused", "per_projection"]
Loss = Literal["vocab_parallel", "gathered_logits"]
Ends = Literal["vocab_parallel", "replicated"]
DataParallelMode = Literal["replicate", "shard"]
ShardedOrder = Literal["as_traced", "prefetched", "fsdp2"]
Dtype = Literal["bfloat16", "float32"]

#: Slots per expert over the tokens' fair share (``dhelix_compile.testing.moe.MoEConfig``'s default).
MOE_CAPACITY_FACTOR: float = 1.25

#: Bytes of one element of each :data:`Dtype`.
DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: multi-head attention, or grouped-query with ``kv_heads``."""

    name: str
    """Display name, e.g. ``"Llama-8B"``."""
    family: Family
    """``"llama"``: RMSNorm, SwiGLU MLP (three matrices), RoPE; ``"gpt"``: LayerNorm, GeLU MLP (two);
    ``"moe"``: one mixture-of-experts layer and nothing else (the bench's ``moe_*``: a router,
    top-k dispatch to ``experts`` SwiGLU experts of ``ffn_hidden``, each taking at most
    ``MOE_CAPACITY_FACTOR * tokens * top_k / experts`` tokens), its experts split over the DP
    ranks, the tokens sent to them and back by all-to-all (tp = pp = cp = 1; ``layers`` 1)."""
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    vocab: int
    source: str
    """Where the shape comes from ("assumed: ..." when the paper does not give it)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention, e.g. 8 for Llama-3-8B); None: one per query head."""
    experts: int = 0
    """Experts of the ``"moe"`` family's layer."""
    top_k: int = 0
    """Experts each token goes to (``"moe"``)."""

    def expert_capacity(self, tokens: int) -> int:
        """Tokens one expert takes from a dispatch group of ``tokens`` (``"moe"``; ``testing.moe``'s rule)."""
        return max(1, math.ceil(MOE_CAPACITY_FACTOR * tokens * self.top_k / self.experts))

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def key_value_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key projection (and of the value projection): ``kv_heads * head_dim``."""
        return self.key_value_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.family == "llama" else 2

    def layer_matmul_params(self) -> int:
        """Weights of one layer's matmuls: Q, K, V, output projection, MLP (norms and biases left out).

        With grouped-query attention K and V are ``hidden x kv_dim`` each, so QKV + output is
        ``2h^2 + 2h * kv_dim`` (``4h^2`` for multi-head attention)."""
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim
        return attention + self.mlp_matrices * self.hidden * self.ffn_hidden

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
    dtype: Dtype = "bfloat16"
    """Weights' and activations' dtype: element bytes of every tensor and transfer, the peak FLOP/s."""
    projection_reduces: ProjectionReduces = "fused"
    """Without SP: ``"fused"`` reduces a layer input's gradient once (Megatron's fused QKV and
    gate/up; dhelix's ``combine_all_reduces`` on PyTorch's plan); ``"per_projection"`` once per
    column-parallel projection (PyTorch's TP plan on separate q, k, v and gate, up: five all-reduces
    a layer), each issued after its projection's backward and all waited before their sum."""
    loss: Loss = "vocab_parallel"
    """``"vocab_parallel"``: Megatron's vocab-parallel cross-entropy (three all-reduces of one float32
    per token: max, target logit, sum of exponentials; dhelix's ``vocab_parallel_loss``);
    ``"gathered_logits"``: the logits all-gathered, the loss computed on all of them on every rank."""
    contention_factor: float | None = None
    """Compute slowdown while a transfer is in flight; None: the device's (``cost_model.hardware``)."""
    ends: Ends = "vocab_parallel"
    """``"vocab_parallel"``: the embedding row-parallel over the vocabulary (its output reduced) and
    the LM head column-parallel (``loss`` says what follows it); ``"replicated"``: the embedding,
    the final norm and the LM head outside the TP plan, whole on every rank (the plan covers the
    decoder layers only): no transfer at either end, every rank computes all the logits and the
    loss; ``loss`` does not apply. Without SP only (SP needs the embedding's sequence shards)."""
    dp_mode: DataParallelMode = "replicate"
    """``"replicate"``: gradients reduced over the DP group after the last backward (the step's
    ``dp sync``; the strands hold no DP transfer). ``"shard"``: ZeRO-3 as dhelix's
    ``data_parallel(mode="shard")`` writes it: every parameter all-gathered over the DP group when
    its module reads it, its gradient reduce-scattered in each micro-batch's backward (the strands
    hold them; Llama family, tp = pp = cp = 1)."""
    sharded_order: ShardedOrder = "prefetched"
    """With ``dp_mode="shard"``: ``"as_traced"``, each collective waited where it is issued (the
    traced program's order, which Inductor keeps); ``"prefetched"``, each parameter group's gathers
    issued while the group before it computes and the reduce-scatters waited at the step's end
    (dhelix's reorder); ``"fsdp2"``, PyTorch's FSDP2 as the bench applies it (``fully_shard`` on
    each layer, then the root): one gather of a unit's parameters together, the root's (the
    embedding, final norm and head) once before the forward, each layer's again in the backward,
    one reduce-scatter per unit after its backward, each waited where it is issued."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that does not fit the model or cluster."""
        p, m = self.parallel, self.model
        for name in ("dp", "tp", "pp", "cp"):
            if getattr(p, name) < 1:
                raise ValueError(f"{self.name}: {name} must be >= 1, got {getattr(p, name)}")
        if m.family == "moe" and ((p.tp, p.pp, p.cp, m.layers, self.dp_mode) != (1, 1, 1, 1, "replicate")):
            raise ValueError(f"{self.name}: an MoE layer is modeled alone, expert-parallel over dp (tp = pp = cp = 1)")
        if m.family == "moe" and (m.experts < 1 or m.experts % p.dp or m.top_k not in (1, 2) or m.top_k > m.experts):
            raise ValueError(
                f"{self.name}: {m.experts} experts with top_k {m.top_k} do not split over dp={p.dp} (top_k 1 or 2)"
            )
        if m.hidden % m.heads:
            raise ValueError(f"{self.name}: hidden {m.hidden} is not a multiple of heads {m.heads}")
        if m.heads % p.tp:
            raise ValueError(f"{self.name}: {m.heads} heads do not split over tp={p.tp}")
        if m.kv_heads is not None and (m.kv_heads < 1 or m.heads % m.kv_heads):
            raise ValueError(f"{self.name}: {m.heads} heads do not split into groups of kv_heads {m.kv_heads}")
        if m.key_value_heads % p.tp:
            raise ValueError(f"{self.name}: {m.key_value_heads} key/value heads do not split over tp={p.tp}")
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
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.name}: dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.ends == "replicated" and p.sequence_parallel and p.tp > 1:
            raise ValueError(f"{self.name}: replicated ends need tp without sequence parallelism")
        if self.dp_mode == "shard" and ((p.tp, p.pp, p.cp, m.family) != (1, 1, 1, "llama") or p.dp < 2):
            raise ValueError(
                f"{self.name}: dp_mode='shard' is modeled for the Llama family with tp = pp = cp = 1 and dp >= 2"
            )
        if self.contention_factor is not None and self.contention_factor < 1.0:
            raise ValueError(f"{self.name}: contention_factor must be >= 1.0, got {self.contention_factor}")
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

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def peak_bf16_tflops(self) -> float:
        """The device's peak bf16 rate in TFLOP/s (``cost_model.hardware``)."""
        return get_device(self.device).flops_per_s(torch.bfloat16) / 1e12

    def describe(self) -> str:
        m, p = self.model, self.parallel
        nodes = math.ceil(p.gpus / self.gpus_per_node)
        kv = f" ({m.kv_heads} key/value)" if m.kv_heads is not None else ""
        shape = (
            f"one MoE layer: hidden {m.hidden}, {m.experts} SwiGLU experts of FFN {m.ffn_hidden}, top-{m.top_k}, "
            "split over the DP ranks"
            if m.family == "moe"
            else f"{m.params() / 1e9:.1f}B: {m.layers} layers, hidden {m.hidden}, {m.heads} heads{kv}, "
            f"FFN {m.ffn_hidden}, vocab {m.vocab}"
        )
        return (
            f"{m.name} ({shape}) on {p.gpus}x {self.device} ({nodes} nodes x "
            f"{self.gpus_per_node}, {self.intra_node_link} / {self.inter_node_link}); {p.label()}; "
            f"seq {self.seq_len}, micro-batch {self.micro_batch_size}, {self.micro_batches} micro-batches "
            f"per step"
            + ("" if self.dtype == "bfloat16" else f", {self.dtype}")
            + ("; embedding and LM head replicated (outside the TP plan)" if self.ends == "replicated" else "")
            + ("; ZeRO-3: parameters sharded over DP, gathered when read" if self.dp_mode == "shard" else "")
        )


__all__ = [
    "DTYPE_BYTES",
    "MOE_CAPACITY_FACTOR",
    "ClusterSetting",
    "DataParallelMode",
    "Dtype",
    "Ends",
    "Family",
    "Loss",
    "ModelShape",
    "PaperReport",
    "Parallelism",
    "ProjectionReduces",
    "ShardedOrder",
]
