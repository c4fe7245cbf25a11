"""bucket_collectives: parameter gathers and gradient reductions of one group and dtype become one
collective per bucket; activations' collectives stay alone. Structure on a fake world, values on
real gloo ranks (2 and 4) against the unbucketed graph, and the data-parallel model through the
backend."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cost_model.testing import fake_world, trace_aten
from dhelix_compile.testing.multirank import run_on_ranks
from graph_passes import PassContext
from graph_passes.annotate import annotate_pass
from graph_passes.bucket_collectives import PASS, BucketOptions, bucket_collectives_pass, find_buckets
from graph_passes.verify import verify_pass

c10d = torch.ops._c10d_functional
_NAMES = {
    c10d.all_gather_into_tensor.default: "ag",
    c10d.reduce_scatter_tensor.default: "rs",
    c10d.all_reduce.default: "ar",
}


def _step(shards, grads, x, group):
    """A data-parallel step's collectives: three shards gathered (one through a cast), an
    activation all-reduce read by compute, two gradients reduce-scattered (one cast after), two
    all-reduced (avg) and one summed."""
    w = [funcol.all_gather_single(s, 0, group) for s in shards[:2]]
    w.append(funcol.all_gather_single(shards[2].to(torch.float64), 0, group).to(torch.float32))
    h = funcol.all_reduce(x @ w[0][:, : x.shape[1]].t(), "sum", group).relu()  # an activation's: stays
    rs = [
        funcol.reduce_scatter_single(grads[0], "sum", 0, group),
        funcol.reduce_scatter_single(grads[1], "sum", 0, group),
    ]
    ar = [funcol.all_reduce(grads[2], "avg", group), funcol.all_reduce(grads[3] * 2, "avg", group)]
    return h, w[1].sum() + w[2].sum(), rs[0].double(), rs[1], *ar, funcol.all_reduce(grads[4], "sum", group)


def _inputs(ranks: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shards = [torch.randn(2, 6, generator=gen), torch.randn(3, 4, generator=gen), torch.randn(1, 5, generator=gen)]
    grads = [torch.randn(ranks * 2, 3, generator=gen), torch.randn(ranks, 5, generator=gen)]
    grads += [torch.randn(7, generator=gen), torch.randn(2, 2, generator=gen), torch.randn(3, generator=gen)]
    return shards, grads, torch.randn(4, 6, generator=gen)


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [_NAMES[n.target] for n in gm.graph.nodes if n.target in _NAMES]


def _bucketed(gm: torch.fx.GraphModule, cap_mb: float = 25.0) -> PassContext:
    ctx = PassContext("test", "bwd", pass_options={PASS: BucketOptions(cap_mb=cap_mb)})
    bucket_collectives_pass(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    annotate_pass(gm, ctx)
    verify_pass(gm, ctx)
    return ctx


def _traced(group, ranks: int) -> torch.fx.GraphModule:
    shards, grads, x = _inputs(ranks)
    return trace_aten(lambda s, g, a: _step(s, g, a, group), shards, grads, x)


def test_gathers_of_inputs_and_reductions_to_outputs_share_buckets_by_key() -> None:
    with fake_world(2) as group:
        gm = _traced(group, 2)
        assert sorted(_ops(gm)) == sorted(["ag"] * 3 + ["ar"] * 4 + ["rs"] * 2)
        ctx = _bucketed(gm)
    # float32 gathers in one, the float64 one alone; reduce-scatters in one; the two avg
    # all-reduces in one; the sum all-reduce (another key) and the activation's alone
    assert sorted(_ops(gm)) == sorted(["ag", "ag", "rs", "ar", "ar", "ar"])
    assert ctx.stats[PASS] == {"buckets": 3, "collectives removed": 3}


def test_a_cap_below_every_tensor_leaves_the_graph_alone() -> None:
    with fake_world(2) as group:
        gm = _traced(group, 2)
        before = _ops(gm)
        ctx = _bucketed(gm, cap_mb=1e-6)
        assert find_buckets(gm.graph, 0) == []
    assert _ops(gm) == before
    assert ctx.stats[PASS] == {"left alone: over the cap": 8}


def test_cap_zero_turns_it_off() -> None:
    with fake_world(2) as group:
        gm = _traced(group, 2)
        before = _ops(gm)
        ctx = _bucketed(gm, cap_mb=0)
    assert _ops(gm) == before and PASS not in ctx.stats


def _on_ranks(rank: int, world_size: int) -> float:
    group = dist.group.WORLD
    gm = _traced(group, world_size)
    shards, grads, x = _inputs(world_size, seed=rank + 1)  # every rank its own values
    want = gm(shards, grads, x)
    _bucketed(gm)
    assert _ops(gm).count("ar") == 3, _ops(gm)
    got = gm(shards, grads, x)
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("world_size", [2, 4])
def test_bucketed_values_equal_the_unbucketed_graph_on_gloo_ranks(world_size: int) -> None:
    for diff in run_on_ranks(_on_ranks, world_size, timeout_s=240):
        assert diff < 1e-6


def test_the_two_strands_of_a_merged_graph_keep_their_own_buckets() -> None:
    with fake_world(2) as group:
        gm = _traced(group, 2)
        reductions = [n for n in gm.graph.nodes if n.target == c10d.reduce_scatter_tensor.default]
        for strand, node in enumerate(reductions):  # one reduce-scatter per strand: nothing to share
            node.meta["dhelix"] = {"strand": strand}
        buckets = find_buckets(gm.graph, 2**30)
    kinds = sorted(str(bucket[0].issue.target) for bucket in buckets)
    assert kinds == ["_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.all_reduce.default"]
