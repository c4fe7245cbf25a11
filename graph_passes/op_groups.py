"""Groups of aten ops that the pattern finders and the rewrites recognise alike (one definition each).

RESHAPES   view, _unsafe_view, reshape: the same elements in the same (row-major) order,
           another shape. Not ``cost_model.op_kinds.VIEW_OPS`` (every op that moves no
           data: permutes, slices, expands...): a reshape keeps which rows a block holds,
           which is what ``collective_matches`` and ``decompose`` reason about.
MATMULS    mm, addmm: 2-d matmuls whose first (mm) / second (addmm) operand holds the rows.
"""

from __future__ import annotations

import torch

from graph_passes._torch_compat import OpOverload

aten = torch.ops.aten

RESHAPES: tuple[OpOverload, ...] = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
MATMULS: tuple[OpOverload, ...] = (aten.mm.default, aten.addmm.default)
