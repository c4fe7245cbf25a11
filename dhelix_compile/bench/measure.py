"""Timing primitives for the benchmark: interleaved step timing and collective replay.

Contract
    - ``time_interleaved(steps, repeats, barrier)``: for each repeat, runs every variant's step
      once, in the given order, each after ``barrier()`` (so all ranks start a step together);
      returns :class:`Timings`: per-variant lists of wall seconds on this rank, and of the CPU
      seconds this process spent in each step (all its threads: compute, gloo's transport,
      the kernel's socket work done on their behalf). Interleaving puts every variant under
      the same conditions (link, machine load) instead of measuring one after another.
    - ``record_collectives(module, step_of)``: compiles ``module`` through AOTAutograd (eager
      codegen), runs ``step_of(compiled)`` (a whole step) and returns the collective issue
      nodes of the graphs it ran, in execution order; ``replay_collectives(nodes)`` issues exactly those
      collectives (same ops, shapes, dtypes, groups) back to back on the live process group and
      waits for each. Its time is ``T_comm``: the step's communication with no compute around.
    - ``ceiling_steps(replay, compute_s, agree)``: the same collectives, each hidden under a
      share of ``compute_s`` of synthetic matmuls, with one or two of them in flight at a time
      -- the best overlap this machine allows for the step's communication and compute (see its
      docstring). The bench reports the faster of the two depths.
    - On a gloo group an all-gather and a sum reduce-scatter are replayed as all-to-alls, as the
      ``gloo_collectives`` pass sends them (torch 2.13's gloo all-gather in flight beside compute
      corrupts the heap; its reduce-scatter all-reduces the whole input, twice the bytes; the
      pass's docstring says how that was found). ``T_comm`` and the ceiling are the step's
      collectives as dhelix sends them, not as Inductor does.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from cost_model.op_kinds import is_comm, kind_of
from cost_model.profile.running import run_node, transfer_tensors
from cost_model.timing import back_to_back_s, median_run_s
from dhelix_compile import _torch_compat as compat
from dhelix_compile.comm_threads import gloo_threads_cpu_s

c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class Timings:
    """Seconds per step, per variant, on this rank: ``wall_s`` (``time.perf_counter``) and
    ``cpu_s`` (``time.process_time``: every thread of this process). ``wall - cpu`` is a lower
    bound on the time the rank sat idle, waiting for a transfer or a peer; a CPU time close to
    the wall time means the rank was busy throughout (on a machine whose cores the ranks fill,
    the CPU a transfer takes cannot be hidden behind compute). ``gloo_cpu_s``: the part of
    ``cpu_s`` that gloo's threads ran (``comm_threads.gloo_threads_cpu_s``; the kernel's socket
    work in their system calls included, softirq work done elsewhere not)."""

    wall_s: dict[str, list[float]]
    cpu_s: dict[str, list[float]]
    gloo_cpu_s: dict[str, list[float]]


def time_interleaved(
    steps: Mapping[str, Callable[[], Any]],
    repeats: int,
    barrier: Callable[[], Any] | None = None,
    on_step: Callable[[str], Any] | None = None,
) -> Timings:
    """Wall and CPU seconds per step, per variant, measured round-robin (see the module docstring).

    ``on_step(variant)`` is called after each timed step (progress reporting).
    """
    timings = Timings({name: [] for name in steps}, {name: [] for name in steps}, {name: [] for name in steps})
    for _ in range(repeats):
        for name, step in steps.items():
            start_gloo = gloo_threads_cpu_s()  # read outside the timed window: it lists /proc (~0.2 ms)
            if barrier is not None:
                barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            timings.cpu_s[name].append(time.process_time() - start_cpu)
            timings.wall_s[name].append(time.perf_counter() - start)
            timings.gloo_cpu_s[name].append(gloo_threads_cpu_s() - start_gloo)
            if on_step is not None:
                on_step(name)
    return timings


def record_collectives(module: torch.nn.Module, step_of: Callable[[torch.nn.Module], Any]) -> list[torch.fx.Node]:
    """Collective issue nodes of the graphs ``step_of(compiled_module)`` runs (its forwards and
    backwards, every micro-batch), in execution order: a graph run twice gives its nodes twice."""
    recorded: list[torch.fx.Node] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable[..., Any]:
        comms = [n for n in gm.graph.nodes if is_comm(kind_of(n))]

        def recording(*args: Any) -> Any:
            recorded.extend(comms)
            return gm.forward(*args)

        return compat.eager_partition(recording)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return compat.compile_with_aot_autograd(gm, example_inputs, inner)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)
    assert isinstance(compiled, torch.nn.Module), "torch.compile of a module is a module"
    step_of(compiled)
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


class CollectiveReplay:
    """``nodes``' collectives on the live process group, with real tensors of their shapes.

    Calling it issues each collective and waits for it before the next (``T_comm``);
    ``issue(i)`` and ``wait(handles)`` split one collective for schedules that put work between.
    An all-gather or a sum reduce-scatter on a gloo group is issued as one all-to-all (see the
    module docstring), the way dhelix's compiled graphs send them.
    """

    def __init__(self, nodes: Sequence[torch.fx.Node]) -> None:
        self.calls = [(n, _materialize(n.args), _materialize(n.kwargs)) for n in nodes]

    def __len__(self) -> int:
        return len(self.calls)

    def issue(self, i: int) -> list[torch.Tensor]:
        node, args, kwargs = self.calls[i]
        return transfer_tensors(
            run_node(node, args, kwargs)
        )  # the profiler's runner: gloo gathers and reduce-scatters as all-to-alls

    @staticmethod
    def wait(handles: Sequence[torch.Tensor]) -> None:
        for tensor in handles:
            c10d.wait_tensor(tensor)

    def __call__(self) -> None:
        for i in range(len(self)):
            self.wait(self.issue(i))


def replay_collectives(nodes: Sequence[torch.fx.Node]) -> CollectiveReplay:
    """A function that issues ``nodes``' collectives one after another, waiting for each."""
    return CollectiveReplay(nodes)


class _Matmuls:
    """Square fp32 matmuls into a preallocated output: stand-in compute of a known cost."""

    SIZE = 256

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = (torch.randn(self.SIZE, self.SIZE, generator=gen) for _ in range(2))
        self.out = torch.empty(self.SIZE, self.SIZE)

    def run(self, count: int) -> None:
        for _ in range(count):
            torch.mm(self.a, self.b, out=self.out)

    def seconds_each(self, count: int = 50) -> float:
        self.run(5)
        return back_to_back_s(lambda: self.run(1), count)


def ceiling_steps(
    replay: CollectiveReplay,
    compute_s: float,
    agree: Callable[[list[int]], list[int]],
    samples: int = 5,
    alone_s: Sequence[float] | None = None,
    in_flight: Sequence[int] = (1, 2),
) -> tuple[Callable[[], None], dict[int, Callable[[], None]]]:
    """``(compute_alone, overlapped)``: about ``compute_s`` of synthetic matmuls alone, and for
    each depth ``d`` in ``in_flight`` the same matmuls with ``replay``'s collectives issued among
    them: each collective is followed by a share of the matmuls in proportion to its time alone
    (median of ``samples``), and waited for once ``d`` collectives are in flight (``d = 1``: right
    after its own share; ``d = 2``: after the next one's, as dhelix's schedules keep
    ``max_in_flight=2``), the rest at the end.

    Each ``overlapped[d]`` is a schedule with every transfer in flight under compute that does not
    depend on it, nothing else between; the faster depth is the best this step's communication
    and this much compute can have, and its time on the real link is what this machine allows --
    the *ceiling* a rewrite of the step can reach (the CPU the transfers take and the cores they
    share show up here as they do in the step). One collective at a time pays each one's fixed
    cost in series, which a step of many small collectives (a data-parallel step's per-parameter
    gathers) does not have to; two at a time share the link between them. ``agree(counts)``: the
    element-wise maximum over ranks, so every rank runs the same matmul counts (called once
    for the count from one matmul's time, then once per calibration loop: ``_calibrated_count``);
    every rank must call this together. ``alone_s``: the collectives' times alone, if already known (then only the
    matmuls are timed). The matmuls are small enough to stay in cache, so if anything the
    ceiling is optimistic.
    """
    if not in_flight or min(in_flight) < 1:
        raise ValueError(f"in_flight must list depths >= 1, got {list(in_flight)}")
    alone = list(alone_s) if alone_s is not None else _times_alone(replay, samples)
    matmuls = _Matmuls()
    total = _calibrated_count(matmuls, compute_s, agree)
    counts = _shares(total, alone)

    def compute_alone() -> None:
        matmuls.run(sum(counts))

    def overlapped(depth: int) -> None:
        pending: deque[list[torch.Tensor]] = deque()
        for i, count in enumerate(counts):
            pending.append(replay.issue(i))
            matmuls.run(count)
            while len(pending) >= depth:
                replay.wait(pending.popleft())
        while pending:
            replay.wait(pending.popleft())

    return compute_alone, {depth: functools.partial(overlapped, depth) for depth in in_flight}


#: ``_calibrated_count``: the loop is timed again until the count moves by at most this share ...
CALIBRATION_TOLERANCE = 0.02
#: ... or this many times
CALIBRATION_ROUNDS = 4


def _calibrated_count(matmuls: _Matmuls, compute_s: float, agree: Callable[[list[int]], list[int]]) -> int:
    """How many of ``matmuls`` take ``compute_s``, the same count on every rank (``agree``).

    A first count from one matmul's time, then corrected by the loop's own time, again until the
    count settles (``CALIBRATION_TOLERANCE``, at most ``CALIBRATION_ROUNDS`` loops): a lone matmul
    timed while the other ranks do something else runs at another speed than a long loop of them,
    and one loop timed while the machine was still busy with something else (a rank writing its
    profiles, a transfer's tail) counted 12% too few matmuls (the MoE layer's ceiling on
    2026-11-26: 221 ms of matmuls for a 251 ms ``T_compute``).
    """
    total = agree([max(round(compute_s / matmuls.seconds_each()), 1)])[0]
    for _ in range(CALIBRATION_ROUNDS):
        start = time.perf_counter()
        matmuls.run(total)
        corrected = agree([max(round(total * compute_s / (time.perf_counter() - start)), 1)])[0]
        settled = abs(corrected - total) <= CALIBRATION_TOLERANCE * total
        total = corrected
        if settled:
            break
    return total


def _shares(count: int, weights: Sequence[float]) -> list[int]:
    """``count`` split in proportion to ``weights`` (rounded cumulatively, so the parts sum to it)."""
    total = sum(weights)
    if total <= 0:
        return [count if i == 0 else 0 for i in range(len(weights))]
    bounds, cumulative = [0], 0.0
    for w in weights:
        cumulative += w
        bounds.append(round(count * cumulative / total))
    return [b - a for a, b in itertools.pairwise(bounds)]


def _times_alone(replay: CollectiveReplay, samples: int) -> list[float]:
    """Each collective's time issued and waited alone: the median of ``samples`` after a warm-up."""
    cpu = torch.device("cpu")

    def alone(i: int) -> None:
        replay.wait(replay.issue(i))

    return [median_run_s(functools.partial(alone, i), 1, samples, cpu) for i in range(len(replay))]
