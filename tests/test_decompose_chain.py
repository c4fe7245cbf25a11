"""The decompose pass's chain rewrite: all-gather -> row-wise compute -> reduce-scatter as one
per-peer pipeline (``graph_passes.decompose.chain``).

Traced graphs on a fake world (order, what is left alone and why), then numerics on 2 and 4
gloo ranks over explicit shapes (both layouts), forward and backward, eager and through Inductor.
"""

from __future__ import annotations

import os
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dhelix_compile.ops.exchange import P2P_EXCHANGE
from dhelix_compile.testing.multirank import run_on_ranks
from graph_passes.decompose import CHAIN, DecomposeOptions
from graph_passes.decompose.row_region import Rows, locate
from tests.test_collective_matches import _swiglu_backward_graph
from tests.test_decompose import _decompose_stats, _ops, _p2p_peers, _run, _tp_sp, _traced, per_peer_sites

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _mlp(x, w1, w3, w2, group, dim=1, act=torch.nn.functional.silu):
    """Sequence-parallel SwiGLU MLP: gather along ``dim``, w1/w3, act * mul, w2, scatter along ``dim``."""
    full = funcol.all_gather_single(x, dim, group)
    flat = full.reshape(-1, x.shape[-1])
    h = act(flat @ w1.t()) * (flat @ w3.t())
    return funcol.reduce_scatter_single((h @ w2.t()).reshape(*full.shape[:-1], -1), "sum", dim, group)


_SHAPES = ((2, 4, 8), (6, 8), (6, 8), (8, 6))
#: The chain is opt-in: tried first, then every single-site pattern.
_PATTERNS = (CHAIN, *DecomposeOptions.patterns)


def test_locate_finds_the_gathered_dim_inside_merged_dims_and_refuses_split_ones() -> None:
    # [B=2, S=8, D], in 2 blocks (2 ranks) along S
    assert locate([2, 8, 16], 2, 2) == Rows(1, 1, 4)
    assert locate([16, 16], 2, 2) == Rows(0, 2, 4)  # [B*S, D]: the blocks inside dim 0, B outside them
    assert locate([1, 16, 16], 2, 2) == Rows(1, 2, 4)
    assert locate([2, 2, 4, 16], 2, 2) == Rows(1, 1, 1)  # S as [ranks, rows per rank]
    assert locate([2, 4, 2, 16], 2, 8) is None  # the blocks cut by a dim boundary


@pytest.mark.parametrize("world", [2, 4])
def test_chain_runs_each_peers_rows_through_the_block_and_sends_them_back(world: int) -> None:
    shapes = ((2, 8 // world, 8), (6, 8), (6, 8), (8, 6))
    gm = _traced(_mlp, *shapes, world=world, rank=1)
    ctx = _run(gm, world=world, rank=1, mode="per_peer", patterns=_PATTERNS)
    assert ctx.stats["decompose"] == {"all_gather_chain: per_peer": 1}
    r, n = 1, world
    ops, peers = ["p2p", "mm", "mm", "mm"], [[(r - 1) % n, (r + 1) % n]]  # rows out, local rows through w1 w3 w2
    for step in range(1, n):  # rank r+step's rows land, go through the block and go back as its partial
        ops += ["wait", "wait"]
        if step + 1 < n:
            ops.append("p2p")
            peers.append([(r - step - 1) % n, (r + step + 1) % n])
        ops += ["mm", "mm", "mm", "p2p"]
        peers.append([(r + step) % n, (r - step) % n])
    assert _ops(gm) == ops + ["wait", "wait"] * (n - 1)
    assert _p2p_peers(gm) == peers
    # nothing full-size between the two collectives: no cat before the last exchange
    nodes = list(gm.graph.nodes)
    last_send = max(i for i, node in enumerate(nodes) if node.target == P2P_EXCHANGE)
    assert not any(node.target == aten.cat.default for node in nodes[:last_send])


def test_chain_in_pieces_sends_each_pieces_partial_when_it_is_ready() -> None:
    gm = _traced(_mlp, *_SHAPES)
    ctx = _run(gm, mode="per_peer", pieces=2, patterns=_PATTERNS)
    assert ctx.stats["decompose"] == {"all_gather_chain: per_peer_2": 1}
    piece = ["wait", "wait", "mm", "mm", "mm", "p2p"]
    assert _ops(gm) == ["p2p", "p2p", *["mm"] * 6, *piece, *piece, *["wait"] * 4]


def test_backward_chain_reads_saved_activations_block_by_block_and_rebuilds_weight_gradient_inputs() -> None:
    gm = _swiglu_backward_graph()
    ctx = _run(gm, estimator=None, mode="per_peer", patterns=_PATTERNS)  # no costs: the chain is forced
    assert ctx.stats["decompose"] == {"all_gather_chain: per_peer": 1}
    targets = [n.target for n in gm.graph.nodes]
    assert c10d.all_gather_into_tensor.default not in targets and c10d.reduce_scatter_tensor.default not in targets
    # the weight gradients (t(rows) @ ...) read full tensors concatenated from the blocks
    wgrads = [n for n in gm.graph.nodes if n.target == aten.mm.default and n.args[0].target == aten.t.default]
    assert len(wgrads) == 3
    assert all(n.args[0].args[0].args[0].target == aten.cat.default for n in wgrads)


def test_chains_that_are_not_row_wise_are_left_alone_and_their_sites_decomposed_alone() -> None:
    softmax = lambda t: torch.softmax(t, dim=0)  # noqa: E731  mixes rows
    gm = _traced(lambda *a: _mlp(*a, act=softmax), *_SHAPES)
    stats = _run(gm, mode="per_peer", patterns=_PATTERNS).stats["decompose"]
    assert stats["all_gather_chain: skipped: not row-wise"] == 1  # a softmax between the two collectives
    assert stats["all_gather_matmul: per_peer"] == 1 and stats["matmul_reduce_scatter: per_peer"] == 1

    def other_dims(x, w1, w3, w2, group):  # gathered along the sequence, scattered along the batch
        flat = funcol.all_gather_single(x, 1, group).reshape(-1, 8)
        y = (torch.relu(flat @ w1.t()) @ w2[:, :6].t()).reshape(2, 8, 8)
        return funcol.reduce_scatter_single(y, "sum", 0, group)

    gm = _traced(other_dims, *_SHAPES)
    stats = _run(gm, mode="per_peer", patterns=_PATTERNS).stats["decompose"]
    assert stats["all_gather_chain: skipped: scatter dim differs"] == 1


def test_chain_competes_with_its_two_collectives_decomposed_on_their_own() -> None:
    """The whole graph is priced with the chain's best variant and with the two collectives
    decomposed on their own (each at its best variant); the chain is taken only when it predicts
    less: here (compute 1 s per op, exchanges 5 s) the forward's chain does; the backward's, whose
    weight gradients hide the single sites' transfers, does not, and the two collectives are
    decomposed alone."""
    gm = _traced(_mlp, *_SHAPES)
    ctx = _run(gm, mode="per_peer", patterns=_PATTERNS)
    assert ctx.stats["decompose"] == {"all_gather_chain: per_peer": 1}
    chain = ctx.records["decompose"]
    assert chain["all_gather_chain0_graph_chain_s"] < chain["all_gather_chain0_graph_single_sites_s"]

    gm = _swiglu_backward_graph()
    ctx = _run(gm, mode="per_peer", patterns=_PATTERNS)
    assert ctx.stats["decompose"] == {
        "all_gather_chain: left to the single sites": 1,
        "all_gather_matmul: per_peer": 1,
        "matmul_reduce_scatter: per_peer": 1,
    }
    assert ctx.notes["decompose"]["all_gather_chain: left to the single sites"]
    records = ctx.records["decompose"]
    assert records["all_gather_chain0_graph_single_sites_s"] <= records["all_gather_chain0_graph_chain_s"]
    assert c10d.all_gather_into_tensor.default not in [n.target for n in gm.graph.nodes]
    # every variant emitted to price the chain and its rivals was removed again
    assert sum(n.target == P2P_EXCHANGE for n in gm.graph.nodes) == 2


def test_chain_is_opt_in() -> None:
    gm = _traced(_mlp, *_SHAPES)
    stats = _run(gm, mode="per_peer").stats["decompose"]
    assert stats == {"all_gather_matmul: per_peer": 1, "matmul_reduce_scatter: per_peer": 1}


# ------------------------------------------------------------------------------ numerics


def _chains_forced(rank: int, world: int, worker, *args, **kwargs):
    """``worker`` on this rank with every chain preferred to its two single sites (they are never
    built): these tests check the chain rewrite's numerics; the choice is tested on traced graphs."""
    # by name: the module the backend runs, even if a test re-imported it
    with mock.patch("graph_passes.decompose.selection.Selection.single_site_rivals", return_value=[]):
        return worker(rank, world, *args, **kwargs)


def _check_chains(rank: int, world: int, cases: list[tuple], pieces: int, codegen: str) -> dict[str, int]:
    """Each case: the SP MLP compiled with the chain rewrite vs eager, outputs and all gradients."""
    import dhelix_compile

    group = dist.group.WORLD.group_name
    with tempfile.TemporaryDirectory() as dump_dir:
        backend = dhelix_compile.backend(
            codegen=codegen,
            fallback="error",
            dump_dir=dump_dir,
            decompose="per_peer",
            decompose_pieces=pieces,
            decompose_chains=True,
        )
        for seed, (b, s, k, hidden, n_out, dim) in enumerate(cases):
            gen = torch.Generator().manual_seed(seed)
            shard = (b, s, k) if dim == 1 else (b * s, k)
            xs = [torch.randn(shard, generator=gen) for _ in range(world)]
            w1, w3 = torch.randn(hidden, k, generator=gen), torch.randn(hidden, k, generator=gen)
            w2 = torch.randn(n_out, hidden, generator=gen)
            probe = torch.randn(*shard[:-1], n_out, generator=gen)

            def fn(x, w1, w3, w2, dim=dim):
                return _mlp(x, w1, w3, w2, group, dim)

            results = []
            for run in (fn, torch.compile(fn, backend=backend)):
                leaves = [t.clone().requires_grad_() for t in (xs[rank], w1, w3, w2)]
                out = run(*leaves)
                (out * probe).sum().backward()
                results.append([out.detach()] + [t.grad for t in leaves])
            for i, (want, got) in enumerate(zip(*results, strict=True)):
                where = f"case {(b, s, k, hidden, n_out, dim)} #{i}"
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, where=where: f"{where}: {m}")
            torch._dynamo.reset()
        return _decompose_stats(dump_dir, rank)


def _chains(stats: dict[str, int]) -> int:
    return sum(v for k, v in stats.items() if k.startswith("all_gather_chain: per_peer"))


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "pieces"),
    [
        (2, 1),
        (2, 2),
        pytest.param(4, 1, marks=pytest.mark.full),
    ],
)
def test_chain_equals_undecomposed_forward_and_backward(world: int, pieces: int) -> None:
    # (b, s, k, hidden, n_out, gather/scatter dim), both layouts every time; each shard splits
    # into 2 pieces per peer (b * s rows along dim 0, s rows along dim 1)
    cases = [(1, 2, 5, 6, 8, 0), (2, 4, 3, 2, 3, 1)]
    for stats in run_on_ranks(_chains_forced, world, _check_chains, cases, pieces, "eager", timeout_s=240):
        assert _chains(stats) == 2 * len(cases), stats  # the forward's chain and the backward's


@pytest.mark.multirank
@pytest.mark.inductor
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.environ.get("DHELIX_TEST_FULL"), reason="DHELIX_TEST_FULL=1: opt-in chains, the budget")
def test_chain_through_inductor_codegen() -> None:
    for stats in run_on_ranks(_chains_forced, 2, _check_chains, [(2, 4, 8, 6, 8, 1)], 2, "inductor", timeout_s=500):
        assert _chains(stats) == 2, stats


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not os.environ.get("DHELIX_TEST_FULL"),
    reason="DHELIX_TEST_FULL=1: opt-in chains on the whole model, the budget (the chain's numerics run by default above)",
)
def test_tp_sp_reference_model_with_chains() -> None:
    """Every MLP block (2 layers, forward and backward) as one chain; attention's all-gather feeds
    attention, not a row-wise chain, so its two collectives stay sites of their own."""
    for stats in run_on_ranks(_chains_forced, 2, _tp_sp, "per_peer", "eager", decompose_chains=True, timeout_s=540):
        assert per_peer_sites(stats, "all_gather_chain") >= 4, stats
        assert per_peer_sites(stats, "all_gather_matmul") >= 4, stats
        assert per_peer_sites(stats, "matmul_reduce_scatter") >= 4, stats
