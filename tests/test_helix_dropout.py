"""``helix`` and the backend on models that draw random numbers (dropout in training mode).

Two kinds of checks:

* **Mask replay, read off the numbers.** :class:`MaskProbe` drops entries of a parameter vector
  of ones and weighs entry j by 2**j and micro-batch i by 4**i (float64, p = 0.5: every value is
  exact). Micro-batch i's loss is then 2 * 4**i * sum_j m_ij 2**j: its forward's mask m_i in
  binary; the accumulated gradient of entry j is 2 * 2**j * sum_i m'_ij 4**i: the masks m'_i its
  backward used, one base-4 digit per micro-batch. Every micro-batch's backward must use the
  mask its forward drew (m' = m), under checkpointing too, where the backward draws it again.
* **The random stream.** A step equals the accumulation loop through the same code generator
  from the same seed (``backend="inductor"`` for Inductor's code, dhelix's backend with eager
  codegen for eager code), losses and gradients; two steps from one seed are identical.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import pytest
import torch
from torch import nn

import dhelix_compile
from dhelix_compile.helix_runtime.schedule import SCHEDULE_KINDS
from dhelix_compile.testing.checkpointing import Checkpointed

FULL = bool(os.environ.get("DHELIX_TEST_FULL"))
#: Inductor's C++ compile takes seconds per graph: the default schedule by default, every one with FULL.
INDUCTOR_SCHEDULES = SCHEDULE_KINDS if FULL else ("forward_backward",)
WIDTH = 20  # mask bits per micro-batch


class MaskProbe(nn.Module):
    """loss(scale) = sum_j dropout(w)_j * 2**j * scale, with w a float64 parameter of ones."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(WIDTH, dtype=torch.float64))
        self.register_buffer("weights", 2.0 ** torch.arange(WIDTH, dtype=torch.float64))
        self.drop = nn.Dropout(0.5)
        self.body = Checkpointed(_Dropped(self.drop)) if checkpointed else _Dropped(self.drop)

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return (self.body(self.w) * self.weights * scale).sum()


class _Dropped(nn.Module):
    def __init__(self, drop: nn.Module) -> None:
        super().__init__()
        self.drop = drop

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return self.drop(w)


def _forward_masks(losses: list[torch.Tensor]) -> list[list[int]]:
    """Micro-batch i's forward mask from its loss, 2 * 4**i * sum_j m_ij 2**j."""
    masks = []
    for i, loss in enumerate(losses):
        bits = round(loss.item() / (2 * 4**i))
        masks.append([(bits >> j) & 1 for j in range(WIDTH)])
    return masks


def _backward_masks(grad: torch.Tensor, n: int) -> list[list[int]]:
    """The masks the backwards used, from the accumulated gradient 2 * 2**j * sum_i m'_ij 4**i."""
    digits = [round(g) for g in (grad / (2 * 2.0 ** torch.arange(WIDTH, dtype=torch.float64))).tolist()]
    return [[(d >> (2 * i)) & 3 for d in digits] for i in range(n)]


def _scales(n: int) -> list[torch.Tensor]:
    return [torch.tensor(4.0**i, dtype=torch.float64) for i in range(n)]


def _probe_step(model: MaskProbe, n: int, seed: int, **options) -> tuple[list[torch.Tensor], torch.Tensor]:
    model.w.grad = None
    torch.manual_seed(seed)
    losses = dhelix_compile.helix(model, **options)(_scales(n))
    assert model.w.grad is not None
    return losses, model.w.grad.clone()


CODEGENS = [
    *(pytest.param("eager", schedule, id=f"eager-{schedule}") for schedule in SCHEDULE_KINDS),
    *(
        pytest.param("inductor", schedule, id=f"inductor-{schedule}", marks=pytest.mark.inductor)
        for schedule in INDUCTOR_SCHEDULES
    ),
]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize(("codegen", "schedule"), CODEGENS)
def test_every_backward_uses_the_mask_its_forward_drew(codegen: str, schedule: str, checkpointed: bool) -> None:
    n = 4
    model = MaskProbe(checkpointed)
    options = {"codegen": codegen, "fallback": "error", "helix_schedule": schedule}
    losses, grad = _probe_step(model, n, seed=7, **options)
    forward = _forward_masks(losses)
    assert _backward_masks(grad, n) == forward
    assert all(0 < sum(mask) < WIDTH for mask in forward), "p = 0.5 drops some entries and keeps some"
    assert len({tuple(mask) for mask in forward}) == n, "each micro-batch draws its own mask"
    again, grad_again = _probe_step(model, n, seed=7, **options)
    assert [loss.item() for loss in again] == [loss.item() for loss in losses]
    assert torch.equal(grad_again, grad)


class _DroppedMLP(nn.Module):
    """Two linear layers with dropout on the input and the hidden activation."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.relu(self.up(self.drop(x))))).pow(2).mean()


def _loop(step: Callable[[torch.Tensor], torch.Tensor], microbatches: list[torch.Tensor]) -> list[torch.Tensor]:
    losses = []
    for mb in microbatches:
        loss = step(mb)
        loss.backward()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize(("codegen", "schedule"), CODEGENS)
def test_a_step_equals_the_accumulation_loop_of_the_same_code_generator(codegen: str, schedule: str) -> None:
    torch.manual_seed(0)
    model = _DroppedMLP()
    reference = copy.deepcopy(model)
    microbatches = [torch.randn(8, 16) for _ in range(5)]
    backend = "inductor" if codegen == "inductor" else dhelix_compile.backend(codegen="eager", fallback="error")
    compiled = torch.compile(reference, backend=backend)
    torch.manual_seed(123)
    want = _loop(compiled, microbatches)
    torch.manual_seed(123)
    got = dhelix_compile.helix(model, lambda m, x: m(x), codegen=codegen, fallback="error", helix_schedule=schedule)(
        microbatches
    )
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-6, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("codegen", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_the_backends_recompute_draws_the_mask_its_forward_drew(codegen: str) -> None:
    """``backend="dhelix"`` on a checkpointed dropout: the backward recomputes the mask from the
    seed its forward drew, in Inductor's code and in eager code (``compat.seeded_random_prims``)."""
    n = 3
    model = MaskProbe(checkpointed=True)
    compiled = torch.compile(model, backend=dhelix_compile.backend(codegen=codegen, fallback="error"))
    torch.manual_seed(3)
    losses = _loop(compiled, _scales(n))
    assert model.w.grad is not None
    assert _backward_masks(model.w.grad, n) == _forward_masks(losses)
