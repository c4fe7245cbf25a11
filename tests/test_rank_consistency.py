"""Rank consistency: ranks that would issue different collectives get a clear error, not a hang."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dhelix_compile.consistency import collective_signatures
from dhelix_compile.testing.multirank import run_on_ranks

pytestmark = pytest.mark.multirank


def _all_reduce_twice(x: torch.Tensor) -> torch.Tensor:
    y = funcol.all_reduce(x, "sum", dist.group.WORLD)
    return funcol.all_reduce(y * 2, "sum", dist.group.WORLD)


def _compile_and_run(rank: int, world_size: int, sizes: list[int | None], timeout_s: float) -> str:
    import dhelix_compile

    size = sizes[rank]
    if size is None:  # this rank never compiles the graph
        return "skipped"
    backend = dhelix_compile.backend(codegen="eager", fallback="error", consistency_timeout_s=timeout_s)
    compiled = torch.compile(_all_reduce_twice, backend=backend)
    try:
        out = compiled(torch.ones(size))
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return str(exc)
    torch.testing.assert_close(out, torch.full((size,), 2.0 * world_size**2))
    return "ok"


def test_same_collectives_pass() -> None:
    assert run_on_ranks(_compile_and_run, 2, [8, 8], 30.0, timeout_s=120) == ["ok", "ok"]


def test_different_shapes_name_the_first_diverging_collective() -> None:
    results = run_on_ranks(_compile_and_run, 2, [8, 16], 30.0, timeout_s=120)
    for message in results:
        assert "collective #0 on process group" in message, message
        assert "rank 0: all_reduce.default(float32[8])" in message
        assert "rank 1: all_reduce.default(float32[16])" in message


def test_a_rank_that_never_compiles_is_named_within_the_timeout() -> None:
    results = run_on_ranks(_compile_and_run, 2, [8, None], 3.0, timeout_s=120)
    assert results[1] == "skipped"
    assert "rank 1 of process group" in results[0] and "did not publish" in results[0], results[0]


def test_signatures_group_collectives_by_process_group() -> None:
    from cost_model.testing import fake_world, trace_aten

    with fake_world(4) as group:
        gm = trace_aten(
            lambda x: funcol.all_reduce(funcol.all_gather_single(x, 0, group), "sum", group), torch.ones(2, 3)
        )
        signatures = collective_signatures(gm)
    (sequence,) = signatures.values()
    assert sequence == [
        "all_gather_into_tensor.default(float32[2, 3]) -> float32[8, 3]",
        "all_reduce.default(float32[8, 3]) -> float32[8, 3]",
    ]


def test_signatures_compare_the_exchanges_with_the_collectives() -> None:
    """``dhelix::exchange`` is called by every rank of its group in the same per-peer step (on gloo
    it is an all-to-all), so it is part of the sequence the ranks compare; its peers are not."""
    from cost_model.testing import fake_world, trace_aten
    from dhelix_compile.ops.exchange import P2P_EXCHANGE

    with fake_world(4) as group:

        def f(x: torch.Tensor) -> torch.Tensor:
            _, received = P2P_EXCHANGE(x, 1, 3, 0, group.group_name)
            return funcol.all_reduce(received, "sum", group)

        gm = trace_aten(f, torch.ones(2, 3))
        signatures = collective_signatures(gm)
    (sequence,) = signatures.values()
    assert sequence == [
        "dhelix.exchange.default(float32[2, 3]) -> [float32[0], float32[2, 3]]",
        "all_reduce.default(float32[2, 3]) -> float32[2, 3]",
    ]


def test_collectives_of_equal_shapes_in_another_order_are_a_mismatch() -> None:
    """Two ranks that schedule two same-shape all-reduces in opposite orders would not deadlock:
    each would reduce the other's tensor. The node names tell them apart."""
    from cost_model.testing import fake_world, trace_aten
    from dhelix_compile.consistency import RankMismatchError, _compare

    with fake_world(2) as group:
        gm = trace_aten(
            lambda x, y: funcol.all_reduce(x, "sum", group) + funcol.all_reduce(y, "sum", group),
            *[torch.ones(2, 3)] * 2,
        )
        (mine,) = collective_signatures(gm, named=True).values()
        first, second = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
        first.prepend(second)  # the other rank's order: y's all-reduce first
        (theirs,) = collective_signatures(gm, named=True).values()
    assert mine != theirs and sorted(mine) == sorted(theirs)
    with pytest.raises(RankMismatchError, match=r"collective #0 .* exchange the wrong tensors"):
        _compare(mine, {"graph": "g", "collectives": theirs}, 0, 1, "0", "g")


def _swapped_on_rank_1(rank: int, world_size: int) -> str:
    from cost_model.testing import trace_aten
    from dhelix_compile.consistency import RankMismatchError, check_rank_consistency

    group = dist.group.WORLD
    gm = trace_aten(
        lambda x, y: funcol.all_reduce(x, "sum", group) + funcol.all_reduce(y, "sum", group), *[torch.ones(2, 3)] * 2
    )
    if rank == 1:
        first, second = [n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
        first.prepend(second)
    try:
        check_rank_consistency(gm, "swapped", 30.0)
    except RankMismatchError as exc:
        return str(exc)
    return "ok"


def test_the_same_graph_scheduled_in_another_order_on_one_rank_fails_the_check() -> None:
    for message in run_on_ranks(_swapped_on_rank_1, 2, timeout_s=120):
        assert "collective #0" in message and "all_reduce_1 = all_reduce.default" in message, message
