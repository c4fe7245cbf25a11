"""Numerics against eager: run the same training steps eagerly and compiled, compare everything.

``assert_matches_eager`` is how every test (and any user) checks a backend configuration:
two copies of one seeded model, the same inputs, one eager and one ``torch.compile``-d; after
each step the outputs, the loss, every parameter gradient and every buffer (BatchNorm running
statistics, say) must agree within tolerance.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

LossFn = Callable[[Any], torch.Tensor]


def default_loss(output: Any) -> torch.Tensor:
    """A scalar that depends on every output element: the mean of squares, in float32."""
    terms = [t.float().pow(2).mean() for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    if not terms:
        raise ValueError("default_loss: the output holds no tensor")
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


@dataclasses.dataclass
class StepResult:
    outputs: list[torch.Tensor]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def train_step(
    model: nn.Module,
    call: Callable[..., Any],
    args: Sequence[Any],
    loss_fn: LossFn = default_loss,
) -> StepResult:
    """One forward + backward of ``call(*args)``; gradients and buffers are read from ``model``."""
    model.zero_grad(set_to_none=True)
    output = call(*args)
    loss = loss_fn(output)
    loss.backward()
    return StepResult(
        outputs=[t.detach().clone() for t in tree_leaves(output) if isinstance(t, torch.Tensor)],
        loss=loss.detach().clone(),
        grads={n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()},
        buffers={n: b.detach().clone() for n, b in model.named_buffers()},
    )


def _prefixed(prefix: str) -> Callable[[str], str]:
    """A ``torch.testing.assert_close`` message that says where the mismatch is."""
    return lambda message: f"{prefix}: {message}"


def assert_close_results(
    expected: StepResult, actual: StepResult, *, atol: float, rtol: float, where: str = ""
) -> None:
    """Outputs, loss, every gradient and every buffer agree; the message names what differs."""
    assert len(expected.outputs) == len(actual.outputs), f"{where}: number of outputs differs"
    for i, (e, a) in enumerate(zip(expected.outputs, actual.outputs)):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=_prefixed(f"{where} output {i}"))
    torch.testing.assert_close(actual.loss, expected.loss, atol=atol, rtol=rtol)
    assert expected.grads.keys() == actual.grads.keys()
    for name, e_grad in expected.grads.items():
        a_grad = actual.grads[name]
        assert (e_grad is None) == (a_grad is None), f"{where}: grad of {name} is None on one side only"
        if e_grad is not None:
            torch.testing.assert_close(a_grad, e_grad, atol=atol, rtol=rtol, msg=_prefixed(f"{where} grad {name}"))
    for name, e in expected.buffers.items():
        torch.testing.assert_close(
            actual.buffers[name], e, atol=atol, rtol=rtol, msg=_prefixed(f"{where} buffer {name}")
        )


def assert_matches_eager(
    make_model: Callable[[], nn.Module],
    batches: Sequence[Sequence[Any]],
    *,
    backend: Any = "dhelix",
    options: Mapping[str, Any] | None = None,
    dynamic: bool | None = None,
    loss_fn: LossFn = default_loss,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    seed: int = 0,
) -> list[StepResult]:
    """Train a seeded eager model and a compiled copy on ``batches``; assert each step matches.

    ``options`` go to ``torch.compile(options=...)`` (only for string backends). Returns the
    compiled side's results, for further checks.
    """
    torch.manual_seed(seed)
    reference = make_model()
    subject = copy.deepcopy(reference)
    compile_kwargs: dict[str, Any] = {"backend": backend, "dynamic": dynamic}
    if options:
        compile_kwargs["options"] = dict(options)
    compiled = torch.compile(subject, **compile_kwargs)
    results = []
    for step, args in enumerate(batches):
        expected = train_step(reference, reference, args, loss_fn)
        actual = train_step(subject, compiled, args, loss_fn)
        assert_close_results(expected, actual, atol=atol, rtol=rtol, where=f"step {step}")
        results.append(actual)
    return results
