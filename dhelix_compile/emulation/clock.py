"""When an emulated transfer completes: a deadline on CPU, a delay kernel on a side stream on CUDA.

Contract
--------
* Transfers are FIFO per *queue* (a side of the rank's link: ``emulation.group`` puts every
  operation that sends bytes on the outbound one, receives on the inbound one): an operation
  starts when its inputs are ready and the previous operation of its queue has finished, and
  takes the link model's time. The two queues run concurrently.
* CPU (:class:`CpuQueues`): an operation is a deadline. ``wait`` sleeps, then spins the last
  ~0.2 ms on the waiting thread (which has nothing else to do), so a wait ends within
  microseconds of the deadline. The outputs are written by one helper thread while the deadline
  runs (as gloo's threads copy; a message of at most :data:`INLINE_BYTES` is written at once, on
  the caller's thread, where a hand-off would cost more than the copy); ``wait`` also waits for
  that write, so an operation lasts at least its output's memory write.
* CUDA (:class:`CudaQueues`): per queue a *delay* stream (high priority) and a *data* stream.
  The delay stream waits for the compute stream (the inputs) and the queue's earlier operations,
  then runs ``torch.cuda._sleep`` for the link time (cycles calibrated once against CUDA events);
  the data stream, from the same point, writes the outputs and, in ``traffic`` mode, copies the
  bytes the rank would push through its link, so HBM bandwidth is shared as NCCL's kernels share
  it. The delay kernel is launched first and its stream has the higher priority, so a large write
  cannot hold back its one block (the GPU dispatches an earlier kernel's blocks first). The delay
  stream joins the data stream and records the completion event; ``wait`` makes the *compute
  stream* wait on it (the host does not block), as NCCL's ``work.wait()`` does. What an operation
  costs beside its delay (the stream hand-offs, the join) is measured once per shape of operation
  (with or without a data stream) and taken off the delay, so an operation lasts the link
  model's time, or its writes' time where they take longer.

    compute  --[inputs]--+--------------------------------------[wait: stream waits]-->
                         |                                        ^
    delay                +--[ _sleep(link time) ]--+--[event]-----+
    data                 +--[ outputs ][ traffic ]-+
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from cost_model.timing import cuda_window_s, time_samples_s
from dhelix_compile import _torch_compat as compat

#: ``wait`` sleeps until this long before the deadline, then spins (Linux timer slack and the
#: scheduler overshoot a ``sleep`` by up to ~0.1 ms).
SPIN_S: float = 2e-4


def wait_until(deadline_s: float) -> None:
    """Return at ``time.perf_counter() >= deadline_s``: sleep, then spin the last :data:`SPIN_S`."""
    while True:
        left = deadline_s - time.perf_counter()
        if left <= 0:
            return
        if left > SPIN_S:
            time.sleep(left - SPIN_S)


#: Outputs up to this size are written on the issuing thread (a thread hand-off costs ~20 us).
INLINE_BYTES: int = 256 * 1024


class CpuQueues:
    """Deadlines of FIFO queues on the host clock (``time.perf_counter``).

    ``host_overhead_s`` is what an operation costs the host before its deadline is set and after
    it passes (torch's dispatch into the Python group, the wait's return), measured once by
    :meth:`calibrate`: it is taken off each operation's time, so that an operation seen from
    the caller lasts the link model's time."""

    def __init__(self) -> None:
        self._free_at_s: dict[Hashable, float] = {}
        self.host_overhead_s = 0.0
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None

    def write(self, write_outputs: Callable[[], None], nbytes: int) -> concurrent.futures.Future[None] | None:
        """Write an operation's outputs: at once when small, else on the helper thread (FIFO)."""
        if nbytes <= INLINE_BYTES:
            write_outputs()
            return None
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dhelix-emulated-link")
        return self._writer.submit(write_outputs)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def schedule(self, queue: Hashable, seconds: float) -> float:
        """The deadline of an operation issued now that takes ``seconds`` on ``queue``."""
        return self.schedule_span(queue, seconds)[1]

    def schedule_span(self, queue: Hashable, seconds: float) -> tuple[float, float]:
        """When an operation issued now that takes ``seconds`` on ``queue`` starts (after the
        queue's earlier operations) and its deadline."""
        start = max(time.perf_counter(), self._free_at_s.get(queue, 0.0))
        end = start + max(0.0, seconds - self.host_overhead_s)
        self._free_at_s[queue] = end
        return start, end

    def calibrate(self, round_trip: Callable[[], None], repeats: int = 50) -> None:
        """Set :attr:`host_overhead_s` to the fastest of ``repeats`` issue-and-wait round trips of
        an operation that takes no time."""
        self.host_overhead_s = min(time_samples_s(round_trip, repeats, warmup=0))


class _DelayKernel:
    """``torch.cuda._sleep`` calibrated: cycles per second and the kernel's fixed cost."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            compat.cuda_delay(1000)  # load the kernel
            small, large = 1_000_000, 20_000_000
            t_small = min(self._timed(small) for _ in range(3))
            t_large = min(self._timed(large) for _ in range(3))
            t_one = min(self._timed(1) for _ in range(5))
        self.cycles_per_s = (large - small) / max(t_large - t_small, 1e-9)
        self.fixed_s = max(0.0, t_one)

    @staticmethod
    def _timed(cycles: int) -> float:
        """GPU seconds of one delay kernel, queued behind ~1 ms of GPU work (so the host's launch
        runs ahead and the events time the kernel, not the launch)."""
        return cuda_window_s(lambda: compat.cuda_delay(cycles), lead_in=lambda: compat.cuda_delay(2_000_000))

    def sleep(self, seconds: float) -> None:
        """Enqueue a kernel on the current stream that runs ``seconds`` (at least its fixed cost)."""
        cycles = int(max(0.0, seconds - self.fixed_s) * self.cycles_per_s)
        if cycles > 0:
            compat.cuda_delay(cycles)


class CudaQueues:
    """Side streams per queue on one CUDA device; see the module docstring."""

    #: The link time of the operations :meth:`calibrate` times (long enough to hide a small write).
    CALIBRATION_S: float = 100e-6

    def __init__(self, device: torch.device, traffic: bool) -> None:
        self.device = device
        self.traffic = traffic
        self._delay = _DelayKernel(device)
        self._streams: dict[Hashable, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8, device=device)
        self.overhead_s: dict[bool, float] = {False: 0.0, True: 0.0}
        """What an operation costs beside its delay kernel, by whether it uses the data stream."""
        self.calibrate()

    def _queue_streams(self, queue: Hashable) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if queue not in self._streams:
            # priority -1: above the default 0 (torch maps it into the device's range)
            self._streams[queue] = (torch.cuda.Stream(self.device, priority=-1), torch.cuda.Stream(self.device))
        return self._streams[queue]

    def _move_bytes(self, wire_bytes: int) -> None:
        """Read and write ``wire_bytes`` of device memory (what NCCL's kernels move for them)."""
        half = max(1, wire_bytes // 2)
        if self._scratch.numel() < 2 * half:
            self._scratch = torch.empty(2 * half, dtype=torch.uint8, device=self.device)
        self._scratch[half : 2 * half].copy_(self._scratch[:half])

    def calibrate(self, repeats: int = 7) -> None:
        """Set :attr:`overhead_s`: an operation of :data:`CALIBRATION_S` timed on the compute
        stream (issue to wait, behind queued GPU work so the host runs ahead), with and without
        a small write, less what its delay kernel was asked for."""
        probe = torch.empty(1024, dtype=torch.uint8, device=self.device)
        with torch.cuda.device(self.device):
            for writes in (False, True):
                self.overhead_s[writes] = 0.0

                def write_probe() -> None:
                    probe.fill_(1)

                def op(writes: bool = writes) -> None:
                    write = write_probe if writes else None
                    event = self.issue(("calibration", writes), self.CALIBRATION_S, write, [probe], 0)
                    torch.cuda.current_stream(self.device).wait_event(event)

                samples = []
                for _ in range(repeats):
                    torch.cuda.synchronize(self.device)
                    samples.append(cuda_window_s(op, lead_in=lambda: compat.cuda_delay(2_000_000)))
                self.overhead_s[writes] = max(0.0, statistics.median(samples) - self.CALIBRATION_S)
            self._streams.pop(("calibration", False), None)
            self._streams.pop(("calibration", True), None)

    def issue(
        self,
        queue: Hashable,
        seconds: float,
        write_outputs: Callable[[], None] | None,
        tensors: Sequence[torch.Tensor],
        wire_bytes: int,
    ) -> torch.cuda.Event:
        """Enqueue one operation; the returned event completes when the link model says it ends
        (or when its writes end, if later). ``write_outputs``: None for an operation that
        writes nothing (an all-reduce's output is its input here)."""
        delay, data = self._queue_streams(queue)
        compute = torch.cuda.current_stream(self.device)
        delay.wait_stream(compute)  # the inputs, after the queue's earlier operations
        uses_data = write_outputs is not None or (self.traffic and wire_bytes > 0)
        if uses_data:
            data.wait_stream(delay)
        with torch.cuda.stream(delay):
            self._delay.sleep(seconds - self.overhead_s[uses_data])
        if uses_data:
            with torch.cuda.stream(data):
                if write_outputs is not None:
                    write_outputs()
                if self.traffic and wire_bytes > 0:
                    self._move_bytes(wire_bytes)
            delay.wait_stream(data)
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(delay)
                if uses_data:
                    tensor.record_stream(data)
        done = torch.cuda.Event()
        done.record(delay)
        return done
