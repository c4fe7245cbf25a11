"""Rank-side checks: a parallel model (optionally compiled) against the single-process reference.

Contract
--------
``check_against_reference(rank, world_size, kind, backend=None, config=CheckConfig())`` runs on
every rank of an initialised default process group (e.g. under ``run_on_ranks``) and

1. runs the reference model on the full seeded inputs, loss, backward (the same on every rank);
2. builds the ``kind`` parallel model from the reference's weights, runs this rank's part of
   the inputs, loss, backward; sums partial gradients of replicated parameters; asserts that
   its output, every local parameter and every local gradient equal the corresponding slice of
   the reference's (``sharding.assert_matches_reference``; MoE also checks the input gradient),
   the slice at the rank's place in its TP group, where torch's collectives put its tile
   (``CheckConfig.tp_mesh`` may list the mesh's ranks in any order);
3. if ``backend`` is given, repeats 2 with a fresh parallel model under
   ``torch.compile(model, backend=backend)`` (after ``torch._dynamo.reset()``), asserting the
   same, and records how many graphs dynamo produced and how many graph breaks it hit.

It returns a picklable ``dict`` report (losses, timings, graph counts) and raises
``AssertionError`` on a mismatch. Every rank issues the same collectives in the same order,
mismatch or not (mismatches are collected and raised at the end).

``check_against_eager(rank, world_size, kind, backend, config)`` compares the compiled parallel model
with the same model run eagerly on the same mesh instead: torch's own DTensor results as the oracle
(on a mesh listed out of order they are not the reference's).

``check_all`` runs several kinds in one process (spawning ranks costs seconds) and returns, per
kind, the report or the formatted exception, so one failing kind does not hide the others.

Kinds: ``tp`` (DTensor Megatron TP), ``tp_sp`` (DTensor TP + sequence parallel),
``functional_sp`` (hand-written Megatron-SP with functional collectives), ``moe``
(expert parallel with ``all_to_all_single``).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dhelix_compile.models.llama import ModelConfig, Transformer, lm_loss
from dhelix_compile.models.tensor_parallel import parallelize_tp, parallelize_tp_sp
from dhelix_compile.testing.moe import ExpertParallelMoE, MoEConfig, ReferenceMoE
from dhelix_compile.testing.sequence_parallel import FunctionalSPTransformer, shard_sequence
from dhelix_compile.testing.sharding import assert_matches_reference, local_grad, local_value, sync_replicated_grads

__all__ = [
    "MODEL_KINDS",
    "CheckConfig",
    "ModelKind",
    "ParallelCase",
    "build_case",
    "check_against_eager",
    "check_against_reference",
    "check_all",
]

ModelKind = Literal["tp", "tp_sp", "functional_sp", "moe"]
MODEL_KINDS: tuple[ModelKind, ...] = ("tp", "tp_sp", "functional_sp", "moe")


@dataclasses.dataclass(frozen=True)
class CheckConfig:
    """Models, data and tolerances of the checks; defaults are tiny (CPU, seconds)."""

    model: ModelConfig = ModelConfig()
    """The transformer (kinds tp, tp_sp, functional_sp)."""
    moe: MoEConfig = MoEConfig()
    """The MoE layer (kind moe)."""
    batch: int = 2
    """Sequences per batch."""
    seq_len: int = 16
    """Tokens per sequence (<= model.max_seq_len, divisible by the world size)."""
    moe_tokens: int = 16
    """Tokens per rank (dispatch group) for the MoE layer."""
    data_seed: int = 1234
    """Seed of the inputs, targets and probes (the same on every rank)."""
    tp_mesh: tuple[Any, ...] | None = None
    """The tensor-parallel mesh of kinds tp and tp_sp, its ranks as ``DeviceMesh`` lists them:
    ``(1, 0)``, or ``((3, 2), (1, 0))`` for a ``(dp, tp)`` mesh whose ``tp`` dim carries the model
    (each row a replica on the same inputs); ``None``: ``range(world_size)``."""
    atol: float = 1e-5
    rtol: float = 1e-4


@dataclasses.dataclass
class ParallelCase:
    """One model kind on one rank: reference and parallel model, inputs, losses."""

    reference: nn.Module
    parallel: nn.Module
    reference_inputs: tuple[torch.Tensor, ...]
    local_inputs: tuple[torch.Tensor, ...]
    reference_loss: Callable[[torch.Tensor], torch.Tensor]
    local_loss: Callable[[torch.Tensor], torch.Tensor]
    local_slice: Callable[[torch.Tensor], torch.Tensor]
    """Maps a reference-shaped tensor (output, input grad) to this rank's part of it."""
    replicated: list[str]
    """Plain replicated parameters whose gradients are partial (summed before comparing)."""
    position: int
    """Which of the ``shards`` parameter shards this rank holds: for a DTensor model, its place in
    the TP group (``mesh.get_local_rank()``), where torch's collectives put its tile; on a mesh
    listed out of order that is not its ``get_coordinate()``."""
    shards: int
    """How many ranks the parameters are sharded over."""


def _transformer_case(kind: ModelKind, rank: int, world_size: int, config: CheckConfig) -> ParallelCase:
    gen = torch.Generator().manual_seed(config.data_seed)
    shape = (config.batch, config.seq_len)
    tokens = torch.randint(0, config.model.vocab_size, shape, generator=gen)
    targets = torch.randint(0, config.model.vocab_size, shape, generator=gen)
    reference = Transformer(config.model)

    def full_loss(logits: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)

    if kind == "functional_sp":
        sp_model = FunctionalSPTransformer.from_reference(reference)
        local_targets = shard_sequence(targets, rank, world_size)
        n_tokens = targets.numel()
        return ParallelCase(
            reference=reference,
            parallel=sp_model,
            reference_inputs=(tokens,),
            local_inputs=(shard_sequence(tokens, rank, world_size),),
            reference_loss=full_loss,
            local_loss=lambda logits: lm_loss(logits, local_targets, normalizer=n_tokens),
            local_slice=lambda t: shard_sequence(t, rank, world_size),
            replicated=sp_model.replicated_parameter_names(),
            position=rank,
            shards=world_size,
        )
    mesh = _tp_mesh(world_size, config.tp_mesh)
    parallelize = parallelize_tp if kind == "tp" else parallelize_tp_sp
    parallel = parallelize(Transformer(config.model), mesh)
    return ParallelCase(
        reference=reference,
        parallel=parallel,
        reference_inputs=(tokens,),
        local_inputs=(tokens,),
        reference_loss=full_loss,
        local_loss=full_loss,
        local_slice=lambda t: t,
        replicated=[],
        position=mesh.get_local_rank(),
        shards=mesh.size(),
    )


def _tp_mesh(world_size: int, listed: tuple[Any, ...] | None) -> DeviceMesh:
    """The 1-D tensor-parallel mesh ``CheckConfig.tp_mesh`` describes (a 2-D one's ``tp`` dim)."""
    if listed is None:
        return DeviceMesh("cpu", list(range(world_size)))
    if all(isinstance(r, int) for r in listed):
        return DeviceMesh("cpu", list(listed))
    return DeviceMesh("cpu", [list(row) for row in listed], mesh_dim_names=("dp", "tp"))["tp"]


def _moe_case(rank: int, world_size: int, config: CheckConfig) -> ParallelCase:
    gen = torch.Generator().manual_seed(config.data_seed)
    shape = (world_size, config.moe_tokens, config.moe.dim)
    x = torch.randn(shape, generator=gen).to(config.moe.dtype)
    probe = torch.randn(shape, generator=gen).to(config.moe.dtype)
    reference = ReferenceMoE(config.moe)
    parallel = ExpertParallelMoE.from_reference(reference)
    return ParallelCase(
        reference=reference,
        parallel=parallel,
        reference_inputs=(x.clone().requires_grad_(),),
        local_inputs=(x[rank].clone().requires_grad_(),),
        reference_loss=lambda out: (out * probe).sum(),
        local_loss=lambda out: (out * probe[rank]).sum(),
        local_slice=lambda t: t[rank],
        replicated=parallel.replicated_parameter_names(),
        position=rank,
        shards=world_size,
    )


def build_case(kind: ModelKind, rank: int, world_size: int, config: CheckConfig = CheckConfig()) -> ParallelCase:
    """Reference + parallel model of ``kind`` for this rank, with seeded inputs."""
    if kind == "moe":
        return _moe_case(rank, world_size, config)
    if kind in ("tp", "tp_sp", "functional_sp"):
        return _transformer_case(kind, rank, world_size, config)
    raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")


def _close(what: str, got: torch.Tensor, want: torch.Tensor, config: CheckConfig) -> str | None:
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.allclose(got, want, atol=config.atol, rtol=config.rtol):
        return f"{what}: max abs diff {(got - want).abs().max().item():.3g}"
    return None


def _run_parallel(
    case: ParallelCase,
    module: Callable[..., torch.Tensor],
    reference_out: torch.Tensor,
    rank: int,
    world_size: int,
    config: CheckConfig,
    label: str,
) -> dict[str, Any]:
    start = time.perf_counter()
    out = module(*case.local_inputs)
    loss = case.local_loss(out)
    loss.backward()
    elapsed_s = time.perf_counter() - start
    sync_replicated_grads(case.parallel, case.replicated)
    # Collect problems rather than raise at the first, so every rank runs the same collectives.
    problems: list[str | None] = [_close(f"{label} output", out.detach(), case.local_slice(reference_out), config)]
    inputs = zip(case.local_inputs, case.reference_inputs, strict=True)
    for i, (local_in, ref_in) in enumerate(inputs):
        if not local_in.requires_grad:
            continue
        if local_in.grad is None or ref_in.grad is None:
            problems.append(f"{label} input {i}: missing gradient")
        else:
            want = case.local_slice(ref_in.grad)
            problems.append(_close(f"{label} input {i} grad", local_in.grad, want, config))
    try:
        assert_matches_reference(
            case.parallel, case.reference, case.position, case.shards, atol=config.atol, rtol=config.rtol
        )
    except AssertionError as err:
        problems.append(f"{label} parameters: {err}")
    found = [p for p in problems if p]
    if found:
        raise AssertionError(f"rank {rank}/{world_size}: " + "; ".join(found))
    return {"loss": loss.item(), "time_s": elapsed_s}


def check_against_reference(
    rank: int,
    world_size: int,
    kind: ModelKind,
    backend: str | Callable[..., Any] | None = None,
    config: CheckConfig = CheckConfig(),
) -> dict[str, Any]:
    """See the module docstring; returns ``{"eager": {...}, "compiled": {...}}``."""
    if not dist.is_initialized():
        raise RuntimeError("check_against_reference needs an initialised default process group")
    case = build_case(kind, rank, world_size, config)
    reference_out = case.reference(*case.reference_inputs)
    reference_loss = case.reference_loss(reference_out)
    reference_loss.backward()
    reference_out = reference_out.detach()
    report: dict[str, Any] = {"kind": kind, "reference_loss": reference_loss.item()}
    report["eager"] = _run_parallel(case, case.parallel, reference_out, rank, world_size, config, "eager")
    if backend is not None:
        torch._dynamo.reset()
        counter = _GraphCounter(backend)
        fresh = build_case(kind, rank, world_size, config)
        fresh.reference = case.reference  # same weights; keep the reference's gradients
        fresh.reference_inputs = case.reference_inputs
        compiled = torch.compile(fresh.parallel, backend=counter)
        breaks_before = _graph_breaks()
        report["compiled"] = _run_parallel(fresh, compiled, reference_out, rank, world_size, config, "compiled")
        report["compiled"]["graphs"] = counter.graphs
        report["compiled"]["graph_breaks"] = _graph_breaks() - breaks_before
        report["compiled"]["collectives"] = counter.collectives
    return report


def check_against_eager(
    rank: int,
    world_size: int,
    kind: ModelKind,
    backend: str | Callable[..., Any],
    config: CheckConfig = CheckConfig(),
) -> dict[str, Any]:
    """The parallel model compiled with ``backend`` against the same model run eagerly on the same
    mesh (torch's DTensor results as the oracle, not the single-process reference): output, loss,
    every local parameter and gradient. On a mesh listed out of order torch 2.13's eager results
    differ from the reference (its ``Replicate() -> Shard()`` keeps the chunk at the rank's
    ``get_coordinate()``, its collectives place tiles by group rank); a compiled graph must
    reproduce them. Returns ``{"loss", "eager_vs_reference"}`` (the eager output's largest
    difference from the reference's slice, for the record); raises ``AssertionError``."""
    case = build_case(kind, rank, world_size, config)
    reference_out = case.reference(*case.reference_inputs).detach()
    runs = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            case = build_case(kind, rank, world_size, config)
        module = torch.compile(case.parallel, backend=backend) if compiled else case.parallel
        out = module(*case.local_inputs)
        loss = case.local_loss(out)
        loss.backward()
        sync_replicated_grads(case.parallel, case.replicated)
        state = {name: (local_value(p), local_grad(p)) for name, p in case.parallel.named_parameters()}
        runs.append((out.detach(), loss.detach(), state))
    (want_out, want_loss, want), (out, loss, got) = runs
    problems = [
        _close("output", out, want_out, config),
        _close("loss", loss, want_loss, config),
        *(
            _close(f"{name}.{what}", g, w, config) if g is not None and w is not None else f"{name}.{what}: missing"
            for name in want
            for what, g, w in zip(("value", "grad"), got[name], want[name], strict=True)
            if g is not None or w is not None
        ),
    ]
    found = [p for p in problems if p]
    if found:
        raise AssertionError(f"rank {rank}/{world_size}: compiled vs eager: " + "; ".join(found))
    eager_diff = (want_out - case.local_slice(reference_out)).abs().max().item()
    return {"loss": loss.item(), "eager_vs_reference": eager_diff}


def check_all(
    rank: int,
    world_size: int,
    kinds: Sequence[ModelKind] = MODEL_KINDS,
    backend: str | Callable[..., Any] | None = None,
    config: CheckConfig = CheckConfig(),
) -> dict[str, dict[str, Any] | str]:
    """``{kind: report, or the formatted exception}`` for each kind, in order."""
    results: dict[str, dict[str, Any] | str] = {}
    for kind in kinds:
        try:
            results[kind] = check_against_reference(rank, world_size, kind, backend, config)
        except Exception:  # noqa: BLE001 (returned to the test, which fails with it)
            results[kind] = traceback.format_exc()
    return results


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


class _GraphCounter:
    """A dynamo backend that counts graphs and records collectives, then defers to ``backend``.

    ``collectives["dynamo"]``: the communication calls in dynamo's graphs, for any backend:
    ``_c10d_functional`` ops for hand-written collectives, but only ``redistribute`` calls for
    DTensor models (their collectives appear after AOTAutograd lowers DTensor). For
    ``"aot_eager"`` also ``collectives["forward"]`` / ``["backward"]``: the ``_c10d_functional``
    ops (waits left out) of the graphs AOTAutograd partitions, i.e. what a graph pass sees.
    """

    def __init__(self, backend: str | Callable[..., Any]) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.is_aot_eager = backend == "aot_eager"
        self.inner = lookup_backend(backend) if isinstance(backend, str) else backend
        self.graphs = 0
        self.collectives: dict[str, list[str]] = {"dynamo": []}
        if self.is_aot_eager:
            self.collectives.update(forward=[], backward=[])

    def _recording(self, which: str) -> Callable[..., Any]:
        from torch._dynamo.backends.debugging import boxed_nop

        def compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            for node in gm.graph.nodes:
                if node.op == "call_function" and "c10d_functional" in str(node.target):
                    name = str(node.target).split("c10d_functional.")[-1]
                    if not name.startswith("wait_tensor"):
                        self.collectives[which].append(name)
            return boxed_nop(gm, example_inputs)

        return compiler

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        for node in gm.graph.nodes:
            target = str(node.target)
            if node.op == "call_method" and target == "redistribute":
                self.collectives["dynamo"].append("DTensor.redistribute")
            elif node.op == "call_function" and "c10d_functional." in target:
                name = target.split("c10d_functional.")[-1]
                if not name.startswith("wait_tensor"):
                    self.collectives["dynamo"].append(name)
        if self.is_aot_eager:
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(
                gm,
                example_inputs,
                fw_compiler=self._recording("forward"),
                bw_compiler=self._recording("backward"),
            )
        return self.inner(gm, example_inputs)
