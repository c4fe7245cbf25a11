"""What a cluster setting is: a transformer's shape, the parallel degrees, the cluster, the paper's number.

Contract
--------
A :class:`ClusterSetting` is one configuration ``dhelix simulate`` predicts: a decoder-only
transformer (:class:`ModelShape`), its :class:`Parallelism` degrees, sequence and batch sizes,
the device and links by their ``cost_model.hardware`` names, and what the DHelix paper reports
for it (:class:`PaperReport`). ``validate()`` raises ``ValueError`` naming the first field that
does not fit (heads % tp, layers % pp, seq_len % (cp * tp with SP), degrees < 1, ...) or an
unknown device or link (``UnknownHardwareError``).

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

Family = Literal["llama", "gpt"]


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

    @property
    def peak_bf16_tflops(self) -> float:
        """The device's peak bf16 rate in TFLOP/s (``cost_model.hardware``)."""
        return get_device(self.device).flops_per_s(torch.bfloat16) / 1e12

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


__all__ = ["ClusterSetting", "Family", "ModelShape", "PaperReport", "Parallelism"]
