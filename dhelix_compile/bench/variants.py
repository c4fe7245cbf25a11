"""The variants a benchmark compares, each a way to run the same parallel model.

    eager             the DTensor-parallel model as written
    inductor          torch.compile(backend="inductor")
    inductor_overlap  Inductor with its own overlap scheduler (aten_distributed_optimizations);
                      on CPU with an analytical estimator fed this machine's measured numbers
    dhelix            torch.compile(backend="dhelix"): single strand, reordered, Inductor codegen
    dhelix_decompose  dhelix with the decompose pass forced to per-peer steps at every site
                      (option decompose="per_peer"), then reordered, Inductor codegen
    dhelix_decompose_pieces
                      the same with the cost model picking 1, 2 or 4 pieces per transfer
                      (decompose_pieces=0)
    dhelix_decompose_chain
                      dhelix_decompose_pieces with an all-gather -> MLP -> reduce-scatter as
                      one pipeline (decompose_chains=True)
    dhelix_eager      dhelix's schedule run op by op (codegen="eager"): what the cost model
                      predicts, for predicted-vs-measured checks
    helix             dhelix_compile.helix: micro-batch i+1's forward merged with micro-batch
                      i's backward, ordered by the Strand Interleaving DP (Inductor codegen)
    helix_decompose   helix with decompose="per_peer" (``choices.HELIX_VARIANTS``)

A step runs every micro-batch's forward and backward (``step_function``): the other variants
loop over the micro-batches, helix takes them all at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dhelix_compile import _torch_compat as compat
from dhelix_compile.bench.choices import VARIANTS


def _compiled(module: torch.nn.Module, backend: str, options: dict[str, Any] | None = None) -> torch.nn.Module:
    """``torch.compile(module, ...)``: torch types the result as the callable it was given,
    for a module it is an ``OptimizedModule``, the module the loss functions take."""
    compiled = torch.compile(module, backend=backend, options=options)
    assert isinstance(compiled, torch.nn.Module), "torch.compile of a module is a module"
    return compiled


def compile_variant(
    name: str, module: torch.nn.Module, dhelix_options: Mapping[str, Any] | None = None
) -> torch.nn.Module:
    """``module`` prepared as variant ``name`` (compilation happens at its first call)."""
    options = dict(dhelix_options or {})
    if name == "eager":
        return module
    if name == "inductor":
        return _compiled(module, backend="inductor")
    if name == "inductor_overlap":
        return _compiled(module, backend="inductor", options=compat.inductor_overlap_config())
    if name == "dhelix":
        return _compiled(module, backend="dhelix", options=options)
    if name == "dhelix_decompose":
        return _compiled(module, backend="dhelix", options={**options, "decompose": "per_peer"})
    if name == "dhelix_decompose_pieces":
        return _compiled(module, backend="dhelix", options={**options, "decompose": "per_peer", "decompose_pieces": 0})
    if name == "dhelix_decompose_chain":
        chain: dict[str, str | int | bool] = {"decompose": "per_peer", "decompose_pieces": 0, "decompose_chains": True}
        return _compiled(module, backend="dhelix", options={**options, **chain})
    if name == "dhelix_eager":
        return _compiled(module, backend="dhelix", options={**options, "codegen": "eager"})
    raise ValueError(f"unknown benchmark variant {name!r}; choose from {', '.join(VARIANTS)}")


class overlap_scheduler_on_cpu:
    """Inductor's overlap scheduler needs GPU specs; give it this CPU's measured numbers."""

    def __init__(self, variant: str) -> None:
        self.active = variant.partition("[")[0] == "inductor_overlap"
        self._context: Any = None

    def __enter__(self) -> None:
        if self.active:
            from cost_model import measure_cpu_device

            device = measure_cpu_device()
            self._context = compat.cpu_roofline_for_inductor(
                tflops=device.flops_per_s(torch.float32) / 1e12,
                dram_gbps=device.mem_bandwidth_bytes_per_s / 1e9,
            )
            self._context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
