"""The data-parallel benchmark workload: PyTorch's DDP / FSDP2 as users run them, beside ``data_parallel``.

    dhelix bench --model small --data-parallel shard --microbatches 4 --rate 1gbit

The model of ``--model`` (the reference transformer or a Hugging Face Llama) as written, data
parallel over every rank; each rank its own micro-batches, gradients accumulated over a step as
users do (reduced once per step where the method allows: DDP's ``no_sync``,
``set_requires_gradient_sync``). Variants:

    torch_eager      PyTorch's own: ``DistributedDataParallel`` (``replicate``) or FSDP2
                     ``fully_shard`` on each block, then the root (``shard``)
    torch_inductor   the same, ``torch.compile`` d (Inductor; DDP's graph splits at buckets,
                     FSDP2's hooks run outside the graphs)
    eager            ``dhelix_compile.data_parallel(model, mesh, mode)`` as written
    inductor         ``data_parallel`` compiled by Inductor: the collectives in the graphs, in
                     Inductor's order
    dhelix           ``data_parallel`` through ``backend="dhelix"``
    helix            ``data_parallel`` under ``dhelix_compile.helix``: micro-batch i's reductions
                     in one graph with micro-batch i+1's forward and its all-gathers

Bracket options go to the backend, except ``data_parallel``'s own (``WRAPPER_OPTIONS``):
``dhelix[reshard_after_forward=true]`` gathers the weights again in the backward.

``T_comm`` replays the collectives ``data_parallel``'s step runs (every micro-batch's all-gathers
and reduce-scatters; one all-reduce per parameter per step in ``replicate``); PyTorch's own move
the same bytes in other pieces (DDP buckets, FSDP2's per-block groups).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dhelix_compile.bench.choices import DATA_PARALLEL_VARIANTS, HELIX_VARIANTS
from dhelix_compile.bench.steps import split_variant, step_function
from dhelix_compile.bench.workloads import Workload
from dhelix_compile.own_code import with_own_code


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """FSDP2's units: the transformer blocks (``model.layers``, Hugging Face's ``model.model.layers``)."""
    layers: Any = getattr(model, "layers", None)
    if layers is None:
        layers = model.model.layers  # type: ignore[union-attr]
    return list(layers)


#: Bracket options of a variant that go to ``data_parallel``, not to the backend.
WRAPPER_OPTIONS: tuple[str, ...] = ("reshard_after_forward",)


def wrapper_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A variant's bracket options split into ``data_parallel``'s (``WRAPPER_OPTIONS``: e.g.
    ``dhelix[reshard_after_forward=true]``) and the backend's."""
    wrap = {k: v for k, v in options.items() if k in WRAPPER_OPTIONS}
    return wrap, {k: v for k, v in options.items() if k not in WRAPPER_OPTIONS}


def data_parallel_step(
    variant: str, workload: Workload, mode: str, mesh: DeviceMesh, options: Mapping[str, Any]
) -> Callable[[], None]:
    """A fresh model's training step as ``variant`` (``DATA_PARALLEL_VARIANTS``, with bracket options)."""
    from dhelix_compile.data_parallelism import data_parallel
    from dhelix_compile.testing.data_parallel_checks import sync_on_last, torch_data_parallel

    base, own = split_variant(variant, DATA_PARALLEL_VARIANTS)
    wrap, own = wrapper_options(own)
    module = workload.make()
    # each variant's forward its own Dynamo cache: FSDP2's compiled forward graph-breaks at once,
    # and its cache entry would send every later variant's model through it in pieces (own_code.py)
    module.forward = with_own_code(module.forward, f"{base}_forward")
    if base.startswith("torch_"):
        model = torch_data_parallel(module, _blocks(module), mesh, mode)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and dist.get_backend() == "fake":
            # the fake group's all-reduce gives DDP's reducer no result; T_compute sends nothing anyway
            from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

            model.register_comm_hook(None, noop_hook)
        base = base.removeprefix("torch_")
    else:
        model = data_parallel(module, mesh, mode, **wrap)  # type: ignore[arg-type]
    assert base in ("eager", "inductor", "dhelix") or base in HELIX_VARIANTS
    run_step = step_function(base, model, workload.loss_fn, {**options, **own}, gradient_sync=sync_on_last(model))

    def run() -> None:
        model.zero_grad(set_to_none=True)
        run_step(workload.microbatches)

    return run


def data_parallel_collectives_step(workload: Workload, mode: str, mesh: DeviceMesh) -> tuple[torch.nn.Module, Any]:
    """The ``data_parallel`` model and a ``step_of(compiled)`` that runs one step of it (for
    ``measure.record_collectives``: the step's collectives in the order they run)."""
    from dhelix_compile.data_parallelism import data_parallel
    from dhelix_compile.testing.data_parallel_checks import sync_on_last

    model = data_parallel(workload.make(), mesh, mode)  # type: ignore[arg-type]

    def step_of(compiled: torch.nn.Module) -> None:
        step_function("eager", compiled, workload.loss_fn, gradient_sync=sync_on_last(model))(workload.microbatches)

    return model, step_of
