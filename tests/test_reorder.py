"""The reorder pass and the list scheduler: hand-built graphs with stub costs, random DAGs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model.estimator import TableEstimator
from cost_model.memory import peak_memory_bytes
from cost_model.op_kinds import is_comm, kind_of
from cost_model.simulator import simulate
from graph_passes import PassContext
from graph_passes.annotate import annotate_pass
from graph_passes.reorder import (
    ReorderOptions,
    collective_urgency,
    critical_urgency,
    overlap_rule,
    overlap_schedule,
    reorder_pass,
)
from graph_passes.scheduling import SchedulerState, is_order_sensitive, list_schedule
from graph_passes.verify import verify_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

UNIT = TableEstimator(kind_times_s={"compute": 1.0, "collective": 1.0}, output_bytes={})


def _ctx(estimator=UNIT, **options) -> PassContext:
    ctx = PassContext(graph_name="test", phase="bwd", estimator=estimator)
    if options:
        ctx.pass_options["reorder"] = ReorderOptions(**options)
    return ctx


def _names(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def _is_subsequence(expected: list[str], actual: list[str]) -> bool:
    it = iter(actual)
    return all(name in it for name in expected)


def _backward_slice() -> torch.fx.GraphModule:
    """dgrad -> reduce_scatter -> wait -> add; wgrad independent, originally before the issue."""
    g = torch.fx.Graph()
    x, w, grad = g.placeholder("x"), g.placeholder("w"), g.placeholder("grad")
    dgrad = g.create_node("call_function", aten.mm.default, (grad, w), name="dgrad")
    xt = g.create_node("call_function", aten.t.default, (x,), name="xt")
    wgrad = g.create_node("call_function", aten.mm.default, (xt, grad), name="wgrad")
    rs = g.create_node("call_function", c10d.reduce_scatter_tensor.default, (dgrad, "sum", 2, "0"), name="rs")
    wait = g.create_node("call_function", c10d.wait_tensor.default, (rs,), name="wait_rs")
    out = g.create_node("call_function", aten.add.Tensor, (wait, 1), name="out")
    g.output((out, wgrad))
    return annotate_pass(torch.fx.GraphModule(torch.nn.Module(), g), _ctx())


def test_issue_moves_before_independent_compute_and_wait_after_it() -> None:
    gm = _backward_slice()
    ctx = _ctx()
    reorder_pass(gm, ctx)
    assert _names(gm) == ["dgrad", "rs", "xt", "wgrad", "wait_rs", "out"]
    record = ctx.records["reorder"]
    assert record["predicted_makespan_after_s"] < record["predicted_makespan_before_s"]
    assert record["predicted_exposed_comm_after_s"] == 0.0
    assert ctx.stats["reorder"]["reordered graphs"] == 1
    verify_pass(gm, ctx)


def test_reorder_is_deterministic() -> None:
    a, b = _backward_slice(), _backward_slice()
    reorder_pass(a, _ctx())
    reorder_pass(b, _ctx())
    assert _names(a) == _names(b)


def test_no_gain_leaves_the_graph_alone_and_counts_why() -> None:
    gm = _backward_slice()
    free_comm = TableEstimator(kind_times_s={"compute": 1.0, "collective": 0.0})
    before = _names(gm)
    ctx = _ctx(free_comm)
    reorder_pass(gm, ctx)
    assert _names(gm) == before
    assert ctx.stats["reorder"]["kept original order: no predicted gain"] == 1


def test_without_collectives_or_estimator_it_skips() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(aten.relu.default, (x,)),))
    ctx = _ctx()
    reorder_pass(torch.fx.GraphModule(torch.nn.Module(), g), ctx)
    assert ctx.stats["reorder"]["skipped: no collectives"] == 1
    ctx = _ctx(None)
    reorder_pass(_backward_slice(), ctx)
    assert ctx.stats["reorder"]["skipped: no estimator"] == 1


def _hoistable_reduce_scatter(weight_bytes: int = 0) -> tuple[torch.fx.Graph, TableEstimator]:
    """A backward slice whose reduce-scatter (1000 B) the reorder pass would hoist above the
    weight gradient (500 B, reduced then freed), raising the peak; ``w`` is a parameter (named
    as AOTAutograd names a backward's forward inputs)."""
    g = torch.fx.Graph()
    x, w, grad = g.placeholder("x"), g.placeholder("primals_1"), g.placeholder("grad")
    dgrad = g.create_node("call_function", aten.mm.default, (grad, w), name="dgrad")
    wgrad = g.create_node("call_function", aten.mm.default, (x, grad), name="wgrad")
    total = g.create_node("call_function", aten.sum.default, (wgrad,), name="total")
    rs = g.create_node("call_function", c10d.reduce_scatter_tensor.default, (dgrad, "sum", 2, "0"), name="rs")
    wait = g.create_node("call_function", c10d.wait_tensor.default, (rs,), name="wait_rs")
    out = g.create_node("call_function", aten.add.Tensor, (wait, total), name="out")
    g.output((out,))
    sizes = {"primals_1": weight_bytes, "dgrad": 10, "wgrad": 500, "total": 10, "rs": 1000, "wait_rs": 0, "out": 10}
    return g, TableEstimator(kind_times_s={"compute": 1.0, "collective": 1.0}, output_bytes=sizes)


def test_memory_budget_keeps_the_original_order_when_hoisting_would_grow_the_peak() -> None:
    g, big = _hoistable_reduce_scatter()
    gm = annotate_pass(torch.fx.GraphModule(torch.nn.Module(), g), _ctx())
    before = _names(gm)
    ctx = _ctx(big, memory_budget_ratio=1.0)
    reorder_pass(gm, ctx)
    assert _names(gm) == before
    assert ctx.stats["reorder"]["kept original order: over the memory budget"] == 1
    # with headroom, the same graph is reordered
    gm = annotate_pass(torch.fx.GraphModule(torch.nn.Module(), copy.deepcopy(g)), _ctx())
    ctx = _ctx(big, memory_budget_ratio=2.0)
    reorder_pass(gm, ctx)
    assert _names(gm).index("rs") < _names(gm).index("wgrad")


def test_memory_budget_scales_what_the_order_holds_above_its_parameters() -> None:
    """A large parameter (``w``, never freed) does not dilute the budget: the hoist that a 1.2
    budget refuses without it is refused with it too."""
    for weight_bytes in (0, 10**9):
        g, big = _hoistable_reduce_scatter(weight_bytes)
        gm = annotate_pass(torch.fx.GraphModule(torch.nn.Module(), g), _ctx())
        before = _names(gm)
        ctx = _ctx(big, memory_budget_ratio=1.2)
        reorder_pass(gm, ctx)
        assert _names(gm) == before, weight_bytes
        assert ctx.stats["reorder"]["kept original order: over the memory budget"] == 1


def _two_chains() -> dict[str, torch.fx.Node]:
    """A merged graph in miniature: ``saved`` (a backward's saved input) read by ``use`` then
    freed; ``act`` (a forward's activation, a graph output) made by ``make`` and kept."""
    g = torch.fx.Graph()
    saved, x = g.placeholder("saved"), g.placeholder("x")
    use = g.create_node("call_function", aten.sum.default, (saved,), name="use")
    make = g.create_node("call_function", aten.mul.Tensor, (x, 2), name="act")
    g.output((use, make))
    return {"saved": saved, "x": x, "use": use, "act": make}


def test_the_scheduler_counts_outputs_from_their_making_and_frees_freeable_inputs_at_last_use() -> None:
    n = _two_chains()
    est = TableEstimator(kind_times_s={"compute": 1.0}, output_bytes={"saved": 100, "act": 100, "use": 1})
    body = [n["use"], n["act"]]
    state = SchedulerState(body, est, freeable_inputs=[n["saved"]])
    assert state.live_bytes == 100  # the saved input, live from the start
    assert (state.alloc_bytes(n["use"]), state.net_bytes(n["use"])) == (1, 1 - 100)
    state.advance(n["use"])
    assert state.live_bytes == 1  # the saved input freed at its last use; the 1 B sum is an output: kept
    state.advance(n["act"])
    assert (state.live_bytes, state.peak_bytes) == (101, 101)  # the activation stays: the graph outputs it
    # the other order peaks higher: the activation is made while the saved input is still live
    other = SchedulerState(body, est, freeable_inputs=[n["saved"]])
    other.advance(n["act"])
    other.advance(n["use"])
    assert other.peak_bytes == 201
    # without freeable inputs the saved input is a graph input: live in every order, not counted
    assert SchedulerState(body, est).live_bytes == 0


def test_the_overlap_rule_runs_what_fits_the_budget_first() -> None:
    n = _two_chains()
    est = TableEstimator(kind_times_s={"compute": 1.0}, output_bytes={"saved": 100, "act": 100, "use": 1})
    body = [n["act"], n["use"]]  # the activation first: its order would peak at 201 B
    tight = list_schedule(
        body, est, overlap_rule(ReorderOptions(), collective_urgency(body), budget_bytes=150), [n["saved"]]
    )
    assert [m.name for m in tight] == ["use", "act"]  # "act" does not fit until "use" frees 100 B
    loose = list_schedule(
        body, est, overlap_rule(ReorderOptions(), collective_urgency(body), budget_bytes=1000), [n["saved"]]
    )
    assert [m.name for m in loose] == ["act", "use"]  # both fit: original position decides


def test_order_sensitive_nodes_are_barriers() -> None:
    g = torch.fx.Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    a = g.create_node("call_function", aten.mm.default, (x, x), name="a")
    r1 = g.create_node("call_function", aten.rand.default, ([4, 4],), {"device": torch.device("cpu")}, name="r1")
    ag = g.create_node("call_function", c10d.all_gather_into_tensor.default, (a, 2, "0"), name="ag")
    w = g.create_node("call_function", c10d.wait_tensor.default, (ag,), name="w")
    b = g.create_node("call_function", aten.mm.default, (x, r1), name="b")
    r2 = g.create_node("call_function", aten.rand.default, ([4, 4],), {"device": torch.device("cpu")}, name="r2")
    cp = g.create_node("call_function", aten.copy_.default, (buf, b), name="cp")
    g.output((w, r2, cp))
    gm = annotate_pass(torch.fx.GraphModule(torch.nn.Module(), g), _ctx())
    assert [is_order_sensitive(n) for n in gm.graph.nodes if n.op == "call_function"] == [
        False,
        True,
        False,
        False,
        False,
        True,
        True,
    ]
    reorder_pass(gm, _ctx())
    names = _names(gm)
    assert names.index("a") < names.index("r1") < names.index("b") < names.index("r2") < names.index("cp")
    assert names.index("ag") > names.index("r1")


# ---------------------------------------------------------------- random DAGs


@st.composite
def random_graphs(draw) -> torch.fx.GraphModule:
    """Random DAGs of matmul-like compute with collectives (issue + wait) sprinkled in."""
    g = torch.fx.Graph()
    values = [g.placeholder(f"in{i}") for i in range(draw(st.integers(1, 3)))]
    for i in range(draw(st.integers(1, 25))):
        a = values[draw(st.integers(0, len(values) - 1))]
        if draw(st.integers(0, 3)) == 0:
            issue = g.create_node("call_function", c10d.all_reduce.default, (a, "sum", "0"), name=f"ar{i}")
            values.append(g.create_node("call_function", c10d.wait_tensor.default, (issue,), name=f"wait{i}"))
        else:
            b = values[draw(st.integers(0, len(values) - 1))]
            values.append(g.create_node("call_function", aten.add.Tensor, (a, b), name=f"c{i}"))
    g.output(tuple(values[-3:]))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    return annotate_pass(gm, _ctx())


@settings(max_examples=60, deadline=None)
@given(random_graphs(), st.floats(0.1, 5.0), st.integers(1, 3), st.integers(1, 10), st.data())
def test_random_dags_stay_valid_within_budget_and_never_get_slower(gm, comm_s, max_in_flight, distance, data) -> None:
    names = [n.name for n in gm.graph.nodes if n.op == "call_function" and kind_of(n) != "wait"]
    sizes = {name: data.draw(st.integers(1, 100), label=name) for name in names}
    estimator = TableEstimator(kind_times_s={"compute": 1.0, "collective": comm_s}, output_bytes=sizes)
    original = copy.deepcopy(gm)
    ratio = data.draw(st.sampled_from([1.0, 1.25, 2.0]), label="memory_budget_ratio")
    ctx = _ctx(estimator, max_in_flight=max_in_flight, max_issue_distance=distance, memory_budget_ratio=ratio)
    reorder_pass(gm, ctx)

    def peak(module: torch.fx.GraphModule) -> int:
        return peak_memory_bytes(list(module.graph.nodes), lambda n: estimator.node_cost(n).output_bytes)

    assert peak(gm) <= ratio * peak(original)
    gm.graph.lint()
    verify_pass(gm, ctx)
    assert sorted(_names(gm)) == sorted(_names(original))
    issues = [n.name for n in original.graph.nodes if is_comm(kind_of(n))]
    new_issues = [n.name for n in gm.graph.nodes if is_comm(kind_of(n))]
    assert sorted(issues) == sorted(new_issues)
    record = ctx.records.get("reorder")
    if record and ctx.stats["reorder"]["reordered graphs"]:
        assert record["predicted_makespan_after_s"] < record["predicted_makespan_before_s"]


def test_the_next_collectives_feeders_come_first_then_original_order() -> None:
    """While rs2 is in flight, ``later`` (feeding ag0, after rs1) could fill the wait as well as
    ``wgrad``; run first, it would issue ag0 ahead of rs1 on the one channel and delay the chain
    (rs2 -> h -> rs1). Only the next collective's feeders jump the queue: wgrad (earlier in the
    original order) hides rs2, rs1 goes out as soon as it can, ag0 after it."""
    g = torch.fx.Graph()
    x, w, grad, saved = g.placeholder("x"), g.placeholder("w"), g.placeholder("grad"), g.placeholder("saved")
    dgrad = g.create_node("call_function", aten.mm.default, (grad, w), name="dgrad")
    xt = g.create_node("call_function", aten.t.default, (x,), name="xt")
    wgrad = g.create_node("call_function", aten.mm.default, (xt, grad), name="wgrad")
    rs2 = g.create_node("call_function", c10d.reduce_scatter_tensor.default, (dgrad, "sum", 2, "0"), name="rs2")
    wait2 = g.create_node("call_function", c10d.wait_tensor.default, (rs2,), name="wait_rs2")
    h = g.create_node("call_function", aten.add.Tensor, (wait2, 1), name="h")
    rs1 = g.create_node("call_function", c10d.reduce_scatter_tensor.default, (h, "sum", 2, "0"), name="rs1")
    wait1 = g.create_node("call_function", c10d.wait_tensor.default, (rs1,), name="wait_rs1")
    later = g.create_node("call_function", aten.mul.Tensor, (saved, 2), name="later")
    ag0 = g.create_node("call_function", c10d.all_gather_into_tensor.default, (later, 2, "0"), name="ag0")
    wait0 = g.create_node("call_function", c10d.wait_tensor.default, (ag0,), name="wait_ag0")
    out = g.create_node("call_function", aten.add.Tensor, (wait1, wait0), name="out")
    g.output((out, wgrad))
    gm = annotate_pass(torch.fx.GraphModule(torch.nn.Module(), g), _ctx())
    est = TableEstimator({"h": 0.1, "out": 0.1, "rs2": 1.0, "rs1": 2.0, "ag0": 0.5}, {"compute": 1.0}, output_bytes={})
    ctx = _ctx(est)
    reorder_pass(gm, ctx)
    assert _names(gm) == [
        *("dgrad", "rs2", "xt", "wgrad", "wait_rs2", "h", "rs1", "later", "ag0", "wait_rs1", "wait_ag0", "out")
    ]
    # the chain's transfers back to back: dgrad 1 | rs2 to 2 (under wgrad) | h | rs1 2.1-4.1 | ag0 to 4.6
    assert abs(ctx.records["reorder"]["predicted_makespan_after_s"] - 4.7) < 1e-9


def test_critical_urgency_issues_the_transfer_with_the_most_work_behind_it_first() -> None:
    """Two chains as a merged MoE graph has them: ``b`` (first in the original order) sends once
    and then computes 2 s; ``f`` sends, computes 1 s, sends again. Issued in original order,
    ``f``'s first transfer waits behind ``b``'s on the one channel, and ``b``'s compute runs
    before ``f``'s and leaves ``f``'s second transfer nothing to hide under (5.2 s). Ranked by
    the work behind them, ``f``'s transfer goes first, ``b``'s compute hides ``f``'s second
    (4.2 s)."""
    g = torch.fx.Graph()
    xb, xf = g.placeholder("xb"), g.placeholder("xf")

    def node(target, args, name):
        return g.create_node("call_function", target, args, name=name)

    b0 = node(aten.relu.default, (xb,), "b0")
    cb = node(c10d.all_reduce.default, (b0, "sum", "0"), "cb")
    bx = node(aten.relu.default, (node(c10d.wait_tensor.default, (cb,), "wait_cb"),), "bx")
    f0 = node(aten.relu.default, (xf,), "f0")
    cf1 = node(c10d.all_reduce.default, (f0, "sum", "0"), "cf1")
    fx = node(aten.relu.default, (node(c10d.wait_tensor.default, (cf1,), "wait_cf1"),), "fx")
    cf2 = node(c10d.all_reduce.default, (fx, "sum", "0"), "cf2")
    fc = node(aten.relu.default, (node(c10d.wait_tensor.default, (cf2,), "wait_cf2"),), "fc")
    g.output((bx, fc))
    gm = annotate_pass(torch.fx.GraphModule(torch.nn.Module(), g), _ctx())
    est = TableEstimator(
        {"b0": 0.1, "f0": 0.1, "fc": 0.1, "bx": 2.0, "cb": 1.0, "cf1": 1.0, "cf2": 1.0},
        {"compute": 1.0},
        output_bytes={},
    )
    urgency = critical_urgency(list(gm.graph.nodes), est)
    assert urgency[cf1] < urgency[cb] < urgency[cf2] and urgency[f0] == urgency[cf1]
    assert collective_urgency(list(gm.graph.nodes))[cb] < collective_urgency(list(gm.graph.nodes))[cf1]

    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    head, tail = [n for n in gm.graph.nodes if n.op == "placeholder"], [n for n in gm.graph.nodes if n.op == "output"]
    makespans = {}
    for critical in (False, True):
        order = overlap_schedule(body, est, ReorderOptions(memory_budget_ratio=10.0), critical=critical)
        makespans[critical] = simulate(head + order + tail, est).makespan_s
        issues = [n.name for n in order if is_comm(kind_of(n))]
        assert issues == (["cf1", "cb", "cf2"] if critical else ["cb", "cf1", "cf2"])
    assert makespans == {False: pytest.approx(5.2), True: pytest.approx(4.2)}


def _saved_activation_read_first(phase: str) -> tuple[torch.fx.GraphModule, PassContext]:
    """A backward slice whose saved activation ``act`` (2000 B) is read first, by ``u``: the
    reorder would issue the reduce-scatter ahead of ``u``, so ``act`` lives beside its buffers."""
    g = torch.fx.Graph()
    act, w, grad = g.placeholder("act"), g.placeholder("primals_1"), g.placeholder("tangents_1")
    u = g.create_node("call_function", aten.sum.default, (act,), name="u")
    dgrad = g.create_node("call_function", aten.mm.default, (grad, w), name="dgrad")
    rs = g.create_node("call_function", c10d.reduce_scatter_tensor.default, (dgrad, "sum", 2, "0"), name="rs")
    wait = g.create_node("call_function", c10d.wait_tensor.default, (rs,), name="wait_rs")
    out = g.create_node("call_function", aten.add.Tensor, (wait, u), name="out")
    g.output((out,))
    sizes = {"act": 2000, "primals_1": 0, "tangents_1": 0, "u": 10, "dgrad": 500, "rs": 500, "wait_rs": 0, "out": 10}
    estimator = TableEstimator(kind_times_s={"compute": 1.0, "collective": 1.0}, output_bytes=sizes)
    ctx = PassContext(graph_name="test", phase=phase, estimator=estimator)
    ctx.pass_options["reorder"] = ReorderOptions(memory_budget_ratio=1.0)
    return annotate_pass(torch.fx.GraphModule(torch.nn.Module(), g), ctx), ctx


def test_a_backward_frees_its_saved_activations_so_reading_them_later_costs_memory() -> None:
    """AOTAutograd's backward frees a saved activation after its last reader: an order that
    reads ``act`` later holds 2000 B more at its peak, over a 1.0 budget. A forward's inputs
    are held by their owners, so there the same order costs nothing."""
    gm, ctx = _saved_activation_read_first("bwd")
    before = _names(gm)
    reorder_pass(gm, ctx)
    assert _names(gm) == before
    assert "reordered graphs" not in ctx.stats["reorder"], ctx.notes["reorder"]
    gm, ctx = _saved_activation_read_first("fwd")
    reorder_pass(gm, ctx)
    assert _names(gm).index("rs") < _names(gm).index("u")
    assert ctx.stats["reorder"]["reordered graphs"] == 1
