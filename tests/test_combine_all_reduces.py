"""combine_all_reduces: traced graphs on a fake world (structure, reasons, random sum trees), then
numerics on real gloo ranks (2 and 4) and the Megatron-TP reference model through the backend."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_model.testing import fake_world, trace_aten
from dhelix_compile.testing.multirank import run_on_ranks
from graph_passes import PassContext
from graph_passes.annotate import annotate_pass
from graph_passes.combine_all_reduces import PASS, combine_all_reduces_pass, find_summed_all_reduces
from graph_passes.pass_list import pass_names
from graph_passes.verify import verify_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _qkv_grad(dq, dk, dv, wq, wk, wv, residual, group):
    """The backward of three column-parallel projections of one input, plus a local term."""
    parts = [funcol.all_reduce(d @ w, "sum", group) for d, w in ((dq, wq), (dk, wk), (dv, wv))]
    return parts[0] + parts[1] + parts[2] + residual


_QKV_SHAPES = [(8, 4), (8, 4), (8, 4), (4, 6), (4, 6), (4, 6), (8, 6)]


def _run(gm) -> PassContext:
    ctx = PassContext("test", "bwd")
    combine_all_reduces_pass(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    annotate_pass(gm, ctx)
    verify_pass(gm, ctx)
    return ctx


def _ops(gm) -> list[str]:
    names = {c10d.all_reduce.default: "ar", c10d.wait_tensor.default: "wait", aten.mm.default: "mm"}
    return [names[n.target] for n in gm.graph.nodes if n.target in names]


def test_three_summed_all_reduces_become_one_issued_after_the_last_partial() -> None:
    with fake_world(2) as group:
        gm = trace_aten(lambda *a: _qkv_grad(*a, group), *[torch.randn(s) for s in _QKV_SHAPES])
        assert _ops(gm) == ["mm", "ar", "wait", "mm", "ar", "wait", "mm", "ar", "wait"]
        ctx = _run(gm)
    assert _ops(gm) == ["mm", "mm", "mm", "ar", "wait"]
    assert ctx.stats[PASS] == {"combined": 1, "all-reduces removed": 2}
    # the sum of the partials feeds the all-reduce; the local term is added after the wait
    issue = next(n for n in gm.graph.nodes if n.target == c10d.all_reduce.default)
    assert issue.args[0].target == aten.add.Tensor and issue.args[1:] == ("sum", group.group_name)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    result = output.args[0]
    assert result.target == aten.add.Tensor and result.args[0].target == c10d.wait_tensor.default
    assert all(n.meta["dhelix"]["kind"] for n in gm.graph.nodes)  # annotate tagged the new nodes


def test_values_equal_the_original_graph_on_the_fake_world() -> None:
    # the fake group's all-reduce returns its input, so this checks which partials and terms are summed
    inputs = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(_QKV_SHAPES)]
    with fake_world(2) as group:
        gm = trace_aten(lambda *a: _qkv_grad(*a, group), *inputs)
        want = gm(*inputs)
        _run(gm)
        got = gm(*inputs)
    torch.testing.assert_close(got, want)


def _leaves_left_alone(a, b, c, d, group):
    kept_for_later = funcol.all_reduce(a, "sum", group)
    return (
        kept_for_later + funcol.all_reduce(b, "sum", group) + funcol.all_reduce(c, "max", group) + d,
        kept_for_later * 2,
    )


def test_all_reduces_that_cannot_combine_are_left_alone_with_reasons() -> None:
    with fake_world(2) as group:
        gm = trace_aten(lambda *a: _leaves_left_alone(*a, group), *[torch.randn(4, 4)] * 4)
        before = _ops(gm)
        ctx = _run(gm)
    assert _ops(gm) == before
    assert ctx.stats[PASS] == {
        "not combined: result read elsewhere": 1,
        "not combined: reduce op": 1,
        "not combined: no partner": 1,
    }


def _two_groups(a, b, c, d, group, other):
    return (
        funcol.all_reduce(a, "sum", group)
        + funcol.all_reduce(b, "sum", other)
        + funcol.all_reduce(c, "sum", group)
        + funcol.all_reduce(d, "sum", other)
    )


def test_each_group_gets_its_own_all_reduce() -> None:
    with fake_world(4) as group:
        other = dist.new_group([0, 1])
        gm = trace_aten(lambda *a: _two_groups(*a, group, other), *[torch.randn(4, 4)] * 4)
        ctx = _run(gm)
    groups = [n.args[2] for n in gm.graph.nodes if n.target == c10d.all_reduce.default]
    assert sorted(groups) == sorted([group.group_name, other.group_name])
    assert ctx.stats[PASS]["all-reduces removed"] == 2


def test_mixed_precision_and_broadcasting_sums_are_not_trees() -> None:
    def fn(a, b, bias, group):
        return funcol.all_reduce(a, "sum", group) + funcol.all_reduce(b, "sum", group).half() + bias

    with fake_world(2) as group:
        gm = trace_aten(lambda *a: fn(*a, group), torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
        assert find_summed_all_reduces(gm.graph) == []


@st.composite
def _sum_trees(draw: st.DrawFn) -> list:
    """A random add tree (nested pairs) over all-reduced and local terms, with ops and groups."""
    leaves = draw(
        st.lists(
            st.tuples(st.sampled_from(["ar", "local"]), st.sampled_from(["sum", "sum", "avg", "max"]), st.booleans()),
            min_size=2,
            max_size=7,
        )
    )
    while len(leaves) > 1:  # pair up neighbours at random until one tree is left
        i = draw(st.integers(0, len(leaves) - 2))
        leaves[i : i + 2] = [(leaves[i], leaves[i + 1])]
    return leaves[0]


def _evaluate(tree, xs, group, other):
    if isinstance(tree[0], str):
        kind, op, in_other = tree
        x = xs.pop()
        return funcol.all_reduce(x * 1.5, op, other if in_other else group) if kind == "ar" else x * 1.5
    return _evaluate(tree[0], xs, group, other) + _evaluate(tree[1], xs, group, other)


def _count_leaves(tree) -> list[tuple]:
    return [tree] if isinstance(tree[0], str) else _count_leaves(tree[0]) + _count_leaves(tree[1])


@settings(max_examples=40, deadline=None)
@given(tree=_sum_trees())
def test_random_sum_trees_keep_their_value_and_combine_each_op_and_group(tree) -> None:
    leaves = _count_leaves(tree)
    inputs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(i)) for i in range(len(leaves))]
    with fake_world(4) as group:
        other = dist.new_group([0, 1, 2, 3])
        gm = trace_aten(lambda *a: _evaluate(tree, list(a), group, other), *inputs)
        want = gm(*inputs)
        _run(gm)
        got = gm(*inputs)
    torch.testing.assert_close(got, want)
    linear = [(op, g) for kind, op, g in leaves if kind == "ar" and op in ("sum", "avg")]
    others = [1 for kind, op, _ in leaves if kind == "ar" and op not in ("sum", "avg")]
    issues = [n for n in gm.graph.nodes if n.target == c10d.all_reduce.default]
    assert len(issues) == len(set(linear)) + len(others)


# ------------------------------------------------------------------------------ real ranks


def _on_ranks(rank: int, world_size: int) -> float:
    """The traced q/k/v gradient on this rank's random inputs, combined, against eager funcol."""
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in _QKV_SHAPES]
    want = _qkv_grad(*inputs, group)
    gm = trace_aten(lambda *a: _qkv_grad(*a, group), *inputs)
    ctx = _run(gm)
    assert ctx.stats[PASS]["all-reduces removed"] == 2
    got = gm(*inputs)
    return float((got - want).abs().max())


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_combined_equals_eager_on_gloo_ranks(world_size: int) -> None:
    for diff in run_on_ranks(_on_ranks, world_size, timeout_s=240):
        assert diff < 1e-12


def _tp_reference(rank: int, world_size: int) -> dict[str, int]:
    import dhelix_compile
    from dhelix_compile.testing.checks import check_against_reference

    with tempfile.TemporaryDirectory() as dump_dir:
        backend = dhelix_compile.backend(codegen="eager", fallback="error", dump_dir=dump_dir, cost_model="analytic")
        check_against_reference(rank, world_size, "tp", backend)
        total: dict[str, int] = {}
        for path in sorted((Path(dump_dir) / f"rank{rank}").glob("*/summary.json")):
            for k, v in json.loads(path.read_text())["stats"].get(PASS, {}).items():
                total[k] = total.get(k, 0) + v
        return total


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_megatron_tp_reference_model_combines_its_input_gradient_all_reduces() -> None:
    """PyTorch's TP plan on the reference transformer: per layer, the backward's q/k/v and w1/w3
    input gradients each all-reduced once (5 -> 2), gradients as the single-process reference."""
    for stats in run_on_ranks(_tp_reference, 2, timeout_s=540):
        assert stats.get("combined", 0) >= 4, stats  # 2 sums per layer, 2 layers at least
        assert stats.get("all-reduces removed", 0) >= 6, stats


def test_runs_before_annotate_so_annotate_tags_what_it_adds() -> None:
    names = pass_names()
    assert names.index(PASS) < names.index("annotate")
