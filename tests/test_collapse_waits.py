"""collapse_waits: eager-style code that waits on a functional collective's result explicitly
(``funcol.wait_tensor(funcol.all_reduce(...))``) traces to two waits in a row; the pass leaves
one, and every later pass (``verify`` included) then sees a wait completing an issue."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from cost_model.testing import fake_world, trace_aten
from graph_passes import PassContext
from graph_passes.annotate import annotate_pass
from graph_passes.collapse_waits import collapse_waits_pass
from graph_passes.pass_list import pass_names
from graph_passes.verify import VerifyError, verify_pass

c10d = torch.ops._c10d_functional


def _waited_twice(x: torch.Tensor, w: torch.Tensor, group) -> torch.Tensor:
    gathered = funcol.wait_tensor(funcol.all_gather_single(x, 0, group))
    reduced = funcol.wait_tensor(funcol.wait_tensor(funcol.all_reduce(gathered @ w, "sum", group)))
    return reduced.relu()


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    names = {
        c10d.all_gather_into_tensor.default: "ag",
        c10d.all_reduce.default: "ar",
        c10d.wait_tensor.default: "wait",
    }
    return [names[n.target] for n in gm.graph.nodes if n.target in names]


def test_waits_of_waited_tensors_collapse_to_the_first_and_values_stay() -> None:
    with fake_world(2) as group:
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        gm = trace_aten(lambda a, b: _waited_twice(a, b, group), x, w)
        assert _ops(gm) == ["ag", "wait", "wait", "ar", "wait", "wait", "wait"]
        want = gm(x, w)
        with pytest.raises(VerifyError, match="completes no collective issue"):
            verify_pass(gm, PassContext("test", "fwd"))
        ctx = PassContext("test", "fwd")
        collapse_waits_pass(gm, ctx)
        gm.graph.lint()
        gm.recompile()
        assert _ops(gm) == ["ag", "wait", "ar", "wait"]
        assert ctx.stats["collapse_waits"] == {"waits of waited tensors removed": 3}
        annotate_pass(gm, ctx)
        verify_pass(gm, ctx)
        torch.testing.assert_close(gm(x, w), want)


def test_a_graph_without_repeated_waits_is_left_alone() -> None:
    with fake_world(2) as group:
        gm = trace_aten(lambda a: funcol.all_reduce(a, "sum", group) * 2, torch.randn(4))
        before = _ops(gm)
        ctx = PassContext("test", "fwd")
        collapse_waits_pass(gm, ctx)
    assert _ops(gm) == before == ["ar", "wait"]
    assert "collapse_waits" not in ctx.stats


def test_it_runs_first() -> None:
    assert pass_names()[0] == "collapse_waits"
