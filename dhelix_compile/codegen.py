"""Code generation for one scheduled partition: Inductor (default) or the FX graph run eagerly.

Contract
    ``generate(gm, example_inputs, codegen, inductor_kwargs)`` returns a *boxed* callable
    (AOTAutograd's convention: it takes one list of arguments and may clear it).

    - ``"inductor"``: ``compile_fx_inner`` on the graph dhelix scheduled, with the keyword
      arguments ``compile_fx`` passed us (``is_backward``, ``static_input_idxs``, ...). When the
      graph holds collectives, Inductor's own reorderings are off and no fusion crosses a
      collective, so the generated code issues and waits in dhelix's order
      (``_torch_compat.inductor_compile_partition_keeping_order``). In a merged graph (helix's
      M, two strands) no fused kernel joins the strands: M's kernels are then its strands' own,
      which Inductor's cache holds from compiling F and B (the DDP bench's step, ``small
      --data-parallel replicate``: 39 kernels in all instead of 50, M compiled in 3.4 s instead
      of 8.8; docs/backend.md), and the strands keep the places the interleave order gave them.
    - Placeholders named as donated (``_torch_compat.mark_donated``: helix's merged graphs
      name a backward's saved activations so) become Inductor's donated buffers.
    - ``"eager"``: the FX graph as is — every aten op runs in the order dhelix chose. For
      debugging and fast tests; numerically it is the reference for the passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from cost_model.op_kinds import is_comm, kind_of
from dhelix_compile import _torch_compat as compat
from dhelix_compile.config import Codegen
from graph_passes.annotate import strand_of


def has_communication(gm: torch.fx.GraphModule) -> bool:
    """True if the graph issues any collective or P2P transfer."""
    return any(is_comm(kind_of(n)) for n in gm.graph.nodes)


def holds_strands(gm: torch.fx.GraphModule) -> bool:
    """True if ``gm`` is a merged graph: its nodes are tagged with more than one strand."""
    return len({strand_of(n) for n in gm.graph.nodes if n.op == "call_function"} - {None}) > 1


def generate(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    codegen: Codegen,
    inductor_kwargs: dict[str, Any],
    *,
    strand_kernels: bool = True,
) -> Callable[..., Any]:
    """Turn a scheduled partition into a boxed callable (see the module docstring);
    ``strand_kernels=False`` lets Inductor fuse across a merged graph's strands."""
    if codegen == "eager":
        return compat.eager_partition(gm)
    if codegen == "inductor":
        fusion_group = strand_of if strand_kernels and holds_strands(gm) else None
        with compat.donated_placeholders():
            if has_communication(gm):
                return compat.inductor_compile_partition_keeping_order(
                    gm, example_inputs, fusion_group=fusion_group, **inductor_kwargs
                )
            return compat.inductor_compile_partition(gm, example_inputs, fusion_group=fusion_group, **inductor_kwargs)
    raise ValueError(f"unknown dhelix codegen {codegen!r}; choose 'inductor' or 'eager'")
