"""How long a transfer waits for a peer that does not answer: the timeouts of dhelix's process groups.

A rank that dies on a machine that stays up ends its peers' next transfer at once: the kernel
closes the dead process's sockets and gloo raises "Connection closed by peer" (or "Connection
reset by peer"); ``tests/test_dead_rank.py`` measures it. Where the death is not seen (the
peer's machine lost, a network partition, a peer stopped or hung), a transfer waits until its
process group's timeout. torch 2.13 gives the default group ``init_process_group``'s ``timeout``,
but creates every other group (a ``DeviceMesh``'s subgroups, ``new_group``'s) with torch's own
default, 30 minutes on gloo, whatever that ``timeout`` was: on 4 gloo ranks initialised with a
3 s timeout, an all-reduce on a 2x2 mesh's TP group whose peer was stopped still waited after 57 s.

Contract
--------
``bound_group_timeouts(groups, timeout_s)``: every live process group in ``groups`` whose backend
has a timeout (gloo, NCCL) gets ``timeout_s`` seconds; with ``timeout_s=None`` (the
``group_timeout_s`` option's default) the default group's timeout, where the group's own is
longer. torch keeps one timeout per group, so every later transfer on the group has it,
dhelix's or not. A group whose backend has none (the fake backend) is left alone.

``bound_graph_timeouts(gm, timeout_s)``: the same for the live groups ``gm``'s collectives and
exchanges run on (a name that resolves to no live group is skipped; nothing without a process
group that talks to other processes). The backend calls it for each graph with communication it
compiles, before it measures anything on its groups (``capture``).

``p2p_timeout_s(groups)``: how long to wait for a send or receive on ``groups``, once bounded:
the shortest of their timeouts where all are gloo groups, else ``None`` (each transfer's own). A
gloo send or receive keeps the timeout its group was made with: a timeout set later reaches its
collectives only (torch 2.13: a receive from a stopped peer on a group made with 30 minutes and
set to 3 s still waited after 25 s; ``Work.wait(timeout)`` ended it at 3 s).
``helix_pipeline`` bounds its stages' groups and waits that long for its stages' inputs and
output gradients and for the sends torch's runtime waits for at the end of a step; ``reshard``
makes its groups with the default group's timeout (``_torch_compat.new_member_group``), so their
sends and receives have it too; ``data_parallel`` bounds its mesh's groups when it wraps a model
(its option ``group_timeout_s``), so its collectives run eagerly have it too.

``peer_wait_s(wait_s, groups)``: how long a rank waits at the c10d store for a peer at compile
time (the rank-consistency check, the CPU device agreement, ``reshard``'s first call): ``wait_s``
(``consistency_timeout_s``; reshard's ``AGREE_TIMEOUT_S``), or the shortest timeout of ``groups``
(``None``: the default group's) where shorter. The store sees no death: a rank killed while the
others compile leaves them waiting there, not in a transfer. A peer that publishes later than its
groups' timeout is that far behind, and the first transfer after the wait, issued while the peer
still compiles, waits for it under the same timeout. ``graph_wait_s(gm, wait_s)``: the same for
the live groups of ``gm``'s transfers (``wait_s`` where it has none).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
import torch.fx

from dhelix_compile import _torch_compat as compat
from dhelix_compile.consistency import collective_groups

__all__ = ["bound_graph_timeouts", "bound_group_timeouts", "graph_wait_s", "p2p_timeout_s", "peer_wait_s"]

log = logging.getLogger("dhelix")


def bound_group_timeouts(groups: Iterable[Any], timeout_s: float | None) -> None:
    """Give each of ``groups`` the timeout ``timeout_s`` (``None``: at most the default group's); see the module doc."""
    default_s = compat.default_group_timeout_s() if timeout_s is None else None
    for group in groups:
        current_s = compat.group_timeout_s(group)
        if current_s is None:
            continue
        ceiling_s = current_s if default_s is None else default_s
        wanted_s = timeout_s if timeout_s is not None else min(current_s, ceiling_s)  # None: never longer
        if wanted_s == current_s:
            continue
        compat.set_group_timeout(group, wanted_s)
        log.info(
            "process group %s: transfers time out after %g s instead of %g s (%s)",
            getattr(group, "group_name", group),
            wanted_s,
            current_s,
            "group_timeout_s" if timeout_s is not None else "the default group's timeout",
        )


def bound_graph_timeouts(gm: torch.fx.GraphModule, timeout_s: float | None) -> None:
    """:func:`bound_group_timeouts` for the live groups of ``gm``'s transfers; see the module doc."""
    bound_group_timeouts(_live_groups(gm), timeout_s)


def _live_groups(gm: torch.fx.GraphModule) -> list[Any]:
    """The live process groups ``gm``'s collectives and exchanges run on (none without a real process group)."""
    if not compat.real_process_group_initialized():
        return []
    groups = []
    for name in collective_groups(gm):
        try:
            groups.append(compat.resolve_group(name))
        except (RuntimeError, ValueError, KeyError):  # not a live group of this process
            continue
    return groups


def p2p_timeout_s(groups: Iterable[Any]) -> float | None:
    """How long to wait for a send or receive on ``groups`` (gloo: the shortest of their timeouts); see the module doc."""
    timeouts = []
    for group in groups:
        timeout_s = compat.group_timeout_s(group)
        if timeout_s is None or dist.get_backend(group) != "gloo":
            return None
        timeouts.append(timeout_s)
    return min(timeouts, default=None)


def peer_wait_s(wait_s: float, groups: Iterable[Any] | None = None) -> float:
    """``wait_s``, or the shortest timeout of ``groups`` (``None``: the default group) where shorter; see the module doc."""
    if groups is None:
        if not compat.real_process_group_initialized():
            return wait_s
        default_s = compat.default_group_timeout_s()
        timeouts = [] if default_s is None else [default_s]
    else:
        timeouts = [t for t in map(compat.group_timeout_s, groups) if t is not None]
    return min([wait_s, *timeouts])


def graph_wait_s(gm: torch.fx.GraphModule, wait_s: float) -> float:
    """:func:`peer_wait_s` for the live groups of ``gm``'s transfers."""
    return peer_wait_s(wait_s, _live_groups(gm))
