"""Code generation for one scheduled partition: Inductor (default) or the FX graph run eagerly.

Contract
    ``generate(gm, example_inputs, codegen, inductor_kwargs)`` returns a *boxed* callable
    (AOTAutograd's convention: it takes one list of arguments and may clear it).

    - ``"inductor"``: ``compile_fx_inner`` on the graph dhelix scheduled, with the keyword
      arguments ``compile_fx`` passed us (``is_backward``, ``static_input_idxs``, ...).
    - ``"eager"``: the FX graph as is — every aten op runs in the order dhelix chose. For
      debugging and fast tests; numerically it is the reference for the passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from dhelix_compile import _torch_compat as compat
from dhelix_compile.config import Codegen


def generate(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    codegen: Codegen,
    inductor_kwargs: dict[str, Any],
) -> Callable[..., Any]:
    """Turn a scheduled partition into a boxed callable (see the module docstring)."""
    if codegen == "eager":
        return compat.eager_partition(gm)
    if codegen == "inductor":
        return compat.inductor_compile_partition(gm, example_inputs, **inductor_kwargs)
    raise ValueError(f"unknown dhelix codegen {codegen!r}; choose 'inductor' or 'eager'")
