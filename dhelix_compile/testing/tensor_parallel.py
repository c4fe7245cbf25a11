"""The reference transformer's TP and TP+SP plans: :mod:`dhelix_compile.models.tensor_parallel`'s, re-exported for the tests."""

from __future__ import annotations

from dhelix_compile.models.tensor_parallel import (
    parallelize_tp,
    parallelize_tp_sp,
    tp_plan,
    tp_sp_plan,
)

__all__ = [
    "parallelize_tp",
    "parallelize_tp_sp",
    "tp_plan",
    "tp_sp_plan",
]
