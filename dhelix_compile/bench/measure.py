"""Timing primitives for the benchmark: interleaved step timing and collective replay.

Contract
    - ``time_interleaved(steps, repeats, barrier)``: for each repeat, runs every variant's step
      once, in the given order, each after ``barrier()`` (so all ranks start a step together);
      returns per-variant lists of seconds on this rank. Interleaving puts every variant under
      the same conditions (link, machine load) instead of measuring one after another.
    - ``record_collectives(module, inputs, loss_fn)``: compiles ``module`` once through
      AOTAutograd (eager codegen) and returns the collective issue nodes of its forward and
      backward graphs, in order; ``replay_collectives(nodes)`` issues exactly those
      collectives (same ops, shapes, dtypes, groups) back to back on the live process group and
      waits for each. Its time is ``T_comm``: the step's communication with no compute around.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from cost_model.op_kinds import is_comm, kind_of
from dhelix_compile import _torch_compat as compat

c10d = torch.ops._c10d_functional


def time_interleaved(
    steps: Mapping[str, Callable[[], Any]],
    repeats: int,
    barrier: Callable[[], Any] | None = None,
    on_step: Callable[[str], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step, per variant, measured round-robin (see the module docstring).

    ``on_step(variant)`` is called after each timed step (progress reporting).
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            if on_step is not None:
                on_step(name)
    return times


def record_collectives(
    module: torch.nn.Module, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor]
) -> list[torch.fx.Node]:
    """Collective issue nodes of ``module``'s forward and backward graphs, in execution order."""
    recorded: list[torch.fx.Node] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable[..., Any]:
        recorded.extend(n for n in gm.graph.nodes if is_comm(kind_of(n)))
        return compat.eager_partition(gm)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return compat.compile_with_aot_autograd(gm, example_inputs, inner)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)
    loss_fn(compiled(*inputs)).backward()
    torch._dynamo.reset()
    return recorded


def _materialize(value: Any) -> Any:
    """A real tensor for each fake tensor (``meta["val"]``) in a node argument."""
    if isinstance(value, torch.fx.Node):
        val = value.meta["val"]
        return torch.empty(val.shape, dtype=val.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v) for v in value)
    return value


def replay_collectives(nodes: Sequence[torch.fx.Node]) -> Callable[[], None]:
    """A function that issues ``nodes``' collectives one after another, waiting for each."""
    calls = [(n.target, _materialize(n.args), _materialize(n.kwargs)) for n in nodes]

    def run() -> None:
        for target, args, kwargs in calls:
            result = target(*args, **kwargs)
            for tensor in result if isinstance(result, (list, tuple)) else (result,):
                c10d.wait_tensor(tensor)

    return run
