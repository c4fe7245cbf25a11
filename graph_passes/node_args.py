"""Typed reads of an FX node's arguments.

fx types every argument as ``torch.fx.node.Argument`` (a union of nodes, numbers, containers,
slices, dtypes...), while an aten op's schema fixes each one: a ``Tensor`` argument is a
``Node``, an ``int`` one an int, a ``Tensor[]`` one a list of nodes. These read an argument as
the type its op's schema gives it, and raise ``TypeError`` when it is something else (as using it
as that type would, later).

    as_node(value)    a Tensor argument
    as_int(value)     an int / SymInt argument: a dim, a size, an index, a group size
    as_ints(value)    an int[] argument (a permutation, split sizes)
    as_nodes(value)   a Tensor[] argument (``cat``'s tensors)
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.node import Argument


def as_node(value: Argument) -> torch.fx.Node:
    """A Tensor argument: the node that computes it."""
    if not isinstance(value, torch.fx.Node):
        raise TypeError(f"expected a tensor argument (an fx Node), got {value!r}")
    return value


def as_int(value: Argument) -> int:
    """An int argument as a Python int (``int()`` of a SymInt: its hint, as everywhere in the passes)."""
    if not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"expected an int argument, got {value!r}")
    return int(value)


def as_ints(value: Argument) -> list[int]:
    """An int[] argument as a list of ints."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected an int[] argument, got {value!r}")
    return [as_int(v) for v in value]


def as_nodes(value: Argument) -> list[torch.fx.Node]:
    """A Tensor[] argument (``cat``'s tensors): the nodes that compute them."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a Tensor[] argument, got {value!r}")
    return [as_node(v) for v in value]
