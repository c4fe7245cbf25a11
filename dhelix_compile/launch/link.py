"""Where local ranks run: an emulated slow (cross-node-like) link between two network namespaces, or loopback.

Contract
--------
``place(link, world_size, created) -> Placement``: a command prefix, rendezvous address and
``GLOO_SOCKET_IFNAME`` per rank, and a description of the link. ``dhelix_compile.launch.ranks``
starts the ranks there.

* **Rate-limited link** (``link.rate`` is a ``tc`` rate such as ``"200mbit"``; needs Linux, root,
  ``ip`` and ``tc``, see ``can_rate_limit``): two fresh network namespaces joined by one veth
  pair, each end with an IPv4 address from a private ``10.x.y.0/24`` and a ``tbf`` qdisc
  (``rate``/``burst``/``latency``), so each direction is limited separately. Rank ``r`` runs in
  namespace ``r`` (``ip netns exec``) with ``GLOO_SOCKET_IFNAME`` set to its veth end, so gloo's
  traffic really crosses the link. More than two ranks: a star, every rank's namespace joined
  by a veth pair to a bridge in a hub namespace, a ``tbf`` on both ends of each pair, so every
  rank has a link of its own, limited each way (the busiest rank's link sets the pace, as a
  node's NIC does). A rate (or burst, latency) that ``tc`` rejects gives
  ``ValueError`` naming it and quoting ``tc``.
* **Loopback** when ``link.rate is None`` or ``can_rate_limit()`` is false: ranks run in this
  namespace on ``127.0.0.1`` (``GLOO_SOCKET_IFNAME=lo`` on Linux); the description says so and why.
* Names are unique per launch (pid and a per-process counter): namespaces
  ``dhx<pid>-<k>-<rank>``, veth ends ``dx<pid36>-<k36>-<rank>`` (at most 15 characters), so
  concurrent launches never collide. ``created`` lists every namespace as it is made, so the
  caller's ``delete_namespaces(created)`` cleans up even after an interrupt. Traffic stays
  inside the namespaces made here.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["LinkSpec", "Placement", "can_rate_limit", "delete_namespaces", "place"]

# Longest network interface name Linux accepts (IFNAMSIZ - 1).
_MAX_IFNAME = 15
_SETUP_TIMEOUT_S = 30.0
_EXTRA_TOOL_DIRS = ("/usr/sbin", "/sbin", "/usr/local/sbin")

_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """The emulated link: a ``tc tbf`` rate, burst and latency; ``rate=None`` means loopback."""

    rate: str | None = "1gbit"
    burst: str = "256kb"
    latency: str = "50ms"


@dataclasses.dataclass(frozen=True)
class _Names:
    """Unique names and addresses of one launch's namespace pair."""

    namespaces: tuple[str, str]
    ifnames: tuple[str, str]
    addrs: tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the ranks run: a command prefix per rank, the rendezvous address, the interfaces."""

    prefixes: list[list[str]]
    master_addr: str
    ifnames: list[str | None]
    description: str
    rate_limited: bool


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
        _check([ip, "-n", ns, "link", "add", "dxprobe0", "type", "veth", "peer", "name", "dxprobe1"])
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
            f"tc rejected the link (rate={link.rate!r}, burst={link.burst!r}, latency={link.latency!r}): {msg}"
        )


def _create_pair(names: _Names, link: LinkSpec, created: list[str]) -> None:
    """Two namespaces joined by a veth pair with a tbf on each end; ``created`` lists them."""
    ip, tc = _which("ip"), _which("tc")
    assert ip is not None and tc is not None
    for ns in names.namespaces:
        created.append(ns)  # before creating: an interrupt right after must still clean it up
        _check([ip, "netns", "add", ns])
    (ns0, ns1), (if0, if1) = names.namespaces, names.ifnames
    _check([ip, "link", "add", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1])
    for ns, ifname, addr in zip(names.namespaces, names.ifnames, names.addrs, strict=True):
        _bring_up_rank_end(ip, tc, ns, ifname, addr, link)


def _bring_up_rank_end(ip: str, tc: str, ns: str, ifname: str, addr: str, link: LinkSpec) -> None:
    """A rank's veth end in its namespace: its address, up (and ``lo``), rate-limited."""
    # No IPv6 link-local address: gloo takes the first address of GLOO_SOCKET_IFNAME.
    _run([ip, "-n", ns, "link", "set", "dev", ifname, "addrgenmode", "none"])
    _check([ip, "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname])
    _check([ip, "-n", ns, "link", "set", "dev", ifname, "up"])
    _check([ip, "-n", ns, "link", "set", "dev", "lo", "up"])
    _apply_tbf(ip, tc, ns, ifname, link)


def delete_namespaces(created: list[str]) -> None:
    """Delete the namespaces ``place`` created (their veth ends go with them)."""
    ip = _which("ip")
    if ip is None:
        return
    for ns in created:
        _run([ip, "netns", "delete", ns])  # deleting a namespace removes its veth end


def _namespace_placement(names: _Names, link: LinkSpec, world_size: int) -> Placement:
    ip = _which("ip")
    assert ip is not None
    return Placement(
        prefixes=[[ip, "netns", "exec", names.namespaces[r]] for r in range(world_size)],
        master_addr=names.addrs[0],
        ifnames=list(names.ifnames[:world_size]),
        description=(
            f"veth {link.rate} tbf (namespaces {names.namespaces[0]}, {names.namespaces[1]}; "
            f"{names.addrs[0]} <-> {names.addrs[1]}; burst {link.burst}, latency {link.latency})"
        ),
        rate_limited=True,
    )


def _star_placement(link: LinkSpec, world_size: int, created: list[str]) -> Placement:
    """``world_size`` namespaces, each with a veth pair to a bridge in a hub namespace; a tbf on both ends."""
    ip, tc = _which("ip"), _which("tc")
    assert ip is not None and tc is not None
    pid, k = os.getpid(), next(_counter)
    tag = f"{_b36(pid)}-{_b36(k % 36**5)}"
    hub = f"dhx{pid}-{k}-hub"
    subnet = f"10.{64 + (k >> 8) % 64}.{k & 255}"
    created.append(hub)
    _check([ip, "netns", "add", hub])
    _check([ip, "-n", hub, "link", "add", "br0", "type", "bridge"])
    _check([ip, "-n", hub, "link", "set", "br0", "up"])
    namespaces, ifnames, addrs = [], [], []
    for r in range(world_size):
        ns, ifname, hub_end, addr = f"dhx{pid}-{k}-{r}", f"dx{tag}-{r}", f"dh{tag}-{r}", f"{subnet}.{r + 1}"
        assert len(ifname) <= _MAX_IFNAME and len(hub_end) <= _MAX_IFNAME, (ifname, hub_end)
        created.append(ns)
        _check([ip, "netns", "add", ns])
        _check([ip, "link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", hub_end, "netns", hub])
        _bring_up_rank_end(ip, tc, ns, ifname, addr, link)
        _check([ip, "-n", hub, "link", "set", "dev", hub_end, "master", "br0"])
        _check([ip, "-n", hub, "link", "set", "dev", hub_end, "up"])
        _apply_tbf(ip, tc, hub, hub_end, link)
        namespaces.append(ns)
        ifnames.append(ifname)
        addrs.append(addr)
    return Placement(
        prefixes=[[ip, "netns", "exec", ns] for ns in namespaces],
        master_addr=addrs[0],
        ifnames=list(ifnames),
        description=(
            f"{world_size} veth links of {link.rate} tbf each way, joined by a bridge (namespaces "
            f"{namespaces[0]}..{namespaces[-1]}, hub {hub}; {subnet}.0/24; burst {link.burst}, latency {link.latency})"
        ),
        rate_limited=True,
    )


def _loopback_placement(world_size: int, reason: str) -> Placement:
    ifname = "lo" if sys.platform.startswith("linux") else None
    return Placement(
        prefixes=[[] for _ in range(world_size)],
        master_addr="127.0.0.1",
        ifnames=[ifname] * world_size,
        description=f"loopback ({reason})",
        rate_limited=False,
    )


def place(link: LinkSpec, world_size: int, created: list[str]) -> Placement:
    """Where ``world_size`` ranks run over ``link`` (namespaces it makes are appended to ``created``)."""
    if link.rate is None:
        return _loopback_placement(world_size, "no rate requested")
    ok, reason = can_rate_limit()
    if not ok:
        return _loopback_placement(world_size, reason)
    if world_size > 2:
        return _star_placement(link, world_size, created)
    # two ranks: one veth pair (no bridge between them)
    names = _next_names()
    _create_pair(names, link, created)
    return _namespace_placement(names, link, world_size)
