"""Alpha-beta collective models: bytes on the wire per algorithm/backend, and times."""

from __future__ import annotations

import math

import pytest
import sympy
import torch

from cost_model.collectives import (
    NCCL_BASE_LATENCY_S,
    alpha_beta_terms,
    collective_bytes_on_wire,
    collective_time_expr,
    collective_time_s,
)
from cost_model.hardware import Link, get_link

aten = torch.ops.aten

LINK = Link("test", bandwidth_bytes_per_s=100e9, latency_s=2e-6, source="test")
S = 8 * 2**20  # 8 MiB full buffer


@pytest.mark.parametrize(
    ("op", "n", "expected"),
    [
        ("all_reduce", 8, 2 * 7 / 8 * S),
        ("all_gather", 8, 7 / 8 * S),
        ("reduce_scatter", 8, 7 / 8 * S),
        ("all_to_all", 4, 3 / 4 * S),
        ("broadcast", 8, S),
        ("send", 2, S),
        ("recv", 2, S),
        ("all_reduce", 1, 0),
    ],
)
def test_nccl_ring_bytes_on_wire(op: str, n: int, expected: float) -> None:
    assert collective_bytes_on_wire(op, S, n) == pytest.approx(expected, rel=0, abs=0)


def test_a_gloo_reduce_scatter_moves_the_bytes_of_the_all_to_all_dhelix_sends() -> None:
    """gloo's own reduce-scatter all-reduces the whole input; graph_passes.gloo_collectives sends
    it as an all-to-all, which moves NCCL's reduce-scatter bytes, half the all-reduce's."""
    nccl = collective_bytes_on_wire("reduce_scatter", S, 4, backend="nccl")
    gloo = collective_bytes_on_wire("reduce_scatter", S, 4, backend="gloo")
    assert gloo == nccl == collective_bytes_on_wire("all_to_all", S, 4, backend="gloo")
    assert 2 * gloo == collective_bytes_on_wire("all_reduce", S, 4, backend="gloo")


def test_gloo_broadcast_is_binomial_tree() -> None:
    steps, factor = alpha_beta_terms("broadcast", 8, "ring", "gloo")
    assert (steps, factor) == (3, 3)
    assert collective_bytes_on_wire("broadcast", S, 8, backend="gloo") == 3 * S


def test_tree_all_reduce_terms() -> None:
    assert alpha_beta_terms("all_reduce", 16, "tree", "nccl") == (8, 2)
    # tree only applies to NCCL all-reduce; gloo keeps the ring
    gloo_ring = alpha_beta_terms("all_reduce", 16, "ring", "gloo")
    assert alpha_beta_terms("all_reduce", 16, "tree", "gloo") == gloo_ring == (30, 2 * 15 / 16)


def test_ring_time_formula_exact() -> None:
    n = 8
    t = collective_time_s("all_gather", S, n, LINK)
    assert t == pytest.approx(NCCL_BASE_LATENCY_S + (n - 1) * 2e-6 + (n - 1) / n * S / 100e9)
    t_gloo = collective_time_s("all_reduce", S, n, LINK, backend="gloo")
    assert t_gloo == pytest.approx(2 * (n - 1) * 2e-6 + 2 * (n - 1) / n * S / 100e9)


def test_auto_picks_tree_for_small_messages_at_scale() -> None:
    n = 64
    small, large = 1024, 1 << 30
    ring_small = collective_time_s("all_reduce", small, n, LINK, "ring")
    tree_small = collective_time_s("all_reduce", small, n, LINK, "tree")
    assert tree_small < ring_small
    assert collective_time_s("all_reduce", small, n, LINK, "auto") == tree_small
    ring_large = collective_time_s("all_reduce", large, n, LINK, "ring")
    assert collective_time_s("all_reduce", large, n, LINK, "auto") == ring_large


def test_single_rank_is_free_and_bad_input_raises() -> None:
    assert collective_time_s("all_gather", S, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time_s("gather", S, 2, LINK)
    with pytest.raises(ValueError, match="backend"):
        collective_time_s("all_gather", S, 2, LINK, backend="mpi")  # type: ignore[arg-type]  # unknown backend, on purpose
    with pytest.raises(ValueError, match="group_size"):
        alpha_beta_terms("all_gather", 0)


def test_time_grows_with_world_size_and_slower_links() -> None:
    times = [collective_time_s("all_reduce", S, n, get_link("ib_ndr")) for n in (2, 4, 8, 16)]
    assert times == sorted(times)
    assert collective_time_s("all_reduce", S, 8, get_link("ib_hdr")) > times[2]


def test_symbolic_expression_matches_numeric() -> None:
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    expr = collective_time_expr("reduce_scatter", 4096 * s0, 4, LINK)
    assert expr.free_symbols == {s0}
    value = float(expr.subs(s0, 1000))
    assert math.isclose(value, collective_time_s("reduce_scatter", 4096 * 1000, 4, LINK))
    wire = collective_bytes_on_wire("all_reduce", 4096 * s0, 4)
    assert sympy.simplify(wire - sympy.Rational(3, 2) * 4096 * s0) == 0
