"""The reference parallel models equal the single-process reference (outputs and gradients).

Single-process tests check the reference pieces (determinism, routing, loss sharding). The
multi-rank tests spawn one gloo run per world size and check every model kind in it
(``checks.check_all``: spawning ranks costs seconds, checking a kind a fraction of one):

* world size 2: eager parallel model == reference, and the ``torch.compile(backend="aot_eager")``
  parallel model == reference, captured as one graph without breaks, with the expected
  collectives in its forward and backward graphs;
* world size 4: eager parallel model == reference.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch

from dhelix_compile.models.llama import ModelConfig, Transformer, lm_loss
from dhelix_compile.testing.checks import MODEL_KINDS, ModelKind, check_all
from dhelix_compile.testing.moe import MoEConfig, ReferenceMoE, expert_ffn, route
from dhelix_compile.testing.multirank import MultiRankError, run_on_ranks
from dhelix_compile.testing.sequence_parallel import shard_sequence
from dhelix_compile.testing.sharding import reference_slice

COMPILE_WORLD_SIZE = 2
COMPILE_BACKEND = "aot_eager"

# ---- single process ---------------------------------------------------------------------------


def test_reference_transformer_is_deterministic_and_leaves_global_rng_alone() -> None:
    config = ModelConfig(seed=3)
    state = torch.get_rng_state()
    a, b = Transformer(config), Transformer(config)
    assert torch.equal(state, torch.get_rng_state())
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    c = Transformer(ModelConfig(seed=4))
    assert not torch.equal(a.output.weight, c.output.weight)


def test_reference_transformer_shapes_and_causality() -> None:
    config = ModelConfig()
    model = Transformer(config)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
    logits = model(tokens)
    assert logits.shape == (2, 12, config.vocab_size)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % config.vocab_size
    torch.testing.assert_close(model(changed)[:, :8], logits[:, :8])  # the future is not seen


def test_config_validate_names_the_uneven_split() -> None:
    ModelConfig().validate(4)
    with pytest.raises(ValueError, match="n_heads=4 not divisible by world_size=3"):
        ModelConfig().validate(3)
    with pytest.raises(ValueError, match="n_experts=4 not divisible"):
        MoEConfig().validate(3)


def test_sharded_losses_sum_to_the_full_loss() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 16, generator=gen)
    targets = torch.randint(0, 16, (2, 8), generator=gen)
    parts = [lm_loss(shard_sequence(logits, r, 4), shard_sequence(targets, r, 4), normalizer=16) for r in range(4)]
    torch.testing.assert_close(sum(parts), lm_loss(logits, targets))
    assert torch.equal(reference_slice(logits, 2, 1, 2), logits[:, :, 8:])


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_with_ample_capacity_equals_dense_per_token_formula(top_k: int) -> None:
    config = MoEConfig(top_k=top_k, capacity_factor=float(4 // top_k))  # room for every token
    moe = ReferenceMoE(config)
    x = torch.randn(3, 10, config.dim, generator=torch.Generator().manual_seed(0))
    probs = (x @ moe.router.weight.t()).softmax(-1)
    top_p, top_i = probs.topk(top_k, -1)
    gates = top_p / top_p.sum(-1, keepdim=True) if top_k == 2 else top_p
    every_expert = expert_ffn(
        x.reshape(1, -1, config.dim).expand(config.n_experts, -1, -1), moe.w1, moe.w3, moe.w2
    ).view(config.n_experts, 3, 10, config.dim)
    expected = torch.zeros_like(x)
    for j in range(top_k):
        picked = every_expert.permute(1, 2, 0, 3).gather(2, top_i[..., j, None, None].expand(-1, -1, 1, config.dim))[
            :, :, 0
        ]
        expected += gates[..., j, None] * picked
    torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-4)


def test_moe_routing_respects_capacity_and_priority() -> None:
    config = MoEConfig(top_k=2, capacity_factor=1.0)
    moe = ReferenceMoE(config)
    n_tokens = 16
    capacity = config.capacity(n_tokens)
    x = torch.randn(1, n_tokens, config.dim, generator=torch.Generator().manual_seed(1))
    dispatch, combine = route(x, moe.router.weight, config.top_k, capacity)
    assert dispatch.shape == (1, n_tokens, config.n_experts, capacity)
    assert dispatch.amax() == 1
    assert (dispatch.sum(1) <= 1).all()  # each (expert, slot) holds at most one token
    assert (dispatch.sum((2, 3)) <= 2).all()  # each token goes to at most top_k slots
    assert dispatch.sum() < n_tokens * config.top_k  # this seed overflows some expert
    # Slots fill in order: an expert's occupied slots are a prefix 0..n-1.
    occupied = dispatch[0].sum(0)  # [E, C]
    for e in range(config.n_experts):
        n = int(occupied[e].sum())
        assert occupied[e, :n].all() and not occupied[e, n:].any()
    assert ((combine > 0) == (dispatch > 0)).all()


# ---- multi-rank -------------------------------------------------------------------------------


@functools.cache
def _checks(world_size: int, backend: str | None) -> list[dict[str, dict[str, Any] | str]] | str:
    """Per-rank ``check_all`` reports (cached per module run), or the harness error text."""
    try:
        return run_on_ranks(check_all, world_size, MODEL_KINDS, backend, timeout_s=240)
    except MultiRankError as err:
        return str(err)


def _reports(world_size: int, kind: ModelKind) -> list[dict[str, Any]]:
    backend = COMPILE_BACKEND if world_size == COMPILE_WORLD_SIZE else None
    per_rank = _checks(world_size, backend)
    if isinstance(per_rank, str):
        pytest.fail(per_rank, pytrace=False)
    reports = []
    for rank, by_kind in enumerate(per_rank):
        report = by_kind[kind]
        if isinstance(report, str):
            pytest.fail(f"{kind} on rank {rank}/{world_size}:\n{report}", pytrace=False)
        reports.append(report)
    return reports


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_parallel_model_matches_reference(kind: ModelKind, world_size: int) -> None:
    reports = _reports(world_size, kind)  # each rank asserted outputs, params, grads itself
    reference_loss = reports[0]["reference_loss"]
    losses = [r["eager"]["loss"] for r in reports]
    if kind in ("tp", "tp_sp"):  # DTensor: the replicated loss is the reference loss
        for loss in losses:
            assert loss == pytest.approx(reference_loss, rel=1e-5)
    else:  # each rank's loss covers its shard; the shards' losses sum to the reference loss
        assert sum(losses) == pytest.approx(reference_loss, rel=1e-4, abs=1e-4)


_AG = "all_gather_into_tensor.default"
_RS = "reduce_scatter_tensor.default"
_EXPECTED_COLLECTIVES: dict[ModelKind, dict[str, Counter[str]]] = {
    # 2 layers. Hand-written: exactly what the model calls, and the autograd duals.
    "functional_sp": {
        "forward": Counter({_AG: 4, _RS: 4}),
        "backward": Counter({_AG: 4, _RS: 4}),
    },
    "moe": {
        "forward": Counter({"all_to_all_single.default": 2}),
        "backward": Counter({"all_to_all_single.default": 2}),
    },
}
_EXPECTED_COLLECTIVE_KINDS: dict[ModelKind, set[str]] = {
    # DTensor lowers its redistributions itself; pin only which collectives appear.
    "tp": {"all_reduce.default", _AG},
    "tp_sp": {_AG, _RS},
}


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_compiled_parallel_model_matches_reference(kind: ModelKind) -> None:
    reports = _reports(COMPILE_WORLD_SIZE, kind)
    for rank, report in enumerate(reports):
        compiled = report["compiled"]
        assert isinstance(compiled, dict)
        assert compiled["graphs"] == 1, f"rank {rank}: dynamo split the model: {compiled}"
        assert compiled["graph_breaks"] == 0, f"rank {rank}: {compiled}"
        assert compiled["loss"] == pytest.approx(report["eager"]["loss"], rel=1e-5)
        collectives = compiled["collectives"]
        assert isinstance(collectives, dict)
        if kind in _EXPECTED_COLLECTIVES:
            for which, expected in _EXPECTED_COLLECTIVES[kind].items():
                assert Counter(collectives[which]) == expected, (rank, which, collectives)
        else:
            assert set(collectives["forward"]) == _EXPECTED_COLLECTIVE_KINDS[kind], collectives
            assert collectives["backward"], collectives
    assert reports[0]["compiled"]["collectives"] == reports[1]["compiled"]["collectives"]
