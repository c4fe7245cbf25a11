"""deferral: weight gradients (work no later transfer needs) moved later in a strand; its use by interleave."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model.estimator import TableEstimator
from cost_model.op_kinds import is_comm, kind_of
from cost_model.testing import aot_partitions, fake_world
from graph_passes import PassContext
from graph_passes.annotate import annotate_pass
from graph_passes.deferral import defer_off_chain, off_chain_nodes
from graph_passes.interleave import InterleaveOptions, interleave_pass
from graph_passes.merge_strands import merge_strands
from graph_passes.node_order import apply_order
from graph_passes.verify import verify_pass

aten = torch.ops.aten


def _is_transfer(node: torch.fx.Node) -> bool:
    return is_comm(kind_of(node))


def _tp_layers(x, w1, w2, group):
    """Two sequence-parallel layers: all-gather -> mm -> relu -> reduce-scatter."""
    for w in (w1, w2):
        gathered = funcol.all_gather_tensor(x, 0, group)
        x = funcol.reduce_scatter_tensor(torch.relu(gathered @ w), "sum", 0, group)
    return x


def _tp_partitions() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    with fake_world(2) as group, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        args = [torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)]
        return aot_partitions(lambda *a: _tp_layers(*a, group), *[a.requires_grad_() for a in args])


def _body(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _weight_grads(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The backward's outputs for w1 and w2: ``t(gathered) @ grad``."""
    (outputs,) = next(n for n in gm.graph.nodes if n.op == "output").args
    return [o for o in outputs if isinstance(o, torch.fx.Node) and o.target is aten.mm.default]


def test_weight_gradients_are_off_chain_and_input_gradients_are_not() -> None:
    _, bwd = _tp_partitions()
    body = _body(bwd)
    off = off_chain_nodes(body, _is_transfer)
    weight_grads = _weight_grads(bwd)
    assert len(weight_grads) == 2 and all(w in off for w in weight_grads)
    # the input-gradient matmul feeding each reduce-scatter is on the chain
    scatters = [n for n in body if n.target is torch.ops._c10d_functional.reduce_scatter_tensor.default]
    assert scatters and all(s.args[0] not in off for s in scatters)
    assert not any(_is_transfer(n) for n in off)


def test_deferral_moves_weight_gradients_one_segment_later_in_a_valid_order() -> None:
    _, bwd = _tp_partitions()
    body = _body(bwd)
    order = defer_off_chain(body, _is_transfer, 1)
    assert sorted(map(str, order)) == sorted(map(str, body))
    transfers = {n for n in body if _is_transfer(n)}
    before, after = _segments(body, transfers), _segments(order, transfers)
    last = max(before.values())
    for node in _weight_grads(bwd):
        assert after[node] == min(before[node] + 1, last)
    position = {n: i for i, n in enumerate(order)}
    for node in order:
        assert all(position[p] < position[node] for p in node.all_input_nodes if p in position)
    apply_order(bwd.graph, order)
    bwd.graph.lint()
    assert defer_off_chain(body, _is_transfer, 0) == body


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_deferral_keeps_any_dag_topological_and_the_chain_in_place(data) -> None:
    size = data.draw(st.integers(1, 14))
    graph = torch.fx.Graph()
    nodes = [graph.placeholder("x")]
    transfers = set()
    for _i in range(size):
        picks = data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=2, unique=True))
        node = graph.call_function(torch.add, tuple(nodes[p] for p in picks) * (1 if len(picks) == 2 else 2))
        if data.draw(st.booleans()):
            transfers.add(node)
        nodes.append(node)
    graph.output(nodes[-1])
    body = nodes[1:]
    distance = data.draw(st.integers(0, 3))
    order = defer_off_chain(body, lambda n: n in transfers, distance)
    assert sorted(map(str, order)) == sorted(map(str, body))
    position = {n: i for i, n in enumerate(order)}
    assert all(position[p] < position[n] for n in order for p in n.all_input_nodes if p in position)
    off = off_chain_nodes(body, lambda n: n in transfers)
    assert [n for n in order if n not in off] == [n for n in body if n not in off]  # the chain keeps its order
    before, after = _segments(body, transfers), _segments(order, transfers)
    last = len(transfers)
    for node in off:
        assert after[node] == (min(before[node] + distance, last) if transfers else before[node])


def _segments(order, transfers) -> dict:
    segment, seen = 0, {}
    for node in order:
        seen[node] = segment
        segment += node in transfers
    return seen


def _merged_with_costs(mm_s: float, comm_s: float) -> tuple[torch.fx.GraphModule, TableEstimator]:
    fwd, bwd = _tp_partitions()
    with fake_world(2):
        gm = merge_strands(fwd, bwd, shared_fwd_inputs=[1, 2]).gm
    times = {n.name: mm_s for n in gm.graph.nodes if n.target is aten.mm.default}
    return gm, TableEstimator(times, {"collective": comm_s})


def test_interleave_offers_the_deferred_backward_to_the_dp_and_the_simulator() -> None:
    gm, estimator = _merged_with_costs(1e-3, 1e-3)
    ctx = PassContext(
        graph_name="merged",
        phase="fwd",
        estimator=estimator,
        pass_options={"interleave": InterleaveOptions(memory_budget_ratio=3.0)},
    )
    gm = interleave_pass(annotate_pass(gm, ctx), ctx)
    verify_pass(gm, ctx)
    record = ctx.records["interleave"]
    # weight gradients moved later give the DP's order compute where the forward's transfers need it
    assert record["predicted_makespan_dp_defer1_s"] < record["predicted_makespan_dp_s"]
    chosen = record["predicted_makespan_s"]
    assert all(record[f"predicted_makespan_{c}_s"] >= chosen for c in ("sequential", "dp", "dp_defer1", "list"))
    assert sum(v for k, v in ctx.stats["interleave"].items() if k.startswith("interleaved by ")) == 1


def test_deferral_can_be_switched_off() -> None:
    gm, estimator = _merged_with_costs(1e-3, 1e-3)
    ctx = PassContext(
        graph_name="merged",
        phase="fwd",
        estimator=estimator,
        pass_options={"interleave": InterleaveOptions(memory_budget_ratio=3.0, defer_weight_grads=())},
    )
    interleave_pass(annotate_pass(gm, ctx), ctx)
    assert not any("defer" in key for key in ctx.records["interleave"])


@pytest.mark.parametrize("distance", [1, 2])
def test_deferred_backward_computes_the_same_gradients(distance: int) -> None:
    """A 3-layer MLP's backward, its input-gradient matmuls standing in for transfers: same values."""

    def mlp(x, w1, w2, w3):
        return torch.tanh(torch.tanh(x @ w1) @ w2) @ w3

    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(6, 5, generator=gen)] + [torch.randn(5, 5, generator=gen).requires_grad_() for _ in range(3)]
    _, bwd = aot_partitions(mlp, *args)
    body = _body(bwd)
    weight_grads = set(_weight_grads(bwd))
    chain = {n for n in body if n.target is aten.mm.default and n not in weight_grads}
    assert chain and weight_grads
    order = defer_off_chain(body, lambda n: n in chain, distance)
    assert order != body
    inputs = [torch.randn(n.meta["val"].shape, generator=gen) for n in bwd.graph.nodes if n.op == "placeholder"]
    want = bwd(*inputs)
    apply_order(bwd.graph, order)
    bwd.graph.lint()
    bwd.recompile()
    got = bwd(*inputs)
    assert len(got) == len(want)
    assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(got, want))
