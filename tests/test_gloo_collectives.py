"""gloo_collectives: on a gloo group, an all-gather becomes one all-to-all of its repeated shard
and a sum reduce-scatter one all-to-all of its input summed after the wait, at the positions the
passes gave the issue and the wait; values stay (2 and 4 gloo ranks; bitwise on 2; on a mesh that
lists its ranks out of order too, where each rank's tile is at its group rank, as torch's DTensor
places it), the profiler's ``run_node`` sends them the same way, and a graph on another group is
left alone."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from cost_model.testing import fake_world, trace_aten
from dhelix_compile import _torch_compat as compat
from dhelix_compile.capture import gloo_groups
from dhelix_compile.testing.multirank import run_on_ranks
from graph_passes import PassContext
from graph_passes.annotate import annotate_pass
from graph_passes.gloo_collectives import GlooCollectiveOptions, gloo_collectives_pass
from graph_passes.pass_list import pass_names
from graph_passes.verify import verify_pass

c10d = torch.ops._c10d_functional
PASS = "gloo_collectives"


def _gather_then_compute(x: torch.Tensor, w: torch.Tensor, group: object) -> torch.Tensor:
    gathered = funcol.all_gather_single(x, 0, group)  # type: ignore[arg-type]
    early = (x @ w).relu()  # independent compute between the issue and the wait
    return (gathered @ w).sum(0) + early.sum(0)


def _traced(group: object, ranks: int) -> torch.fx.GraphModule:
    x, w = torch.randn(3, 8), torch.randn(8, 8)
    gm = trace_aten(lambda a, b: _gather_then_compute(a, b, group), x, w)
    # issue first, wait last: what reorder makes of an all-gather with compute beside it
    gather = next(n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default)
    wait = next(iter(gather.users))
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    first.prepend(gather)
    return _waited_last(gm, wait)


def _waited_last(gm: torch.fx.GraphModule, wait: torch.fx.Node) -> torch.fx.GraphModule:
    """``wait`` moved right before its first reader, as reorder places a wait."""
    user = min(wait.users, key=lambda n: list(gm.graph.nodes).index(n))
    user.prepend(wait)
    gm.graph.lint()
    gm.recompile()
    return gm


_OPS = {
    c10d.all_gather_into_tensor.default: "ag",
    c10d.reduce_scatter_tensor.default: "rs",
    c10d.all_to_all_single.default: "a2a",
    torch.ops.dhelix.tile_rows.default: "repeat",
    torch.ops.dhelix.sum_row_blocks.default: "blocks",
    c10d.wait_tensor.default: "wait",
    torch.ops.aten.cat.default: "cat",
    torch.ops.aten.mm.default: "mm",
    torch.ops.aten.sum.dim_IntList: "sum",
}


def _ops(gm: torch.fx.GraphModule, *, sums: bool = False) -> list[str]:
    """The graph's collectives, waits, matmuls, repeats and cats (and sums), in order."""
    ops = [_OPS[n.target] for n in gm.graph.nodes if n.target in _OPS]
    return ops if sums else [op for op in ops if op != "sum"]


def _rewritten(gm: torch.fx.GraphModule, groups: frozenset[str]) -> PassContext:
    ctx = PassContext("test", "fwd", pass_options={PASS: GlooCollectiveOptions(groups)})
    annotate_pass(gm, ctx)
    gloo_collectives_pass(gm, ctx)
    verify_pass(gm, ctx)
    gm.recompile()
    return ctx


def test_an_all_gather_becomes_an_all_to_all_of_the_repeated_shard_where_it_was_issued() -> None:
    with fake_world(4) as group:
        gm = _traced(group, 4)
        assert _ops(gm) == ["ag", "mm", "wait", "mm"]
        name = str(next(n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default).args[2])
        ctx = _rewritten(gm, frozenset({name}))
    assert _ops(gm) == ["repeat", "a2a", "mm", "wait", "mm"]
    (repeat,) = [n for n in gm.graph.nodes if n.target == torch.ops.dhelix.tile_rows.default]
    (sent,) = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]
    assert repeat.args[1] == 4 and sent.args[1:] == ([3] * 4, [3] * 4, name)  # the shard is 3 x 8
    assert list(repeat.meta["val"].shape) == [12, 8]
    assert repeat.meta["dhelix"]["kind"] == "compute" and sent.meta["dhelix"]["kind"] == "collective"
    assert ctx.stats[PASS] == {"all-gathers sent as all-to-alls": 1}


def test_other_groups_and_graphs_without_options_are_left_alone() -> None:
    with fake_world(2) as group:
        gm = _traced(group, 2)
        before = _ops(gm)
        ctx = _rewritten(gm, frozenset({"some other group"}))
        assert _ops(gm) == before and PASS not in ctx.stats
        gloo_collectives_pass(gm, PassContext("test", "fwd"))
        assert _ops(gm) == before
        assert gloo_groups(gm) == frozenset()  # the fake group is no gloo group
    assert pass_names()[-2:] == (PASS, "verify")


def _on_ranks(rank: int, world_size: int) -> float:
    group = dist.group.WORLD
    gm = _traced(group, world_size)
    x, w = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank)), torch.randn(8, 8)
    dist.broadcast(w, 0)
    want = gm(x, w)
    groups = gloo_groups(gm)
    assert groups == {compat.group_name(group)}, groups
    _rewritten(gm, groups)
    assert _ops(gm).count("a2a") == 1 and "ag" not in _ops(gm)
    return float((gm(x, w) - want).abs().max())


def _mesh_listed_out_of_order(world_size: int) -> tuple[DeviceMesh, list[Placement], list[Placement]]:
    """``[1, 0]`` (its group: the default one), or ``[[3, 2], [1, 0]]`` and its dim-1 groups
    ``{2, 3}`` and ``{0, 1}`` (group ranks neither the global ranks nor the coordinates); the
    placements of a tensor whose dim 0 that dim shards, and of its partial sums."""
    if world_size == 2:
        return DeviceMesh("cpu", [1, 0]), [Shard(0)], [Partial()]
    return DeviceMesh("cpu", [[3, 2], [1, 0]]), [Replicate(), Shard(0)], [Replicate(), Partial()]


def _gathers_on_a_mesh_listed_out_of_order(rank: int, world_size: int) -> tuple[float, float]:
    """The rewritten all-gather on the sharded dim's group against torch's ``full_tensor()`` of a
    ``distribute_tensor`` on a mesh listed out of order (tile ``i`` on the group's ``i``-th rank);
    and the all-gather of the ranks' partial sums scattered by torch (``Partial() -> Shard(0)``)
    against the rewritten reduce-scatter. Every rank's tile there is not the one at its
    ``get_coordinate()``, so gathering or scattering in the mesh's listed order would differ."""
    mesh, sharded, partial = _mesh_listed_out_of_order(world_size)
    dim = mesh.ndim - 1
    group, n = mesh.get_group(dim), mesh.size(dim)
    full = torch.arange(2.0 * n * 3).reshape(2 * n, 3)
    tiles = distribute_tensor(full, mesh, sharded)
    assert not torch.equal(tiles.to_local(), full.chunk(n)[mesh.get_coordinate()[dim]])  # type: ignore[index]
    gm = trace_aten(lambda x: funcol.all_gather_single(x, 0, group) * 1.0, tiles.to_local())  # type: ignore[arg-type]
    _rewritten(gm, gloo_groups(gm))
    assert _ops(gm).count("a2a") == 1 and "ag" not in _ops(gm)
    gathered = float((gm(tiles.to_local()) - tiles.full_tensor()).abs().max())

    sums = torch.randn(2 * n, 3, generator=torch.Generator().manual_seed(rank))
    want = DTensor.from_local(sums, mesh, partial, run_check=False).redistribute(mesh, sharded).to_local()
    gm = trace_aten(lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, group) * 1.0, sums)  # type: ignore[arg-type]
    _rewritten(gm, gloo_groups(gm))
    assert _ops(gm, sums=True).count("a2a") == 1 and "rs" not in _ops(gm)
    scattered = float((gm(sums) - want).abs().max())
    return gathered, scattered


def _on_ranks_and_a_mesh_listed_out_of_order(rank: int, world_size: int) -> tuple[float, float, float]:
    return _on_ranks(rank, world_size), *_gathers_on_a_mesh_listed_out_of_order(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_all_to_all_gathers_equal_the_all_gather_on_gloo_ranks(world_size: int) -> None:
    """And on a mesh listed out of order: the all-to-all receives in group-rank order, as torch's
    all-gather and reduce-scatter place tiles (``DTensor`` as the oracle)."""
    for diff, gathered, scattered in run_on_ranks(_on_ranks_and_a_mesh_listed_out_of_order, world_size, timeout_s=240):
        assert diff == 0.0
        assert gathered == 0.0
        assert scattered == 0.0 if world_size == 2 else scattered < 1e-6  # 2 ranks: one addition either way


def test_the_all_to_all_keeps_the_price_the_plan_gave_the_all_gather() -> None:
    """The estimator measured the all-gather, never the all-to-all node: the final graph's
    predicted timeline (``PlannedCosts``) must price it as the plan priced the gather."""
    from cost_model import PlannedCosts, TableEstimator, simulate

    with fake_world(4) as group:
        gm = _traced(group, 4)
        gather = next(n for n in gm.graph.nodes if n.target == c10d.all_gather_into_tensor.default)
        estimator = TableEstimator({gather.name: 0.030}, {"compute": 0.001, "collective": 0.0005})
        planned_s = simulate(gm.graph, estimator).makespan_s
        ctx = PassContext(
            "test", "fwd", estimator=estimator, pass_options={PASS: GlooCollectiveOptions(frozenset({gather.args[2]}))}
        )
        annotate_pass(gm, ctx)
        gloo_collectives_pass(gm, ctx)
    assert ctx.stats[PASS] == {"all-gathers sent as all-to-alls": 1}
    assert simulate(gm.graph, estimator).makespan_s < planned_s  # priced as an all-to-all of its own: 0.5 ms
    (repeat,) = [n for n in gm.graph.nodes if n.target == torch.ops.dhelix.tile_rows.default]  # the lowering's own op
    as_planned_s = planned_s + estimator.node_cost(repeat).time_s
    assert simulate(gm.graph, PlannedCosts(estimator)).makespan_s == pytest.approx(as_planned_s)


def _traced_scatter(group: object, ranks: int, op: str = "sum") -> torch.fx.GraphModule:
    x, w = torch.randn(3 * ranks, 8), torch.randn(8, 8)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        scattered = funcol.reduce_scatter_tensor(a @ b, op, 0, group)  # type: ignore[arg-type]
        early = (a @ b).relu()
        return (scattered @ b).sum(0) + early.sum(0)

    gm = trace_aten(f, x, w)
    # issue right after its input, wait last: what reorder makes of it
    scatter = next(n for n in gm.graph.nodes if n.target == c10d.reduce_scatter_tensor.default)
    return _waited_last(gm, next(iter(scatter.users)))


def test_a_reduce_scatter_becomes_an_all_to_all_summed_after_its_wait() -> None:
    with fake_world(4) as group:
        gm = _traced_scatter(group, 4)
        assert _ops(gm, sums=True) == ["mm", "rs", "mm", "wait", "mm", "sum", "sum"]
        name = str(next(n for n in gm.graph.nodes if n.target == c10d.reduce_scatter_tensor.default).args[3])
        ctx = _rewritten(gm, frozenset({name}))
    assert _ops(gm, sums=True) == ["mm", "a2a", "mm", "wait", "blocks", "mm", "sum", "sum"]
    (sent,) = [n for n in gm.graph.nodes if n.target == c10d.all_to_all_single.default]
    assert sent.args[1:] == ([3] * 4, [3] * 4, name)  # the input is 12 x 8: 3 rows per rank
    assert list(sent.meta["val"].shape) == [12, 8] and sent.meta["dhelix"]["kind"] == "collective"
    (wait,) = sent.users
    (total,) = wait.users
    assert total.target == torch.ops.dhelix.sum_row_blocks.default and total.args[1] == 4
    assert list(total.meta["val"].shape) == [3, 8] and total.meta["dhelix"]["kind"] == "compute"
    assert ctx.stats[PASS] == {"reduce-scatters sent as all-to-alls": 1}


def test_a_reduce_scatter_of_another_op_is_left_alone() -> None:
    with fake_world(2) as group:
        gm = _traced_scatter(group, 2, op="avg")
        before = _ops(gm, sums=True)
        name = str(next(n for n in gm.graph.nodes if n.target == c10d.reduce_scatter_tensor.default).args[3])
        ctx = _rewritten(gm, frozenset({name}))
    assert _ops(gm, sums=True) == before
    assert ctx.stats[PASS] == {"reduce-scatter left: reduce op avg": 1}


def test_only_a_gloo_sum_reduce_scatter_is_sent_as_an_all_to_all_by_the_profiler() -> None:
    from cost_model.profile.running import scatter_sent_as_all_to_all

    with fake_world(2) as group:
        for op in ("sum", "avg"):
            gm = _traced_scatter(group, 2, op=op)
            (scatter,) = [n for n in gm.graph.nodes if n.target == c10d.reduce_scatter_tensor.default]
            assert not scatter_sent_as_all_to_all(scatter)  # the fake group is no gloo group


def _scatter_on_ranks(rank: int, world_size: int) -> tuple[float, float]:
    from cost_model.profile.running import run_node, scatter_sent_as_all_to_all

    group = dist.group.WORLD
    gm = _traced_scatter(group, world_size)
    x = torch.randn(3 * world_size, 8, generator=torch.Generator().manual_seed(rank))
    w = torch.randn(8, 8)
    dist.broadcast(w, 0)
    want = gm(x, w)
    groups = gloo_groups(gm)
    assert groups == {compat.group_name(group)}, groups
    scatter = next(n for n in gm.graph.nodes if n.target == c10d.reduce_scatter_tensor.default)
    assert scatter_sent_as_all_to_all(scatter)  # the estimator prices its contention as a move
    y = x @ w
    wanted = c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", world_size, compat.group_name(group)))
    # the profiler's runner sends it as the pass does: the wait it runs adds the received chunks up
    (wait,) = scatter.users
    run = run_node(wait, (run_node(scatter, (y, *scatter.args[1:]), {}),), {})
    _rewritten(gm, groups)
    assert _ops(gm, sums=True).count("a2a") == 1 and "rs" not in _ops(gm, sums=True)
    scale = float(want.abs().max())
    return float((gm(x, w) - want).abs().max()) / scale, float((run - wanted).abs().max()) / float(wanted.abs().max())


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_all_to_all_reduce_scatters_equal_the_reduce_scatter_on_gloo_ranks(world_size: int) -> None:
    """Bitwise on 2 ranks (two operands add the same either way); on 4, gloo's ring adds in
    another order (relative differences of float32 rounding)."""
    for diffs in run_on_ranks(_scatter_on_ranks, world_size, timeout_s=240):
        for diff in diffs:
            assert diff == 0.0 if world_size == 2 else diff < 1e-6


def test_the_copies_around_the_all_to_alls_are_repeat_and_sum_and_inductor_calls_them() -> None:
    x = torch.randn(3, 4, 2)
    assert torch.equal(torch.ops.dhelix.tile_rows(x, 3), x.repeat(3, 1, 1))
    blocks = torch.randn(12, 5)
    assert torch.equal(torch.ops.dhelix.sum_row_blocks(blocks, 4), blocks.view(4, 3, 5).sum(0))

    def f(a: torch.Tensor) -> torch.Tensor:
        return torch.ops.dhelix.sum_row_blocks(torch.ops.dhelix.tile_rows(a * 2, 2), 2) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="inductor", fullgraph=True, dynamic=True)
    for rows in (3, 5):  # symbolic rows: the fake implementations give the shapes
        a = torch.randn(rows, 4)
        assert torch.equal(compiled(a), a * 4 + 1)
