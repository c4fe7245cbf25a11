"""Per-node estimates: FLOPs / bytes formulas, roofline time, symbolic sizes, collectives."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sympy
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from cost_model import (
    AnalyticEstimator,
    Device,
    Link,
    TableEstimator,
    evaluate,
    graph_size_hints,
    graph_time_expr,
    op_bytes,
    op_flops,
)
from cost_model.testing import fake_world, trace_aten

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

DEVICE = Device(
    "unit",
    {torch.float32: 1e12, torch.bfloat16: 4e12},
    mem_bandwidth_bytes_per_s=1e11,
    launch_overhead_s=1e-6,
    source="unit test",
)
LINK = Link("unit_link", bandwidth_bytes_per_s=1e10, latency_s=1e-5, source="unit test")


@pytest.fixture
def world4() -> Iterator[object]:
    with fake_world(4) as group:
        yield group


_MODE = FakeTensorMode()


def _fake(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with _MODE:
        return torch.empty(shape, dtype=dtype)


def _hand_graph(
    target: object,
    in_shapes: list[tuple[int, ...]],
    out_shape: tuple[int, ...],
    extra_args: tuple[object, ...] = (),
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.fx.Graph, torch.fx.Node]:
    g = torch.fx.Graph()
    inputs = []
    for i, shape in enumerate(in_shapes):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = _fake(*shape, dtype=dtype)
        inputs.append(p)
    node = g.call_function(target, (*inputs, *extra_args))
    node.meta["val"] = _fake(*out_shape, dtype=dtype)
    g.output(node)
    return g, node


def test_mm_flops_bytes_and_time_exact() -> None:
    m, k, n = 128, 256, 64
    _, mm = _hand_graph(aten.mm.default, [(m, k), (k, n)], (m, n))
    assert op_flops(mm) == 2 * m * k * n
    assert op_bytes(mm) == 4 * (m * k + k * n + m * n)
    cost = AnalyticEstimator(DEVICE, LINK).node_cost(mm)
    assert cost.kind == "compute"
    assert cost.flops == 2 * m * k * n
    expected = 1e-6 + max(2 * m * k * n / 1e12, 4 * (m * k + k * n + m * n) / 1e11)
    assert cost.time_s == pytest.approx(expected)
    assert cost.output_bytes == 4 * m * n
    assert float(cost.time_expr) == pytest.approx(expected)


def test_dtype_selects_peak() -> None:
    m = k = n = 1024
    _, mm16 = _hand_graph(aten.mm.default, [(m, k), (k, n)], (m, n), dtype=torch.bfloat16)
    cost = AnalyticEstimator(DEVICE, LINK).node_cost(mm16)
    assert cost.time_s == pytest.approx(1e-6 + 2 * m * k * n / 4e12)


@pytest.mark.parametrize(
    ("target", "ins", "out", "flops"),
    [
        (aten.bmm.default, [(4, 8, 16), (4, 16, 32)], (4, 8, 32), 2 * 4 * 8 * 16 * 32),
        (aten.addmm.default, [(32,), (8, 16), (16, 32)], (8, 32), 2 * 8 * 16 * 32),
        (aten.baddbmm.default, [(4, 8, 32), (4, 8, 16), (4, 16, 32)], (4, 8, 32), 2 * 4 * 8 * 16 * 32),
        (aten.linear.default, [(2, 8, 16), (32, 16)], (2, 8, 32), 2 * 2 * 8 * 16 * 32),
    ],
)
def test_matmul_family_flops(target: object, ins: list[tuple[int, ...]], out: tuple[int, ...], flops: int) -> None:
    _, node = _hand_graph(target, ins, out)
    assert op_flops(node) == flops


def test_conv_and_backward_match_flop_counter() -> None:
    x = torch.randn(2, 3, 10, 10, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.nn.functional.conv2d(x, w, padding=1)
        return (y, *torch.autograd.grad(y.sum(), [x, w]))

    with FlopCounterMode(display=False) as counter:
        f(x, w)
    gm = trace_aten(f, x, w)
    convs = [n for n in gm.graph.nodes if n.target in (aten.convolution.default, aten.convolution_backward.default)]
    assert len(convs) == 2
    assert sum(op_flops(n) for n in convs) == counter.get_total_flops()


def test_cpu_sdpa_forward_and_backward() -> None:
    q = torch.randn(2, 4, 16, 8, requires_grad=True)

    def f(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        o = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return (o, *torch.autograd.grad(o.sum(), [q]))

    gm = trace_aten(f, q)
    by_name = {str(n.target): n for n in gm.graph.nodes}
    fwd = by_name["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    bwd = by_name["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    b, h, s, d = 2, 4, 16, 8
    assert op_flops(fwd) == 2 * (2 * b * h * s * s * d)
    assert op_flops(bwd) == 5 * (2 * b * h * s * s * d)


def test_views_free_elementwise_by_numel_embedding_reads_rows() -> None:
    def f(x: torch.Tensor, table: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        v = x.view(-1).t() if x.dim() == 1 else x.view(-1)
        return v.relu(), x.sum(), torch.nn.functional.embedding(idx, table)

    x = torch.randn(8, 16)
    table = torch.randn(1000, 32)
    idx = torch.zeros(5, dtype=torch.long)
    gm = trace_aten(f, x, table, idx)
    est = AnalyticEstimator(DEVICE, LINK)
    nodes = {str(n.target): n for n in gm.graph.nodes}
    view = est.node_cost(nodes["aten.view.default"])
    assert (view.kind, view.time_s, view.output_bytes) == ("view", 0.0, 0)
    relu = nodes["aten.relu.default"]
    assert op_flops(relu) == 128 and op_bytes(relu) == 2 * 128 * 4
    total = nodes["aten.sum.default"]
    assert op_flops(total) == 128 and op_bytes(total) == 128 * 4 + 4
    emb = nodes["aten.embedding.default"]
    assert op_flops(emb) == 0
    assert op_bytes(emb) == 5 * 8 + 2 * 5 * 32 * 4  # indices + rows read + rows written


def test_symbolic_cost_grows_with_sequence_length() -> None:
    def attn_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.bmm(q, k.transpose(1, 2))

    gm = trace_aten(attn_scores, torch.randn(3, 24, 16), torch.randn(3, 24, 16), dynamic=True)
    est = AnalyticEstimator(DEVICE, LINK)
    bmm = next(n for n in gm.graph.nodes if n.target == aten.bmm.default)
    flops_expr = op_flops(bmm)
    assert isinstance(flops_expr, sympy.Expr)
    (b, s, d) = (sym for sym in bmm.args[0].meta["val"].shape)
    seq = s.node.expr
    assert sympy.expand(flops_expr - 2 * b.node.expr * d.node.expr * seq**2) == 0
    cost = est.node_cost(bmm)
    assert cost.flops == 2 * 3 * 24 * 24 * 16
    hints = graph_size_hints(gm)
    assert hints[seq] == 24
    total = graph_time_expr(gm, est)
    node_sum = sum(est.node_cost(n).time_s for n in gm.graph.nodes)
    assert evaluate(total, hints) == pytest.approx(node_sum)
    # extrapolate: a 64x longer sequence makes the compute-bound bmm 4096x the FLOPs
    longer = dict(hints) | {seq: 24 * 64}
    assert evaluate(flops_expr, longer) == 4096 * cost.flops


def test_tensor_meta_fallback() -> None:
    g, mm = _hand_graph(aten.mm.default, [(4, 8), (8, 2)], (4, 2))
    for node in g.nodes:
        if "val" in node.meta:
            from torch.fx.passes.shape_prop import _extract_tensor_metadata

            node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta.pop("val"))
    assert op_flops(mm) == 2 * 4 * 8 * 2


def test_collective_costs_read_group_size_from_args(world4: object) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g = funcol.all_gather_single(x, 0, dist.group.WORLD)
        r = funcol.reduce_scatter_single(g, "sum", 0, dist.group.WORLD)
        a = funcol.all_reduce(r, "sum", dist.group.WORLD)
        return g, a

    gm = trace_aten(f, torch.randn(16, 32))
    est = AnalyticEstimator(DEVICE, LINK)
    costs = {str(n.target): est.node_cost(n) for n in gm.graph.nodes}
    x_bytes = 16 * 32 * 4
    ag = costs["_c10d_functional.all_gather_into_tensor.default"]
    assert (ag.kind, ag.collective, ag.group_size) == ("collective", "all_gather", 4)
    assert ag.comm_bytes == 3 * x_bytes  # (n-1)/n of the gathered 4*x
    assert ag.time_s == pytest.approx(8.4e-6 + 3 * 1e-5 + 3 * x_bytes / 1e10)
    assert ag.output_bytes == 4 * x_bytes
    rs = costs["_c10d_functional.reduce_scatter_tensor.default"]
    assert rs.comm_bytes == 3 * x_bytes
    ar = costs["_c10d_functional.all_reduce.default"]  # group size from the fake pg
    assert (ar.group_size, ar.comm_bytes) == (4, 2 * 3 * x_bytes // 4)
    wait = costs["_c10d_functional.wait_tensor.default"]
    assert (wait.kind, wait.time_s, wait.output_bytes) == ("wait", 0.0, 0)
    gloo = AnalyticEstimator(DEVICE, LINK, comm_backend="gloo")
    rs_node = next(n for n in gm.graph.nodes if n.target == c10d.reduce_scatter_tensor.default)
    # sent as an all-to-all (graph_passes.gloo_collectives): NCCL's bytes, not gloo's all-reduce's
    assert gloo.node_cost(rs_node).comm_bytes == rs.comm_bytes


def test_inter_node_link_for_groups_beyond_a_node(world4: object) -> None:
    gm = trace_aten(lambda x: funcol.all_reduce(x, "sum", dist.group.WORLD), torch.randn(1024))
    ar = next(n for n in gm.graph.nodes if n.target == c10d.all_reduce.default)
    slow = Link("slow", 1e9, 1e-4, "unit test")
    intra = AnalyticEstimator(DEVICE, LINK).node_cost(ar).time_s
    multi = AnalyticEstimator(DEVICE, LINK, inter_node_link=slow, ranks_per_node=2).node_cost(ar)
    assert multi.time_s > intra


def test_group_size_fallback_and_error() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = _fake(256)
    ar = g.call_function(c10d.all_reduce.default, (x, "sum", "no_such_group"))
    ar.meta["val"] = _fake(256)
    g.output(ar)
    assert AnalyticEstimator(DEVICE, LINK, world_size=8).node_cost(ar).group_size == 8
    with pytest.raises(ValueError, match="world_size"):
        AnalyticEstimator(DEVICE, LINK).node_cost(ar)


def test_table_estimator() -> None:
    g, mm = _hand_graph(aten.mm.default, [(4, 8), (8, 2)], (4, 2))
    est = TableEstimator({mm.name: 3.0}, {"compute": 1.0}, output_bytes={mm.name: 99})
    cost = est.node_cost(mm)
    assert (cost.time_s, cost.output_bytes, cost.kind) == (3.0, 99, "compute")
    placeholder = next(iter(g.nodes))
    assert est.node_cost(placeholder).output_bytes == 4 * 8 * 4
    assert TableEstimator(kind_times_s={"compute": 2.0}).node_cost(mm).time_s == 2.0


def test_all_to_all_broadcast_coalesced_and_p2p(world4: object) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a2a = funcol.all_to_all_single(x, None, None, dist.group.WORLD)
        bc = funcol.broadcast(x, 0, dist.group.WORLD)
        co = funcol.all_reduce_coalesced([x, x * 2], "sum", dist.group.WORLD)
        return (a2a, bc, *co)

    gm = trace_aten(f, torch.randn(8, 16))
    est = AnalyticEstimator(DEVICE, LINK)
    costs = {str(n.target): est.node_cost(n) for n in gm.graph.nodes}
    s = 8 * 16 * 4
    a2a = costs["_c10d_functional.all_to_all_single.default"]
    assert (a2a.collective, a2a.comm_bytes) == ("all_to_all", 3 * s // 4)
    bc = costs["_c10d_functional.broadcast.default"]
    assert (bc.collective, bc.comm_bytes) == ("broadcast", s)
    co = costs["_c10d_functional.all_reduce_coalesced.default"]
    assert (co.collective, co.comm_bytes) == ("all_reduce", 2 * (3 * (2 * s) // 4))

    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = _fake(1024)
    send = g.call_function(c10d.isend.default, (x, 1, 0, "0"))
    send.meta["val"] = _fake(1024)
    g.output(send)
    cost = est.node_cost(send)
    assert (cost.kind, cost.collective, cost.comm_bytes) == ("p2p", "send", 4096)
    assert cost.time_s == pytest.approx(8.4e-6 + 1e-5 + 4096 / 1e10)  # base + alpha + S/B


def test_symbolic_formula_that_compares_sizes_is_evaluated_at_hints() -> None:
    def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, False)[0]

    kv = torch.randn(2, 2, 16, 8)
    gm = trace_aten(gqa, torch.randn(2, 8, 16, 8), kv, kv, dynamic=True)
    node = next(n for n in gm.graph.nodes if n.target == aten._scaled_dot_product_efficient_attention.default)
    assert op_flops(node) == 2 * (2 * 2 * 8 * 16 * 16 * 8)


def test_grouped_query_attention_keeps_its_flops_where_torch_asserts_equal_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's SDPA formulas assert as many key heads as query heads; a grouped-query
    kernel still costs its matmuls, with the key and value heads broadcast (not an elementwise op)."""
    from torch.utils import flop_counter

    q = torch.randn(2, 8, 16, 8, requires_grad=True)
    kv = torch.randn(2, 2, 16, 8, requires_grad=True)

    def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return (o, *torch.autograd.grad(o.sum(), [q, k]))

    gm = trace_aten(gqa, q, kv, kv)
    attention = [n for n in gm.graph.nodes if "attention" in str(n.target)]
    expected = {str(n.target): op_flops(n) for n in attention}
    assert len(expected) == 2 and all(v > 0 for v in expected.values())
    sdpa, sdpa_backward = flop_counter.sdpa_flop_count, flop_counter.sdpa_backward_flop_count

    def equal_heads(count: Any) -> Any:
        def formula(*shapes: Any) -> Any:
            heads = {shape[1] for shape in shapes}
            assert len(heads) == 1, "as torch 2.11 asserts"
            return count(*shapes)

        return formula

    monkeypatch.setattr(flop_counter, "sdpa_flop_count", equal_heads(sdpa))
    monkeypatch.setattr(flop_counter, "sdpa_backward_flop_count", equal_heads(sdpa_backward))
    b, h, s, d = 2, 8, 16, 8
    assert {str(n.target): op_flops(n) for n in attention} == expected
    assert sorted(expected.values()) == [2 * (2 * b * h * s * s * d), 5 * (2 * b * h * s * s * d)]


def test_inplace_and_schema_views_allocate_nothing() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y.add_(1)
        return y.diagonal()

    gm = trace_aten(f, torch.randn(6, 6))
    est = AnalyticEstimator(DEVICE, LINK)
    by_target = {str(n.target): est.node_cost(n) for n in gm.graph.nodes}
    assert by_target["aten.clone.default"].output_bytes == 144
    assert by_target["aten.diagonal.default"].output_bytes == 0
    assert by_target["aten.diagonal.default"].time_s == 0.0


def test_memoized_estimator_costs_each_node_once_and_forwards_attributes() -> None:
    from cost_model import MemoizedEstimator, NodeCost, TableEstimator

    calls: list[str] = []

    class Counting(TableEstimator):
        def node_cost(self, node: torch.fx.Node) -> NodeCost:
            calls.append(node.name)
            return super().node_cost(node)

    gm = torch.fx.symbolic_trace(lambda x: (x + 1).relu())
    memo = MemoizedEstimator(Counting(default_s=1.0, contention_factor=1.3))
    nodes = list(gm.graph.nodes)
    first = [memo.node_cost(n) for n in nodes]
    assert [memo.node_cost(n) for n in nodes] == first
    assert calls == [n.name for n in nodes]
    assert memo.contention_factor == 1.3


def test_every_estimator_answers_the_whole_protocol(tmp_path) -> None:
    """contention_factor, segment_pair_times and measure_new are part of :class:`Estimator`:
    called directly, with the neutral answer where an estimator has no real one."""
    from cost_model import Estimator, MemoizedEstimator, ProfiledEstimator

    gm = trace_aten(lambda x, w: (x @ w).relu(), torch.randn(4, 8), torch.randn(8, 8))
    nodes = list(gm.graph.nodes)
    analytic = AnalyticEstimator(DEVICE, LINK, contention_factor=1.2)
    table = TableEstimator(default_s=1.0)
    profiled = ProfiledEstimator(analytic, tmp_path, progress=False)
    for est in (analytic, table, profiled, MemoizedEstimator(table), MemoizedEstimator(profiled)):
        assert isinstance(est, Estimator)
        assert est.contention_factor >= 1.0
    for est in (analytic, table, MemoizedEstimator(table)):
        assert est.segment_pair_times([nodes[:2]], [nodes[2:]]) == {}  # nothing measured
    pairs = MemoizedEstimator(profiled).segment_pair_times([nodes[:2]], [nodes[2:]])  # measured here
    assert set(pairs) == {(0, None), (None, 0), (0, 0)} and min(pairs.values()) > 0
    asked = MemoizedEstimator(profiled).segment_pair_times([nodes[:2]], [nodes[2:]], [(0, 0)])  # those asked for
    assert asked == {(0, 0): pairs[(0, 0)]}  # from the memo: measured above
    assert table.contention_factor == MemoizedEstimator(table).contention_factor == 1.0
    assert profiled.contention_factor == MemoizedEstimator(profiled).contention_factor == 1.2
    assert table.measure_new(nodes) is None and MemoizedEstimator(analytic).measure_new(nodes) is None
    report = MemoizedEstimator(profiled).measure_new(nodes)  # the profiled one measures them
    assert report.measured == 2 and profiled.measurements
