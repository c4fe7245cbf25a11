"""The pass pipeline on hand-built and traced graphs: annotate, verify, the driver, dumps, fallback."""

from __future__ import annotations

import json
import logging
import operator
from typing import Any

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

import graph_passes.pass_list as pass_list
from dhelix_compile.testing.toy_models import MLP
from graph_passes import GraphPass, PassContext, PassError, UnknownPassError, pass_names, run_pipeline
from graph_passes.annotate import annotate_pass
from graph_passes.context import Phase
from graph_passes.verify import VerifyError, verify_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _ctx(phase: Phase = "fwd", **kw: Any) -> PassContext:
    return PassContext(graph_name="test", phase=phase, **kw)


def _gm(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _all_gather_mm_graph(with_wait: bool = True) -> torch.fx.GraphModule:
    """x -> all_gather -> [wait] -> mm(., w);  y = relu(w) independent of the collective."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    gathered = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0"))
    if with_wait:
        gathered = g.call_function(c10d.wait_tensor.default, (gathered,))
    y = g.call_function(aten.relu.default, (w,))
    wt = g.call_function(aten.t.default, (y,))
    out = g.call_function(aten.mm.default, (gathered, wt))
    g.output((out,))
    return _gm(g)


def test_annotate_kinds_and_pairs_collectives_with_waits() -> None:
    gm = annotate_pass(_all_gather_mm_graph(), _ctx("bwd", strand=1))
    meta = {n.name: n.meta["dhelix"] for n in gm.graph.nodes}
    assert meta["all_gather_into_tensor_default"]["kind"] == "collective"
    assert meta["wait_tensor_default"]["kind"] == "wait"
    assert meta["all_gather_into_tensor_default"]["comm_id"] == meta["wait_tensor_default"]["comm_id"] == 0
    assert meta["relu_default"]["kind"] == "compute" and meta["mm_default"]["kind"] == "compute"
    assert meta["t_default"]["kind"] == "view"
    assert meta["x"]["kind"] == "other" and meta["output"]["kind"] == "other"
    assert all(m["phase"] == "bwd" and m["strand"] == 1 for m in meta.values())
    assert "comm_id" not in meta["mm_default"]


def test_annotate_keeps_existing_strand_and_is_idempotent() -> None:
    gm = _all_gather_mm_graph()
    for node in gm.graph.nodes:
        if node.name == "relu_default":
            node.meta["dhelix"] = {"strand": 7}
    ctx = _ctx()
    annotate_pass(gm, ctx)
    first = {n.name: dict(n.meta["dhelix"]) for n in gm.graph.nodes}
    annotate_pass(gm, ctx)
    assert first == {n.name: n.meta["dhelix"] for n in gm.graph.nodes}
    assert first["relu_default"]["strand"] == 7 and first["mm_default"]["strand"] == 0


def test_coalesced_collective_and_p2p_waits_are_paired_through_getitem() -> None:
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    co = g.call_function(c10d.all_reduce_coalesced.default, ([a, b], "sum", "0"))
    waits = [g.call_function(c10d.wait_tensor.default, (g.call_function(operator.getitem, (co, i)),)) for i in range(2)]
    sent = g.call_function(c10d.isend.default, (a, 1, 0, "0"))
    sent_wait = g.call_function(c10d.wait_tensor.default, (sent,))
    g.output((*waits, sent_wait))
    gm = annotate_pass(_gm(g), _ctx())
    meta = {n.name: n.meta["dhelix"] for n in gm.graph.nodes}
    assert meta["all_reduce_coalesced_default"]["kind"] == "collective"
    assert meta["isend_default"]["kind"] == "p2p"
    assert meta["wait_tensor_default"]["comm_id"] == meta["wait_tensor_default_1"]["comm_id"] == 0
    assert meta["wait_tensor_default_2"]["comm_id"] == meta["isend_default"]["comm_id"] == 1
    verify_pass(gm, _ctx())


def test_verify_accepts_a_good_graph_and_counts() -> None:
    ctx = _ctx()
    verify_pass(_all_gather_mm_graph(), ctx)
    assert ctx.stats["verify"]["collective issue with wait"] == 1


def test_reasons_are_counted_by_code_and_their_details_noted_apart() -> None:
    ctx = _ctx()
    ctx.count("p", "skipped: no estimator")
    ctx.explain("p", "site: skipped: indivisible", "site0: dim 1 (3) not divisible by 2")
    ctx.explain("p", "site: skipped: indivisible", "site1: dim 0 (5) not divisible by 2", n=2)
    ctx.explain("p", "site: skipped: indivisible", "site0: dim 1 (3) not divisible by 2")
    assert ctx.stats["p"] == {"skipped: no estimator": 1, "site: skipped: indivisible": 4}
    # distinct details, in the order they came; none for a code only counted
    assert ctx.notes["p"] == {
        "site: skipped: indivisible": ["site0: dim 1 (3) not divisible by 2", "site1: dim 0 (5) not divisible by 2"]
    }


def test_annotate_explains_a_wait_without_an_issue() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(c10d.wait_tensor.default, (x,)))
    ctx = _ctx()
    annotate_pass(_gm(g), ctx)
    assert ctx.stats["annotate"]["wait without a collective issue"] == 1
    assert ctx.notes["annotate"]["wait without a collective issue"]


def test_verify_rejects_a_collective_without_wait() -> None:
    with pytest.raises(VerifyError, match=r"'all_gather_into_tensor_default'.*has no wait_tensor"):
        verify_pass(_all_gather_mm_graph(with_wait=False), _ctx())


def test_verify_rejects_a_wait_on_a_non_collective() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(c10d.wait_tensor.default, (g.call_function(aten.relu.default, (x,)),)),))
    with pytest.raises(VerifyError, match="completes no collective"):
        verify_pass(_gm(g), _ctx())


def test_verify_rejects_a_read_before_the_wait() -> None:
    gm = _all_gather_mm_graph()
    issue = next(n for n in gm.graph.nodes if n.name == "all_gather_into_tensor_default")
    with gm.graph.inserting_after(issue):
        early = gm.graph.call_function(aten.relu.default, (issue,))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((output.args[0][0], early),)
    with pytest.raises(VerifyError, match="read by \\['relu_default_1'\\] before its wait_tensor"):
        verify_pass(gm, _ctx())


def test_verify_rejects_a_broken_topological_order() -> None:
    gm = _all_gather_mm_graph()
    mm = next(n for n in gm.graph.nodes if n.name == "mm_default")
    first = next(iter(gm.graph.nodes))
    first.prepend(mm)  # mm now runs before its inputs exist
    with pytest.raises(RuntimeError, match="used before it has been defined"):
        verify_pass(gm, _ctx())


def test_annotate_on_a_traced_model_graph() -> None:
    model = MLP()
    gm = make_fx(lambda x: model(x))(torch.randn(2, 16))
    annotate_pass(gm, _ctx())
    kinds = {n.meta["dhelix"]["kind"] for n in gm.graph.nodes}
    assert kinds <= {"compute", "view", "other"} and "compute" in kinds


# ---------------------------------------------------------------- driver


def _add_clone_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        clone = gm.graph.call_function(aten.clone.default, (output.args[0][0],))
    output.args = ((clone,),)
    ctx.count("add_clone", "clones added")
    return gm


def _boom_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    raise ValueError("cannot schedule this")


def test_driver_runs_in_order_skips_disabled_and_logs_times(caplog) -> None:
    passes = [
        GraphPass("annotate", annotate_pass, ""),
        GraphPass("add_clone", _add_clone_pass, ""),
        GraphPass("boom", _boom_pass, ""),
    ]
    ctx = _ctx()
    with caplog.at_level(logging.INFO, logger="dhelix"):
        gm = run_pipeline(_all_gather_mm_graph(), ctx, passes=passes, disabled=["boom"])
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"][-1] == aten.clone.default
    assert ctx.stats["add_clone"]["clones added"] == 1
    assert "test: pass add_clone" in caplog.text and "ms" in caplog.text
    assert "test: pass boom disabled" in caplog.text


def _relu_to_abs_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.target == aten.relu.default:
            node.target = aten.abs.default
    return gm


def _move_relu_first_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    relu = next(n for n in gm.graph.nodes if n.target == aten.relu.default)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    first.prepend(relu)
    return gm


def _pointwise_graph() -> torch.fx.GraphModule:
    """x -> neg, relu (independent) -> add; returns (add, relu)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    negated = g.call_function(aten.neg.default, (x,))
    y = g.call_function(aten.relu.default, (x,))
    g.output((g.call_function(aten.add.Tensor, (negated, y)), y))
    return _gm(g)


def test_driver_regenerates_the_code_exactly_when_a_pass_changed_what_it_is_made_of(monkeypatch) -> None:
    x = torch.randn(8)
    recompiles = []
    real_recompile = torch.fx.GraphModule.recompile
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: recompiles.append(1) or real_recompile(self))

    def run(*fns: Any) -> torch.fx.GraphModule:
        gm = _pointwise_graph()
        recompiles.clear()
        return run_pipeline(gm, _ctx(), passes=[GraphPass(f"p{i}", fn, "") for i, fn in enumerate(fns)])

    gm = run(lambda gm, ctx: gm, lambda gm, ctx: gm)
    assert len(recompiles) == 1  # the driver's own, before the first pass
    torch.testing.assert_close(gm(x), (torch.relu(x) - x, torch.relu(x)))

    gm = run(lambda gm, ctx: gm, _relu_to_abs_pass, lambda gm, ctx: gm)  # a target changed in place
    assert len(recompiles) == 2
    torch.testing.assert_close(gm(x), (x.abs() - x, x.abs()))

    gm = run(_move_relu_first_pass)  # the same nodes in another order
    assert len(recompiles) == 2 and gm.code.index("relu") < gm.code.index("neg")

    gm = run(_add_clone_pass)  # an argument of the output replaced
    assert len(recompiles) == 2 and "clone" in gm.code
    torch.testing.assert_close(gm(x)[0], torch.relu(x) - x)


def test_driver_wraps_pass_errors_with_the_pass_name() -> None:
    passes = [GraphPass("boom", _boom_pass, "")]
    with pytest.raises(PassError, match="dhelix pass 'boom' failed on graph 'test': ValueError: cannot schedule"):
        run_pipeline(_all_gather_mm_graph(), _ctx(), passes=passes)


def test_driver_rejects_unknown_disabled_names() -> None:
    with pytest.raises(UnknownPassError, match="'nope'"):
        run_pipeline(_all_gather_mm_graph(), _ctx(), disabled=["nope"])


# ---------------------------------------------------------------- through torch.compile


def _train_once(options: dict) -> torch.Tensor:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="dhelix", options=options)
    out = compiled(torch.randn(4, 16))
    out.sum().backward()
    return out


def _pass_stems() -> list[str]:
    """Dump file stems of the pipeline's passes: ``01_collapse_waits``, ``02_combine_all_reduces``, ..."""
    return [f"{i:02d}_{name}" for i, name in enumerate(pass_names(), start=1)]


def _annotate_stem() -> str:
    return next(stem for stem in _pass_stems() if stem.endswith("_annotate"))


def test_dumps_every_pass_before_after_and_op_count_diff(tmp_path) -> None:
    _train_once({"codegen": "eager", "fallback": "error", "dump_dir": str(tmp_path)})
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())  # beside them, compile_clock.json
    assert any(f.endswith("_fwd") for f in folders) and any(f.endswith("_bwd") for f in folders)
    for folder in (tmp_path / name for name in folders):
        names = sorted(p.name for p in folder.iterdir())
        for stem in _pass_stems():
            assert {f"{stem}.before.txt", f"{stem}.after.txt", f"{stem}.opcount.txt"} <= set(names)
        assert "00_input.txt" in names
        after = (folder / f"{_annotate_stem()}.after.txt").read_text()
        assert "node.meta['dhelix']" in after and "'kind': 'compute'" in after
        assert "total:" in (folder / f"{_annotate_stem()}.opcount.txt").read_text()
        summary = json.loads((folder / "summary.json").read_text())
        assert set(summary["pass_seconds"]) == set(pass_names())
        assert summary["stats"]["annotate"]["compute"] > 0


def test_disable_passes_option_skips_them(tmp_path) -> None:
    _train_once({"codegen": "eager", "fallback": "error", "dump_dir": str(tmp_path), "disable_passes": "verify"})
    for folder in (p for p in tmp_path.iterdir() if p.is_dir()):
        assert not (folder / f"{_pass_stems()[-1]}.after.txt").exists()
        assert (folder / f"{_annotate_stem()}.after.txt").exists()


@pytest.fixture
def failing_pipeline(monkeypatch):
    monkeypatch.setattr(pass_list, "PASSES", (*pass_list.PASSES, GraphPass("boom", _boom_pass, "")))


@pytest.mark.inductor
def test_failing_pass_falls_back_to_plain_inductor_with_a_warning(failing_pipeline, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="dhelix"):
        out = _train_once({"codegen": "eager", "fallback": "inductor"})
    assert "dhelix pass 'boom' failed" in caplog.text
    assert "falling back to plain Inductor" in caplog.text
    torch.manual_seed(0)
    model = MLP()
    torch.testing.assert_close(out, model(torch.randn(4, 16)))


def test_failing_pass_raises_with_fallback_error(failing_pipeline) -> None:
    with pytest.raises(Exception, match=r"dhelix pass 'boom' failed on graph '.*fwd'"):
        _train_once({"codegen": "eager", "fallback": "error"})
