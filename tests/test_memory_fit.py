"""memory_fit.sink_to_budget: compute run early and held at the peak moves to its first reader."""

from __future__ import annotations

import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model.estimator import TableEstimator
from cost_model.memory import held_peak_bytes
from graph_passes.memory_fit import sink_to_budget

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _node(g: torch.fx.Graph, target, args, name: str) -> torch.fx.Node:
    return g.create_node("call_function", target, args, name=name)


def _sizes(order, sizes: dict[str, int]):
    estimator = TableEstimator(kind_times_s={"compute": 1.0, "collective": 1.0}, output_bytes=sizes)
    return lambda n: estimator.node_cost(n).output_bytes


def _hoisted_chain() -> tuple[torch.fx.Graph, dict[str, int]]:
    """A pointwise chain (neg -> exp -> add -> div, 100 B; Inductor fuses the first three into
    div) run before a 100 B buffer (``big``) and its sum, where the order peaks, though only
    ``out`` (a matmul), after them, reads ``div``."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    neg = _node(g, aten.neg.default, (x,), "neg")
    exp = _node(g, aten.exp.default, (neg,), "exp")
    add = _node(g, aten.add.Tensor, (exp, 1), "add")
    div = _node(g, aten.div.Tensor, (x, add), "div")
    big = _node(g, aten.mul.Tensor, (x, 2), "big")
    total = _node(g, aten.sum.default, (big,), "total")
    out = _node(g, aten.mm.default, (div, total), "out")
    g.output((out,))
    return g, {"neg": 100, "exp": 100, "add": 100, "div": 100, "big": 100, "total": 1, "out": 1}


def test_a_chain_held_across_the_peak_moves_whole_to_its_first_reader() -> None:
    g, sizes = _hoisted_chain()
    order = list(g.nodes)
    output_bytes = _sizes(order, sizes)
    assert held_peak_bytes(order, output_bytes) == 201  # div, big, total
    fitted = sink_to_budget(order, output_bytes, 150)
    assert [n.name for n in fitted] == ["x", "big", "total", "neg", "exp", "add", "div", "out", "output"]
    assert held_peak_bytes(fitted, output_bytes) == 102  # div, total and out
    # div alone would be fused with nothing to read (add would be computed at its old place): the chain moves whole


def test_an_order_within_the_budget_is_returned_as_it_is() -> None:
    g, sizes = _hoisted_chain()
    order = list(g.nodes)
    assert sink_to_budget(order, _sizes(order, sizes), 10**6) == order


def test_collectives_waits_and_order_sensitive_nodes_stay_and_nothing_crosses_them() -> None:
    g = torch.fx.Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    early = _node(g, aten.neg.default, (x,), "early")
    issue = _node(g, c10d.all_reduce.default, (x, "sum", "0"), "issue")
    wait = _node(g, c10d.wait_tensor.default, (issue,), "wait")
    copy = _node(g, aten.copy_.default, (buf, wait), "copy")  # mutates: a barrier
    big = _node(g, aten.mul.Tensor, (x, 2), "big")
    total = _node(g, aten.sum.default, (big,), "total")
    out = _node(g, aten.add.Tensor, (early, total), "out")
    g.output((out, copy))
    order = list(g.nodes)
    sizes = {"early": 100, "issue": 100, "big": 100, "total": 1, "out": 1}
    assert sink_to_budget(order, _sizes(order, sizes), 0) == order


@st.composite
def _random_orders(draw) -> tuple[list[torch.fx.Node], dict[str, int]]:
    g = torch.fx.Graph()
    values = [g.placeholder(f"in{i}") for i in range(draw(st.integers(1, 3)))]
    sizes: dict[str, int] = {}
    for i in range(draw(st.integers(1, 25))):
        a = values[draw(st.integers(0, len(values) - 1))]
        kind = draw(st.integers(0, 5))
        if kind == 0:
            issue = _node(g, c10d.all_reduce.default, (a, "sum", "0"), f"ar{i}")
            values.append(_node(g, c10d.wait_tensor.default, (issue,), f"wait{i}"))
            sizes[f"ar{i}"] = draw(st.integers(1, 100))
        elif kind == 1:
            values.append(_node(g, aten.view.default, (a, [-1]), f"v{i}"))
        else:
            b = values[draw(st.integers(0, len(values) - 1))]
            values.append(_node(g, aten.add.Tensor, (a, b), f"c{i}"))
            sizes[f"c{i}"] = draw(st.integers(1, 100))
    g.output(tuple(values[-2:]))
    return list(g.nodes), sizes


@settings(max_examples=80, deadline=None)
@given(_random_orders(), st.integers(0, 400))
def test_random_orders_stay_valid_and_their_peak_never_grows(case, budget: int) -> None:
    order, sizes = case
    output_bytes = _sizes(order, sizes)
    fitted = sink_to_budget(order, output_bytes, budget)
    assert sorted(n.name for n in fitted) == sorted(n.name for n in order)
    position = {n: i for i, n in enumerate(fitted)}
    assert all(position[i] < position[n] for n in fitted for i in n.all_input_nodes)
    fixed = [n.name for n in order if n.name.startswith(("ar", "wait"))]
    assert [n.name for n in fitted if n.name.startswith(("ar", "wait"))] == fixed
    assert held_peak_bytes(fitted, output_bytes) <= held_peak_bytes(order, output_bytes)
