"""cost_model.cluster against the emulated cluster: GQA shapes, the bench's programs, the recorded GPU runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from cost_model.cluster import EMULATED_SETTINGS, Parallelism, get_setting, model_flops_per_step, strands
from cost_model.cluster.emulated import (
    TOLERANCE,
    BenchRecord,
    compare_bench,
    predict_variant,
    recorded_link,
    variant_setting,
)
from cost_model.cluster.strands import matmul_time_s
from cost_model.hardware import get_device
from dhelix_compile.bench.recorded import setting_from_bench
from dhelix_compile.cli import main

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
#: The recorded GPU runs (BENCHMARKS.md, "Emulated cluster") and the settings they ran.
RECORDED = {
    "2026-11-28-h200-emulated-tp8-ib400.json": "h200-emulated-llama3_8b_gpu-tp8-ib400",
    "2026-11-28-h200-emulated-tp8-nvlink4.json": "h200-emulated-llama3_8b_gpu-tp8-nvlink4",
}
IB400 = "2026-11-28-h200-emulated-tp8-ib400.json"


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


# --------------------------------------------------------------------------- grouped-query attention


def test_gqa_shrinks_the_key_value_projections_only() -> None:
    setting = EMULATED_SETTINGS["h200-emulated-llama3_8b_gpu-tp8-ib400"]
    gqa = setting.model
    mha = dataclasses.replace(gqa, kv_heads=None)
    h, kv_dim = gqa.hidden, gqa.kv_dim
    assert (gqa.key_value_heads, kv_dim) == (8, 1024)
    assert mha.layer_matmul_params() - gqa.layer_matmul_params() == 2 * h * (h - kv_dim)
    # Megatron's model FLOPs count the smaller K and V (P_layer), not the attention scores
    diff = model_flops_per_step(dataclasses.replace(setting, model=mha)) - model_flops_per_step(setting)
    tokens = setting.micro_batches * setting.seq_len
    assert diff == pytest.approx(3 * 2 * tokens * gqa.layers * 2 * h * (h - kv_dim))
    fused = variant_setting(setting, "dhelix")  # one QKV matmul per layer
    segment = next(s for s in strands(fused)[0] if "q+k+v" in s.ops)
    mha_segment = next(s for s in strands(dataclasses.replace(fused, model=mha))[0] if "q+k+v" in s.ops)
    h200 = get_device("h200")
    tp, t = setting.parallel.tp, setting.seq_len
    saved = matmul_time_s(t, 3 * h // tp, h, h200) - matmul_time_s(t, (h + 2 * kv_dim) // tp, h, h200)
    rope_saved = 2 * t * (h - kv_dim) // tp * 2 / h200.mem_bandwidth_bytes_per_s  # k's rope, read + write
    # the segment holds norm, QKV, rope, attention, out projection: only QKV and rope shrink
    assert mha_segment.compute_s - segment.compute_s == pytest.approx(saved + rope_saved)


def test_gqa_shapes_that_do_not_split_are_named() -> None:
    setting = EMULATED_SETTINGS["h200-emulated-llama3_8b_gpu-tp8-ib400"]
    with pytest.raises(ValueError, match="groups of kv_heads 5"):
        dataclasses.replace(setting, model=dataclasses.replace(setting.model, kv_heads=5)).validate()
    with pytest.raises(ValueError, match="4 key/value heads do not split over tp=8"):
        dataclasses.replace(setting, model=dataclasses.replace(setting.model, kv_heads=4)).validate()


# --------------------------------------------------------------------------- the programs


def test_without_sp_the_backward_reduces_the_column_parallel_inputs() -> None:
    setting = variant_setting(EMULATED_SETTINGS["h200-emulated-llama3_8b_gpu-tp8-ib400"], "dhelix")
    fwd, bwd = strands(setting)
    # forward: the embedding's and each row-parallel output's all-reduce, then the logits' gather
    assert [s.collective for s in fwd[:3]] == [
        "all_reduce (embedding-out)",
        "all_reduce (attn-out)",
        "all_reduce (mlp-out)",
    ]
    assert fwd[-2].collective == "all_gather (logits)" and fwd[-1].ops == ("cross-entropy",)
    # backward: each all-reduce ends the segment of the projections whose input gradient it sums
    ends = [(s.ops[-1], s.collective) for s in bwd if s.collective is not None]
    assert ends[:3] == [
        ("logits", "all_reduce (head-in grad)"),
        ("gate+up", "all_reduce (mlp-in grad)"),
        ("q+k+v", "all_reduce (attn-in grad)"),
    ]
    assert all(s.weight_grad_s > 0 for s in bwd)  # every backward segment holds a weight gradient


def test_pytorch_tp_plan_reduces_each_projection_and_waits_once() -> None:
    setting = variant_setting(EMULATED_SETTINGS["h200-emulated-llama3_8b_gpu-tp8-ib400"], "inductor")
    _, bwd = strands(setting)
    attention = [s for s in bwd if s.collective is not None and "attn-in" in s.collective][:3]
    assert [(s.ops[-1], s.waits) for s in attention] == [("v", True), ("k", False), ("q", False)]
    mlp = [s for s in bwd if s.collective is not None and "mlp-in" in s.collective][:2]
    assert [(s.ops[-1], s.waits) for s in mlp] == [("up", True), ("gate", False)]
    # the segment after the last projection's all-reduce reads their sum: it waits
    after = bwd[bwd.index(attention[-1]) + 1]
    assert after.waits and after.ops[0] == "add+norm"


@pytest.mark.parametrize("name", list(RECORDED))
def test_predicted_transfers_are_the_recorded_ones(name: str) -> None:
    """Each modeled variant sends what the bench's ledger recorded: transfers, bytes, link time."""
    setting, record = setting_from_bench(_load(name))
    assert setting == EMULATED_SETTINGS[RECORDED[name]]
    for variant, measured in record.variants.items():
        predicted = predict_variant(setting, variant)
        assert predicted.transfers == measured.transfers, variant
        assert predicted.wire_bytes == pytest.approx(measured.wire_bytes, rel=1e-9), variant
        assert predicted.comm_s == pytest.approx(measured.t_comm_s, rel=1e-9), variant


# --------------------------------------------------------------------------- against the recorded runs


@pytest.mark.parametrize("name", list(RECORDED))
def test_claimed_predictions_are_within_tolerance_of_the_recorded_gpu_steps(name: str) -> None:
    setting, record = setting_from_bench(_load(name))
    comparison = compare_bench(setting, record)
    assert {r.variant for r in comparison.rows} == {"inductor", "inductor_overlap", "dhelix", "helix"}
    for row in comparison.rows:
        assert abs(row.measured_inputs_ratio - 1) <= TOLERANCE, (row.variant, row.measured_inputs_ratio)
        if row.analytic_claimed:
            assert abs(row.analytic_ratio - 1) <= TOLERANCE, (row.variant, row.analytic_ratio)


def test_the_communication_bound_run_is_claimed_analytically_and_ordered_as_measured() -> None:
    setting, record = setting_from_bench(_load(IB400))
    rows = {r.variant: r for r in compare_bench(setting, record).rows}
    assert all(r.analytic_claimed and not r.host_bound for r in rows.values())
    steps = [rows[v].analytic.step_s for v in ("inductor", "dhelix", "helix")]
    assert steps == sorted(steps, reverse=True)  # measured: 54.6, 38.8, 33.9 ms


def test_the_host_bound_run_is_not_claimed_analytically() -> None:
    setting, record = setting_from_bench(_load("2026-11-28-h200-emulated-tp8-nvlink4.json"))
    for row in compare_bench(setting, record).rows:
        assert row.host_bound and not row.analytic_claimed
        assert row.measured_inputs_s == max(row.measured.host_s, row.analytic.step_s)


def test_compute_scale_scales_the_compute_only() -> None:
    setting = EMULATED_SETTINGS["h200-emulated-llama3_8b_gpu-tp8-ib400"]
    base, doubled = predict_variant(setting, "helix"), predict_variant(setting, "helix", compute_scale=2.0)
    assert doubled.compute_s == pytest.approx(2 * base.compute_s)
    assert (doubled.comm_s, doubled.wire_bytes) == (base.comm_s, base.wire_bytes)
    assert doubled.step_s > base.step_s


def test_records_that_cannot_be_modeled_are_named() -> None:
    data = _load(IB400)
    with pytest.raises(ValueError, match="no field 'variants'"):
        BenchRecord.from_json({k: v for k, v in data.items() if k != "variants"})
    other = {**data, "link": {**data["link"], "alpha_s": 1e-3}}
    with pytest.raises(ValueError, match="differs from the cost model's entry"):
        recorded_link(BenchRecord.from_json(other))
    with pytest.raises(ValueError, match="no cluster model"):
        setting_from_bench({**data, "model": "moe_small"})
    with pytest.raises(ValueError, match="no program model for bench variant 'eager'"):
        predict_variant(EMULATED_SETTINGS[RECORDED[IB400]], "eager")


def test_cli_from_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--from-bench", str(RESULTS / IB400)]) == 0
    out = capsys.readouterr().out
    assert "### h200-emulated-llama3_8b_gpu-tp8-ib400 against" in out
    assert "Measured (the bench run on NVIDIA H200, bfloat16)" in out and "Claimed within 15%" in out
    assert "| helix |" in out and "| 1175 / 1175 | 26 / 26 |" in out
    assert main(["simulate", "--from-bench", str(RESULTS / "no-such.json")]) == 2


def test_cli_emulated_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--setting", "h200-emulated-llama3_8b_gpu-tp8-nvlink4"]) == 0
    out = capsys.readouterr().out
    assert "not measurements" in out and "| dhelix |" in out
    assert get_setting("h200-emulated-llama3_8b_gpu-tp8-nvlink4").parallel == Parallelism(
        dp=1, tp=8, sequence_parallel=False
    )
