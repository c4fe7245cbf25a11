"""The decompose pass's all-to-all chain: an MoE layer's dispatch -> experts -> combine as one
per-peer pipeline (``graph_passes.decompose.all_to_all_chain``).

Traced graphs on a fake world (order, pieces, the choice against the two single sites, what is
left alone), then numerics on 2 and 4 gloo ranks, forward and backward, eager and through
Inductor, and the MoE reference model.
"""

from __future__ import annotations

import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cost_model.estimator import TableEstimator
from dhelix_compile.ops.exchange import P2P_EXCHANGE
from dhelix_compile.testing.multirank import run_on_ranks
from graph_passes.decompose import SINGLE_SITE_PATTERNS
from tests.test_decompose import SLOW_LINK, _decompose_stats, _ops, _p2p_peers, _run, _traced, per_peer_sites

aten = torch.ops.aten


def _moe(send, w1, w3, w2, group, experts=2, act=torch.nn.functional.silu):
    """Expert parallelism: dispatch, each local expert's SwiGLU (``act``) on its slots, combine."""
    world = dist.get_world_size(group)
    rows, dim = send.shape
    slots = rows // (world * experts)
    split = [rows // world] * world
    recv = funcol.all_to_all_single(send, split, split, group)
    tokens = recv.view(world, experts, slots, dim).transpose(0, 1).reshape(experts, world * slots, dim)
    h = act(torch.bmm(tokens, w1)) * torch.bmm(tokens, w3)
    y = torch.bmm(h, w2).view(experts, world, slots, -1).transpose(0, 1).reshape(rows, -1)
    return funcol.all_to_all_single(y, split, split, group)


def _shapes(world: int, slots: int = 4, dim: int = 8, hidden: int = 6, out: int = 8) -> tuple[tuple[int, ...], ...]:
    return (world * 2 * slots, dim), (2, dim, hidden), (2, dim, hidden), (2, hidden, out)


@pytest.mark.parametrize("world", [2, 4])
def test_chain_runs_each_sources_tokens_through_the_experts_and_sends_them_back(world: int) -> None:
    r, n = 1, world
    gm = _traced(_moe, *_shapes(world), world=world, rank=r)
    ctx = _run(gm, world=world, rank=r, mode="per_peer")
    assert ctx.stats["decompose"] == {"all_to_all_chain: per_peer": 1}
    experts = ["mm", "mm", "mm"]  # w1, w3, w2 on one block
    ops = ["p2p"] * (n - 1) + experts  # every chunk out; the local tokens through the experts
    peers = [[(r + s) % n, (r - s) % n] for s in range(1, n)]
    for s in range(1, n):  # rank r-s's tokens land, go through the experts and go straight back
        ops += ["wait", "wait", *experts, "p2p"]
        peers.append([(r - s) % n, (r + s) % n])
    assert _ops(gm) == ops + ["wait", "wait"] * (n - 1)
    assert _p2p_peers(gm) == peers
    nodes = list(gm.graph.nodes)
    last_send = max(i for i, node in enumerate(nodes) if node.target == P2P_EXCHANGE)
    assert not any(node.target == aten.cat.default for node in nodes[:last_send])  # nothing full-size between


def test_chain_in_pieces_sends_each_pieces_result_when_it_is_ready() -> None:
    gm = _traced(_moe, *_shapes(2))
    ctx = _run(gm, mode="per_peer", pieces=2)
    assert ctx.stats["decompose"] == {"all_to_all_chain: per_peer_2": 1}
    piece = ["wait", "wait", "mm", "mm", "mm", "p2p"]
    assert _ops(gm) == ["p2p", "p2p", *["mm"] * 6, *piece, *piece, *["wait"] * 4]


def test_chain_is_tried_by_default_and_only_the_single_sites_without_it() -> None:
    gm = _traced(_moe, *_shapes(2))
    stats = _run(gm, mode="per_peer", patterns=SINGLE_SITE_PATTERNS).stats["decompose"]
    assert {k: v for k, v in stats.items() if not k.startswith("not matched")} == {
        "all_to_all_compute: per_peer": 1,
        "bmm_all_to_all: per_peer": 1,
    }


class _MeasuresByShape(TableEstimator):
    """SLOW_LINK's predictions; "measured" times by a segment's (bmm count, exchange count)."""

    def __init__(self, seconds: dict[tuple[int, int], float]) -> None:
        super().__init__(kind_times_s=SLOW_LINK.kind_times_s)
        self.seconds = seconds

    def segment_times(self, segments):
        def key(nodes):
            return sum(n.target == aten.bmm.default for n in nodes), sum(n.target == P2P_EXCHANGE for n in nodes)

        return [self.seconds.get(key(nodes)) for nodes in segments]


#: Measured seconds by (bmms, exchanges): the chain's original (3 bmms) and its variant (6 bmms, 2
#: exchanges); the dispatch's original (w1, w3) and variant; the combine's (w2) and variant.
_SITES_SAVE_3 = {(2, 0): 6.0, (4, 1): 4.0, (1, 0): 4.0, (2, 1): 3.0}


@pytest.mark.parametrize(("chain_s", "chosen"), [(4.0, True), (8.0, False)])
def test_measured_savings_decide_between_the_chain_and_its_two_sites(chain_s: float, chosen: bool) -> None:
    """Measured, the two sites save 2 + 1 s on their originals; the chain saves 10 - ``chain_s``."""
    estimator = _MeasuresByShape({(3, 0): 10.0, (6, 2): chain_s, **_SITES_SAVE_3})
    ctx = _run(_traced(_moe, *_shapes(2)), estimator=estimator, mode="auto", pieces=1)
    stats = {k: v for k, v in ctx.stats["decompose"].items() if not k.startswith("not matched")}
    records = ctx.records["decompose"]
    assert records["all_to_all_chain0_chain_saved_measured_s"] == 10.0 - chain_s
    assert records["all_to_all_chain0_sites_saved_measured_s"] == 3.0
    assert "all_to_all_chain0_graph_chain_s" not in records  # the prediction did not decide
    if chosen:
        assert stats == {"all_to_all_chain: per_peer": 1}, stats
    else:
        assert stats == {
            "all_to_all_chain: left to the single sites": 1,
            "all_to_all_compute: per_peer": 1,
            "bmm_all_to_all: per_peer": 1,
        }, stats


def test_experts_that_are_not_row_wise_leave_the_two_sites_to_themselves() -> None:
    def mixing(send, w1, w3, w2, group):  # a softmax over the slots mixes the sources' tokens
        return _moe(send, w1, w3, w2, group, act=lambda h: h.softmax(1))

    gm = _traced(mixing, *_shapes(2))
    ctx = _run(gm, mode="per_peer")
    stats = ctx.stats["decompose"]
    assert stats["all_to_all_chain: skipped: not row-wise"] == 1, stats
    assert stats["all_to_all_compute: per_peer"] == 1 and stats["bmm_all_to_all: per_peer"] == 1, stats


# ------------------------------------------------------------------------------ numerics


def _check(rank: int, world: int, pieces: int, codegen: str, chains_only: bool) -> dict[str, int]:
    """The MoE layer compiled with every all-to-all chain rewritten vs eager: output and every
    gradient (the tokens' too, so the backward has its mirror chain). ``chains_only``: the two
    single sites are never built as the chain's rivals (the choice is tested on traced graphs)."""
    import dhelix_compile

    group = dist.group.WORLD
    rivals = mock.patch("graph_passes.decompose.selection.Selection.single_site_rivals", return_value=[])
    with tempfile.TemporaryDirectory() as dump_dir, rivals if chains_only else mock.patch.dict({}):
        backend = dhelix_compile.backend(
            codegen=codegen, fallback="error", dump_dir=dump_dir, decompose="per_peer", decompose_pieces=pieces
        )
        gen = torch.Generator().manual_seed(rank)
        shapes = _shapes(world)
        leaves = [torch.randn(s, generator=gen) for s in shapes]
        probe = torch.randn(shapes[0][0], shapes[3][2], generator=gen)

        def fn(send, w1, w3, w2):
            return _moe(send, w1, w3, w2, group)

        results = []
        for run in (fn, torch.compile(fn, backend=backend)):
            inputs = [t.clone().requires_grad_() for t in leaves]
            out = run(*inputs)
            (out * probe).sum().backward()
            results.append([out.detach()] + [t.grad for t in inputs])
        for i, (want, got) in enumerate(zip(*results, strict=True)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"tensor #{i}: {m}")
        torch._dynamo.reset()
        return _decompose_stats(dump_dir, rank)


def _chains(stats: dict[str, int]) -> int:
    return per_peer_sites(stats, "all_to_all_chain")


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("world", "pieces", "codegen"),
    [
        (2, 1, "eager"),
        (2, 2, "eager"),
        (4, 1, "eager"),
        pytest.param(2, 2, "inductor", marks=pytest.mark.inductor),
    ],
)
def test_chain_equals_undecomposed_forward_and_backward(world: int, pieces: int, codegen: str) -> None:
    for stats in run_on_ranks(_check, world, pieces, codegen, True, timeout_s=240):
        assert _chains(stats) == 2, stats  # the forward's dispatch -> combine and the backward's mirror


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_chain_or_single_sites_as_the_cost_model_chooses_equal_undecomposed() -> None:
    for stats in run_on_ranks(_check, 2, 0, "eager", False, timeout_s=240):
        rewritten = sum(per_peer_sites(stats, p) for p in ("all_to_all_chain", "all_to_all_compute", "bmm_all_to_all"))
        assert rewritten >= 2, stats
