"""``data_parallel``: DDP and ZeRO-3 / FSDP whose collectives live in the graph.

    model = dhelix_compile.data_parallel(model, mesh["dp"], mode="shard")   # or mode="replicate"

wrap.py         ``data_parallel(model, dp_mesh, mode)`` and ``gradient_sync_on_last``: the model
                checked, each parameter stored as a DTensor and gathered when read (the contract
                is its docstring)
layout.py       how one parameter is stored, and the tensor its module computes with
collectives.py  the gathers and gradient reductions, as differentiable functional collectives
"""

from __future__ import annotations

from dhelix_compile.data_parallelism.wrap import (
    DataParallelError,
    DataParallelInfo,
    data_parallel,
    gradient_sync_on_last,
)

__all__ = ["DataParallelError", "DataParallelInfo", "data_parallel", "gradient_sync_on_last"]
