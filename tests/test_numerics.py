"""dhelix equals eager: outputs, loss, every gradient and buffer, on seeded random inputs.

Every model runs on the eager codegen path (fast); a representative subset also goes through
Inductor's C++ codegen. All runs use ``fallback="error"`` so a failing pass is never hidden.
"""

from __future__ import annotations

import functools

import pytest
import torch

from dhelix_compile.testing.compare import assert_matches_eager
from dhelix_compile.testing.toy_models import (
    GPT,
    MLP,
    BatchNormNet,
    ConvNet,
    GraphBreakNet,
    InPlaceNet,
    lm_loss,
)

STRICT = {"fallback": "error"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def _gpt_batch(seed: int, batch: int = 2, seq: int = 8, vocab: int = 64) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (batch, seq), generator=g),)


def _gpt_loss(batch_targets: torch.Tensor):
    return functools.partial(lm_loss, targets=batch_targets)


CASES = {
    "mlp": (MLP, lambda s: [(_rand(4, 16),) for _ in range(2)]),
    "convnet": (ConvNet, lambda s: [(_rand(2, 3, 8, 8),)]),
    "gpt": (GPT, lambda s: [_gpt_batch(s), _gpt_batch(s + 1)]),
    "batchnorm": (BatchNormNet, lambda s: [(_rand(8, 16),) for _ in range(2)]),
    "inplace": (InPlaceNet, lambda s: [(_rand(4, 16),)]),
    "graph_break": (GraphBreakNet, lambda s: [(_rand(4, 16),), (-_rand(4, 16).abs() * 5,)]),
}

INDUCTOR_CASES = ["mlp", "gpt", "batchnorm"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_codegen_matches_eager(name: str) -> None:
    make_model, make_batches = CASES[name]
    torch.manual_seed(1)
    assert_matches_eager(make_model, make_batches(1), options={**STRICT, "codegen": "eager"})


@pytest.mark.inductor
@pytest.mark.parametrize("name", INDUCTOR_CASES)
def test_inductor_codegen_matches_eager(name: str) -> None:
    make_model, make_batches = CASES[name]
    torch.manual_seed(1)
    assert_matches_eager(make_model, make_batches(1), options=STRICT)


def test_gpt_cross_entropy_loss_matches_eager() -> None:
    torch.manual_seed(2)
    (idx,) = _gpt_batch(3)
    targets = torch.roll(idx, -1, dims=1)
    assert_matches_eager(GPT, [(idx,)], options={**STRICT, "codegen": "eager"}, loss_fn=_gpt_loss(targets))


@pytest.mark.parametrize("codegen", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_bfloat16(codegen: str) -> None:
    torch.manual_seed(4)
    batches = [(_rand(4, 16, dtype=torch.bfloat16),)]
    assert_matches_eager(
        lambda: MLP().to(torch.bfloat16),
        batches,
        options={**STRICT, "codegen": codegen},
        atol=2e-2,
        rtol=2e-2,
    )


@pytest.mark.parametrize("codegen", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_dynamic_shapes_changing_batch(codegen: str) -> None:
    torch.manual_seed(5)
    batches = [(_rand(b, 16),) for b in (3, 5, 7)]
    assert_matches_eager(MLP, batches, options={**STRICT, "codegen": codegen}, dynamic=True)


def test_batch_size_change_without_dynamic_recompiles() -> None:
    torch.manual_seed(6)
    batches = [(_rand(b, 16),) for b in (2, 4, 6)]
    assert_matches_eager(MLP, batches, options={**STRICT, "codegen": "eager"})


@pytest.mark.parametrize("codegen", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_inference_graph_under_no_grad(codegen: str) -> None:
    torch.manual_seed(7)
    model = MLP().eval()
    x = _rand(4, 16)
    compiled = torch.compile(model, backend="dhelix", options={**STRICT, "codegen": codegen})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)


@pytest.mark.inductor
def test_inductor_codegen_is_bitwise_plain_inductor() -> None:
    """With passes that do not rewrite, dhelix generates exactly Inductor's program."""
    torch.manual_seed(8)
    model = GPT()
    twin = GPT()
    twin.load_state_dict(model.state_dict())
    (idx,) = _gpt_batch(9)
    ours = torch.compile(model, backend="dhelix", options=STRICT)(idx)
    theirs = torch.compile(twin, backend="inductor")(idx)
    assert torch.equal(ours, theirs)
    ours.float().pow(2).mean().backward()
    theirs.float().pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name
