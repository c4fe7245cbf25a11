"""Rank-side checks that a rank killed (or stopped) in the middle of a step ends every other rank's step with an error.

Contract
--------
``die_mid_step(rank, world_size, case, victim, record_dir, *, stop=False, group="default",
before_compiling=False, **options)`` runs on every rank of a gloo process group (``run_on_ranks``),
``options`` being dhelix's (``data_parallel``'s for ``data_parallel_eager``). Each rank builds the
case, runs one step (it compiles), then a second one in which rank ``victim`` SIGKILLs itself
(``stop=True``: SIGSTOPs itself, a peer that hangs, or whose death is not seen) at the case's
point:

=======================  =============================================================================
``helix``                a tensor-parallel MLP's ``helix`` step over 2 micro-batches: inside the merged
                         graph B0+F1, at F1's death point (between the first column-wise and row-wise
                         linears)
``pipeline``             ``helix_pipeline`` over one ``Schedule1F1B`` stage per rank (torch's own module
                         classes): in stage ``victim``'s forward of its second micro-batch, while the
                         stages beside it wait on their receives
``pipeline_sends``       ``helix_pipeline`` over one ``Schedule1F1B`` stage per rank, each scaling its
                         64 MiB micro-batches (more than loopback's socket buffers take in): in stage
                         ``victim``'s third backward of 4, with every later stage's inputs received;
                         on 2 ranks with victim 0, the last stage then waits on nothing but its last
                         gradient's send, which torch's runtime waits for at the end of the step
``reshard``              ``reshard`` of a DTensor from the first half of the ranks to the second half
                         (``Shard(0)`` to ``Shard(1)``; 1-rank meshes on 2 ranks), then its backward:
                         right after the victim issued its first broadcast of the forward
``data_parallel``        a ``data_parallel`` (``shard``) MLP through ``backend="dhelix"``, 2
                         micro-batches: inside the second micro-batch's forward graph, at its death
                         point
``data_parallel_eager``  the same MLP run eagerly (no compile): in the second micro-batch's forward,
                         at its death point
=======================  =============================================================================

``before_compiling=True``: the victim dies before the first step instead, once every rank built
its case, and the others run their first step (which compiles) without it: they meet its absence
at their first wait for it, at the c10d store where there is one (the rank-consistency check of
``helix`` and ``data_parallel``, ``reshard``'s agreement on its first call), else in a transfer.

``group="new"`` puts the helix and data_parallel meshes and the pipelines' stages on a group of
every rank made by ``new_group`` (torch makes it with its own timeout, not the default group's).

A death point is the op ``dhelix_testing::death_point`` (the identity, its own gradient too) in
the model (``pipeline_sends``: ``dhelix_testing::grad_death_point``, whose gradient passes
``death_point``); on the victim it sends the signal on the armed call. Just before, the victim writes
``victim.json`` to ``record_dir``: ``{"at": time.time(), "frames": [...]}``, the names of
dhelix's functions on its stack (``_run_merged``: a merged graph; ``<fx graph>``: a compiled
graph's code).

Every other rank's second step (its first, ``before_compiling``) must raise. It then raises
:class:`PeerDiedError` whose message carries one JSON line after :data:`RECORD_MARK`: ``rank``,
``after_s`` (its error's time minus the victim's), ``error`` (the type and first line of what the
step raised), ``causes`` (the same of each exception it was raised from, in turn), ``frames`` (as
above, of the error's traceback) and ``threads`` (threads other than the main one, alive and not
daemon, after the step raised: one would keep the process from exiting). A step that returns
instead raises ``AssertionError``. :func:`survivor_records` reads the records out of a
``MultiRankError``.

``python -m dhelix_compile.testing.dead_rank_checks CASE VICTIM RECORD_DIR [OPTIONS_JSON]`` runs
it as a user's script does: the gloo group from the environment (``launch.ranks``), a
survivor's record printed to stdout and its error left uncaught (exit code 1), no
``destroy_process_group``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from dhelix_compile.testing.multirank import MultiRankError

CaseName = Literal["helix", "pipeline", "pipeline_sends", "reshard", "data_parallel", "data_parallel_eager"]
GroupKind = Literal["default", "new"]
CASES: tuple[CaseName, ...] = ("helix", "pipeline", "pipeline_sends", "reshard", "data_parallel", "data_parallel_eager")

#: What precedes a survivor's JSON record in its error message.
RECORD_MARK = "dead peer record: "
_DIM = 16


class PeerDiedError(RuntimeError):
    """A survivor's step failed after the victim died, as it should; the message holds the record."""


# ---------------------------------------------------------------------------------- death points


class _Death:
    """Where this process dies: the armed call of its death points (none until armed)."""

    def __init__(self) -> None:
        self.record_path: Path | None = None
        self.calls_left = 0
        self.signal = signal.SIGKILL

    def arm(self, record_path: Path, on_call: int, signum: signal.Signals) -> None:
        self.record_path, self.calls_left, self.signal = record_path, on_call, signum

    def reached(self) -> None:
        if self.record_path is None:
            return
        self.calls_left -= 1
        if self.calls_left == 0:
            die(self.record_path, self.signal)


_DEATH = _Death()


def die(record_path: Path, signum: signal.Signals = signal.SIGKILL) -> None:
    """Write ``{"at", "frames"}`` to ``record_path``, then send this process ``signum``."""
    record = {"at": time.time(), "frames": _dhelix_frames(traceback.extract_stack())}
    tmp = record_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(record_path)
    os.kill(os.getpid(), signum)


def _dhelix_frames(frames: traceback.StackSummary) -> list[str]:
    """Names of dhelix's functions (and torch pipelining's) among ``frames``, outermost first; a
    compiled FX graph's code is ``<fx graph>``."""
    names = []
    for frame in frames:
        if frame.filename.startswith("<eval_with_key>"):
            names.append("<fx graph>")
        elif any(k in frame.filename for k in ("dhelix_compile", "pipelining")) and "testing" not in frame.filename:
            names.append(frame.name)
    return names


@torch.library.custom_op("dhelix_testing::death_point", mutates_args=())
def death_point(x: torch.Tensor) -> torch.Tensor:
    """The identity; on an armed victim, the call it dies at."""
    _DEATH.reached()
    return x.clone()


@death_point.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _death_point_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return grad


death_point.register_autograd(_death_point_backward)


@torch.library.custom_op("dhelix_testing::grad_death_point", mutates_args=())
def grad_death_point(x: torch.Tensor) -> torch.Tensor:
    """The identity, whose gradient passes :func:`death_point` (the victim dies in a backward)."""
    return x.clone()


@grad_death_point.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _grad_death_point_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return death_point(grad)


grad_death_point.register_autograd(_grad_death_point_backward)


class DeathPoint(nn.Module):
    """A module that calls :func:`death_point`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return death_point(x)


class _MLP(nn.Module):
    """up -> relu -> death point -> down, then up -> relu -> down (under TP: an all-reduce in the
    forward of each block, and one of the second block's input gradient in the backward)."""

    def __init__(self, dim: int = _DIM, hidden: int = 2 * _DIM) -> None:
        super().__init__()
        self.up1 = nn.Linear(dim, hidden, bias=False)
        self.death = DeathPoint()
        self.down1 = nn.Linear(hidden, dim, bias=False)
        self.up2 = nn.Linear(dim, hidden, bias=False)
        self.down2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down1(self.death(torch.relu(self.up1(x))))
        return self.down2(torch.relu(self.up2(h)))


def _seeded(module: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return module


def _inputs(count: int, rows: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, _DIM, generator=gen) for _ in range(count)]


# ----------------------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class _Case:
    """One rank's step of a case, and where in it the victim dies."""

    step: Callable[[], Any]
    die_on_call: int
    """The victim dies at this call of its death points in the second step."""
    victim_context: Callable[[], AbstractContextManager[Any]] = nullcontext
    """Entered around the victim's second step (what puts death points where no model op is)."""


def _group(on: GroupKind, world_size: int) -> Any:
    """``None`` (the default group) or a group of every rank that torch makes with its own timeout."""
    return None if on == "default" else dist.new_group(list(range(world_size)))


def _world_mesh(group: Any, world_size: int, name: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is None:
        return init_device_mesh("cpu", (world_size,), mesh_dim_names=(name,))
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=(name,))


def _helix(rank: int, world_size: int, group: Any, options: dict[str, Any]) -> _Case:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import dhelix_compile

    plan = {"up1": ColwiseParallel(), "down1": RowwiseParallel(), "up2": ColwiseParallel(), "down2": RowwiseParallel()}
    model = parallelize_module(_seeded(_MLP()), _world_mesh(group, world_size, "tp"), plan)
    step = dhelix_compile.helix(model, lambda m, x: m(x).pow(2).mean(), **options)
    microbatches = _inputs(2, 4, seed=1)
    return _Case(lambda: step(microbatches), die_on_call=2)  # F0 alone, then F1 in the merged graph B0+F1


def _pipeline(rank: int, world_size: int, group: Any, options: dict[str, Any]) -> _Case:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import dhelix_compile
    from dhelix_compile.testing.pipeline_checks import TORCH_MODULES_VOCAB, torch_module_chunks

    chunk = torch_module_chunks(world_size)[rank]
    module = nn.Sequential(chunk, DeathPoint()) if rank < world_size - 1 else nn.Sequential(DeathPoint(), chunk)
    stage = PipelineStage(module, rank, world_size, torch.device("cpu"), group=group)
    n_microbatches = 4

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, targets.flatten())

    schedule = dhelix_compile.helix_pipeline(Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn), **options)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, TORCH_MODULES_VOCAB, (n_microbatches, 3), generator=gen)
    targets = torch.randint(0, TORCH_MODULES_VOCAB, (n_microbatches, 3), generator=gen)

    def step() -> Any:
        args = (tokens,) if rank == 0 else ()
        return schedule.step(*args, target=targets if rank == world_size - 1 else None)

    return _Case(step, die_on_call=2)  # the second micro-batch's forward


class _Scale(nn.Module):
    """``x * weight`` over its last dim, then :func:`grad_death_point`: a stage whose transfers
    are as large as its input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grad_death_point(x * self.weight)


#: Rows and columns of one micro-batch of ``pipeline_sends``: 64 MiB of float32, more than
#: loopback's socket buffers hold, so a send to a stopped peer stays in flight.
_SEND_ROWS, _SEND_DIM = 2048, 8192


def _pipeline_sends(rank: int, world_size: int, group: Any, options: dict[str, Any]) -> _Case:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import dhelix_compile

    n_microbatches = 4
    stage = PipelineStage(_Scale(_SEND_DIM), rank, world_size, torch.device("cpu"), group=group)
    schedule = dhelix_compile.helix_pipeline(
        Schedule1F1B(stage, n_microbatches, loss_fn=lambda y, t: (y * t).mean()), **options
    )
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n_microbatches * _SEND_ROWS, _SEND_DIM, generator=gen)
    target = torch.randn(n_microbatches * _SEND_ROWS, _SEND_DIM, generator=gen)

    def step() -> Any:
        args = (x,) if rank == 0 else ()
        return schedule.step(*args, target=target if rank == world_size - 1 else None)

    # the victim's (stage 0's) third backward: the last stage has received every input and
    # waits on nothing but its last gradient send to the victim
    return _Case(step, die_on_call=n_microbatches - 1)


def _reshard(rank: int, world_size: int, group: Any, options: dict[str, Any]) -> _Case:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import dhelix_compile

    half = world_size // 2
    source = DeviceMesh("cpu", list(range(half)))
    dest = DeviceMesh("cpu", list(range(half, world_size)))
    full = torch.randn(4 * half, 4 * half, generator=torch.Generator().manual_seed(3))

    def step() -> Any:
        x = distribute_tensor(full, source, [Shard(0)]).requires_grad_(True)  # local copies: no collective
        y = dhelix_compile.reshard(x, dest, [Shard(1)])
        assert isinstance(y, DTensor)
        if rank >= half:
            y.to_local().sum().backward()
        else:  # outside the destination mesh (README): its share of the gradient goes back all the same
            y.backward(torch.zeros_like(y))
        return x.grad

    return _Case(step, die_on_call=1, victim_context=_dying_broadcasts)


@contextmanager
def _dying_broadcasts() -> Iterator[None]:
    """Every functional broadcast passes a death point once it is issued (reshard's, on the victim)."""
    import torch.distributed._functional_collectives as funcol

    issue = funcol.broadcast

    def broadcast(tensor: torch.Tensor, src: int, group: Any, tag: str = "") -> torch.Tensor:
        out = issue(tensor, src, group, tag)
        _DEATH.reached()
        return out

    funcol.broadcast = broadcast  # type: ignore[assignment]  # this process only, while its step runs
    try:
        yield
    finally:
        funcol.broadcast = issue


def _data_parallel(rank: int, world_size: int, group: Any, options: dict[str, Any]) -> _Case:
    import dhelix_compile

    model = dhelix_compile.data_parallel(_seeded(_MLP()), _world_mesh(group, world_size, "dp"), "shard")
    compiled = torch.compile(model, backend=dhelix_compile.backend(**options), fullgraph=True)
    microbatches = _inputs(2, 4, seed=10 + rank)

    def step() -> None:
        for k, x in enumerate(microbatches):
            model.dhelix_data_parallel.set_requires_gradient_sync(k == len(microbatches) - 1)
            compiled(x).pow(2).mean().backward()

    return _Case(step, die_on_call=2)  # the second micro-batch's forward


def _data_parallel_eager(rank: int, world_size: int, group: Any, options: dict[str, Any]) -> _Case:
    import dhelix_compile

    model = dhelix_compile.data_parallel(_seeded(_MLP()), _world_mesh(group, world_size, "dp"), "shard", **options)
    microbatches = _inputs(2, 4, seed=10 + rank)

    def step() -> None:
        for x in microbatches:
            model(x).pow(2).mean().backward()

    return _Case(step, die_on_call=2)  # the second micro-batch's forward


_BUILD: dict[CaseName, Callable[[int, int, Any, dict[str, Any]], _Case]] = {
    "helix": _helix,
    "pipeline": _pipeline,
    "pipeline_sends": _pipeline_sends,
    "reshard": _reshard,
    "data_parallel": _data_parallel,
    "data_parallel_eager": _data_parallel_eager,
}


# ------------------------------------------------------------------------------------- the check


def die_mid_step(
    rank: int,
    world_size: int,
    case: CaseName,
    victim: int,
    record_dir: str,
    *,
    stop: bool = False,
    group: GroupKind = "default",
    before_compiling: bool = False,
    **options: Any,
) -> None:
    """See the module docstring."""
    victim_record = Path(record_dir) / "victim.json"
    built = _BUILD[case](rank, world_size, _group(group, world_size), options)
    signum = signal.SIGSTOP if stop else signal.SIGKILL
    if before_compiling:
        dist.barrier()  # every rank built its case
        if rank == victim:
            die(victim_record, signum)
    else:
        built.step()  # compiles
        if rank == victim:
            _DEATH.arm(victim_record, built.die_on_call, signum)
        dist.barrier()  # every rank compiled: the victim dies in the step, not during a peer's compile
    started = time.time()
    try:
        with built.victim_context() if rank == victim else nullcontext():
            built.step()
    except Exception as exc:  # noqa: BLE001 - what a survivor's step raised is the record
        failed_at = time.time()
        frames = _dhelix_frames(traceback.extract_tb(exc.__traceback__))
        causes = _causes(exc)
        del exc  # its traceback holds the step's frames (and the tensors they hold)
        threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        died_at = json.loads(victim_record.read_text())["at"] if victim_record.exists() else started
        record = {
            "rank": rank,
            "after_s": round(failed_at - died_at, 4),
            "error": causes[0],
            "causes": causes[1:],
            "frames": frames,
            "threads": threads,
        }
        raise PeerDiedError(RECORD_MARK + json.dumps(record)) from None
    raise AssertionError(f"rank {rank}: the step finished although rank {victim} was {'stopped' if stop else 'killed'}")


def _causes(exc: BaseException) -> list[str]:
    """``exc`` and each exception it was raised from (Dynamo's wrapping of a backend's error
    included), in turn, each as its type and the first line of its message."""
    causes: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(causes) < 8:
        causes.append(f"{type(current).__name__}: {(str(current).strip().splitlines() or [''])[0]}")
        current = getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
    return causes


def survivor_records(error: MultiRankError) -> dict[int, dict[str, Any]]:
    """Each survivor's record (module docstring), by rank, from the error ``run_on_ranks`` raised."""
    records = {}
    for failure in error.failures:
        for line in failure.detail.splitlines():
            if RECORD_MARK in line:
                records[failure.rank] = json.loads(line.split(RECORD_MARK, 1)[1])
    return records


def victim_record(record_dir: str) -> dict[str, Any]:
    """What the victim wrote just before it died."""
    return dict(json.loads((Path(record_dir) / "victim.json").read_text()))


def main(argv: list[str]) -> None:
    """The command line (module docstring)."""
    case, victim, record_dir = argv[0], int(argv[1]), argv[2]
    if case not in CASES:
        raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES)}")
    options = json.loads(argv[3]) if len(argv) > 3 else {}
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        die_mid_step(dist.get_rank(), dist.get_world_size(), case, victim, record_dir, **options)
    except PeerDiedError as exc:
        print(exc, flush=True)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
