"""The emulated process group: rank r of an N-rank job in one process, timed by a link model.

Contract
--------
* :class:`EmulatedGroup` is a ``torch.distributed.ProcessGroup`` (registered as the backend
  ``"emulated"``): eager ``torch.distributed`` calls, DTensor and the functional collectives of
  compiled graphs reach its methods.
* Outputs have the right shapes and finite values, as if every rank held this rank's data:
  all-reduce and broadcast leave the tensor as it is, all-gather repeats the input,
  reduce-scatter keeps this rank's chunk of the input, all-to-all returns the input (tiled or
  cut to the output's size for uneven splits), a non-root scatter writes zeros, a receive
  writes ones (a peer that agrees: torch's pipelining votes for static stage shapes by
  multiplying ones it receives; a pipeline runs emulated when its stages declare their shapes,
  ``PipelineStage(input_args=..., output_args=...)``, since a peer's pickled shapes cannot be
  received).
  Numerics are checked on real gloo ranks; this group is for time.
* Time: each operation takes ``cost_model.collectives.collective_time_s`` (NCCL's algorithms)
  on the emulation's link for its bytes and group size. A rank has one link: every operation
  that sends bytes (collectives of every group, sends) runs in one FIFO queue, its outbound
  side; receives run in another, its inbound side (``emulation.clock``). Per-peer steps share
  the link as they would a NIC, not one link each.
  ``link=None`` makes every operation complete at once (the step with no communication).
* Every operation is written to the emulation's :class:`Ledger` (kind, bytes, group size,
  seconds), so a benchmark reads the collectives a variant actually sent and their link time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.futures import Future

from cost_model.collectives import collective_bytes_on_wire, collective_time_s
from cost_model.hardware import Link
from dhelix_compile import _torch_compat as compat
from dhelix_compile.emulation.clock import CpuQueues, CudaQueues, wait_until
from dhelix_compile.step_phases import current_step_phase

if TYPE_CHECKING:
    from collections.abc import Iterator


def link_side(op: str) -> str:
    """The side of the rank's link an operation runs on: ``"in"`` for a receive, else ``"out"``."""
    return "in" if op == "recv" else "out"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One emulated operation: ``nbytes`` is the full buffer S (nccl-tests convention)."""

    op: str
    nbytes: int
    group_size: int
    group_name: str
    seconds: float

    @property
    def queue(self) -> str:
        """The side of the rank's link it runs on (:func:`link_side`)."""
        return link_side(self.op)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank pushes through its link for it (none for a receive)."""
        if self.op == "recv":
            return 0
        return int(collective_bytes_on_wire(self.op, self.nbytes, self.group_size))


@dataclasses.dataclass
class TransferTimes:
    """When a transfer ran on the CPU clock (``perf_counter`` seconds) and what it cost its caller.

    ``phase`` / ``waited_phase``: the step part (``step_phases``) that issued / first waited for it.
    ``blocked_s``: how long that first wait blocked the calling thread (its exposed time);
    ``queued_s`` of it can be put down to the link being busy with earlier transfers."""

    phase: str | None
    issued_s: float
    start_s: float
    end_s: float
    waited_phase: str | None = None
    wait_called_s: float | None = None
    blocked_s: float = 0.0

    @property
    def queued_s(self) -> float:
        """How long it waited behind earlier transfers of its side of the link before starting."""
        return max(0.0, self.start_s - self.issued_s)

    def record_wait(self, called_s: float, returned_s: float) -> None:
        """Note the first wait for it (later waits of a finished transfer do not block)."""
        if self.wait_called_s is None:
            self.wait_called_s = called_s
            self.waited_phase = current_step_phase()
            self.blocked_s = max(0.0, returned_s - called_s)


class Ledger:
    """The operations issued since the last :meth:`clear` (thread-safe), with their
    :class:`TransferTimes` where the clock is the CPU's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transfers: list[Transfer] = []
        self._times: list[TransferTimes | None] = []

    def add(self, transfer: Transfer, times: TransferTimes | None = None) -> None:
        with self._lock:
            self._transfers.append(transfer)
            self._times.append(times)

    def clear(self) -> None:
        with self._lock:
            self._transfers.clear()
            self._times.clear()

    def transfers(self) -> list[Transfer]:
        with self._lock:
            return list(self._transfers)

    def timed(self) -> list[tuple[Transfer, TransferTimes]]:
        """The transfers with CPU times, each with them."""
        with self._lock:
            return [(t, times) for t, times in zip(self._transfers, self._times, strict=True) if times is not None]

    def wire_bytes(self) -> int:
        """Bytes this rank sent over its link."""
        return sum(t.wire_bytes for t in self.transfers())

    def link_s(self) -> float:
        """The communication alone: everything recorded issued at once, each side of the link
        busy for the sum of its operations' times (:func:`link_time_s`)."""
        return link_time_s(self.transfers())


def link_time_s(transfers: list[Transfer]) -> float:
    """How long ``transfers`` keep the link busy with nothing else to wait for: the longer of the
    two sides' (outbound, inbound) summed times."""
    sides = {"out": 0.0, "in": 0.0}
    for transfer in transfers:
        sides[transfer.queue] += transfer.seconds
    return max(sides.values())


@dataclasses.dataclass
class EmulationState:
    """What every emulated group of the process shares (owned by ``emulation.Emulation``)."""

    link: Link | None
    traffic: bool
    ledger: Ledger = dataclasses.field(default_factory=Ledger)
    cpu: CpuQueues = dataclasses.field(default_factory=CpuQueues)
    cuda: dict[int, CudaQueues] = dataclasses.field(default_factory=dict)

    def cuda_queues(self, device: torch.device) -> CudaQueues:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.cuda:
            self.cuda[index] = CudaQueues(torch.device("cuda", index), self.traffic)
        return self.cuda[index]


class EmulatedWork(dist.Work):
    """A transfer in flight: a host deadline (CPU) or a CUDA event (CUDA)."""

    def __init__(
        self,
        result: list[torch.Tensor],
        deadline_s: float = 0.0,
        written: concurrent.futures.Future[None] | None = None,
        event: Any = None,
        device: Any = None,
        times: TransferTimes | None = None,
    ) -> None:
        super().__init__()
        self._result = result
        self._deadline_s = deadline_s
        self._times = times
        self._written = written
        self._event = event
        self._device = device

    def wait(self, timeout: Any = None) -> bool:
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            return True
        called = time.perf_counter()
        wait_until(self._deadline_s)
        if self._written is not None:
            self._written.result()
        if self._times is not None:
            self._times.record_wait(called, time.perf_counter())
        return True

    def is_completed(self) -> bool:
        if self._event is not None:
            return bool(self._event.query())
        written = self._written is None or self._written.done()
        return written and time.perf_counter() >= self._deadline_s

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> Future[list[torch.Tensor]]:
        self.wait()
        future: Future[list[torch.Tensor]] = Future()
        future.set_result(self._result)
        return future


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _outside_autograd(write_outputs: Callable[[], None]) -> Callable[[], None]:
    """``write_outputs`` run as the wire writes: outside autograd (a pipeline receives into
    leaves that require grad)."""

    def write() -> None:
        with torch.no_grad():
            write_outputs()

    return write


def _fill(out: torch.Tensor, source: torch.Tensor) -> None:
    """Write ``source``'s values into ``out``, tiled or cut to its size (zeros if it is empty)."""
    if out.numel() == 0:
        return
    flat = source.reshape(-1)
    if flat.numel() == 0:
        out.zero_()
        return
    if flat.numel() == out.numel():
        out.copy_(flat.view(out.shape))
        return
    if out.is_contiguous() and out.numel() % flat.numel() == 0:  # all-gather: one pass
        out.view(-1, flat.numel()).copy_(flat.unsqueeze(0).expand(out.numel() // flat.numel(), -1))
        return
    repeats = -(-out.numel() // flat.numel())
    out.copy_(flat.repeat(repeats)[: out.numel()].view(out.shape))


class EmulatedGroup(dist.ProcessGroup):
    """One process's member of an emulated group (see the module docstring)."""

    def __init__(self, rank: int, size: int, name: str, state: EmulationState) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) constructor is not in the stubs
        self._rank = rank
        self._size = size
        self._name = name
        self._state = state
        compat.attach_placeholder_backend(self)

    # -- identity ---------------------------------------------------------------------------

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @property
    def group_name(self) -> str:  # type: ignore[override]  # torch's setter does not reach a Python subclass
        return self._name

    def getBackendName(self) -> str:
        return "emulated"

    def __repr__(self) -> str:
        return f"EmulatedGroup(rank={self._rank}, size={self._size}, name={self._name!r})"

    # -- one operation ------------------------------------------------------------------------

    def _issue(
        self,
        op: str,
        nbytes: int,
        tensors: Sequence[torch.Tensor],
        write_outputs: Callable[[], None] | None,
        result: list[torch.Tensor],
    ) -> EmulatedWork:
        """Issue ``op`` on ``nbytes``; ``write_outputs`` writes the outputs (None: nothing to
        write, the output is the input)."""
        state = self._state
        seconds = 0.0 if state.link is None else collective_time_s(op, nbytes, self._size, state.link)
        transfer = Transfer(op, int(nbytes), self._size, self._name, seconds)
        key = transfer.queue

        write = None if write_outputs is None else _outside_autograd(write_outputs)
        cuda = next((t.device for t in tensors if t.is_cuda), None)
        if cuda is not None:
            state.ledger.add(transfer)
            event = state.cuda_queues(cuda).issue(key, seconds, write, tensors, transfer.wire_bytes)
            return EmulatedWork(result, event=event, device=cuda)
        written = None if write is None else state.cpu.write(write, self._nbytes(result))
        issued = time.perf_counter()
        start, deadline = state.cpu.schedule_span(key, seconds)
        times = TransferTimes(current_step_phase(), issued, start, deadline)
        state.ledger.add(transfer, times)
        return EmulatedWork(result, deadline_s=deadline, written=written, times=times)

    @staticmethod
    def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- collectives --------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:  # type: ignore[override]  # torch's stubs list its overloads
        return self._issue("all_reduce", self._nbytes(tensors), tensors, None, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:  # type: ignore[override]  # torch's stubs list its overloads
        return self._issue("broadcast", self._nbytes(tensors), tensors, None, tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> EmulatedWork:  # type: ignore[override]  # torch's stubs list its overloads
        return self._issue("all_reduce", self._nbytes(tensors), tensors, None, tensors)

    def allgather(  # type: ignore[override]  # torch's stubs list its overloads
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> EmulatedWork:
        def write() -> None:
            for outs, inp in zip(outputs, inputs, strict=True):
                for out in outs:
                    _fill(out, inp)

        flat = list(_tensors(outputs))
        return self._issue("all_gather", self._nbytes(flat), [*inputs, *flat], write, flat)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> EmulatedWork:
        return self.allgather(outputs, inputs, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> EmulatedWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> EmulatedWork:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> EmulatedWork:
        def write() -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                _fill(out, inp)

        return self._issue("all_gather", self._nbytes(outputs), [*inputs, *outputs], write, outputs)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> EmulatedWork:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> EmulatedWork:  # type: ignore[override]  # torch's stubs list its overloads
        def write() -> None:
            for outs, inp in zip(outputs, inputs, strict=False):
                for out in outs:
                    _fill(out, inp)

        flat = list(_tensors(outputs))
        return self._issue("all_gather", self._nbytes(inputs) * self._size, [*inputs, *flat], write, flat)

    def _own_chunk(self, source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        flat = source.reshape(-1)
        start = min(self._rank * out.numel(), max(0, flat.numel() - out.numel()))
        return flat[start : start + out.numel()]

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> EmulatedWork:
        def write() -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                _fill(out, self._own_chunk(inp, out))

        return self._issue("reduce_scatter", self._nbytes(inputs), [*inputs, *outputs], write, outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> EmulatedWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> EmulatedWork:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> EmulatedWork:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter(  # type: ignore[override]  # torch's stubs list its overloads
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> EmulatedWork:
        def write() -> None:
            for out, chunks in zip(outputs, inputs, strict=True):
                _fill(out, chunks[min(self._rank, len(chunks) - 1)])

        flat = list(_tensors(inputs))
        return self._issue("reduce_scatter", self._nbytes(flat), [*flat, *outputs], write, outputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        opts: Any = None,
    ) -> EmulatedWork:
        return self._issue("all_to_all", self._nbytes([input]), [input, output], lambda: _fill(output, input), [output])

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> EmulatedWork:
        return self.alltoall_base(*args, **kwargs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> EmulatedWork:
        def write() -> None:
            for out, inp in zip(outputs, inputs, strict=True):
                _fill(out, inp)

        return self._issue("all_to_all", self._nbytes(inputs), [*inputs, *outputs], write, outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> EmulatedWork:  # type: ignore[override]  # torch's stubs list its overloads
        def write() -> None:
            for k, out in enumerate(outputs):
                if inputs and k < len(inputs) and inputs[k]:
                    _fill(out, inputs[k][min(self._rank, len(inputs[k]) - 1)])
                else:
                    out.zero_()

        return self._issue("broadcast", self._nbytes(outputs), [*outputs, *_tensors(inputs)], write, outputs)

    def barrier(self, opts: Any = None) -> EmulatedWork:
        return self._issue("all_reduce", 4, [], None, [])

    # -- point to point -----------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> EmulatedWork:
        return self._issue("send", self._nbytes(tensors), tensors, None, tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> EmulatedWork:
        def write() -> None:
            for tensor in tensors:
                tensor.fill_(1)

        return self._issue("recv", self._nbytes(tensors), tensors, write, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> EmulatedWork:
        return self.recv(tensors, -1, tag)
