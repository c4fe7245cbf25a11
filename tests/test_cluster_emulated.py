"""cost_model.cluster against the emulated cluster: GQA shapes, the bench's programs, the recorded GPU and CPU runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cost_model.cluster import EMULATED_SETTINGS, Parallelism, get_setting, model_flops_per_step, strands
from cost_model.cluster.emulated import (
    PER_PEER_OPERATIONS,
    TOLERANCE,
    BenchRecord,
    compare_bench,
    modeled,
    per_peer_steps,
    predict_variant,
    program_kind,
    recorded_link,
    variant_setting,
)
from cost_model.cluster.setting import MOE_CAPACITY_FACTOR
from cost_model.cluster.strands import elementwise_time_s, matmul_time_s
from cost_model.hardware import get_device
from cost_model.helix_schedule import SCHEDULE_KINDS
from cost_model.strand_plan import Segment
from dhelix_compile.bench.recorded import setting_from_bench
from dhelix_compile.cli import main
from dhelix_compile.testing.moe import MoEConfig

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
#: The recorded GPU runs (BENCHMARKS.md, "Emulated cluster") and the settings they ran.
RECORDED = {
    "2026-11-28-h200-emulated-tp8-ib400.json": "h200-emulated-llama3_8b_gpu-tp8-ib400",
    "2026-11-28-h200-emulated-tp8-nvlink4.json": "h200-emulated-llama3_8b_gpu-tp8-nvlink4",
}
IB400 = "2026-11-28-h200-emulated-tp8-ib400.json"
HF_TP = "2026-11-29-cpu-emulated-hf_tp.json"
HF_TP_SP = "2026-11-29-cpu-emulated-hf_tp_sp.json"
ZERO3 = "2026-11-29-cpu-emulated-zero3.json"
MOE = "2026-11-29-cpu-emulated-moe.json"
PIPELINE = "2026-11-29-cpu-emulated-pp_1f1b.json"
#: The same pipeline, 8 micro-batches, another run (its balanced link of the same label, another rate).
PIPELINE_8 = "2026-11-29-cpu-emulated-pp_1f1b-8mb.json"
#: The recorded CPU runs (BENCHMARKS.md, "The emulated cluster, predicted") and the variants whose
#: run issued per-peer steps (decompose="auto"), which no modeled program holds.
RECORDED_CPU = {
    "2026-11-28-cpu-emulated-l8b_ib400.json": (),
    HF_TP: ("dhelix",),
    HF_TP_SP: ("dhelix",),
    ZERO3: (),
    MOE: ("dhelix",),
}


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
        setting_from_bench({**data, "model": "mlp_medium"})
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


# --------------------------------------------------------------------------- the recorded CPU runs


def test_hugging_face_llama_is_the_bench_shape_under_its_tp_plans() -> None:
    tp, _ = setting_from_bench(_load(HF_TP))
    sp, _ = setting_from_bench(_load(HF_TP_SP))
    m = tp.model
    assert (m.layers, m.hidden, m.heads, m.key_value_heads, m.ffn_hidden, m.vocab) == (2, 512, 8, 8, 1536, 2048)
    assert (tp.seq_len, tp.micro_batch_size, tp.micro_batches, tp.dtype, tp.device) == (256, 2, 4, "float32", "cpu")
    assert sp.model == m and (tp.parallel.tp, sp.parallel.tp) == (2, 2)
    # the TP plan covers the decoder layers only; TP + SP shards the embedding and the head as the reference's
    assert (tp.ends, tp.parallel.sequence_parallel) == ("replicated", False)
    assert (sp.ends, sp.parallel.sequence_parallel) == ("vocab_parallel", True)
    with pytest.raises(ValueError, match="replicated ends need tp without sequence parallelism"):
        dataclasses.replace(sp, ends="replicated").validate()


def test_replicated_ends_send_nothing_and_compute_every_logit() -> None:
    setting, _ = setting_from_bench(_load(HF_TP))
    fwd, bwd = strands(variant_setting(setting, "dhelix"))
    assert [s.collective for s in fwd] == ["all_reduce (attn-out)", "all_reduce (mlp-out)"] * 2 + [None]
    assert fwd[0].ops[0] == "embedding" and fwd[-1].ops[-2:] == ("logits", "cross-entropy")
    assert [s.collective for s in bwd if s.collective is not None] == [
        "all_reduce (mlp-in grad)",
        "all_reduce (attn-in grad)",
    ] * 2
    # the last segment: final norm, all 2048 logits of the 512 tokens, the loss over them (float32)
    cpu, tokens, e = get_device("cpu"), 512, 4
    head = (
        elementwise_time_s(4 * tokens * 512 * e, cpu)
        + matmul_time_s(tokens, 2048, 512, cpu, dtype=torch.float32)
        + elementwise_time_s(3 * tokens * 2048 * e, cpu)
    )
    assert fwd[-1].compute_s == pytest.approx(head, rel=1e-12)


@pytest.mark.parametrize("name", list(RECORDED_CPU))
def test_what_the_cpu_runs_sent_is_predicted_exactly(name: str) -> None:
    """Transfers by kind, bytes and link time equal the ledger's; where decompose="auto" issued
    collectives as per-peer steps, the bytes still do, and the collectives replaced, the steps and
    their fixed costs account for the rest exactly."""
    setting, record = setting_from_bench(_load(name))
    assert {"inductor", "dhelix", "helix"} <= set(record.variants)
    for variant, measured in record.variants.items():
        if not modeled(variant, setting):  # a run may carry variants with options of their own too
            continue
        predicted = predict_variant(setting, variant)
        assert predicted.wire_bytes == pytest.approx(measured.wire_bytes, rel=1e-9), variant
        steps = per_peer_steps(setting, predicted, measured)
        if variant not in RECORDED_CPU[name]:
            assert steps is None, variant
            assert predicted.transfers == measured.transfers, variant
            assert predicted.operations == measured.operations, variant
            assert predicted.comm_s == pytest.approx(measured.t_comm_s, rel=1e-9), variant
            continue
        assert steps is not None and steps.sends == steps.recvs > 0, variant
        left = {op: n - steps.replaced.get(op, 0) for op, n in predicted.operations.items()}
        assert {op: n for op, n in left.items() if n} == {
            op: n for op, n in measured.operations.items() if op not in PER_PEER_OPERATIONS
        }, variant
        assert predicted.transfers - sum(steps.replaced.values()) + steps.sends + steps.recvs == measured.transfers
        assert steps.comm_s == pytest.approx(measured.t_comm_s, rel=1e-9), variant


@pytest.mark.parametrize("name", list(RECORDED_CPU))
def test_claimed_predictions_are_within_tolerance_of_the_recorded_cpu_steps(name: str) -> None:
    setting, record = setting_from_bench(_load(name))
    rows = compare_bench(setting, record).rows
    claimed = {r.variant for r in rows if r.measured_inputs_claimed}
    assert claimed == {r.variant for r in rows} - set(RECORDED_CPU[name])
    for row in rows:
        assert not row.analytic_claimed, row.variant  # no roofline describes Python dispatch
        if row.measured_inputs_claimed:
            assert abs(row.measured_inputs_ratio - 1) <= TOLERANCE, (row.variant, row.measured_inputs_ratio)


def test_helix_schedules_are_priced_as_the_runtime_pairs_the_calls() -> None:
    """``helix[helix_schedule=...]`` is helix's program on that schedule's steps: the default
    schedule is helix itself, the others send the same and step otherwise, an unknown one is
    named."""
    setting, record = setting_from_bench(_load(HF_TP))
    assert "helix[helix_schedule=same_phase]" in record.variants
    helix = predict_variant(setting, "helix")
    assert predict_variant(setting, "helix[helix_schedule=forward_backward]").step_s == helix.step_s
    for kind in ("same_phase", "paired_ends"):
        other = predict_variant(setting, f"helix[helix_schedule={kind}]")
        assert (other.wire_bytes, other.transfers, other.comm_s) == (helix.wire_bytes, helix.transfers, helix.comm_s)
        assert other.step_s != helix.step_s, kind
        assert kind in other.program.describe(setting)
    one = dataclasses.replace(setting, micro_batches=1)  # one forward and one backward, whatever the schedule
    assert {predict_variant(one, f"helix[helix_schedule={k}]").step_s for k in SCHEDULE_KINDS} == {
        predict_variant(one, "helix").step_s
    }
    assert not modeled("helix[helix_schedule=zigzag]") and not modeled("helix[decompose=off]")
    with pytest.raises(ValueError, match="same_phase"):
        predict_variant(setting, "helix[helix_schedule=zigzag]")


def test_fsdp2_gathers_each_unit_together_and_each_layer_again_in_the_backward() -> None:
    """The bench's FSDP2 + Inductor (``torch_inductor``): fully_shard on each layer, then the root."""
    setting, record = setting_from_bench(_load(ZERO3))
    assert modeled("torch_inductor", setting) and "torch_inductor" in record.variants
    fwd, bwd = strands(variant_setting(setting, "torch_inductor"))
    layers = setting.model.layers
    kinds = [[c.collective for c in side if c.collective is not None] for side in (fwd, bwd)]
    assert kinds[0] == ["all_gather (root)", *(f"all_gather (layer {i})" for i in range(layers))]
    backward = [f"all_gather (layer {i})" for i in reversed(range(layers))]
    assert kinds[1] == [
        x for i in reversed(range(layers)) for x in (f"all_gather (layer {i})", f"reduce_scatter (layer {i} grad)")
    ] + ["reduce_scatter (root grad)"]
    assert [k for k in kinds[1] if k.startswith("all_gather")] == backward
    fsdp2, zero3 = predict_variant(setting, "torch_inductor"), predict_variant(setting, "inductor")
    # the same parameters gathered and reduced, and the layers gathered once more
    layer_bytes = fsdp2.wire_bytes - zero3.wire_bytes
    assert 0 < layer_bytes < zero3.wire_bytes / 2
    tp_setting, _ = setting_from_bench(_load(HF_TP))
    assert not modeled("torch_inductor", tp_setting)
    with pytest.raises(ValueError, match="zero3 settings only"):
        predict_variant(tp_setting, "torch_inductor")


def test_helix_has_no_logits_gather_to_rewrite_under_the_hugging_face_tp_plan() -> None:
    setting, record = setting_from_bench(_load(HF_TP))
    rows = {r.variant: r for r in compare_bench(setting, record).rows}
    assert any("vocab_parallel_loss has no logits gather" in note for note in rows["helix"].notes)
    assert not rows["dhelix"].notes
    # its program's loss field changes nothing where the head is replicated
    gathered = dataclasses.replace(variant_setting(setting, "helix"), loss="gathered_logits")
    assert strands(gathered) == strands(variant_setting(setting, "helix"))


def test_cli_from_bench_hugging_face_llama(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--from-bench", str(RESULTS / HF_TP), "--from-bench", str(RESULTS / HF_TP_SP)]) == 0
    out = capsys.readouterr().out
    assert "### cpu-emulated-hf_llama-tp2-balanced against" in out
    assert "### cpu-emulated-hf_llama-tp_sp2-balanced against" in out
    assert "embedding and LM head replicated (outside the TP plan)" in out
    assert "| 59 / 59 | 56 / 56 | 1066.8 / 1066.8 |" in out and "| 50 / 50 | 84 / 84 | 1225.5 / 1225.5 |" in out
    assert "none: per-peer steps" in out
    assert "decompose='auto' issued 16 all_reduce a step as per-peer steps (" in out


# --------------------------------------------------------------------------- ZeRO-3


def test_a_zero3_run_is_the_reference_transformer_sharded_over_the_ranks() -> None:
    setting, _ = setting_from_bench(_load(ZERO3))
    m = setting.model
    assert (m.layers, m.hidden, m.heads, m.key_value_heads, m.ffn_hidden, m.vocab) == (4, 512, 8, 8, 1536, 1024)
    assert setting.parallel == Parallelism(dp=2, tp=1, sequence_parallel=False)
    assert (setting.dp_mode, setting.seq_len, setting.micro_batch_size, setting.micro_batches) == ("shard", 256, 4, 4)
    assert "ZeRO-3: parameters sharded over DP" in setting.describe()
    with pytest.raises(ValueError, match="dp_mode='shard' is modeled for the Llama family with tp = pp = cp = 1"):
        dataclasses.replace(setting, parallel=Parallelism(dp=2, tp=2)).validate()


def test_zero3_gathers_each_parameter_before_its_group_and_reduce_scatters_its_gradient() -> None:
    setting, _ = setting_from_bench(_load(ZERO3))
    layer = ["attention norm", "wq", "wk", "wv", "wo", "ffn norm", "w1", "w2", "w3"]
    params = ["embedding", *layer * 4, "final norm", "output"]
    for variant in ("inductor", "dhelix"):
        fwd, bwd = strands(variant_setting(setting, variant))
        assert [s.collective for s in fwd if s.collective] == [f"all_gather ({p})" for p in params]
        assert [s.collective for s in bwd if s.collective] == [f"reduce_scatter ({p} grad)" for p in reversed(params)]
        # every transfer but the backward's first of each group is a segment of its own: no compute
        assert all(s.compute_s == 0 for s in fwd if s.collective)
        assert all(s.weight_grad_s == 0 for s in fwd + bwd)  # the reduce-scatters send the weight gradients
        assert sum(1 for s in bwd if s.compute_s > 0) == 6  # embedding, 4 layers, head
    traced_fwd, traced_bwd = strands(variant_setting(setting, "inductor"))
    assert all(s.waits for s in traced_fwd + traced_bwd)  # each collective waited where it is issued
    fwd, bwd = strands(variant_setting(setting, "dhelix"))
    # layer 0's nine gathers go out before the embedding computes, the first of them once the embedding's landed
    embedding = next(k for k, s in enumerate(fwd) if s.ops == ("embedding",))
    assert [s.collective for s in fwd[1:embedding]] == [f"all_gather ({p})" for p in layer]
    assert fwd[1].waits and not any(s.waits for s in fwd[2 : embedding + 1])
    assert not any(s.waits for s in bwd)  # the backward reads none of its reduce-scatters


def test_zero3_prefetched_gathers_hide_under_the_compute_and_traced_ones_do_not() -> None:
    setting, _ = setting_from_bench(_load(ZERO3))
    traced = predict_variant(setting, "inductor")
    assert traced.step_s == pytest.approx(traced.compute_s + traced.comm_s, rel=1e-12)
    # compute far above the link time: the prefetched orders hide all but the ends of the step
    slow = {v: predict_variant(setting, v, compute_scale=1e3) for v in ("inductor", "dhelix", "helix")}
    for variant in ("dhelix", "helix"):
        exposed = slow[variant].step_s - slow[variant].compute_s
        assert 0 < exposed < 0.1 * slow[variant].comm_s, variant
    assert slow["inductor"].step_s == pytest.approx(slow["inductor"].compute_s + slow["inductor"].comm_s)
    steps = [predict_variant(setting, v).step_s for v in ("inductor", "dhelix", "helix")]
    assert steps == sorted(steps, reverse=True)


def test_cli_from_bench_zero3(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--from-bench", str(RESULTS / ZERO3)]) == 0
    out = capsys.readouterr().out
    assert "### cpu-emulated-medium-dp_shard2-balanced against" in out
    assert "DP2 TP1 PP1" in out and "ZeRO-3: parameters sharded over DP" in out
    assert "| helix | as dhelix, two strands (SI DP) |" in out and "| 235 / 235 | 312 / 312 |" in out
    assert "| torch_inductor | FSDP2: a gather per layer" in out and "| 344 / 344 | 56 / 56 |" in out
    assert "Not modeled" not in out


# --------------------------------------------------------------------------- the MoE layer


def test_an_moe_run_is_one_layer_with_its_experts_split_over_the_ranks() -> None:
    setting, _ = setting_from_bench(_load(MOE))
    m = setting.model
    assert (m.family, m.hidden, m.ffn_hidden, m.experts, m.top_k) == ("moe", 512, 1024, 4, 2)
    assert setting.parallel == Parallelism(dp=2, tp=1, sequence_parallel=False)
    assert (setting.seq_len, setting.micro_batch_size, setting.micro_batches) == (256, 1, 4)
    # the layer's own rule: ceil(1.25 * 256 tokens * top-2 / 4 experts) slots per expert
    assert MoEConfig().capacity_factor == MOE_CAPACITY_FACTOR
    assert m.expert_capacity(256) == MoEConfig(dim=512, ffn_hidden=1024).capacity(256) == 160
    assert "one MoE layer: hidden 512, 4 SwiGLU experts of FFN 1024, top-2" in setting.describe()
    with pytest.raises(ValueError, match="an MoE layer is modeled alone"):
        dataclasses.replace(setting, parallel=Parallelism(dp=2, tp=2)).validate()
    with pytest.raises(ValueError, match="3 experts with top_k 2 do not split over dp=2"):
        dataclasses.replace(setting, model=dataclasses.replace(m, experts=3)).validate()


def test_the_moe_layer_sends_its_tokens_and_back_and_one_gradient() -> None:
    setting, record = setting_from_bench(_load(MOE))
    fwd, bwd = strands(variant_setting(setting, "inductor"))
    # neither the tokens nor the routing masks need a gradient: the dispatch's all-to-all has no backward
    assert [s.collective for s in fwd] == ["all_to_all (dispatch)", "all_to_all (combine)", None]
    assert [s.ops for s in fwd] == [("router", "dispatch"), ("experts",), ("combine", "loss")]
    assert [s.collective for s in bwd] == ["all_to_all (combine grad)", None]
    assert bwd[1].ops == ("experts", "router") and bwd[1].waits  # the experts' backward reads the gradient
    assert bwd[0].weight_grad_s > 0  # the gates' gradient: only the router's backward reads it
    # 4 experts x 160 slots x 512 float32 a transfer, half of it to the other rank
    assert fwd[0].wire_bytes == 4 * 160 * 512 * 4 / 2
    assert predict_variant(setting, "helix").operations == {"all_to_all": 12} == record.variants["helix"].operations


# --------------------------------------------------------------------------- the pipeline's last stage


def test_a_pipeline_run_is_its_last_stage_tensor_parallel_within_it() -> None:
    setting, record = setting_from_bench(_load(PIPELINE))
    assert program_kind(setting) == "pipeline"
    assert (setting.parallel.pp, setting.parallel.tp, setting.parallel.dp) == (2, 2, 1)
    assert setting.name == "cpu-emulated-small-pp2-tp2-ranks4-balanced"
    fwd, bwd = strands(variant_setting(setting, "pipeline_inductor"))
    assert not any("embedding" in " ".join(c.ops) for c in fwd + bwd)  # the first stage's
    assert {v for v in record.variants if modeled(v, setting)} == {"pipeline_inductor", "helix_pipeline"}
    assert not modeled("helix", setting) and not modeled(
        "pipeline_inductor", get_setting(next(iter(RECORDED.values())))
    )


@pytest.mark.parametrize("name", [PIPELINE, PIPELINE_8])
def test_what_the_pipeline_run_sent_is_predicted_exactly(name: str) -> None:
    """Its stage's collectives, and a receive and a send of one micro-batch's hidden states each
    micro-batch; helix_pipeline's per-peer steps account for the rest of its transfers."""
    setting, record = setting_from_bench(_load(name))
    m = record.microbatches
    inductor, helix = (record.variants[v] for v in ("pipeline_inductor", "helix_pipeline"))
    predicted = predict_variant(setting, "pipeline_inductor")
    expected = {"all_gather": m, "all_reduce": 15 * m, "recv": m, "send": m}
    assert predicted.operations == inductor.operations == expected
    assert (predicted.transfers, predicted.wire_bytes) == (inductor.transfers, inductor.wire_bytes)
    assert predicted.comm_s == pytest.approx(inductor.t_comm_s, rel=1e-9)  # the sends: the outbound queue
    assert per_peer_steps(setting, predicted, inductor) is None
    predicted = predict_variant(setting, "helix_pipeline")
    assert predicted.wire_bytes == helix.wire_bytes
    steps = per_peer_steps(setting, predicted, helix)
    assert steps is not None and steps.sends == steps.recvs == 21 * m and steps.replaced == {"all_reduce": 5 * m}
    assert steps.comm_s == pytest.approx(helix.t_comm_s, rel=1e-9)


def test_records_of_one_link_label_and_other_rates_are_each_priced_on_their_own() -> None:
    """A balanced link's label rounds its rate: two runs' links of one label are two links."""
    (first, _), (second, _) = (setting_from_bench(_load(name)) for name in (PIPELINE, PIPELINE_8))
    links = [first.tp_link, second.tp_link]
    assert links[0].name.split("@")[0] == links[1].name.split("@")[0] == "balanced_0.14gbps"
    assert [link.bandwidth_bytes_per_s for link in links] == [
        _load(name)["link"]["bandwidth_bytes_per_s"] for name in (PIPELINE, PIPELINE_8)
    ]
    assert setting_from_bench(_load(PIPELINE))[0].tp_link == links[0]  # the same numbers: the same entry


@pytest.mark.parametrize("name", [PIPELINE, PIPELINE_8])
def test_the_pipeline_run_is_predicted_within_tolerance_where_claimed(name: str) -> None:
    setting, record = setting_from_bench(_load(name))
    rows = {r.variant: r for r in compare_bench(setting, record).rows}
    assert rows["pipeline_inductor"].measured_inputs_claimed
    assert abs(rows["pipeline_inductor"].measured_inputs_ratio - 1) <= TOLERANCE
    assert not rows["helix_pipeline"].measured_inputs_claimed  # per-peer steps


def _stage_program(transfers: str) -> float:
    """Three micro-batches of a 10 s forward and a 10 s backward, 1 s stage transfers."""
    from cost_model.cluster.emulated import _last_stage_s

    def segment(strand: int) -> Segment:
        return Segment(strand=strand, nodes=(), compute_s=10.0, comm_s=0.0, live_after_bytes=0, peak_bytes=0)

    return _last_stage_s([segment(0)], [segment(1)], 3, 1.0, transfers, 1.0)  # type: ignore[arg-type]


def test_the_schedules_loop_waits_every_transfer_and_the_runtime_only_the_first_and_last() -> None:
    """torch's Schedule1F1B on the last stage: the first receive, each send batched with the next
    receive and the last send, all waited where issued. Its runtime (helix_pipeline's) posts each
    later receive before the backward ahead of its forward and waits the sends at the end."""
    assert _stage_program("schedule_loop") == pytest.approx(60.0 + 4 * 1.0)
    assert _stage_program("runtime") == pytest.approx(60.0 + 2 * 1.0)


def test_pipeline_runs_the_model_does_not_hold_are_named() -> None:
    data = _load(PIPELINE)
    with pytest.raises(ValueError, match="only 1f1b is modeled"):
        setting_from_bench({**data, "parallel": "pipeline dualpipev, PP=2 x TP=2"})
    with pytest.raises(ValueError, match="as rank 0: only a rank of the last stage"):
        setting_from_bench({**data, "rank": 0})


def test_cli_from_bench_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--from-bench", str(RESULTS / PIPELINE)]) == 0
    out = capsys.readouterr().out
    assert "### cpu-emulated-small-pp2-tp2-ranks4-balanced against" in out and "DP1 TP2 PP2" in out
    assert "| pipeline_inductor | Schedule1F1B, Inductor stages" in out and "| 36 / 36 | 72 / 72 |" in out
    assert "helix_pipeline: decompose='auto' issued 20 all_reduce a step as per-peer steps" in out
