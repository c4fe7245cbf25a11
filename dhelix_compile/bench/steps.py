"""One training step of a benchmark variant over a list of micro-batches.

Every variant accumulates gradients over the micro-batches; the single-strand variants
(``variants.compile_variant``) loop ``loss_fn(model, mb).backward()``, ``helix`` hands the
whole list to ``dhelix_compile.helix`` (micro-batch i+1's forward merged with micro-batch i's
backward, ordered by the Strand Interleaving DP, Inductor codegen); ``helix_decompose`` is
helix with the decompose pass forced to per-peer steps (as ``dhelix_decompose``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from dhelix_compile.bench.variants import VARIANTS, compile_variant

HELIX_VARIANTS: dict[str, dict[str, Any]] = {"helix": {}, "helix_decompose": {"decompose": "per_peer"}}
"""helix variants: the options each adds to the user's dhelix options."""

STEP_VARIANTS: tuple[str, ...] = (*VARIANTS, *HELIX_VARIANTS)

Microbatch = Any
LossFn = Callable[[torch.nn.Module, Microbatch], torch.Tensor]


def step_function(
    name: str, module: torch.nn.Module, loss_fn: LossFn, dhelix_options: Mapping[str, Any] | None = None
) -> Callable[[list[Microbatch]], None]:
    """One training step of variant ``name`` over a list of micro-batches (gradients accumulate)."""
    if name in HELIX_VARIANTS:
        import dhelix_compile

        helix_step = dhelix_compile.helix(module, loss_fn, **{**dict(dhelix_options or {}), **HELIX_VARIANTS[name]})

        def run_helix(microbatches: list[Microbatch]) -> None:
            helix_step(microbatches)

        return run_helix
    if name not in VARIANTS:
        raise ValueError(f"unknown benchmark variant {name!r}; choose from {', '.join(STEP_VARIANTS)}")
    compiled = compile_variant(name, module, dhelix_options)

    def run_loop(microbatches: list[Microbatch]) -> None:
        for mb in microbatches:
            loss_fn(compiled, mb).backward()

    return run_loop
