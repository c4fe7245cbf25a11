"""``group_timeouts``: the groups dhelix runs transfers on time out with ``group_timeout_s``, else
no later than the default group, and a wait at the c10d store for a peer ends no later than its
groups' timeout; one gloo rank, groups of one (``tests/test_dead_rank.py`` has the peers that stop)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.fx

from dhelix_compile import _torch_compat as compat
from dhelix_compile.group_timeouts import (
    bound_graph_timeouts,
    bound_group_timeouts,
    graph_wait_s,
    p2p_timeout_s,
    peer_wait_s,
)
from dhelix_compile.testing.multirank import run_on_ranks

pytestmark = pytest.mark.multirank

DEFAULT_S = 7.0


def _graph_on(group: dist.ProcessGroup) -> torch.fx.GraphModule:
    """``wait(all_reduce(x))`` on ``group``, built by hand."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    c10d = torch.ops._c10d_functional
    reduced = graph.call_function(c10d.all_reduce.default, (x, "sum", compat.group_name(group)))
    graph.output(graph.call_function(c10d.wait_tensor.default, (reduced,)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _timeouts(rank: int, world_size: int) -> dict[str, float | None]:
    timeout = compat.group_timeout_s
    seen: dict[str, float | None] = {"default": compat.default_group_timeout_s()}
    torchs = dist.new_group([0])  # torch's own default, whatever init_process_group said
    seen["new_group"] = timeout(torchs)
    bound_group_timeouts([torchs], None)
    seen["new_group bounded"] = timeout(torchs)
    shorter = dist.new_group([0], timeout=timedelta(seconds=2))
    bound_group_timeouts([shorter], None)
    seen["shorter bounded"] = timeout(shorter)
    seen["p2p"] = p2p_timeout_s([torchs, shorter])
    bound_group_timeouts([shorter], 30.0)
    seen["shorter given 30"] = timeout(shorter)
    in_graph = dist.new_group([0])
    bound_graph_timeouts(_graph_on(in_graph), 3.0)
    seen["graph's group given 3"] = timeout(in_graph)
    seen["store wait"] = peer_wait_s(300.0)  # the default group's, shorter
    seen["store wait, shorter"] = peer_wait_s(1.5)
    seen["store wait, the graph's"] = graph_wait_s(_graph_on(in_graph), 300.0)
    seen["reshard's"] = timeout(compat.new_member_group([0], "dhelix_test_member_0"))
    return seen


def test_groups_get_the_option_or_at_most_the_default_groups_timeout() -> None:
    (seen,) = run_on_ranks(_timeouts, 1, pg_timeout_s=DEFAULT_S, timeout_s=120)
    assert seen == {
        "default": DEFAULT_S,
        "new_group": 1800.0,  # torch 2.13's gloo default: why this module exists
        "new_group bounded": DEFAULT_S,
        "shorter bounded": 2.0,  # None never lengthens a group's timeout
        "p2p": 2.0,  # the shortest of the gloo groups'
        "shorter given 30": 30.0,  # the option does
        "graph's group given 3": 3.0,
        "store wait": DEFAULT_S,
        "store wait, shorter": 1.5,
        "store wait, the graph's": 3.0,
        "reshard's": DEFAULT_S,
    }
