"""Every private torch API graph_passes touches, in one place.

Private APIs change between torch releases (dhelix supports ``torch>=2.11,<2.14``); anything
under ``torch._*`` that a pass needs is reached through this module and nowhere else in
``graph_passes``, so an upgrade breaks this module and its test
(``tests/test_graph_passes_torch_compat.py``), not the passes. The backend has its own
(``dhelix_compile._torch_compat``); graph_passes imports nothing of the backend.

    OpOverload       ``torch._ops.OpOverload``: the type of an aten op overload (its schema
                     and tags); torch has no public alias
    fake_mode_of     ``torch._guards.detect_fake_mode`` / ``torch._subclasses.FakeTensorMode``:
                     the fake mode a graph's ``meta["val"]`` tensors live in, to give new
                     nodes their ``meta["val"]``
    backward_handed_inputs  AOTAutograd's placeholder names in a backward graph: which inputs
                     the compiled backward is handed to free (saved activations, tangents)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._guards import detect_fake_mode as _detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode as _FakeTensorMode

#: The type of ``torch.ops.aten.mm.default`` and every other op overload.
OpOverload = torch._ops.OpOverload


def fake_mode_of(values: Sequence[Any]) -> Any:
    """The fake-tensor mode the ``values`` (a graph's ``meta["val"]`` tensors) live in; a fresh
    one (that accepts real tensors too) when they are in none."""
    mode = _detect_fake_mode(tuple(values))
    return mode if mode is not None else _FakeTensorMode(allow_non_fake_inputs=True)


#: AOTAutograd names a backward graph's placeholders after what they hold: the forward's inputs
#: (parameters, the batch), which their owners keep, ``primals_<i>``.
_FORWARD_INPUT_PREFIX = "primals_"


def backward_handed_inputs(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The placeholders of an AOTAutograd backward graph that the compiled backward frees after
    their last use: the saved activations and the tangents (AOTAutograd clears the saved tensors
    and hands the argument list over); not the forward's inputs (``primals_<i>``), whose owners
    keep them."""
    return [n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith(_FORWARD_INPUT_PREFIX)]
