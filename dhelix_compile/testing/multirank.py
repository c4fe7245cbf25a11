"""Run a function on N local ranks over gloo and collect every rank's result or failure.

Contract
--------
``run_on_ranks(fn, world_size, *args, timeout_s=120.0, **kwargs) -> list[result]``

* ``fn`` must be picklable by reference (a module-level function). It is called in a fresh
  process (``spawn`` start method) as ``fn(rank, world_size, *args, **kwargs)`` after the
  default process group has been initialised with the gloo backend on 127.0.0.1; the group is
  destroyed after ``fn`` returns. ``args``/``kwargs`` and the return value must be picklable;
  the return value crosses the process boundary by value (``pickle``, no shared memory).
* Each worker calls ``torch.set_num_threads(1)`` (``num_threads=`` overrides it) so that N ranks
  on a small machine do not oversubscribe its cores.
* The result list is ordered by rank.
* Any failure raises ``MultiRankError`` naming every rank that did not return and why: an
  exception (with the remote traceback), a crash (with the exit code), or "did not finish"
  (with the Python stacks of all its threads, dumped by ``faulthandler`` just before the kill).
  ``first_failure`` is the rank that failed first by the workers' own clocks: when one rank
  raises, gloo typically makes its peers raise "Connection closed by peer" moments later, and
  the first failure is the cause. ``MultiRankTimeout`` (a subclass) is raised when no rank failed
  but some had not finished after ``timeout_s``. After a first failure the other ranks get
  ``grace_s`` to finish, then are killed.
* The call never hangs past ``timeout_s`` (plus about a second to dump stacks and reap), and it
  leaves no child process behind: every worker is its own process-group leader, and its group
  is SIGKILLed and reaped on every exit path (success, failure, timeout, KeyboardInterrupt).
* ``timeout_s`` counts from the first spawn, so it includes process start-up (importing torch
  and the package, several seconds per rank on a small machine).

Rendezvous
----------
The rendezvous store is a ``TCPStore`` server that this (parent) process binds to port 0: the OS
picks a free port and it stays bound for the whole run; workers connect to it as clients and
call ``init_process_group("gloo", store=..., rank=..., world_size=...)``. This removes the "find
a free port, close it, hope nobody takes it before rank 0 binds it" race of
``init_method="tcp://127.0.0.1:<port>"`` altogether, so no EADDRINUSE retry is needed. gloo's
own pairwise connections bind ephemeral ports themselves.

Results travel over one one-way pipe per rank; the parent waits on the pipes and the process
sentinels together (``multiprocessing.connection.wait``), so a crash is noticed at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "MultiRankError",
    "MultiRankTimeout",
    "RankFailure",
    "run_on_ranks",
]

T = TypeVar("T")

HOST = "127.0.0.1"
# Time given to faulthandler to write the stacks of ranks about to be killed.
_STACK_DUMP_S = 1.0
# How long to wait for the exit code of a worker whose process has ended.
_REAP_S = 10.0

FailureKind = Literal["exception", "crashed", "not_finished"]


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """Why one rank did not return a result."""

    rank: int
    kind: FailureKind
    """``exception``: ``fn`` (or the process-group setup) raised; ``crashed``: the process died
    without reporting; ``not_finished``: still running at the timeout or after ``grace_s``."""
    detail: str
    """The remote traceback, the exit code, or why the rank was stopped."""
    failed_at: float = float("inf")
    """``time.time()`` when it failed (worker clock for exceptions, parent clock for crashes)."""
    stack: str = ""
    """Python stacks of all threads of a rank that was still running, dumped before the kill."""

    def format(self) -> str:
        text = f"--- rank {self.rank}: {self.kind}: {self.detail.rstrip()}"
        if self.stack:
            text += f"\n    stacks of rank {self.rank} when it was stopped:\n{self.stack.rstrip()}"
        return text


class MultiRankError(RuntimeError):
    """One or more ranks failed; ``failures`` says which and why (ordered by rank)."""

    def __init__(
        self, summary: str, failures: list[RankFailure], world_size: int, pids: list[int]
    ) -> None:
        self.failures: tuple[RankFailure, ...] = tuple(sorted(failures, key=lambda f: f.rank))
        self.world_size = world_size
        self.pids: tuple[int, ...] = tuple(pids)
        body = "\n".join(f.format() for f in self.failures)
        super().__init__(f"{summary}\n{body}")

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that raised or crashed."""
        return [f.rank for f in self.failures if f.kind != "not_finished"]

    @property
    def unfinished_ranks(self) -> list[int]:
        """Ranks that were still running when they were stopped."""
        return [f.rank for f in self.failures if f.kind == "not_finished"]

    @property
    def first_failure(self) -> RankFailure | None:
        """The earliest exception or crash (ties: lowest rank): usually the cause."""
        failed = [f for f in self.failures if f.kind != "not_finished"]
        return min(failed, key=lambda f: (f.failed_at, f.rank)) if failed else None


class MultiRankTimeout(MultiRankError):
    """No rank failed, but ``unfinished_ranks`` had not finished after ``timeout_s``."""


@dataclasses.dataclass(frozen=True)
class _WorkerSpec:
    world_size: int
    port: int
    pg_timeout_s: float
    num_threads: int
    stack_dir: str


def _stack_path(stack_dir: str, rank: int) -> str:
    return os.path.join(stack_dir, f"rank{rank}.stacks")


def _worker_main(
    spec: _WorkerSpec,
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    conn: Connection,
) -> None:
    """Entry point of one rank (runs in the spawned child)."""
    os.setpgrp()  # own process group: the parent can kill this rank and anything it forks
    stack_file = open(_stack_path(spec.stack_dir, rank), "w")  # noqa: SIM115 (lives with the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(spec.num_threads)
    try:
        timeout = datetime.timedelta(seconds=spec.pg_timeout_s)
        store = dist.TCPStore(
            host_name=HOST,
            port=spec.port,
            world_size=spec.world_size,
            is_master=False,
            timeout=timeout,
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=spec.world_size, timeout=timeout
        )
        payload = pickle.dumps(fn(rank, spec.world_size, *args, **kwargs))
    except BaseException:  # noqa: BLE001 (reported to the parent, which raises)
        # Report before tearing down: peers notice the teardown and fail right after.
        conn.send(("exception", traceback.format_exc(), time.time()))
        _destroy_quietly()
        return
    _destroy_quietly()
    conn.send(("ok", payload, time.time()))


def _destroy_quietly() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 (a failed rank's teardown must not mask its error)
            pass


def run_on_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    grace_s: float = 5.0,
    pg_timeout_s: float | None = None,
    num_threads: int = 1,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; see module doc.

    Args:
        fn: module-level function; its return value must be picklable.
        world_size: number of ranks (processes), >= 1.
        timeout_s: wall-clock limit for the whole run, from the first spawn.
        grace_s: after a rank fails, how long the others may still take before they are killed.
        pg_timeout_s: the process group's collective timeout; defaults to ``timeout_s``, so a
            blocked collective is normally stopped by this harness (with stacks), not by gloo.
        num_threads: ``torch.set_num_threads`` in each worker.
        kwargs: passed to ``fn``.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        MultiRankTimeout: no rank failed, but some did not finish within ``timeout_s``.
        MultiRankError: some rank raised or crashed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore(  # the rendezvous server, on a free port the OS picks (port 0)
        host_name=HOST,
        port=0,
        world_size=world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    with tempfile.TemporaryDirectory(prefix="dhelix_multirank_") as stack_dir:
        spec = _WorkerSpec(
            world_size=world_size,
            port=store.port,
            pg_timeout_s=pg_timeout_s if pg_timeout_s is not None else timeout_s,
            num_threads=num_threads,
            stack_dir=stack_dir,
        )
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                readers.append(reader)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(spec, rank, fn, args, kwargs, writer),
                    name=f"dhelix-rank{rank}",
                    daemon=True,
                )
                try:
                    proc.start()
                finally:
                    writer.close()  # the child has its own copy; ours would hide its EOF
                procs.append(proc)
            return _Supervisor(procs, readers, spec, timeout_s, grace_s).run()
        finally:
            _kill_and_reap(procs)
            for reader in readers:
                reader.close()
            del store


class _Supervisor:
    """Waits for the ranks' messages and exits, enforces the deadlines, builds the error."""

    def __init__(
        self,
        procs: list[BaseProcess],
        readers: list[Connection],
        spec: _WorkerSpec,
        timeout_s: float,
        grace_s: float,
    ) -> None:
        self.procs = procs
        self.readers = readers
        self.spec = spec
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.values: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}

    def _pending(self) -> list[int]:
        return [
            r for r in range(len(self.procs)) if r not in self.values and r not in self.failures
        ]

    def _receive(self, rank: int) -> None:
        """Take rank's message, or record a crash if its process ended without one."""
        reader = self.readers[rank]
        try:
            if reader.poll():
                status, payload, at = reader.recv()
                if status != "ok":
                    self.failures[rank] = RankFailure(rank, "exception", payload, at)
                    return
                try:
                    self.values[rank] = pickle.loads(payload)
                except Exception:  # noqa: BLE001 (e.g. a class the parent cannot import)
                    detail = "its result could not be unpickled here:\n" + traceback.format_exc()
                    self.failures[rank] = RankFailure(rank, "exception", detail, at)
                return
        except (EOFError, OSError):
            pass
        proc = self.procs[rank]
        proc.join(_REAP_S)
        self.failures[rank] = RankFailure(
            rank,
            "crashed",
            f"process exited with code {proc.exitcode} without a result",
            time.time(),
        )

    def run(self) -> list[Any]:
        start = time.monotonic()
        stop_at = start + self.timeout_s
        grace_started = False
        while pending := self._pending():
            now = time.monotonic()
            if now >= stop_at:
                break
            waitables: dict[Any, int] = {}
            for rank in pending:
                waitables[self.readers[rank]] = rank
                waitables[self.procs[rank].sentinel] = rank
            ready = multiprocessing.connection.wait(list(waitables), timeout=stop_at - now)
            for rank in sorted({waitables[obj] for obj in ready}):
                self._receive(rank)
            if self.failures and not grace_started:
                grace_started = True
                stop_at = min(stop_at, time.monotonic() + self.grace_s)
        if not self._pending() and not self.failures:
            return [self.values[r] for r in range(len(self.procs))]
        unfinished = self._pending()
        timed_out = not self.failures
        self._stop(unfinished, timed_out)
        elapsed = time.monotonic() - start
        pids = [p.pid if p.pid is not None else -1 for p in self.procs]
        ws = len(self.procs)
        failures = list(self.failures.values())
        if timed_out:
            raise MultiRankTimeout(
                f"run_on_ranks: rank(s) {unfinished} of {ws} did not finish within "
                f"timeout_s={self.timeout_s:g} (stopped after {elapsed:.1f}s)",
                failures,
                ws,
                pids,
            )
        err = MultiRankError("", failures, ws, pids)
        first = err.first_failure
        assert first is not None
        others = [r for r in err.failed_ranks if r != first.rank]
        summary = f"run_on_ranks: rank {first.rank} of {ws} failed first ({first.kind})"
        if others:
            summary += f"; then rank(s) {others} failed"
        if unfinished:
            summary += f"; rank(s) {unfinished} were killed after grace_s={self.grace_s:g}"
        raise MultiRankError(f"{summary} (after {elapsed:.1f}s)", failures, ws, pids)

    def _stop(self, unfinished: list[int], timed_out: bool) -> None:
        """Dump the stacks of still-running ranks and record them (the kill comes later)."""
        if not unfinished:
            return
        for rank in unfinished:
            pid = self.procs[rank].pid
            if pid is not None and self.procs[rank].exitcode is None:
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(_STACK_DUMP_S)
        reason = (
            f"still running at timeout_s={self.timeout_s:g}; killed"
            if timed_out
            else f"still running {self.grace_s:g}s after another rank failed; killed"
        )
        for rank in unfinished:
            self.failures[rank] = RankFailure(
                rank, "not_finished", reason, stack=_read_stack(self.spec.stack_dir, rank)
            )


def _read_stack(stack_dir: str, rank: int) -> str:
    try:
        with open(_stack_path(stack_dir, rank)) as f:
            return f.read()
    except OSError:
        return ""


def _kill_and_reap(procs: list[BaseProcess]) -> None:
    """SIGKILL each worker's process group (the worker and anything it forked), then reap."""
    for proc in procs:
        if proc.pid is None:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group whose leader is our worker
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(_REAP_S)
        if proc.exitcode is None:  # killed before os.setpgrp() ran: not a group leader yet
            proc.kill()
            proc.join(_REAP_S)
