"""An emulated cluster: this process is rank r of an N-rank job whose collectives take a link's time.

    import dhelix_compile
    with dhelix_compile.emulate(world_size=8, link="ib400") as cluster:
        mesh = init_device_mesh("cuda", (8,))          # torch's APIs work as usual
        model = parallelize_module(model, mesh, plan)
        step = torch.compile(model, backend="dhelix")
        ...
        cluster.ledger.wire_bytes()                    # what this rank sent
        with cluster.link_free():                      # the same step with no communication
            ...

:func:`emulate` makes an :class:`~dhelix_compile.emulation.group.EmulatedGroup` this process's
default process group (``init_process_group("emulated", store=HashStore(), ...)``), so
``init_device_mesh``, ``parallelize_module``, ``data_parallel``, ``helix`` and torch's pipelining
build N-rank meshes in one process. Every collective and send/recv completes after the link
model's time for its bytes (``emulation.links``: presets or ``alpha=...,bandwidth=...``),
asynchronously and without the compute's resources (``emulation.clock``). Outputs are copies of
this rank's data: the numbers are for time, numerics are checked on real ranks.

What it cannot show: the SMs NCCL's own kernels take beyond the memory traffic of ``traffic``
mode, congestion between groups that share a NIC (each group is its own queue), stragglers and
skew between ranks (every other rank is exactly on time).

dhelix's cross-rank steps (rank agreement, the rank-consistency check, cost-model profiling)
see one process and nothing to agree with; the cost model prices collectives on the same link.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from cost_model.cluster.emulated import EMULATED_CONTENTION_FACTOR
from cost_model.hardware import LINKS, Device, Link, register_link
from dhelix_compile import _torch_compat as compat
from dhelix_compile.emulation.group import EmulatedGroup, EmulationState, Ledger, Transfer
from dhelix_compile.emulation.links import LINK_PRESETS, LinkSpecError, describe_presets, parse_link

__all__ = [
    "LINK_PRESETS",
    "Emulation",
    "EmulationError",
    "Ledger",
    "LinkSpecError",
    "Transfer",
    "active",
    "describe_presets",
    "emulate",
    "parse_link",
]

BACKEND = "emulated"

_ACTIVE: Emulation | None = None


class EmulationError(RuntimeError):
    """An emulated cluster that cannot be set up as asked."""


class Emulation:
    """A live emulated cluster (returned by :func:`emulate`; a context manager that tears it down)."""

    def __init__(self, world_size: int, rank: int, link: Link, traffic: bool) -> None:
        self.world_size = world_size
        self.rank = rank
        self.link = link
        self._state = EmulationState(link=link, traffic=traffic)

    @property
    def traffic(self) -> bool:
        """Whether a transfer also moves its bytes through device memory (CUDA only)."""
        return self._state.traffic

    @property
    def ledger(self) -> Ledger:
        """Every operation issued since ``ledger.clear()``."""
        return self._state.ledger

    @property
    def cost_model_link(self) -> str:
        """The name of the emulated link in ``cost_model.LINKS`` (what dhelix's planner prices)."""
        return self.link.name

    def contention_factor(self, device: Device, cuda: bool) -> float:
        """How much slower compute runs beside one of this cluster's transfers, for the planner.

        On the CPU a transfer is a timer: it takes no core from the compute, so 1.0 (the
        measured CPU device's factor is gloo's, whose threads copy and send on the compute's
        cores). On CUDA the delay kernel holds one SM (``cost_model.cluster``'s measured
        ``EMULATED_CONTENTION_FACTOR``, as its predictions of an emulated run use); with
        ``traffic`` its copy moves the message's bytes through device memory as NCCL does, so
        ``device``'s own factor (NCCL's) applies."""
        if not cuda:
            return 1.0
        return device.contention_factor if self.traffic else EMULATED_CONTENTION_FACTOR

    def set_link(self, link: str | Link) -> None:
        """Time every later operation on ``link`` (graphs compiled before keep their plan)."""
        resolved = parse_link(link)
        if resolved.name not in LINKS:
            register_link(resolved)
        self.link = resolved
        self._state.link = resolved

    @contextlib.contextmanager
    def link_free(self) -> Iterator[None]:
        """Within: every operation completes at once (the step's compute alone)."""
        saved, self._state.link = self._state.link, None
        try:
            yield
        finally:
            self._state.link = saved

    def _calibrate(self) -> None:
        probe = torch.zeros(1)
        with self.link_free():
            self._state.cpu.calibrate(lambda: dist.all_reduce(probe))
        self.ledger.clear()

    def _create_group(self, group_rank: int, group_size: int, name: str, _global_ranks: list[int]) -> EmulatedGroup:
        return EmulatedGroup(group_rank, group_size, name, self._state)

    def close(self) -> None:
        """Destroy the process group; :func:`emulate` may be called again afterwards."""
        global _ACTIVE
        if dist.is_initialized() and dist.get_backend() == BACKEND:
            dist.destroy_process_group()
        self._state.cpu.close()
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self) -> Emulation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Emulation(world_size={self.world_size}, rank={self.rank}, link={self.link.name!r})"


def _create_group(group_rank: int, group_size: int, name: str, global_ranks: list[int]) -> EmulatedGroup:
    if _ACTIVE is None:
        raise EmulationError("an emulated process group was asked for with no emulation live; call emulate() first")
    return _ACTIVE._create_group(group_rank, group_size, name, global_ranks)


def emulate(world_size: int, rank: int = 0, link: str | Link = "ib400", *, traffic: bool = False) -> Emulation:
    """Make this process rank ``rank`` of an emulated ``world_size``-rank job (see the module
    docstring). ``link``: a preset (:data:`LINK_PRESETS`), ``"alpha=5us,bandwidth=40GB/s"`` or a
    ``cost_model.Link``. ``traffic``: on CUDA, also copy each transfer's bytes in device memory."""
    global _ACTIVE
    if not isinstance(world_size, int) or world_size < 1:
        raise EmulationError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise EmulationError(f"rank must be in [0, {world_size}), got {rank!r}")
    if dist.is_initialized():
        raise EmulationError(
            f"a process group is already initialized (backend {dist.get_backend()!r}); "
            "call torch.distributed.destroy_process_group() before emulate()"
        )
    resolved = parse_link(link)
    if resolved.name not in LINKS:
        register_link(resolved)
    compat.register_process_group_backend(BACKEND, _create_group, devices=("cpu", "cuda"))
    emulation = Emulation(world_size, rank, resolved, traffic)
    _ACTIVE = emulation
    try:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    except BaseException:
        _ACTIVE = None
        raise
    emulation._calibrate()
    return emulation


def active() -> Emulation | None:
    """The live emulation of this process, if any."""
    return _ACTIVE if dist.is_initialized() and dist.get_backend() == BACKEND else None
