"""``dhelix::tile_rows`` and ``dhelix::sum_row_blocks``: the copies around a gloo collective sent as an all-to-all.

``graph_passes.gloo_collectives`` sends an all-gather on a gloo group as an all-to-all of the shard
repeated once per rank, and a reduce-scatter as an all-to-all whose received row blocks (one per
source rank) are summed. The repeat and the sum are one ATen call each; as these ops Inductor calls
them as they are, where ``aten.repeat`` and ``aten.sum`` would each be a kernel it generates and
compiles for every collective of the graph (a ZeRO-3 step has one per parameter: F and B held about
70 such kernels beside about 170 of their own). Importing ``dhelix_compile`` registers both.

Both are pure functions of their input (``mutates_args=()``) with a fake implementation that gives
the output's shape, symbolic rows included.
"""

from __future__ import annotations

import torch

__all__ = ["SUM_ROW_BLOCKS", "TILE_ROWS", "sum_row_blocks", "tile_rows"]


@torch.library.custom_op("dhelix::tile_rows", mutates_args=())
def tile_rows(x: torch.Tensor, copies: int) -> torch.Tensor:
    """``x`` repeated ``copies`` times along dim 0 (``x.repeat(copies, 1, ...)``), contiguous."""
    return x.repeat(copies, *[1] * (x.dim() - 1))


@tile_rows.register_fake
def _tile_rows_fake(x: torch.Tensor, copies: int) -> torch.Tensor:
    return x.new_empty((x.shape[0] * copies, *x.shape[1:]))


@torch.library.custom_op("dhelix::sum_row_blocks", mutates_args=())
def sum_row_blocks(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """The sum of ``x``'s ``blocks`` equal blocks of rows, in block order: ``[blocks * r, ...] -> [r, ...]``."""
    return x.view(blocks, x.shape[0] // blocks, *x.shape[1:]).sum(0)


@sum_row_blocks.register_fake
def _sum_row_blocks_fake(x: torch.Tensor, blocks: int) -> torch.Tensor:
    return x.new_empty((x.shape[0] // blocks, *x.shape[1:]))


TILE_ROWS = torch.ops.dhelix.tile_rows.default
SUM_ROW_BLOCKS = torch.ops.dhelix.sum_row_blocks.default
