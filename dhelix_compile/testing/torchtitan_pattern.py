"""Rank-side checks of torchtitan's training pattern, and of dhelix's whole stack at once.

Contract
--------
``check_torchtitan_pattern(rank, world_size, backends, *, model, tp, checkpoint, steps, against_eager)``
runs on every rank of an initialised default process group of 4 (``run_on_ranks``) and trains
the model once eagerly and once per backend of ``backends``, each built as torchtitan's
``parallelize_llama`` builds it, in its order, on a ``(dp=2, tp=2)`` mesh:

1. tensor parallelism over ``mesh["tp"]``: a DTensor plan of ``models.tensor_parallel``
   (``tp="dtensor"``: Megatron; ``"dtensor_sp"``: torchtitan's Llama plan, with sequence
   parallelism), or the transformer written with functional collectives (``tp="functional"``,
   ``testing.sequence_parallel``: Megatron TP+SP);
2. activation checkpointing of every block (``checkpoint_wrapper``, torchtitan's ``full`` mode);
3. ``block.compile(backend=backend, fullgraph=True)`` for every block (torchtitan's
   ``apply_compile``, whose ``compile.backend`` is the backend's name);
4. FSDP2 ``fully_shard`` over ``mesh["dp"]``: every block, then the root;
5. ``steps`` AdamW steps, one batch each: this DP rank's data, shared by its TP ranks (their
   sequence shards with functional TP, whose replicated parameters' gradients are then summed
   over the TP group, as its forward leaves each rank a partial one).

It returns each variant's losses per step and raises ``AssertionError`` naming every loss and
parameter (after the last step, full tensors) where dhelix's run differs from Inductor's, or a
compiled run from the eager one (``against_eager``). ``compile_refusal`` returns the message with
which torch refuses a checkpointed case.

torch 2.13 computes a wrong gradient for the input of a DTensor TP block compiled on its own,
with Inductor as with ``aot_eager``: the block's input is the ``to_local()`` output of the
uncompiled embedding, and the embedding's gradient differs from eager's (under FSDP2; without it
the backward raises in DTensor's redistribute). dhelix's run equals Inductor's there, and the
DTensor cases are run with ``against_eager=False``.

``check_whole_stack(rank, world_size, *, tp, steps, microbatches, checkpoint)``: the same model
and mesh, trained eagerly with checkpointed blocks, FSDP2 ``fully_shard`` and
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, and through ``data_parallel(model,
mesh["dp"], mode="shard", param_dtype=torch.bfloat16)`` and ``helix`` (its blocks checkpointed
too when ``checkpoint``), ``microbatches`` micro-batches a step, AdamW; raises where losses or
parameters differ beyond bf16's tolerance (``BF16_TOLERANCE``).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from dhelix_compile.models.llama import ModelConfig, Transformer, lm_loss
from dhelix_compile.testing.checkpointing import checkpoint_blocks
from dhelix_compile.testing.helix_checks import full_tensor

__all__ = [
    "BF16_TOLERANCE",
    "FP32_TOLERANCE",
    "TitanModel",
    "TitanTP",
    "check_torchtitan_pattern",
    "check_whole_stack",
    "compile_refusal",
]

TitanModel = Literal["reference", "hf_llama"]
TitanTP = Literal["dtensor", "dtensor_sp", "functional"]

#: (atol, rtol) between float32 variants: Inductor fuses and reorders the sums of a block, so its
#: losses and parameters differ from eager's in the last bits, and AdamW's steps carry that on.
FP32_TOLERANCE = (1e-5, 1e-4)
#: (atol, rtol) between bf16 runs: bf16 keeps 8 bits of mantissa (a relative step of 2**-8 =
#: 0.4%); matmuls of the gathered bf16 weights round differently when Inductor fuses them, and
#: three AdamW steps (lr 1e-2) move a parameter by up to 3e-2, so one rounding step of a gradient's
#: sign can show in a parameter. 2e-2 is the bound the data-parallel checks use for bf16.
BF16_TOLERANCE = (2e-2, 2e-2)

_DP, _TP = 2, 2
_LR = 1e-2
#: Adam's eps well above float noise: its first step is lr * g / (|g| + eps), which would turn a
#: 1e-10 difference in a near-zero gradient (an unused embedding row) into a visible one.
_EPS = 1e-3


def _mesh(world_size: int) -> DeviceMesh:
    if world_size != _DP * _TP:
        raise ValueError(f"the torchtitan pattern runs on {_DP * _TP} ranks (dp={_DP} x tp={_TP}), got {world_size}")
    return init_device_mesh("cpu", (_DP, _TP), mesh_dim_names=("dp", "tp"))


class _Titan:
    """One model kind on one rank: how to build it (tensor-parallel), its blocks, data and loss."""

    def __init__(self, model: TitanModel, tp: TitanTP, mesh: DeviceMesh) -> None:
        if model == "hf_llama" and tp == "functional":
            raise ValueError("Hugging Face Llama runs with the DTensor TP plan only")
        self.model, self.tp, self.mesh = model, tp, mesh
        self.tp_group = mesh["tp"].get_group()

    def build(self) -> nn.Module:
        """The tensor-parallel model (same seeded weights on every call)."""
        if self.model == "hf_llama":
            from dhelix_compile.models.hf_llama import build_hf_llama, parallelize_hf_llama

            return parallelize_hf_llama(build_hf_llama("tiny"), self.mesh["tp"], sequence_parallel=False)
        reference = Transformer(ModelConfig())
        if self.tp == "functional":
            from dhelix_compile.testing.sequence_parallel import FunctionalSPTransformer

            return FunctionalSPTransformer.from_reference(reference, self.tp_group)
        from dhelix_compile.models.tensor_parallel import parallelize_tp, parallelize_tp_sp

        return (parallelize_tp_sp if self.tp == "dtensor_sp" else parallelize_tp)(reference, self.mesh["tp"])

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        layers = model.model.layers if self.model == "hf_llama" else model.layers  # type: ignore[union-attr]
        assert isinstance(layers, nn.ModuleList)
        return layers

    def batches(self, n: int, step: int) -> list[Any]:
        """``n`` micro-batches of this DP rank's data for ``step`` (its TP ranks share them)."""
        generator = torch.Generator().manual_seed(1000 * step + self.mesh["dp"].get_local_rank())
        if self.model == "hf_llama":
            from dhelix_compile.models.hf_llama import hf_llama_batches

            return hf_llama_batches("tiny", n, generator)
        config = ModelConfig()
        shape = (2, config.max_seq_len)
        mbs = [tuple(torch.randint(0, config.vocab_size, shape, generator=generator) for _ in "xy") for _ in range(n)]
        if self.tp == "functional":
            from dhelix_compile.testing.sequence_parallel import shard_sequence

            position = self.mesh["tp"].get_local_rank()
            mbs = [tuple(shard_sequence(t, position, _TP) for t in mb) for mb in mbs]
        return mbs

    def loss(self, model: nn.Module, mb: Any) -> torch.Tensor:
        if self.model == "hf_llama":
            from dhelix_compile.models.hf_llama import hf_llama_loss

            return hf_llama_loss(model, mb)
        tokens, targets = mb
        if self.tp == "functional":  # this rank's sequence shard, over the whole sequence's tokens
            return lm_loss(model(tokens), targets, normalizer=targets.numel() * _TP)
        return lm_loss(model(tokens), targets)

    def sync_tp_grads(self, model: nn.Module) -> None:
        """Sum the partial gradients of the functional TP model's replicated parameters over the
        TP group (DTensor TP's plans leave whole ones)."""
        if self.tp != "functional":
            return
        replicated = {_unwrapped(name) for name in model.replicated_parameter_names()}  # type: ignore[operator]
        for name, param in model.named_parameters():
            grad = param.grad
            if _unwrapped(name) in replicated and grad is not None:
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                dist.all_reduce(local, group=self.tp_group)


def _unwrapped(name: str) -> str:
    """A parameter's name in the unwrapped model (without checkpoint_wrapper's and compile's parts)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _torchtitan_parallelize(
    titan: _Titan, backend: str | None, checkpoint: bool, mp_policy: Any = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """torchtitan's ``parallelize_llama`` in its order: TP, AC, per-block compile, FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = titan.build()
    blocks = titan.blocks(model)
    if checkpoint:
        checkpoint_blocks(blocks, "checkpoint_wrapper")
    if backend is not None:
        for block in blocks:
            block.compile(backend=backend, fullgraph=True)
    policy = mp_policy or MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=titan.mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=titan.mesh["dp"], mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=_LR, eps=_EPS)


def _train(
    titan: _Titan,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    run: Callable[[list[Any]], Sequence[torch.Tensor]],
    steps: int,
    microbatches: int,
) -> dict[str, Any]:
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        losses.append([float(loss) for loss in run(titan.batches(microbatches, step))])
        titan.sync_tp_grads(model)
        optimizer.step()
    params = {_unwrapped(name): full_tensor(p) for name, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def _loop(titan: _Titan, model: nn.Module) -> Callable[[list[Any]], list[torch.Tensor]]:
    def run(mbs: list[Any]) -> list[torch.Tensor]:
        losses = []
        for mb in mbs:
            loss = titan.loss(model, mb)
            loss.backward()
            losses.append(loss.detach())
        return losses

    return run


def _differences(label: str, got: dict[str, Any], want: dict[str, Any], tolerance: tuple[float, float]) -> list[str]:
    atol, rtol = tolerance
    problems = []
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        if not torch.allclose(torch.tensor(g), torch.tensor(w), atol=atol, rtol=rtol):
            problems.append(f"{label}: step {step} losses {g} != {w}")
    if got["params"].keys() != want["params"].keys():
        problems.append(f"{label}: parameters {sorted(got['params'].keys() ^ want['params'].keys())} differ")
    for name, w in want["params"].items():
        g = got["params"].get(name)
        if g is not None and not torch.allclose(g, w, atol=atol, rtol=rtol):
            problems.append(f"{label}: parameter {name} max abs diff {(g - w).abs().max().item():.3g}")
    return problems


def check_torchtitan_pattern(
    rank: int,
    world_size: int,
    backends: Sequence[str] = ("dhelix", "inductor"),
    *,
    model: TitanModel = "reference",
    tp: TitanTP = "dtensor",
    checkpoint: bool = True,
    steps: int = 3,
    against_eager: bool = True,
) -> dict[str, list[list[float]]]:
    """See the module docstring; returns ``{variant: losses per step}``."""
    titan = _Titan(model, tp, _mesh(world_size))
    results = {}
    for backend in (None, *backends):
        torch._dynamo.reset()
        trained, optimizer = _torchtitan_parallelize(titan, backend, checkpoint)
        results[backend or "eager"] = _train(titan, trained, optimizer, _loop(titan, trained), steps, 1)
    problems = []
    for backend in backends if against_eager else ():
        problems += _differences(f"{backend} vs eager", results[backend], results["eager"], FP32_TOLERANCE)
    if "dhelix" in backends and "inductor" in backends:
        problems += _differences("dhelix vs inductor", results["dhelix"], results["inductor"], FP32_TOLERANCE)
    if problems:
        raise AssertionError(f"rank {rank} {model} tp={tp} checkpoint={checkpoint}: " + "; ".join(problems))
    return {variant: result["losses"] for variant, result in results.items()}


def compile_refusal(
    rank: int, world_size: int, backend: str, *, model: TitanModel = "reference", tp: TitanTP = "dtensor"
) -> str:
    """The last line of the error a torchtitan-pattern step with checkpointed blocks compiled by
    ``backend`` raises; raises ``AssertionError`` if the step runs."""
    titan = _Titan(model, tp, _mesh(world_size))
    torch._dynamo.reset()
    trained, optimizer = _torchtitan_parallelize(titan, backend, checkpoint=True)
    try:
        _train(titan, trained, optimizer, _loop(titan, trained), 1, 1)
    except Exception as exc:  # noqa: BLE001 (the refusal is the result)
        return "".join(traceback.format_exception_only(exc)).strip().splitlines()[-1]
    raise AssertionError(f"a torchtitan-pattern step with checkpointed {tp} blocks ran under {backend}")


def check_whole_stack(
    rank: int,
    world_size: int,
    *,
    model: TitanModel = "reference",
    tp: TitanTP = "functional",
    steps: int = 3,
    microbatches: int = 2,
    checkpoint: bool = False,
    **options: Any,
) -> dict[str, list[list[float]]]:
    """See the module docstring; ``options`` go to ``helix``. Returns each run's losses per step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import dhelix_compile

    titan = _Titan(model, tp, _mesh(world_size))
    torch._dynamo.reset()
    eager, eager_optimizer = _torchtitan_parallelize(
        titan, None, checkpoint=True, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    want = _train(titan, eager, eager_optimizer, _loop(titan, eager), steps, microbatches)

    ours = titan.build()
    if checkpoint:
        checkpoint_blocks(titan.blocks(ours), "checkpoint_wrapper")
    dhelix_compile.data_parallel(ours, titan.mesh["dp"], mode="shard", param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(ours.parameters(), lr=_LR, eps=_EPS)
    step = dhelix_compile.helix(ours, titan.loss, **options)
    got = _train(titan, ours, optimizer, step, steps, microbatches)
    problems = _differences("helix vs eager FSDP2", got, want, BF16_TOLERANCE)
    if problems:
        raise AssertionError(f"rank {rank} {model} tp={tp} checkpoint={checkpoint}: " + "; ".join(problems))
    return {"eager FSDP2": want["losses"], "helix": got["losses"]}
