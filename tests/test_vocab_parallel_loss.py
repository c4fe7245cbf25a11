"""vocab_parallel_loss: a cross-entropy over all-gathered logits runs on each rank's vocabulary shard.

Real gloo ranks, PyTorch's own TP plans on the reference transformer (its LM head column-wise
with replicated output: an all-gather of the logits), compiled with the dhelix backend against the
eager loop: same losses and gradients, and the logits' gather gone from the joint graph.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dhelix_compile.testing.multirank import run_on_ranks

c10d = torch.ops._c10d_functional


def _gathers_and_reductions(graph: torch.fx.Graph) -> tuple[list[list[int]], list[str]]:
    gathers = [list(n.meta["val"].shape) for n in graph.nodes if n.target == c10d.all_gather_into_tensor.default]
    reduces = [str(n.args[1]) for n in graph.nodes if n.target == c10d.all_reduce.default]
    return gathers, reduces


#: How the step takes the logits it computes the loss of: all of them, or every other one.
_HEADS = {
    "all": lambda logits, vocab: logits[..., :vocab],  # a slice that keeps the shard
    "every_other": lambda logits, vocab: logits[..., ::2],  # a strided slice: the gather stays
}


def _compare(
    rank: int, world_size: int, plan: str, codegen: str, return_logits: bool, ignored: int, head: str = "all"
) -> dict[str, Any]:
    import copy
    import dataclasses

    import graph_passes.joint.pass_list as joint_pass_list
    from dhelix_compile.models.llama import ModelConfig, Transformer, lm_loss
    from dhelix_compile.models.tensor_parallel import parallelize_tp, parallelize_tp_sp

    seen: list[dict[str, Any]] = []
    (entry,) = [p for p in joint_pass_list.JOINT_PASSES if p.name == "vocab_parallel_loss"]
    original = entry.fn

    def recording(graph: torch.fx.Graph) -> int:
        before = _gathers_and_reductions(graph)
        rewritten = original(graph)
        seen.append({"rewritten": rewritten, "before": before, "after": _gathers_and_reductions(graph)})
        return rewritten

    joint_pass_list.JOINT_PASSES = tuple(
        dataclasses.replace(p, fn=recording) if p is entry else p for p in joint_pass_list.JOINT_PASSES
    )
    config = ModelConfig(dim=32, n_heads=4, n_layers=1, ffn_hidden=64, vocab_size=96, max_seq_len=16)
    mesh = torch.distributed.device_mesh.DeviceMesh("cpu", list(range(world_size)))
    parallelize = parallelize_tp if plan == "tp" else parallelize_tp_sp
    eager = parallelize(Transformer(config), mesh)
    compiled_model = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
    targets = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
    if head == "every_other":
        targets //= 2  # classes of the strided slice
    targets.view(-1)[:ignored] = -100  # ignore_index: no target, no gradient

    def step(model: torch.nn.Module, t: torch.Tensor, y: torch.Tensor) -> Any:
        logits = _HEADS[head](model(t), config.vocab_size)
        loss = lm_loss(logits, y)
        return (loss, logits) if return_logits else loss

    options = {"codegen": codegen, "fallback": "error"}
    compiled = torch.compile(step, backend="dhelix", options=options)
    results = []
    for fn, model in ((step, eager), (compiled, compiled_model)):
        out = fn(model, tokens, targets)
        loss = out[0] if return_logits else out
        loss.backward()
        results.append(loss.detach())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)
    for name, p in eager.named_parameters():
        got = compiled_model.get_parameter(name).grad
        want, got = (getattr(g, "_local_tensor", g) for g in (p.grad, got))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return {"seen": seen, "vocab": config.vocab_size}


def _logit_gathers(shapes: list[list[int]], vocab: int, world_size: int) -> int:
    return sum(1 for s in shapes if s[-1] == vocab // world_size)


@pytest.mark.multirank
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("plan", "world_size", "codegen"),
    [
        ("tp", 2, "inductor"),
        ("tp_sp", 2, "eager"),
        pytest.param(
            "tp_sp",
            4,
            "eager",
            marks=pytest.mark.full,
        ),
    ],
    ids=["tp-2-inductor", "tp_sp-2", "tp_sp-4"],
)
def test_a_loss_over_gathered_logits_runs_on_the_shards(plan: str, world_size: int, codegen: str) -> None:
    results = run_on_ranks(_compare, world_size, plan, codegen, False, 5, timeout_s=200)
    for result in results:
        (joint,) = result["seen"]
        vocab = result["vocab"]
        assert joint["rewritten"] == 1
        assert _logit_gathers(joint["before"][0], vocab, world_size) == 1
        assert _logit_gathers(joint["after"][0], vocab, world_size) == 0
        # the softmax's max and sum, and the target's logit: three all-reduces more than before
        added = sorted(joint["after"][1])
        for op in joint["before"][1]:
            added.remove(op)
        assert added == ["max", "sum", "sum"]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_logits_the_step_returns_stay_gathered() -> None:
    """The logits are an output: every rank needs them whole, so the gather stays."""
    for result in run_on_ranks(_compare, 2, "tp", "eager", True, 0, timeout_s=100):
        (joint,) = result["seen"]
        assert joint["rewritten"] == 0 and joint["after"] == joint["before"]


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_a_strided_slice_of_the_logits_keeps_the_gather() -> None:
    """``x[..., ::2]`` runs from 0 to the end, but is not all of the vocabulary."""
    for result in run_on_ranks(_compare, 2, "tp", "eager", False, 0, "every_other", timeout_s=100):
        (joint,) = result["seen"]
        assert joint["rewritten"] == 0 and joint["after"] == joint["before"]


def test_the_option_turns_the_pass_off() -> None:
    from dhelix_compile.capture import joint_pass
    from dhelix_compile.config import DHelixConfig
    from graph_passes.joint.regather import mark_regathers

    assert [p.fn for p in joint_pass(DHelixConfig(vocab_parallel_loss=False)).passes] == [mark_regathers]
    assert [p.fn for p in joint_pass(DHelixConfig()).passes] != [mark_regathers]
