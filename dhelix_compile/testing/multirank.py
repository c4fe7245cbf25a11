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
* Any failure raises ``MultiRankError`` naming every rank that did not return, why (exception
  with its remote traceback, crash with its exit code, did not finish), and for ranks that were
  still running their Python stacks (dumped with ``faulthandler`` just before they were killed).
  ``MultiRankTimeout`` (a subclass) is raised when some rank had not finished after
  ``timeout_s``. After a first failure the other ranks get ``grace_s`` to finish (they are
  usually blocked in a collective that the failed rank will never join) and are then killed.
* The call never hangs past ``timeout_s`` (plus a few seconds to dump stacks and reap), and it
  leaves no child process behind: every worker is its own process group leader, and the whole
  group is SIGKILLed and reaped on every exit path (success, failure, timeout, KeyboardInterrupt).

Rendezvous
----------
The rendezvous store is a ``TCPStore`` server that this (parent) process binds to port 0, so the
OS picks a free port and keeps it bound for the whole run; workers connect to it as clients and
call ``init_process_group("gloo", store=..., rank=..., world_size=...)``. This removes the
"find a free port, close it, hope nobody takes it before rank 0 binds it" race of
``init_method="tcp://127.0.0.1:<port>"`` altogether, so no EADDRINUSE retry is needed. gloo's own
pairwise connections bind ephemeral ports themselves.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import multiprocessing
import os
import pickle
import queue as queue_mod
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
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
_POLL_S = 0.05
# A worker that exited may still have its message in the queue's pipe; wait this long for it.
_EXIT_FLUSH_S = 2.0
# Time given to faulthandler to write the stacks of ranks about to be killed.
_STACK_DUMP_S = 1.0

FailureKind = Literal["exception", "crashed", "not_finished"]


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """Why one rank did not return a result."""

    rank: int
    kind: FailureKind
    """``exception``: ``fn`` (or setup) raised; ``crashed``: the process died without reporting;
    ``not_finished``: still running at the timeout, or after another rank failed."""
    detail: str
    """The remote traceback, the exit code, or why the rank was stopped."""
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
        self,
        summary: str,
        failures: list[RankFailure],
        world_size: int,
        pids: list[int],
    ) -> None:
        self.failures: tuple[RankFailure, ...] = tuple(sorted(failures, key=lambda f: f.rank))
        self.world_size = world_size
        self.pids: tuple[int, ...] = tuple(pids)
        body = "\n".join(f.format() for f in self.failures)
        super().__init__(f"{summary}\n{body}")

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that raised or crashed (the cause), not those stopped because of them."""
        return [f.rank for f in self.failures if f.kind != "not_finished"]

    @property
    def unfinished_ranks(self) -> list[int]:
        """Ranks that were still running when they were stopped."""
        return [f.rank for f in self.failures if f.kind == "not_finished"]


class MultiRankTimeout(MultiRankError):
    """Some rank had not finished after ``timeout_s``; ``unfinished_ranks`` names them."""


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
    results: Any,
) -> None:
    """Entry point of one rank (runs in the spawned child)."""
    os.setpgrp()  # own process group: the parent can kill this rank and anything it forks
    stack_file = open(_stack_path(spec.stack_dir, rank), "w")  # noqa: SIM115 (kept for life)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(spec.num_threads)
    try:
        timeout = datetime.timedelta(seconds=spec.pg_timeout_s)
        store = dist.TCPStore(HOST, spec.port, spec.world_size, False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=spec.world_size, timeout=timeout
        )
        payload = pickle.dumps(fn(rank, spec.world_size, *args, **kwargs))
    except BaseException:  # noqa: BLE001 (reported to the parent, which raises)
        results.put((rank, "exception", traceback.format_exc()))
        _destroy_quietly()
        return
    _destroy_quietly()
    results.put((rank, "ok", payload))


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
        MultiRankTimeout: some rank did not finish within ``timeout_s``.
        MultiRankError: some rank raised or crashed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore(
        HOST,
        0,
        world_size,
        True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    with tempfile.TemporaryDirectory(prefix="dhelix_multirank_") as stack_dir:
        spec = _WorkerSpec(
            world_size=world_size,
            port=store.port,
            pg_timeout_s=pg_timeout_s if pg_timeout_s is not None else timeout_s,
            num_threads=num_threads,
            stack_dir=stack_dir,
        )
        results_q = ctx.Queue()
        procs: list[multiprocessing.process.BaseProcess] = []
        try:
            for rank in range(world_size):
                proc = ctx.Process(
                    target=_worker_main,
                    args=(spec, rank, fn, args, kwargs, results_q),
                    name=f"dhelix-rank{rank}",
                    daemon=True,
                )
                proc.start()
                procs.append(proc)
            return _Supervisor(procs, results_q, spec, timeout_s, grace_s).run()
        finally:
            _kill_and_reap(procs)
            results_q.close()
            results_q.join_thread()
            del store


class _Supervisor:
    """Waits for the ranks' messages, detects crashes, timeouts and failures; builds the error."""

    def __init__(
        self,
        procs: list[multiprocessing.process.BaseProcess],
        results_q: Any,
        spec: _WorkerSpec,
        timeout_s: float,
        grace_s: float,
    ) -> None:
        self.procs = procs
        self.results_q = results_q
        self.spec = spec
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.values: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}
        self.exited_at: dict[int, float] = {}
        self.first_failure_at: float | None = None

    def _done(self) -> bool:
        return len(self.values) + len(self.failures) == len(self.procs)

    def _receive(self, timeout: float) -> None:
        try:
            rank, status, payload = self.results_q.get(timeout=timeout)
        except queue_mod.Empty:
            return
        if status == "ok":
            self.values[rank] = pickle.loads(payload)
        else:
            self.failures[rank] = RankFailure(rank, "exception", payload)

    def _check_crashed(self, now: float) -> None:
        for rank, proc in enumerate(self.procs):
            if rank in self.values or rank in self.failures or proc.exitcode is None:
                continue
            first_seen = self.exited_at.setdefault(rank, now)
            if now - first_seen > _EXIT_FLUSH_S:
                self.failures[rank] = RankFailure(
                    rank, "crashed", f"process exited with code {proc.exitcode} without a result"
                )

    def run(self) -> list[Any]:
        start = time.monotonic()
        deadline = start + self.timeout_s
        stop_at = deadline
        timed_out = False
        while not self._done():
            now = time.monotonic()
            if now >= stop_at:
                timed_out = not self.failures
                break
            self._receive(timeout=min(_POLL_S, stop_at - now))
            self._check_crashed(time.monotonic())
            if self.failures and self.first_failure_at is None:
                self.first_failure_at = time.monotonic()
                stop_at = min(deadline, self.first_failure_at + self.grace_s)
        if self._done() and not self.failures:
            return [self.values[r] for r in range(len(self.procs))]
        self._stop_unfinished(timed_out)
        elapsed = time.monotonic() - start
        pids = [p.pid or -1 for p in self.procs]
        ws = len(self.procs)
        if timed_out:
            raise MultiRankTimeout(
                f"run_on_ranks: ranks {self._unfinished()} of {ws} did not finish within "
                f"timeout_s={self.timeout_s:g} (stopped after {elapsed:.1f}s)",
                list(self.failures.values()),
                ws,
                pids,
            )
        causes = sorted(r for r, f in self.failures.items() if f.kind != "not_finished")
        raise MultiRankError(
            f"run_on_ranks: rank(s) {causes} of {ws} failed (after {elapsed:.1f}s)",
            list(self.failures.values()),
            ws,
            pids,
        )

    def _unfinished(self) -> list[int]:
        return [
            r for r in range(len(self.procs)) if r not in self.values and r not in self.failures
        ]

    def _stop_unfinished(self, timed_out: bool) -> None:
        unfinished = self._unfinished()
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
        # A rank may have finished in the meantime; take its message rather than misreport it.
        while True:
            try:
                rank, status, payload = self.results_q.get_nowait()
            except queue_mod.Empty:
                break
            if rank in unfinished and status != "ok":
                self.failures[rank] = RankFailure(rank, "exception", payload)
        reason = (
            f"still running at timeout_s={self.timeout_s:g}"
            if timed_out
            else f"still running {self.grace_s:g}s after another rank failed; killed"
        )
        for rank in self._unfinished():
            self.failures[rank] = RankFailure(
                rank, "not_finished", reason, stack=_read_stack(self.spec.stack_dir, rank)
            )


def _read_stack(stack_dir: str, rank: int) -> str:
    try:
        with open(_stack_path(stack_dir, rank)) as f:
            return f.read()
    except OSError:
        return ""


def _kill_and_reap(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """SIGKILL each worker's process group (the worker and anything it forked), then reap."""
    for proc in procs:
        if proc.pid is None:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(timeout=10.0)
        if proc.exitcode is None:  # not in its own group yet (killed before setpgrp ran)
            proc.kill()
            proc.join(timeout=10.0)
