"""dhelix: a ``torch.compile`` backend that hides communication behind computation.

    model = torch.compile(model, backend="dhelix")                       # no import needed
    model = torch.compile(model, backend="dhelix", options={"dump_dir": "dhelix_dump"})
    model = torch.compile(model, backend=dhelix_compile.backend(codegen="eager"))
    step = dhelix_compile.helix(model, loss_fn)                          # strand interleaving
    losses = step(microbatches)
    schedule = dhelix_compile.helix_pipeline(schedule)                   # torch pipelining, merged F+B
    y = dhelix_compile.reshard(x, mesh_b, [Shard(0)])                    # a DTensor to another mesh
    model = dhelix_compile.data_parallel(model, mesh["dp"], mode="shard")  # ZeRO-3 / DDP in the graph
    cluster = dhelix_compile.emulate(world_size=8, link="ib400")       # rank 0 of 8, timed links
    dhelix_compile.compile_seconds()   # where this process's compiles spent their time, per phase
    dhelix_compile.compile_counts()    # how many graphs they compiled, candidates they weighed

The backend entry points import Inductor and AOTAutograd; they load on first use, so that
``import dhelix_compile.testing`` (every spawned test rank does it) stays cheap.
"""

from __future__ import annotations

import logging
from typing import Any

from dhelix_compile.config import ConfigError, DHelixConfig

logging.getLogger("dhelix").addHandler(logging.NullHandler())

__all__ = [
    "ConfigError",
    "DHelixConfig",
    "DataParallelError",
    "HelixError",
    "backend",
    "compile_counts",
    "compile_seconds",
    "data_parallel",
    "dhelix_backend",
    "emulate",
    "helix",
    "helix_pipeline",
    "reshard",
]
__version__ = "0.1.0"


def compile_seconds() -> dict[str, float]:
    """Seconds this process's dhelix compiles spent so far, per phase: ``capture`` (AOTAutograd's
    joint graph, joint passes and partitioner), ``profiling`` (measuring ops, collectives and
    segment pairs on the live group), ``passes`` (the graph passes), ``plan`` (the strand plan's
    search in helix's merged graphs), ``agreement`` (waiting for the other ranks), ``codegen``
    (Inductor's code generation and C++ compile), ``dumps`` (writing them, with ``dump_dir``);
    see :mod:`cost_model.compile_clock`. Dynamo's trace and running the step are the rest of a
    first step's time."""
    from cost_model import compile_clock

    return compile_clock.totals()


def compile_counts() -> dict[str, int]:
    """What this process's dhelix compiles made so far, beside :func:`compile_seconds`: ``graphs``
    (graphs generated), ``candidates`` (helix's merged graphs planned to choose one, where there
    was a choice), ``variants`` (decompose's rewrites of a site priced to choose one); see
    :mod:`cost_model.compile_clock`."""
    from cost_model import compile_clock

    return compile_clock.counts()


def __getattr__(name: str) -> Any:
    if name in ("backend", "dhelix_backend"):
        from dhelix_compile import compiler

        return getattr(compiler, name)
    if name in ("helix", "HelixError"):
        from dhelix_compile.helix_runtime import step

        return getattr(step, name)
    if name == "helix_pipeline":
        from dhelix_compile.pipeline_runtime import schedule

        return schedule.helix_pipeline
    if name == "reshard":
        from dhelix_compile.resharding import reshard

        return reshard
    if name == "emulate":
        from dhelix_compile import emulation

        return emulation.emulate
    if name in ("data_parallel", "DataParallelError"):
        from dhelix_compile import data_parallelism

        return getattr(data_parallelism, name)
    raise AttributeError(f"module 'dhelix_compile' has no attribute {name!r}")
