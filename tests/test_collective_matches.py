"""find_* of graph_passes.collective_matches on traced forward and backward graphs (fake 2-rank world)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from cost_model.testing import aot_partitions, fake_world, trace_aten
from graph_passes.collective_matches import (
    find_all,
    find_all_gather_matmuls,
    find_all_to_all_computes,
    find_bmm_all_to_alls,
    find_matmul_all_reduces,
    find_matmul_reduce_scatters,
)

aten = torch.ops.aten


def _sp_attention_in(x, wq, wk, wv, group):
    """Sequence-parallel input projection: gather the sequence (dim 1), then Q, K, V matmuls."""
    full = funcol.all_gather_single(x, 1, group)
    flat = full.reshape(-1, full.shape[-1])
    return flat @ wq.t(), flat @ wk.t(), flat @ wv.t()


def _row_parallel_out(h, w, group, scatter_dim):
    y = (h.reshape(-1, h.shape[-1]) @ w.t()).reshape(h.shape[0], h.shape[1], -1)
    return funcol.reduce_scatter_single(y, "sum", scatter_dim, group)


def test_all_gather_feeding_qkv_along_the_sequence_dim() -> None:
    with fake_world(2) as group:
        x, w = torch.randn(2, 4, 8), torch.randn(6, 8)
        gm = trace_aten(lambda x, a, b, c: _sp_attention_in(x, a, b, c, group), x, w, w.clone(), w.clone())
    (match,) = find_all_gather_matmuls(gm.graph)
    assert match.gather_dim == 1 and match.group_size == 2
    assert len(match.matmuls) == 3 and all(m.target == aten.mm.default for m in match.matmuls)
    assert match.gathered.target == aten.cat.default
    assert match.shard.op == "placeholder"


def test_all_gather_along_dim0_and_one_addmm() -> None:
    with fake_world(2) as group:
        gm = trace_aten(
            lambda x, w, b: torch.nn.functional.linear(funcol.all_gather_single(x, 0, group), w, b),
            torch.randn(3, 8),
            torch.randn(5, 8),
            torch.randn(5),
        )
    (match,) = find_all_gather_matmuls(gm.graph)
    assert match.gather_dim == 0 and match.gathered is match.wait
    assert [m.target for m in match.matmuls] == [aten.addmm.default]


def test_all_gather_with_non_matmul_consumers_is_skipped_with_a_reason() -> None:
    with fake_world(2) as group:
        gm = trace_aten(
            lambda x, w: (lambda g: (g @ w, g.relu()))(funcol.all_gather_single(x, 0, group)),
            torch.randn(3, 8),
            torch.randn(8, 4),
        )
    skipped: Counter[str] = Counter()
    assert find_all_gather_matmuls(gm.graph, skipped) == []
    assert skipped["all_gather: non-matmul consumer"] == 1


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_matmul_reduce_scatter_along_dim0_and_dim1(scatter_dim: int) -> None:
    with fake_world(2) as group:
        gm = trace_aten(
            lambda h, w: _row_parallel_out(h, w, group, scatter_dim), torch.randn(4, 6, 8), torch.randn(8, 8)
        )
    (match,) = find_matmul_reduce_scatters(gm.graph)
    assert match.scatter_dim == scatter_dim
    assert match.matmul.target == aten.mm.default and match.reduce_op == "sum"


def test_matmul_all_reduce_and_non_matmul_all_reduce() -> None:
    with fake_world(2) as group:
        gm = trace_aten(
            lambda h, w: (funcol.all_reduce(h @ w, "sum", group), funcol.all_reduce(h.relu(), "sum", group)),
            torch.randn(4, 8),
            torch.randn(8, 8),
        )
    skipped: Counter[str] = Counter()
    (match,) = find_matmul_all_reduces(gm.graph, skipped)
    assert match.matmul.target == aten.mm.default
    assert skipped["all_reduce: not fed by a matmul"] == 1


def test_all_to_all_feeding_expert_matmuls() -> None:
    with fake_world(2) as group:
        gm = trace_aten(
            lambda x, w: funcol.all_to_all_single(x, [2, 2], [2, 2], group).reshape(-1, 8) @ w,
            torch.randn(4, 8),
            torch.randn(8, 3),
        )
    (match,) = find_all_to_all_computes(gm.graph)
    assert [c.target for c in match.consumers] == [aten.mm.default]


def test_all_to_all_of_a_bmm_or_a_sum_of_bmms() -> None:
    def combine(h, w, g, v, group):
        y = (torch.bmm(h, w) + torch.bmm(g, v)).view(2, 2, 3, 5).transpose(0, 1).reshape(12, 5)
        sent = funcol.all_to_all_single(y, [6, 6], [6, 6], group)
        return sent, funcol.all_to_all_single(torch.relu(sent), [6, 6], [6, 6], group)

    skipped: Counter[str] = Counter()
    with fake_world(2) as group:
        gm = trace_aten(
            lambda *a: combine(*a, group),
            torch.randn(2, 6, 8),
            torch.randn(2, 8, 5),
            torch.randn(2, 6, 4),
            torch.randn(2, 4, 5),
        )
    (match,) = find_bmm_all_to_alls(gm.graph, skipped)
    assert [b.target for b in match.bmms] == [aten.bmm.default] * 2 and match.output.target == aten.add.Tensor
    assert skipped["all_to_all: not fed by bmms"] == 1


def test_backward_graph_has_matmul_reduce_scatter_from_the_forward_all_gather() -> None:
    """The gradient of all_gather -> linear is grad-matmul -> reduce_scatter in the backward."""
    with fake_world(2) as group:
        fwd, bwd = aot_partitions(
            lambda x, w: funcol.all_gather_single(x, 1, group).reshape(-1, 8) @ w.t(),
            torch.randn(2, 4, 8, requires_grad=True),
            torch.randn(6, 8, requires_grad=True),
        )
    assert len(find_all_gather_matmuls(fwd.graph)) == 1
    found, _ = find_all(bwd.graph)
    (rs,) = found["matmul_reduce_scatter"]
    assert rs.scatter_dim == 1


def _swiglu_backward_graph():
    """The backward graph of a sequence-parallel SwiGLU MLP (fake 2-rank world)."""

    def mlp(x, w1, w3, w2, group):
        flat = funcol.all_gather_single(x, 1, group).reshape(-1, 8)
        h = torch.nn.functional.silu(flat @ w1.t()) * (flat @ w3.t())
        return funcol.reduce_scatter_single((h @ w2.t()).reshape(2, 8, 8), "sum", 1, group)

    with fake_world(2) as group:
        args = [torch.randn(2, 4, 8), torch.randn(6, 8), torch.randn(6, 8), torch.randn(8, 6)]
        _, bwd = aot_partitions(lambda *a: mlp(*a, group), *[a.requires_grad_() for a in args])
    return bwd


def test_backward_weight_gradient_and_summed_input_gradient_are_matched() -> None:
    found, skipped = find_all(_swiglu_backward_graph().graph)
    (ag,) = found["all_gather_matmul"]  # grad of the reduce-scatter: dgrad (rows) and wgrad (t(rows) @ h)
    assert len(ag.matmuls) == 1 and len(ag.transposed) == 1
    (rs,) = found["matmul_reduce_scatter"]  # grad of the all-gather: dgrad via w1 plus dgrad via w3
    assert len(rs.addends) == 1 and rs.scatter_dim == 1
    assert not skipped
