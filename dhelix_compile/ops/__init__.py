"""Custom ops dhelix's rewritten graphs call; importing this package registers them with torch.

exchange.py            ``dhelix::exchange``: a send and a receive in one asynchronous, functional op
accumulated_grad.py    ``dhelix::with_accumulated_grad``: a gradient plus its parameter's accumulated one;
                       ``dhelix::grad_total``: the same sum, computed into the parameter's ``.grad``
row_blocks.py          ``dhelix::tile_rows``, ``dhelix::sum_row_blocks``: the copies around a gloo
                       all-gather or reduce-scatter sent as an all-to-all
"""

from dhelix_compile.ops.accumulated_grad import (
    GRAD_TOTAL,
    WITH_ACCUMULATED_GRAD,
    accumulator_slot,
    grad_total,
    with_accumulated_grad,
)
from dhelix_compile.ops.exchange import P2P_EXCHANGE, p2p_exchange
from dhelix_compile.ops.row_blocks import SUM_ROW_BLOCKS, TILE_ROWS, sum_row_blocks, tile_rows

__all__ = [
    "GRAD_TOTAL",
    "P2P_EXCHANGE",
    "SUM_ROW_BLOCKS",
    "TILE_ROWS",
    "WITH_ACCUMULATED_GRAD",
    "accumulator_slot",
    "grad_total",
    "p2p_exchange",
    "sum_row_blocks",
    "tile_rows",
    "with_accumulated_grad",
]
