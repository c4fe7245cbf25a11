"""The one launcher: run a command once per rank on this machine, supervised, and always cleaned up.

Contract
--------
``launch_ranks(argv, world_size=2, link=LinkSpec(), *, timeout_s=600, env=None, cwd=None)``
runs ``argv`` once per rank where ``dhelix_compile.launch.link.place`` puts it (two rate-limited
network namespaces, or loopback) and returns a ``LaunchResult`` (return codes, stdout, stderr per
rank, pids, and a human description of the link). It never raises because a rank failed: look
at ``returncodes`` (and ``unfinished``: the ranks killed while still running).
``dhelix_compile.testing.multirank.run_on_ranks`` runs a Python function on ranks through it.

* **Rendezvous** is torch's own: ``MASTER_ADDR``/``MASTER_PORT`` for ``init_process_group``'s
  ``env://``. On loopback this process hosts the ``TCPStore`` on a port the OS picks (port 0,
  kept bound for the whole run) and sets ``TORCHELASTIC_USE_AGENT_STORE=True``, so every rank
  connects as a client, as under ``torchrun``: no free-port race, nothing to retry. In fresh
  network namespaces no other process can hold a port, and rank 0 hosts the store.
* Every rank gets ``os.environ``, then the caller's ``env`` on top, then the launcher's own
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (= ``RANK``: all ranks share this machine),
  ``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME``, which win. The directory holding
  this ``dhelix_compile`` package is appended to ``PYTHONPATH`` so that children import the
  same packages as the parent.
* Cleanup always happens, on success, failure, timeout, ``KeyboardInterrupt`` and SIGTERM (a
  temporary SIGTERM handler, installed only from the main thread, raises ``KeyboardInterrupt``;
  the previous handler is restored afterwards): each rank is its own session and its whole
  process group is SIGKILLed and reaped, then the namespaces are deleted (which removes the veth).
* Once a rank exits non-zero, the others get ``failure_grace_s`` to finish; those still running
  then are listed in ``unfinished`` and killed (their return code is then ``-SIGKILL``): peers of
  a crashed rank would otherwise wait in gloo's rendezvous until the timeout.
* After ``timeout_s`` (counted from the first rank's start) unfinished ranks are killed, and
  ``TimeoutError`` names them, with the tail of their stderr (``raise_on_timeout=False``: the
  result says ``timed_out``).
* ``stack_signal``: sent to every rank about to be killed while still running, ``_STACK_DUMP_S``
  before the kill (``run_on_ranks`` registers ``faulthandler`` on it to record where a rank hung).
* ``forkserver``: on loopback, ranks that it can run (``launch.forkserver``: ``python -m``
  commands whose environment is the server's but for the variables read after a rank starts)
  are forked from it instead of started cold; the reason a rank starts cold is logged once. The
  rest of this contract holds for forked ranks as for any rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import IO, Any

from dhelix_compile.launch.forkserver import ForkedProcess, ForkServer
from dhelix_compile.launch.link import LinkSpec, Placement, delete_namespaces, place

__all__ = ["LaunchResult", "LinkSpec", "launch_ranks"]

# MASTER_PORT inside a fresh namespace: high, and below the ephemeral range gloo's sockets use.
_NS_PORT_RANGE = (20000, 32767)
_POLL_S = 0.02
_REAP_S = 10.0
_STACK_DUMP_S = 1.0
_STDERR_TAIL_CHARS = 2000
#: Why ranks were started cold although a fork server was given, each logged once per process.
_COLD_REASONS_LOGGED: set[str] = set()
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What the ranks ran on (``link``), what each returned and printed, and which were still running."""

    link: str
    rate_limited: bool
    returncodes: list[int]
    stdout: list[str]
    stderr: list[str]
    pids: list[int] = dataclasses.field(default_factory=list)
    unfinished: list[int] = dataclasses.field(default_factory=list)
    """Ranks killed while still running: at the timeout, or ``failure_grace_s`` after a failure."""
    timed_out: bool = False


@dataclasses.dataclass
class _Rank:
    proc: subprocess.Popen[bytes] | ForkedProcess
    out: IO[bytes]
    err: IO[bytes]


def _child_pythonpath(current: str | None) -> str:
    """``current`` with the directory that holds this ``dhelix_compile`` package appended."""
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in (current or "").split(os.pathsep) if p]
    if root not in parts:
        parts.append(root)
    return os.pathsep.join(parts)


def _rank_env(base: Mapping[str, str], rank: int, world_size: int, placement: Placement, port: int) -> dict[str, str]:
    env = dict(base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR=placement.master_addr,
        MASTER_PORT=str(port),
    )
    ifname = placement.ifnames[rank]
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


@contextmanager
def _rendezvous(placement: Placement, world_size: int, timeout_s: float) -> Iterator[tuple[int, dict[str, str]]]:
    """``(MASTER_PORT, extra env)``: on loopback a store this process hosts for the whole run."""
    if placement.rate_limited:
        yield random.randint(*_NS_PORT_RANGE), {}
        return
    import torch.distributed as dist

    store = dist.TCPStore(
        host_name=placement.master_addr,
        port=0,
        world_size=world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    try:
        yield store.port, {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def _start_rank(
    prefix: list[str],
    argv: Sequence[str],
    env: dict[str, str],
    cwd: str | None,
    files: ExitStack,
    forkserver: ForkServer | None,
) -> _Rank:
    # The ExitStack of the caller closes them once the ranks are reaped and their output read.
    why_cold = None
    if forkserver is not None:
        why_cold = "it runs in a network namespace" if prefix else forkserver.why_not(argv, env)
        if why_cold is not None and why_cold not in _COLD_REASONS_LOGGED:
            _COLD_REASONS_LOGGED.add(why_cold)
            log.info("rank started cold, not forked: %s", why_cold)
    if forkserver is not None and why_cold is None:
        named_out = files.enter_context(tempfile.NamedTemporaryFile())  # noqa: SIM115
        named_err = files.enter_context(tempfile.NamedTemporaryFile())  # noqa: SIM115
        child = forkserver.spawn(argv, env, cwd, named_out.name, named_err.name)
        return _Rank(child, named_out.file, named_err.file)
    out = files.enter_context(tempfile.TemporaryFile())  # noqa: SIM115
    err = files.enter_context(tempfile.TemporaryFile())  # noqa: SIM115
    proc = subprocess.Popen(
        [*prefix, *argv],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        env=env,
        cwd=cwd,
        start_new_session=True,  # its own process group, killed as a whole
    )
    return _Rank(proc, out, err)


def _kill_ranks(ranks: list[_Rank]) -> None:
    """SIGKILL every rank's process group (strays of finished ranks too), then reap."""
    for rank in ranks:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(rank.proc.pid, signal.SIGKILL)
    for rank in ranks:
        with suppress(subprocess.TimeoutExpired):
            rank.proc.wait(timeout=_REAP_S)


def _signal_running(ranks: list[_Rank], which: list[int], signum: int | None) -> None:
    """Send ``signum`` to the ranks in ``which`` still running, and give them time to act on it."""
    if signum is None or not which:
        return
    for r in which:
        if ranks[r].proc.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(ranks[r].proc.pid, signum)
    time.sleep(_STACK_DUMP_S)


def _read(stream: IO[bytes]) -> str:
    stream.flush()
    stream.seek(0)
    return stream.read().decode("utf-8", errors="replace")


def _wait_ranks(ranks: list[_Rank], deadline: float, grace_s: float) -> tuple[list[int], bool]:
    """Wait until all ranks exit (peers of a failed rank: at most ``grace_s``).

    Returns the ranks still running when the wait ended, and whether the deadline ended it.
    """
    failed_at: float | None = None
    while True:
        codes = [rank.proc.poll() for rank in ranks]
        pending = [r for r, code in enumerate(codes) if code is None]
        now = time.monotonic()
        if not pending:
            return [], False
        if now >= deadline:
            return pending, True
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = now
        if failed_at is not None and now - failed_at >= grace_s:
            return pending, False
        time.sleep(_POLL_S)


@contextmanager
def _sigterm_raises_interrupt() -> Iterator[None]:
    """Turn the first SIGTERM into ``KeyboardInterrupt`` (main thread only); restore after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:  # a second SIGTERM must not interrupt the cleanup
            fired = True
            raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def launch_ranks(
    argv: Sequence[str],
    world_size: int = 2,
    link: LinkSpec = LinkSpec(),
    *,
    timeout_s: float = 600,
    env: Mapping[str, Any] | None = None,
    cwd: str | None = None,
    failure_grace_s: float = 10.0,
    stack_signal: int | None = None,
    raise_on_timeout: bool = True,
    forkserver: ForkServer | None = None,
) -> LaunchResult:
    """Run ``argv`` on ``world_size`` ranks over ``link`` (or loopback); see the module doc.

    At the timeout: ``TimeoutError`` naming the unfinished ranks, with their stderr, or with
    ``raise_on_timeout=False`` the result, its ``timed_out`` set.
    """
    if not argv:
        raise ValueError("argv is empty")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    base = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
    base["PYTHONPATH"] = _child_pythonpath(base.get("PYTHONPATH"))
    created: list[str] = []
    ranks: list[_Rank] = []
    with _sigterm_raises_interrupt(), ExitStack() as files:
        try:
            placement = place(link, world_size, created)
            deadline = time.monotonic() + timeout_s
            with _rendezvous(placement, world_size, timeout_s) as (port, extra):
                try:
                    for r, prefix in enumerate(placement.prefixes):
                        rank_env = _rank_env({**base, **extra}, r, world_size, placement, port)
                        ranks.append(_start_rank(prefix, argv, rank_env, cwd, files, forkserver))
                    unfinished, timed_out = _wait_ranks(ranks, deadline, failure_grace_s)
                    _signal_running(ranks, unfinished, stack_signal)
                finally:
                    _kill_ranks(ranks)
        finally:
            delete_namespaces(created)
        stdout = [_read(rank.out) for rank in ranks]
        stderr = [_read(rank.err) for rank in ranks]
    codes = [rank.proc.returncode if rank.proc.returncode is not None else -9 for rank in ranks]
    if timed_out and raise_on_timeout:
        tails = "\n".join(f"--- rank {r} stderr (tail) ---\n{stderr[r][-_STDERR_TAIL_CHARS:]}" for r in unfinished)
        raise TimeoutError(
            f"ranks {unfinished} did not finish within {timeout_s:g} s on {placement.description}; killed.\n{tails}"
        )
    return LaunchResult(
        placement.description,
        placement.rate_limited,
        codes,
        stdout,
        stderr,
        pids=[rank.proc.pid for rank in ranks],
        unfinished=unfinished,
        timed_out=timed_out,
    )
