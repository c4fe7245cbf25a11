"""cost_model.cluster and ``dhelix simulate``: segment costs, schedules, MFU, links, the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cost_model.cluster import (
    SETTINGS,
    ClusterPrediction,
    ModelShape,
    Parallelism,
    UnknownSettingError,
    get_setting,
    matmul_time_s,
    model_flops_per_step,
    simulate_setting,
    strands,
)
from cost_model.cluster.strands import LOSS_STAT_REDUCES
from cost_model.hardware import get_device
from dhelix_compile.cli import main

aten = torch.ops.aten


@pytest.fixture(scope="module")
def predictions() -> dict[str, ClusterPrediction]:
    return {name: simulate_setting(setting) for name, setting in SETTINGS.items()}


def _wider(shape: ModelShape, factor: int) -> ModelShape:
    return dataclasses.replace(shape, hidden=shape.hidden * factor, ffn_hidden=shape.ffn_hidden * factor)


def test_twice_the_hidden_size_is_about_four_times_the_matmul_work() -> None:
    base = get_setting("a40-gpt-6.7b")
    wide = dataclasses.replace(base, model=_wider(base.model, 2))
    assert wide.model.layer_matmul_params() == 4 * base.model.layer_matmul_params()
    a40 = get_device("a40")
    t, h = 4096, 4096
    assert matmul_time_s(t, 2 * h, 2 * h, a40) / matmul_time_s(t, h, h, a40) == pytest.approx(4.0, rel=0.01)
    # the whole forward strand: matmuls x4, attention and elementwise x2 (same heads, same tokens)
    fwd, _ = strands(base)
    fwd_wide, _ = strands(wide)
    ratio = sum(s.compute_s for s in fwd_wide) / sum(s.compute_s for s in fwd)
    assert 3.5 < ratio < 4.0
    # TP communication moves T*h bytes per collective: ~2x
    comm_ratio = sum(s.comm_s for s in fwd_wide) / sum(s.comm_s for s in fwd)
    assert 1.9 < comm_ratio < 2.0


def test_segments_end_at_tp_collectives() -> None:
    setting = get_setting("a40-llama-8b")  # tp 4 with sequence parallelism, pp 1
    fwd, bwd = strands(setting)
    per_layer = 4  # AG, RS, AG, RS
    layers = setting.model.layers * per_layer
    # embedding RS, the layers, the head's AG, the three loss-statistics all-reduces, the loss
    assert len(fwd) == 1 + layers + 1 + len(LOSS_STAT_REDUCES) + 1
    assert [s.collective for s in fwd[-4:-1]] == [f"all_reduce (loss {stat})" for stat in LOSS_STAT_REDUCES]
    # the head's RS (after the cross-entropy and logits), the layers, the embedding's AG, its lookup
    assert len(bwd) == 1 + layers + 1 + 1
    assert fwd[1].collective is not None and fwd[1].collective.startswith("all_gather")
    assert fwd[2].collective is not None and fwd[2].collective.startswith("reduce_scatter")
    # the embedding's reduce-scatter becomes an all-gather of its gradient, then the lookup's backward
    assert bwd[-2].collective is not None and bwd[-2].collective.startswith("all_gather")
    assert bwd[-1].collective is None and bwd[-1].ops == ("embedding",)
    no_sp = dataclasses.replace(setting, parallel=dataclasses.replace(setting.parallel, sequence_parallel=False))
    fwd_ar, _ = strands(no_sp)
    assert len(fwd_ar) == 1 + setting.model.layers * 2 + len(LOSS_STAT_REDUCES) + 1
    assert all(s.collective is None or s.collective.startswith("all_reduce") for s in fwd_ar)


def test_dhelix_never_slower_than_sequential(predictions: dict[str, ClusterPrediction]) -> None:
    for name, pred in predictions.items():
        assert pred.dhelix.step_s <= pred.sequential.step_s, name
        assert pred.pair_s <= pred.sequential.parts_s["micro-batches"] / pred.setting.micro_batches + 1e-12, name
    assert all(predictions[n].speedup > 1.05 for n in predictions if n.startswith("a40-"))


def test_mfu_between_zero_and_one(predictions: dict[str, ClusterPrediction]) -> None:
    for name, pred in predictions.items():
        for schedule in (pred.sequential, pred.dhelix):
            assert 0.0 < schedule.mfu < 1.0, (name, schedule.name)
            peak = get_device(pred.setting.device).flops_per_s(torch.bfloat16)
            assert schedule.tflops_per_gpu * 1e12 == pytest.approx(schedule.mfu * peak)


def test_model_flops_match_megatron_formula() -> None:
    # Narayanan et al. (SC'21): 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) for a GPT model, B = global batch
    setting = get_setting("a40-gpt-6.7b")
    m, s = setting.model, setting.seq_len
    batch = setting.parallel.dp * setting.micro_batches * setting.micro_batch_size
    expected = 72 * batch * s * m.layers * m.hidden**2 * (1 + s / (6 * m.hidden) + m.vocab / (12 * m.layers * m.hidden))
    assert model_flops_per_step(setting) == pytest.approx(expected, rel=1e-12)


def test_cross_node_tp_uses_the_inter_node_link() -> None:
    tp8, tp16 = get_setting("h100-llama-39b-tp8"), get_setting("h100-llama-39b-tp16")
    assert tp8.tp_link.name == "nvlink4"
    assert tp16.tp_link.name == "ib_ndr"
    small_nodes = dataclasses.replace(get_setting("a40-llama-25b"), gpus_per_node=4)  # tp 8 over 2 nodes
    assert small_nodes.tp_link.name == "ib_hdr"
    assert get_setting("a40-llama-25b").tp_link.name == "pcie4"
    # the inter-node link makes every TP collective slower
    fwd8, _ = strands(tp8)
    fwd16, _ = strands(tp16)
    assert sum(s.comm_s for s in fwd16) > 5 * sum(s.comm_s for s in fwd8)


def test_group_links_follow_megatron_rank_order() -> None:
    setting = get_setting("a40-long-llama-8b")  # tp 4, cp 2: the CP pair shares a node of 8
    assert setting.cp_link.name == "pcie4"
    assert setting.dp_link.name == "ib_hdr"
    assert get_setting("a40-long-llama-25b").cp_link.name == "ib_hdr"  # tp 8 fills the node


def test_pipeline_bubble_and_single_microbatch() -> None:
    pred = simulate_setting(get_setting("a40-llama-39b"))  # pp 2, 8 micro-batches
    parts = pred.sequential.parts_s
    assert parts["pipeline bubble"] == pytest.approx(parts["micro-batches"] / 8)
    assert parts["pipeline p2p"] > 0
    one = simulate_setting(dataclasses.replace(get_setting("a40-llama-8b"), micro_batches=1))
    assert one.dhelix.step_s == pytest.approx(one.sequential.step_s)


def test_contention_makes_dhelix_slower_but_never_worse_than_sequential() -> None:
    setting = get_setting("a40-gpt-18b")
    steps = [simulate_setting(setting, contention_factor=f).dhelix.step_s for f in (1.0, 1.1, 1.5, 3.0)]
    assert steps == sorted(steps)
    assert steps[-1] <= simulate_setting(setting).sequential.step_s
    with pytest.raises(ValueError, match="contention"):
        simulate_setting(setting, contention_factor=0.5)


def test_invalid_settings_are_named() -> None:
    with pytest.raises(UnknownSettingError, match=r"valid settings: .*a40-llama-8b"):
        get_setting("llama-1000b")
    bad = dataclasses.replace(get_setting("a40-llama-8b"), parallel=Parallelism(dp=16, tp=3))
    with pytest.raises(ValueError, match="heads do not split over tp=3"):
        simulate_setting(bad)


def test_cli_one_setting(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out_json = tmp_path / "pred.json"
    assert main(["simulate", "--setting", "a40-llama-8b", "--contention", "1.2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "not measurements" in out
    assert "### a40-llama-8b" in out
    assert "| sequential (Megatron-like) |" in out and "| dhelix plan |" in out
    assert "1.31x" in out  # the paper's reported speedup, with its source
    assert "DHeLlam-502/dhellam" in out
    data = json.loads(out_json.read_text())
    assert [d["setting"] for d in data] == ["a40-llama-8b"]
    # the flag reached the model: the JSON is the contended prediction, which differs from the default's
    setting = get_setting("a40-llama-8b")
    contended = simulate_setting(setting, contention_factor=1.2)
    assert data[0] == json.loads(json.dumps(contended.to_dict()))
    assert data[0]["dhelix"]["step_s"] > simulate_setting(setting).dhelix.step_s


def test_cli_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--setting", "all"]) == 0
    out = capsys.readouterr().out
    for name in SETTINGS:
        assert f"### {name}" in out
        assert f"| {name} |" in out  # the summary table


def test_cli_unknown_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--setting", "llama-1000b"]) == 2
    err = capsys.readouterr().err
    assert "unknown setting 'llama-1000b'" in err
    assert "a40-llama-8b" in err and "h100-llama-39b-tp16" in err
