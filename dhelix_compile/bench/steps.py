"""One training step of a benchmark variant over a list of micro-batches.

Every variant accumulates gradients over the micro-batches; the single-strand variants
(``variants.compile_variant``) loop ``loss_fn(model, mb).backward()``, ``helix`` hands the
whole list to ``dhelix_compile.helix`` (micro-batch i+1's forward merged with micro-batch i's
backward, ordered by the Strand Interleaving DP, Inductor codegen); ``helix_decompose`` is
helix with the decompose pass forced to per-peer steps (as ``dhelix_decompose``).

A variant name may carry dhelix options of its own in brackets, so one run can compare option
sets a user could type: ``helix[cost_model=analytic,decompose=off]`` is ``helix`` with those
two options on top of the run's ``--dhelix-options`` (``parse_variants`` splits a list of
them; values are read as JSON where they parse, else as strings).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from dhelix_compile.bench.choices import HELIX_VARIANTS, STEP_VARIANTS
from dhelix_compile.bench.variants import compile_variant
from dhelix_compile.step_phases import step_phase

Microbatch = Any
LossFn = Callable[[torch.nn.Module, Microbatch], torch.Tensor]


_VARIANT = re.compile(r"^(?P<base>[a-z_]+)(?:\[(?P<options>[^\[\]]*)\])?$")


def parse_variants(spec: str) -> list[str]:
    """``"a,b[x=1,y=2],c"`` -> ``["a", "b[x=1,y=2]", "c"]``: commas inside brackets stay."""
    names, depth, current = [], 0, ""
    for char in spec:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(current.strip())
            current = ""
        else:
            current += char
    names.append(current.strip())
    return [n for n in names if n]


def split_variant(name: str, known: Sequence[str] = STEP_VARIANTS) -> tuple[str, dict[str, Any]]:
    """``"helix[decompose=off]"`` -> ``("helix", {"decompose": "off"})``; ValueError names a bad
    one (its base not in ``known``)."""
    match = _VARIANT.match(name)
    if match is None or match["base"] not in known:
        raise ValueError(
            f"unknown benchmark variant {name!r}; choose from {', '.join(known)}, "
            "each optionally with options in brackets, e.g. helix[decompose=off]"
        )
    return match["base"], parse_options(match["options"] or "", f"benchmark variant {name!r}")


def parse_options(text: str, where: str) -> dict[str, Any]:
    """``"x=1,y=off"`` -> ``{"x": 1, "y": "off"}``: each value read as JSON where it is JSON, else
    as a string. ValueError names ``where`` and the item that is not ``key=value``."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{where}: expected key=value options, got {item!r}")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value.strip()
    return options


def step_function(
    name: str,
    module: torch.nn.Module,
    loss_fn: LossFn,
    dhelix_options: Mapping[str, Any] | None = None,
    gradient_sync: Callable[[bool], AbstractContextManager[Any]] | None = None,
) -> Callable[[list[Microbatch]], None]:
    """One training step of variant ``name`` over a list of micro-batches (gradients accumulate).

    ``gradient_sync(last)`` is entered around each micro-batch of the loop variants (data
    parallelism: gradients reduced by the last backward only); ``helix`` does that itself."""
    name, own = split_variant(name)
    dhelix_options = {**dict(dhelix_options or {}), **own}
    if name in HELIX_VARIANTS:
        import dhelix_compile

        helix_step = dhelix_compile.helix(module, loss_fn, **{**dict(dhelix_options or {}), **HELIX_VARIANTS[name]})

        def run_helix(microbatches: list[Microbatch]) -> None:
            helix_step(microbatches)

        return run_helix
    compiled = compile_variant(name, module, dhelix_options)

    def run_loop(microbatches: list[Microbatch]) -> None:
        for k, mb in enumerate(microbatches):
            with gradient_sync(k == len(microbatches) - 1) if gradient_sync else contextlib.nullcontext():
                with step_phase(f"F{k}"):
                    loss = loss_fn(compiled, mb)
                with step_phase(f"B{k}"):
                    loss.backward()

    return run_loop
