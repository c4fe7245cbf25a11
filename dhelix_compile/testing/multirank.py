"""Run a function on N local ranks over gloo and collect every rank's result or failure.

Contract
--------
``run_on_ranks(fn, world_size, *args, timeout_s=120.0, **kwargs) -> list[result]``

* ``fn`` must be picklable by reference (a module-level function). It is called in a fresh
  Python process (``dhelix_compile.testing.rank_main``, started by the project's one launcher,
  ``dhelix_compile.launch.ranks.launch_ranks``, with this process's ``sys.path``; forked from
  this process's fork server, ``launch.forkserver``, which has imported torch, its compilers
  and this package once; ``DHELIX_FORKSERVER=0`` starts it cold instead) as
  ``fn(rank, world_size, *args, **kwargs)`` after the default process group has been
  initialised with the gloo backend on 127.0.0.1; the group is destroyed after ``fn`` returns.
  ``args``/``kwargs`` and the return value must be picklable; the return value crosses the
  process boundary by value (``pickle``, through a file, no shared memory).
* Each worker calls ``torch.set_num_threads(1)`` (``num_threads=`` overrides it) so that N ranks
  on a small machine do not oversubscribe its cores.
* The result list is ordered by rank.
* Any failure raises ``MultiRankError`` naming every rank that did not return and why: an
  exception (with the remote traceback), a crash (with the exit code), or "did not finish"
  (with the Python stacks of all its threads, dumped by ``faulthandler`` just before the kill).
  A rank that raised and then did not exit is reported with its exception, ``left_running``
  and its stacks.
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
* A rank that fails inside ``init_process_group`` because gloo could not connect the ranks'
  sockets ("connectFullMesh failed"), before ``fn`` ran, has the whole job launched once more,
  with a warning on the ``dhelix.multirank`` logger; a second such failure raises.

Rendezvous
----------
The launcher's: this (parent) process hosts the ``TCPStore`` on a port the OS picks (port 0) and
the ranks join it as clients through ``env://`` with ``TORCHELASTIC_USE_AGENT_STORE=True`` (as
under ``torchrun``), so there is no "find a free port, hope nobody takes it" race. Each rank
writes its result (or its traceback) to a file and exits; the launcher's supervision (grace
after a failure, the timeout, killing and reaping every process group) does the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from dhelix_compile.config import ranks_from_fork_server
from dhelix_compile.launch import forkserver
from dhelix_compile.launch.ranks import LaunchResult, LinkSpec, launch_ranks

_LOOPBACK = LinkSpec(rate=None)
log = logging.getLogger("dhelix.multirank")

__all__ = [
    "MultiRankError",
    "MultiRankTimeout",
    "RankFailure",
    "run_on_ranks",
]

T = TypeVar("T")

FailureKind = Literal["exception", "crashed", "not_finished"]
_STDERR_TAIL_CHARS = 4000
#: A rank's collectives time out this much later than the harness, which then always stops a hang first.
_PG_TIMEOUT_MARGIN_S = 60.0


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
    left_running: bool = False
    """The process was still running when the harness killed it: always for ``not_finished``;
    for ``exception``, it reported and then did not exit (a thread or its teardown held it)."""

    def format(self) -> str:
        text = f"--- rank {self.rank}: {self.kind}: {self.detail.rstrip()}"
        if self.left_running and self.kind == "exception":
            text += f"\n    rank {self.rank} reported this but did not exit; killed"
        if self.stack:
            text += f"\n    stacks of rank {self.rank} when it was stopped:\n{self.stack.rstrip()}"
        return text


class MultiRankError(RuntimeError):
    """One or more ranks failed; ``failures`` says which and why (ordered by rank)."""

    def __init__(self, summary: str, failures: list[RankFailure], world_size: int, pids: list[int]) -> None:
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


def run_on_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    grace_s: float = 5.0,
    pg_timeout_s: float | None = None,
    num_threads: int = 1,
    link: LinkSpec = _LOOPBACK,
    forked: bool = True,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; see module doc.

    Args:
        fn: module-level function; its return value must be picklable.
        world_size: number of ranks (processes), >= 1.
        timeout_s: wall-clock limit for the whole run, from the first spawn.
        grace_s: after a rank fails, how long the others may still take before they are killed.
        pg_timeout_s: the process group's collective timeout; defaults to ``timeout_s`` plus a
            minute, so a blocked collective is stopped by this harness (with stacks), not by gloo.
        num_threads: ``torch.set_num_threads`` in each worker.
        link: where the ranks run (``launch.link``): loopback by default; a rate gives every rank
            a rate-limited link of its own (namespaces; loopback where they cannot be made).
        forked: loopback ranks forked from the fork server (module docstring); False starts
            them cold, as a user's processes start (the benchmarks' measurements do).
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
    if pg_timeout_s is None:  # outlive the harness's own timeout: the harness stops a hang, with stacks
        pg_timeout_s = timeout_s + _PG_TIMEOUT_MARGIN_S
    job = pickle.dumps((fn, args, kwargs, pg_timeout_s, num_threads))
    try:
        return _run_job(job, world_size, timeout_s, grace_s, link, forked)
    except MultiRankError as err:
        if not _gloo_mesh_not_connected(err):
            raise
        log.warning("run_on_ranks: gloo could not connect the ranks' mesh; launching them once more:\n%s", err)
        return _run_job(job, world_size, timeout_s, grace_s, link, forked)


def _gloo_mesh_not_connected(err: MultiRankError) -> bool:
    """Whether a rank failed inside ``init_process_group`` when gloo connected the ranks' sockets
    (``connectFullMesh``), before ``fn`` ran: on a loaded machine a rank's peer closed that
    connection once (docs/testing.md), and nothing of ``fn`` ran, so the job is launched again."""
    return any(
        f.kind == "exception" and "dist.init_process_group(" in f.detail and "connectFullMesh failed" in f.detail
        for f in err.failures
    )


def _run_job(job: bytes, world_size: int, timeout_s: float, grace_s: float, link: LinkSpec, forked: bool) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="dhelix_multirank_") as workdir:
        (Path(workdir) / "job.pkl").write_bytes(job)
        launched = launch_ranks(
            [sys.executable, "-m", "dhelix_compile.testing.rank_main", workdir],
            world_size,
            link,
            timeout_s=timeout_s,
            env={"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            failure_grace_s=grace_s,
            stack_signal=signal.SIGUSR1,
            raise_on_timeout=False,
            forkserver=_forkserver() if forked else None,
        )
        return _Outcome(launched, Path(workdir), timeout_s, grace_s).results()


#: What the fork server imports once: torch and its compilers, the package, and the test tools
#: the modules of ``fn`` import (each a few hundred ms to seconds per rank otherwise).
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.distributed.tensor",
    "dhelix_compile",
    "dhelix_compile.ops",
    "dhelix_compile.testing.rank_main",
    "dhelix_compile.testing.checks",
    "pytest",
    "hypothesis",
)


def _forkserver() -> forkserver.ForkServer | None:
    """The process's fork server for ranks (``DHELIX_FORKSERVER=0``: every rank starts cold)."""
    return forkserver.shared(_PRELOAD) if ranks_from_fork_server() else None


class _Outcome:
    """Each rank's result file, exit code and stacks -> the results, or the error naming every failure."""

    def __init__(self, launched: LaunchResult, workdir: Path, timeout_s: float, grace_s: float) -> None:
        self.launched, self.workdir = launched, workdir
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.values: dict[int, Any] = {}
        self.failures: dict[int, RankFailure] = {}
        for rank in range(len(launched.returncodes)):
            self._collect(rank)

    def _collect(self, rank: int) -> None:
        path = self.workdir / f"rank{rank}.result"
        left_running = rank in self.launched.unfinished
        if path.exists():
            status, payload, at = pickle.loads(path.read_bytes())
            if status != "ok":
                stack = self._stacks(rank) if left_running else ""
                self.failures[rank] = RankFailure(rank, "exception", payload, at, stack, left_running)
                return
            try:
                self.values[rank] = pickle.loads(payload)
            except Exception:  # noqa: BLE001 (e.g. a class the parent cannot import)
                detail = "its result could not be unpickled here:\n" + traceback.format_exc()
                self.failures[rank] = RankFailure(rank, "exception", detail, at)
            return
        if left_running:
            reason = (
                f"still running at timeout_s={self.timeout_s:g}; killed"
                if self.launched.timed_out
                else f"still running {self.grace_s:g}s after another rank failed; killed"
            )
            self.failures[rank] = RankFailure(rank, "not_finished", reason, stack=self._stacks(rank), left_running=True)
            return
        stderr = self.launched.stderr[rank][-_STDERR_TAIL_CHARS:].rstrip()
        detail = f"process exited with code {self.launched.returncodes[rank]} without a result"
        self.failures[rank] = RankFailure(rank, "crashed", detail + (f"; its stderr:\n{stderr}" if stderr else ""))

    def _stacks(self, rank: int) -> str:
        try:
            return (self.workdir / f"rank{rank}.stacks").read_text()
        except OSError:
            return ""

    def results(self) -> list[Any]:
        world_size = len(self.launched.returncodes)
        if not self.failures:
            return [self.values[r] for r in range(world_size)]
        failures = list(self.failures.values())
        pids = self.launched.pids
        unfinished = sorted(r for r, f in self.failures.items() if f.kind == "not_finished")
        if self.launched.timed_out and len(unfinished) == len(failures):
            raise MultiRankTimeout(
                f"run_on_ranks: rank(s) {unfinished} of {world_size} did not finish within "
                f"timeout_s={self.timeout_s:g}",
                failures,
                world_size,
                pids,
            )
        err = MultiRankError("", failures, world_size, pids)
        first = err.first_failure
        assert first is not None
        others = [r for r in err.failed_ranks if r != first.rank]
        summary = f"run_on_ranks: rank {first.rank} of {world_size} failed first ({first.kind})"
        if others:
            summary += f"; then rank(s) {others} failed"
        if unfinished:
            summary += f"; rank(s) {unfinished} were killed after grace_s={self.grace_s:g}"
        raise MultiRankError(summary, failures, world_size, pids)
