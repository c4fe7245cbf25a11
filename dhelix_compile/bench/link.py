"""Launch local rank processes joined by an emulated slow (cross-node-like) link.

Contract
--------
``launch_ranks(argv, world_size=2, link=LinkSpec(), *, timeout_s=600, env=None, cwd=None)``
runs ``argv`` once per rank and returns a ``LaunchResult`` (return codes, stdout, stderr per rank,
and a human description of the link that was used). It never raises because a rank failed: look
at ``returncodes``.

* **Rate-limited link** (``link.rate`` is a ``tc`` rate such as ``"200mbit"``; needs Linux, root,
  ``ip`` and ``tc``, see ``can_rate_limit``): two fresh network namespaces joined by one veth
  pair, each end with an IPv4 address from a private ``10.x.y.0/24`` and a ``tbf`` qdisc
  (``rate``/``burst``/``latency``), so each direction is limited separately. Rank ``r`` runs in
  namespace ``r`` (``ip netns exec``) with ``GLOO_SOCKET_IFNAME`` set to its veth end, so gloo's
  traffic really crosses the link. One veth pair joins exactly two namespaces: ``world_size``
  must be 1 or 2 (``ValueError`` otherwise). A rate (or burst, latency) that ``tc`` rejects gives
  ``ValueError`` naming it and quoting ``tc``.
* **Loopback** when ``link.rate is None`` or ``can_rate_limit()`` is false: ranks run in this
  namespace, ``MASTER_ADDR=127.0.0.1`` on a free port (bound to port 0, then released), and
  ``GLOO_SOCKET_IFNAME=lo`` on Linux. ``LaunchResult.link`` says so and why. If the ranks fail
  fast with "address already in use", the launch is retried once on a fresh port.
* Every rank gets ``os.environ``, then the caller's ``env`` on top, then the launcher's own
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (= ``RANK``: all ranks share this machine),
  ``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME``, which win. The directory holding
  this ``dhelix_compile`` package is appended to ``PYTHONPATH`` so that children import the
  same packages as the parent.
* Names are unique per launch (pid and a per-process counter): namespaces
  ``dhx<pid>-<k>-<rank>``, veth ends ``dx<pid36>-<k36>-<rank>`` (at most 15 characters), so
  concurrent launches never collide. Traffic stays inside the namespaces made here.
* Cleanup always happens, on success, failure, timeout, ``KeyboardInterrupt`` and SIGTERM (a
  temporary SIGTERM handler, installed only from the main thread, raises ``KeyboardInterrupt``;
  the previous handler is restored afterwards): each rank is its own session and its whole
  process group is SIGKILLed and reaped, then the namespaces are deleted (which removes the veth).
* Once a rank exits non-zero, the others get ``failure_grace_s`` to finish and are then killed
  (their return code is then ``-SIGKILL``): peers of a crashed rank would otherwise wait in
  gloo's rendezvous until the timeout.
* After ``timeout_s`` (counted from the first rank's start, retries included) unfinished ranks
  are killed and ``TimeoutError`` names them, with the tail of their stderr.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import IO

__all__ = ["LaunchResult", "LinkSpec", "can_rate_limit", "launch_ranks"]

# Longest network interface name Linux accepts (IFNAMSIZ - 1).
_MAX_IFNAME = 15
# MASTER_PORT inside a fresh namespace: high, and below the ephemeral range gloo's sockets use.
_NS_PORT_RANGE = (20000, 32767)
_SETUP_TIMEOUT_S = 30.0
_POLL_S = 0.02
_REAP_S = 10.0
# An "address already in use" failure is only retried when it happened this soon after start.
_FAST_FAIL_S = 60.0
_ADDR_IN_USE = ("EADDRINUSE", "address already in use")
_STDERR_TAIL_CHARS = 2000
_EXTRA_TOOL_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")

_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """The emulated link: a ``tc tbf`` rate, burst and latency; ``rate=None`` means loopback."""

    rate: str | None = "1gbit"
    burst: str = "256kb"
    latency: str = "50ms"


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What ``launch_ranks`` ran on (``link``) and what each rank returned and printed."""

    link: str
    rate_limited: bool
    returncodes: list[int]
    stdout: list[str]
    stderr: list[str]


@dataclasses.dataclass(frozen=True)
class _Names:
    """Unique names and addresses of one launch's namespace pair."""

    namespaces: tuple[str, str]
    ifnames: tuple[str, str]
    addrs: tuple[str, str]


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where the ranks run: a command prefix per rank, the rendezvous address, the interfaces."""

    prefixes: list[list[str]]
    master_addr: str
    ifnames: list[str | None]
    description: str
    rate_limited: bool


@dataclasses.dataclass
class _Rank:
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]


# ---- tools ------------------------------------------------------------------------------------


def _which(name: str) -> str | None:
    """``name`` on PATH or in the usual sbin directories (often missing from a non-login PATH)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *_EXTRA_TOOL_DIRS])
    return shutil.which(name, path=path)


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(cmd),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=_SETUP_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`{' '.join(cmd)}` did not finish in {_SETUP_TIMEOUT_S:g} s") from exc


def _check(cmd: Sequence[str]) -> None:
    done = _run(cmd)
    if done.returncode != 0:
        msg = (done.stderr or done.stdout).strip()
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {msg}")


# ---- probing ----------------------------------------------------------------------------------


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = digits[d] + out
        if n == 0:
            return out


def _next_names() -> _Names:
    """Namespace and veth names and a /24 unique to this process (pid) and launch (counter)."""
    pid, k = os.getpid(), next(_counter)
    namespaces = (f"dhx{pid}-{k}-0", f"dhx{pid}-{k}-1")
    short_k = _b36(k % 36**5)
    ifnames = (f"dx{_b36(pid)}-{short_k}-0", f"dx{_b36(pid)}-{short_k}-1")
    assert all(len(name) <= _MAX_IFNAME for name in ifnames), ifnames
    subnet = f"10.{64 + (k >> 8) % 64}.{k & 255}"
    return _Names(namespaces, ifnames, (f"{subnet}.1", f"{subnet}.2"))


def _probe_namespace(ip: str, tc: str) -> str:
    """Create a namespace with a veth pair and a tbf qdisc, then delete it; '' or the failure."""
    ns = f"dhx{os.getpid()}-{next(_counter)}-probe"
    try:
        _check([ip, "netns", "add", ns])
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _check(
            [ip, "-n", ns, "link", "add", "dxprobe0", "type", "veth", "peer", "name", "dxprobe1"]
        )
        _check([ip, "netns", "exec", ns, tc, "qdisc", "replace", "dev", "dxprobe0", "root",
                "tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"])  # fmt: skip
    except RuntimeError as exc:
        return f"cannot set up a veth pair with a tbf qdisc: {exc}"
    finally:
        _run([ip, "netns", "delete", ns])
    return ""


def can_rate_limit() -> tuple[bool, str]:
    """``(True, "")`` if rate-limited namespaces can be made here, else ``(False, reason)``."""
    if not sys.platform.startswith("linux"):
        return False, f"not Linux ({sys.platform})"
    if os.geteuid() != 0:
        return False, "not root"
    ip, tc = _which("ip"), _which("tc")
    if ip is None:
        return False, "`ip` (iproute2) not found"
    if tc is None:
        return False, "`tc` (iproute2) not found"
    reason = _probe_namespace(ip, tc)
    return reason == "", reason


# ---- namespaces -------------------------------------------------------------------------------


def _apply_tbf(ip: str, tc: str, ns: str, ifname: str, link: LinkSpec) -> None:
    assert link.rate is not None
    cmd = [ip, "netns", "exec", ns, tc, "qdisc", "replace", "dev", ifname, "root", "tbf",
           "rate", link.rate, "burst", link.burst, "latency", link.latency]  # fmt: skip
    done = _run(cmd)
    if done.returncode != 0:
        msg = (done.stderr or done.stdout).strip()
        raise ValueError(
            f"tc rejected the link (rate={link.rate!r}, burst={link.burst!r}, "
            f"latency={link.latency!r}): {msg}"
        )


def _create_pair(names: _Names, link: LinkSpec, created: list[str]) -> None:
    """Two namespaces joined by a veth pair with a tbf on each end; ``created`` lists them."""
    ip, tc = _which("ip"), _which("tc")
    assert ip is not None and tc is not None
    for ns in names.namespaces:
        created.append(ns)  # before creating: an interrupt right after must still clean it up
        _check([ip, "netns", "add", ns])
    (ns0, ns1), (if0, if1) = names.namespaces, names.ifnames
    _check(
        [ip, "link", "add", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1]
    )
    for ns, ifname, addr in zip(names.namespaces, names.ifnames, names.addrs, strict=True):
        # No IPv6 link-local address: gloo takes the first address of GLOO_SOCKET_IFNAME.
        _run([ip, "-n", ns, "link", "set", "dev", ifname, "addrgenmode", "none"])
        _check([ip, "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname])
        _check([ip, "-n", ns, "link", "set", "dev", ifname, "up"])
        _check([ip, "-n", ns, "link", "set", "dev", "lo", "up"])
        _apply_tbf(ip, tc, ns, ifname, link)


def _delete_namespaces(created: list[str]) -> None:
    ip = _which("ip")
    if ip is None:
        return
    for ns in created:
        _run([ip, "netns", "delete", ns])  # deleting a namespace removes its veth end


def _namespace_placement(names: _Names, link: LinkSpec, world_size: int) -> _Placement:
    ip = _which("ip")
    assert ip is not None
    return _Placement(
        prefixes=[[ip, "netns", "exec", names.namespaces[r]] for r in range(world_size)],
        master_addr=names.addrs[0],
        ifnames=list(names.ifnames[:world_size]),
        description=(
            f"veth {link.rate} tbf (namespaces {names.namespaces[0]}, {names.namespaces[1]}; "
            f"{names.addrs[0]} <-> {names.addrs[1]}; burst {link.burst}, latency {link.latency})"
        ),
        rate_limited=True,
    )


def _loopback_placement(world_size: int, reason: str) -> _Placement:
    ifname = "lo" if sys.platform.startswith("linux") else None
    return _Placement(
        prefixes=[[] for _ in range(world_size)],
        master_addr="127.0.0.1",
        ifnames=[ifname] * world_size,
        description=f"loopback ({reason})",
        rate_limited=False,
    )


# ---- ranks ------------------------------------------------------------------------------------


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child_pythonpath(current: str | None) -> str:
    """``current`` with the directory that holds this ``dhelix_compile`` package appended."""
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in (current or "").split(os.pathsep) if p]
    if root not in parts:
        parts.append(root)
    return os.pathsep.join(parts)


def _rank_env(
    base: Mapping[str, str], rank: int, world_size: int, placement: _Placement, port: int
) -> dict[str, str]:
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


def _start_rank(
    prefix: list[str], argv: Sequence[str], env: dict[str, str], cwd: str | None, files: ExitStack
) -> _Rank:
    # The ExitStack of the caller closes them once the ranks are reaped and their output read.
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


def _read(stream: IO[bytes]) -> str:
    stream.flush()
    stream.seek(0)
    return stream.read().decode("utf-8", errors="replace")


def _wait_ranks(ranks: list[_Rank], deadline: float, grace_s: float) -> list[int]:
    """Wait until all ranks exit (peers of a failed rank: at most ``grace_s``); unfinished ones."""
    failed_at: float | None = None
    while True:
        codes = [rank.proc.poll() for rank in ranks]
        pending = [r for r, code in enumerate(codes) if code is None]
        now = time.monotonic()
        if not pending:
            return []
        if now >= deadline:
            return pending
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = now
        if failed_at is not None and now - failed_at >= grace_s:
            _kill_ranks(ranks)
            continue
        time.sleep(_POLL_S)


def _timeout_error(
    pending: list[int], stderr: list[str], timeout_s: float, link: str
) -> TimeoutError:
    tails = "\n".join(
        f"--- rank {r} stderr (tail) ---\n{stderr[r][-_STDERR_TAIL_CHARS:]}" for r in pending
    )
    return TimeoutError(
        f"ranks {pending} did not finish within {timeout_s:g} s on {link}; killed.\n{tails}"
    )


def _run_ranks_once(
    argv: Sequence[str],
    envs: list[dict[str, str]],
    placement: _Placement,
    cwd: str | None,
    deadline: float,
    grace_s: float,
) -> tuple[list[int], list[str], list[str], list[int]]:
    """Start, wait, kill, reap; returns (returncodes, stdout, stderr, unfinished ranks)."""
    ranks: list[_Rank] = []
    with ExitStack() as files:
        try:
            for prefix, env in zip(placement.prefixes, envs, strict=True):
                ranks.append(_start_rank(prefix, argv, env, cwd, files))
            pending = _wait_ranks(ranks, deadline, grace_s)
        finally:
            _kill_ranks(ranks)
        stdout = [_read(rank.out) for rank in ranks]
        stderr = [_read(rank.err) for rank in ranks]
    codes = [rank.proc.returncode if rank.proc.returncode is not None else -9 for rank in ranks]
    return codes, stdout, stderr, pending


def _address_in_use(codes: list[int], stderr: list[str]) -> bool:
    return any(code != 0 for code in codes) and any(
        marker in text.lower() for text in stderr for marker in (m.lower() for m in _ADDR_IN_USE)
    )


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


# ---- entry point ------------------------------------------------------------------------------


def _validate(argv: Sequence[str], world_size: int, link: LinkSpec) -> None:
    if not argv:
        raise ValueError("argv is empty")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if link.rate is not None and world_size > 2:
        raise ValueError(
            f"a rate-limited link is one veth pair joining exactly two namespaces: world_size "
            f"{world_size} > 2 is not supported (use LinkSpec(rate=None) for loopback)"
        )


def launch_ranks(
    argv: Sequence[str],
    world_size: int = 2,
    link: LinkSpec = LinkSpec(),
    *,
    timeout_s: float = 600,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    failure_grace_s: float = 10.0,
) -> LaunchResult:
    """Run ``argv`` on ``world_size`` ranks over ``link`` (or loopback); see the module doc."""
    _validate(argv, world_size, link)
    base = {**os.environ, **(env or {})}
    base["PYTHONPATH"] = _child_pythonpath(base.get("PYTHONPATH"))
    created: list[str] = []
    with _sigterm_raises_interrupt():
        try:
            placement = _place(link, world_size, created)
            return _launch(argv, world_size, placement, base, cwd, timeout_s, failure_grace_s)
        finally:
            _delete_namespaces(created)


def _place(link: LinkSpec, world_size: int, created: list[str]) -> _Placement:
    if link.rate is None:
        return _loopback_placement(world_size, "no rate requested")
    ok, reason = can_rate_limit()
    if not ok:
        return _loopback_placement(world_size, reason)
    names = _next_names()
    _create_pair(names, link, created)
    return _namespace_placement(names, link, world_size)


def _launch(
    argv: Sequence[str],
    world_size: int,
    placement: _Placement,
    base: Mapping[str, str],
    cwd: str | None,
    timeout_s: float,
    grace_s: float,
) -> LaunchResult:
    start = time.monotonic()
    deadline = start + timeout_s
    attempts = 1 if placement.rate_limited else 2
    for attempt in range(attempts):
        port = random.randint(*_NS_PORT_RANGE) if placement.rate_limited else _free_loopback_port()
        envs = [_rank_env(base, r, world_size, placement, port) for r in range(world_size)]
        codes, stdout, stderr, pending = _run_ranks_once(
            argv, envs, placement, cwd, deadline, grace_s
        )
        if pending:
            raise _timeout_error(pending, stderr, timeout_s, placement.description)
        fast = time.monotonic() - start < _FAST_FAIL_S
        if attempt + 1 < attempts and fast and _address_in_use(codes, stderr):
            continue
        break
    return LaunchResult(placement.description, placement.rate_limited, codes, stdout, stderr)
