"""Helpers for tests of cost-model users: aten graphs with collectives, gloo worlds.

Contract
--------
* :func:`fake_world` -- a single-process "world" on PyTorch's fake backend
  (``torch.testing._internal.distributed.fake_pg.FakeStore`` + backend ``"fake"``): the
  functional collectives trace (``make_fx``) into ``_c10d_functional`` issue + wait nodes
  with the right group size, nothing is sent. The group is destroyed on exit.
* :func:`trace_aten` -- ``make_fx`` with fake tensors (``dynamic=True``: symbolic sizes),
  so every node has ``meta["val"]``. No Inductor.
* :func:`aot_partitions` -- AOTAutograd's forward and backward graphs of a function (run once,
  ``out.sum().backward()``), as the backend sees them before its passes. No Inductor.

Real multi-rank runs use ``dhelix_compile.testing.multirank.run_on_ranks``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten


@contextlib.contextmanager
def fake_world(world_size: int = 4, rank: int = 0) -> Iterator[Any]:
    """Yield the default group of a fake ``world_size``-rank world (single process)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: torch.distributed is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def trace_aten(fn: Callable[..., Any], *args: Any, dynamic: bool = False) -> torch.fx.GraphModule:
    """An aten-level graph of ``fn(*args)`` with fake-tensor ``meta["val"]`` on every node."""
    return make_fx(fn, tracing_mode="symbolic" if dynamic else "fake")(*args)


def aot_partitions(fn: Callable[..., Any], *args: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """AOTAutograd's (forward, backward) graphs of ``fn(*args)``; its output is summed and backpropagated."""
    from functorch.compile import aot_function, make_boxed_func

    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(name: str) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    aot_function(fn, fw_compiler=keep("fwd"), bw_compiler=keep("bwd"))(*args).sum().backward()
    return graphs["fwd"], graphs["bwd"]
