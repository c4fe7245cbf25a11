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

``receive_timeout_s(groups)``: how long to wait for a receive on ``groups``, once bounded: the
shortest of their timeouts where all are gloo groups, else ``None`` (each receive's own). A gloo
send or receive keeps the timeout its group was made with: a timeout set later reaches its
collectives only (torch 2.13: a receive from a stopped peer on a group made with 30 minutes and
set to 3 s still waited after 25 s; ``Work.wait(timeout)`` ended it at 3 s).
``helix_pipeline`` bounds its stages' groups and waits for its stages' inputs and output
gradients that long; ``reshard`` makes its groups with the default group's timeout
(``_torch_compat.new_member_group``), so their sends and receives have it too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
import torch.fx

from dhelix_compile import _torch_compat as compat
from dhelix_compile.consistency import collective_groups

__all__ = ["bound_graph_timeouts", "bound_group_timeouts", "receive_timeout_s"]

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
    if not compat.real_process_group_initialized():
        return
    groups = []
    for name in collective_groups(gm):
        try:
            groups.append(compat.resolve_group(name))
        except (RuntimeError, ValueError, KeyError):  # not a live group of this process
            continue
    bound_group_timeouts(groups, timeout_s)


def receive_timeout_s(groups: Iterable[Any]) -> float | None:
    """How long to wait for a receive on ``groups`` (gloo: the shortest of their timeouts); see the module doc."""
    timeouts = []
    for group in groups:
        timeout_s = compat.group_timeout_s(group)
        if timeout_s is None or dist.get_backend(group) != "gloo":
            return None
        timeouts.append(timeout_s)
    return min(timeouts, default=None)
