"""Helpers for tests of cost-model users: aten graphs with collectives, gloo worlds.

Contract
--------
* :func:`fake_world` -- a single-process "world" on PyTorch's fake backend
  (``torch.testing._internal.distributed.fake_pg.FakeStore`` + backend ``"fake"``): the
  functional collectives trace (``make_fx``) into ``_c10d_functional`` issue + wait nodes
  with the right group size, nothing is sent. The group is destroyed on exit.
* :func:`trace_aten` -- ``make_fx`` with fake tensors (``dynamic=True``: symbolic sizes),
  so every node has ``meta["val"]``. No Inductor.
* :func:`run_gloo_world` -- spawn ``world_size`` processes on 127.0.0.1 with a free port,
  run ``fn(rank, world_size, *args)`` in each after ``init_process_group("gloo")``, return
  what each rank returned (JSON-able), and kill the processes on timeout. ``fn`` must be
  importable (a module-level function).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import socket
import tempfile
import time
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    out_dir: str,
    args: tuple[Any, ...],
) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        result = fn(rank, world_size, *args)
        pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_gloo_world(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout_s: float = 60.0,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on a real gloo world; results in rank order.

    ``"spawn"`` (default) starts a fresh interpreter per rank: safe, but each rank imports
    torch again (seconds). ``"fork"`` starts in milliseconds; each rank then runs with one
    intra-op thread (set first thing), so the OpenMP pool inherited from the parent is
    never entered. Either way the processes are killed after ``timeout_s``.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if start_method == "fork" and dist.is_initialized():
        start_method = "spawn"  # a forked rank would inherit this process's default group
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _gloo_entry,
            args=(fn, world_size, free_port(), out_dir, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gloo world of {world_size} did not finish in {timeout_s}s")
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        return [
            json.loads(pathlib.Path(out_dir, f"rank{r}.json").read_text())
            for r in range(world_size)
        ]
