"""Rank-side checks of ``helix``: a helix step equals the eager accumulation loop.

Contract
--------
``check_helix(rank, world_size, kind, num_microbatches, dtype="float32", **options)`` runs on
every rank of an initialised default process group (e.g. under ``run_on_ranks``) and

1. builds the ``kind`` parallel model twice (same seeded weights; ``checks.build_case``) and
   ``num_microbatches`` seeded micro-batches (different data each, this rank's part);
2. runs the eager loop ``for mb in mbs: loss_fn(model, mb).backward()`` on one copy and
   ``dhelix_compile.helix(copy, loss_fn, **options)(mbs)`` on the other;
3. compares the losses and every local gradient (DTensor shards as local tensors).

It returns a picklable report (losses, graph dump names) and raises ``AssertionError`` naming
every mismatch. Kinds and micro-batches (``loss_fn(model, mb)``):

- ``tp``, ``tp_sp``: ``mb = (tokens, targets)``, ``lm_loss(model(tokens), targets)``;
- ``functional_sp``: this rank's sequence shard of both, normalised by the global token count;
- ``moe``: ``mb = (x, probe)`` (this rank's tokens), ``(model(x) * probe).sum()``.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dhelix_compile.models.llama import lm_loss
from dhelix_compile.testing.checks import CheckConfig, ModelKind, build_case
from dhelix_compile.testing.sequence_parallel import shard_sequence

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_TOLERANCES = {"float32": (1e-5, 1e-4), "bfloat16": (2e-2, 2e-2)}


@dataclasses.dataclass(frozen=True)
class HelixCase:
    """Two identical models, the micro-batches and the loss of one kind on one rank."""

    eager_model: nn.Module
    helix_model: nn.Module
    microbatches: list[tuple[torch.Tensor, ...]]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]


def _loss_fn(kind: ModelKind, normalizer: int | None) -> Callable[[nn.Module, Any], torch.Tensor]:
    if kind == "moe":
        return lambda model, mb: (model(mb[0]) * mb[1]).sum()
    if normalizer is not None:
        return lambda model, mb: lm_loss(model(mb[0]), mb[1], normalizer=normalizer)
    return lambda model, mb: lm_loss(model(mb[0]), mb[1])


def _microbatch(
    kind: ModelKind, rank: int, world_size: int, config: CheckConfig, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "moe":
        shape: tuple[int, ...] = (world_size, config.moe_tokens, config.moe.dim)
        x = torch.randn(shape, generator=gen).to(config.moe.dtype)
        probe = torch.randn(shape, generator=gen).to(config.moe.dtype)
        return x[rank].clone(), probe[rank].clone()
    shape = (config.batch, config.seq_len)
    tokens = torch.randint(0, config.model.vocab_size, shape, generator=gen)
    targets = torch.randint(0, config.model.vocab_size, shape, generator=gen)
    if kind == "functional_sp":
        return shard_sequence(tokens, rank, world_size), shard_sequence(targets, rank, world_size)
    return tokens, targets


def build_helix_case(
    kind: ModelKind,
    rank: int,
    world_size: int,
    num_microbatches: int,
    dtype: str = "float32",
    config: CheckConfig = CheckConfig(),
) -> HelixCase:
    """The models, micro-batches and loss of ``kind`` for this rank (see the module docstring)."""
    models = [build_case(kind, rank, world_size, config).parallel for _ in range(2)]
    models = [m.to(_DTYPES[dtype]) for m in models]
    mbs = [_microbatch(kind, rank, world_size, config, config.data_seed + k) for k in range(num_microbatches)]
    if kind == "moe":
        mbs = [tuple(t.to(_DTYPES[dtype]) for t in mb) for mb in mbs]
    normalizer = config.batch * config.seq_len if kind == "functional_sp" else None
    return HelixCase(models[0], models[1], mbs, _loss_fn(kind, normalizer))


def local_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, DTensor shards as local tensors."""
    grads: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()
        grads[name] = None if grad is None else grad.detach().float()
    return grads


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached in float32, a DTensor as its full tensor (a collective over its mesh)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float()


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient as :func:`full_tensor`."""
    return {name: None if p.grad is None else full_tensor(p.grad) for name, p in model.named_parameters()}


def check_helix(
    rank: int,
    world_size: int,
    kind: ModelKind,
    num_microbatches: int,
    dtype: str = "float32",
    **options: Any,
) -> dict[str, Any]:
    """See the module docstring."""
    import dhelix_compile

    torch._dynamo.reset()
    case = build_helix_case(kind, rank, world_size, num_microbatches, dtype)
    eager_losses = []
    for mb in case.microbatches:
        loss = case.loss_fn(case.eager_model, mb)
        loss.backward()
        eager_losses.append(loss.detach().float())
    step = dhelix_compile.helix(case.helix_model, case.loss_fn, **options)
    helix_losses = [loss.float() for loss in step(case.microbatches)]

    atol, rtol = _TOLERANCES[dtype]
    problems = []
    if len(helix_losses) != len(eager_losses):
        problems.append(f"{len(helix_losses)} losses for {len(eager_losses)} micro-batches")
    for k, (got_loss, want_loss) in enumerate(zip(helix_losses, eager_losses)):
        if got_loss.shape != () or not torch.allclose(got_loss, want_loss, atol=atol, rtol=rtol):
            problems.append(f"loss {k}: {got_loss} != {want_loss}")
    want_grads, got_grads = local_grads(case.eager_model), local_grads(case.helix_model)
    for name, want in want_grads.items():
        got = got_grads[name]
        if (got is None) != (want is None):
            problems.append(f"{name}: grad {'missing' if got is None else 'unexpected'}")
        elif got is not None and want is not None and not torch.allclose(got, want, atol=atol, rtol=rtol):
            problems.append(f"{name}: max abs grad diff {(got - want).abs().max().item():.3g}")
    if problems:
        raise AssertionError(f"rank {rank}/{world_size} {kind} n={num_microbatches} {dtype}: " + "; ".join(problems))
    return {"kind": kind, "losses": [loss.item() for loss in helix_losses]}


def check_helix_cases(
    rank: int,
    world_size: int,
    cases: list[tuple[ModelKind, int, str] | tuple[ModelKind, int, str, dict[str, Any]]],
    **options: Any,
) -> dict[str, dict[str, Any] | str]:
    """``check_helix`` for each ``(kind, num_microbatches, dtype[, options of the case])``: the
    report or the formatted exception.

    One failing case does not hide the others (and every rank runs every case, so the ranks'
    collectives stay matched).
    """
    results: dict[str, dict[str, Any] | str] = {}
    for kind, n, dtype, *rest in cases:
        own: dict[str, Any] = rest[0] if rest else {}
        name = " ".join([f"{kind} n={n} {dtype}", *(f"{k}={v}" for k, v in own.items())])
        try:
            results[name] = check_helix(rank, world_size, kind, n, dtype, **{**options, **own})
        except Exception:  # noqa: BLE001 (returned to the test, which fails with it)
            results[name] = traceback.format_exc()
    return results
