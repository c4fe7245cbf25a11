"""``python -m dhelix_compile.bench.gpu``: its checks run on the CPU at small sizes (the GPU's numbers
are benchmarks, in BENCHMARKS.md, not tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dhelix_compile.bench.gpu.contention import check_contention
from dhelix_compile.bench.gpu.layer_ops import LayerShape, check_ops

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")


def test_the_ops_check_prices_and_times_every_compute_node_of_a_grouped_query_layer() -> None:
    """Every compute node of the layer's forward and backward has an estimate and a time; the
    grouped-query attention (2 key heads for 4 query heads) is priced by its matmuls."""
    shape = LayerShape(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, seq=16)
    report = check_ops(shape, torch.device("cpu"), torch.float32)
    rows: list[dict[str, Any]] = report["rows"]
    assert {r["phase"] for r in rows} == {"fwd", "bwd"}
    assert not [r for r in rows if "error" in r]
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)
    attention = [r for r in rows if r["class"] == "attention"]
    assert len(attention) == 2
    b, h, s, d = 1, 4, 16, 8
    assert sorted(r["flops"] for r in attention) == [4 * b * h * s * s * d, 10 * b * h * s * s * d]
    assert set(report["summary"]) >= {"matmul", "attention", "other"}
    assert report["inductor_layer_s"] > 0


def test_contention_needs_a_gpu() -> None:
    assert check_contention(torch.device("cpu")) == {"skipped": "needs a CUDA device"}
