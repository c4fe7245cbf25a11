"""Activation checkpointing under ``helix`` and the backend: equal to eager, the recompute in the backward.

Checkpointing wraps each recomputed op tagged ``nondeterministic_seeded`` in AOTAutograd's
RNG-state wrappers, attention kernels included (their ``dropout_p``). Layers of tests: which
calls draw random numbers, on hand-built graphs; the reference transformer with its blocks
checkpointed in each way users do (``testing.checkpointing``) against the eager accumulation
loop, counting the matmuls recomputed in the backward; Hugging Face's Llama with its own
checkpointing; a real dropout in a checkpointed region; and 2 gloo ranks of the
tensor-parallel transformer written with functional collectives (``functional_sp``, Megatron
TP+SP). The DTensor plans (kind ``tp``) with checkpointed blocks fail inside torch itself under
``torch.compile`` -- Inductor too ("expected all tensors_saved_with_vc_check to be Tensors, got
... DeviceMesh": AOTAutograd saves the mesh among the tensors) -- so they are not run here.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.fx
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import dhelix_compile
from cost_model.op_kinds import op_name
from dhelix_compile.helix_runtime import merged_candidates, strand_handoff
from dhelix_compile.helix_runtime.random_ops import RNG_STATE_WRAPPERS, draws_random_numbers, random_ops
from dhelix_compile.models.llama import ModelConfig, Transformer, lm_loss
from dhelix_compile.testing.checkpointing import CHECKPOINT_KINDS, Checkpointed, CheckpointKind, checkpoint_blocks
from dhelix_compile.testing.multirank import run_on_ranks
from graph_passes.joint.regather import REGATHER_AC_GRAPH_ID

aten = torch.ops.aten
higher_order = torch.ops.higher_order

EAGER: dict[str, Any] = {"codegen": "eager", "fallback": "error"}

LossFn = Callable[[nn.Module, Any], torch.Tensor]


# ---------------------------------------------------------------- which calls draw (hand-built graphs)


def _graph_calling(make: Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(make(graph, x))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _call(target: object, *args: object, **kwargs: object) -> Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node]:
    def make(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
        filled = tuple(x if a == "x" else a for a in args)
        return graph.call_function(target, filled, kwargs)  # type: ignore[arg-type]

    return make


DROPOUT = aten.native_dropout.default
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SAVE, WITH, GRAPHSAFE = (
    higher_order.run_and_save_rng_state,
    higher_order.run_with_rng_state,
    higher_order.graphsafe_run_with_rng_state,
)

#: (id, the call, what random_ops finds)
RANDOM_OP_CASES: list[tuple[str, Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node], list[str]]] = [
    ("mm", _call(aten.mm.default, "x", "x"), []),
    ("dropout", _call(DROPOUT, "x", 0.5, True), ["aten.native_dropout.default"]),
    ("dropout_p0", _call(DROPOUT, "x", 0.0, True), []),  # nothing dropped
    ("dropout_eval", _call(DROPOUT, "x", 0.5, False), []),
    ("dropout_train_unset", _call(DROPOUT, "x", 0.5, None), ["aten.native_dropout.default"]),
    ("aten_dropout_p0", _call(aten.dropout.default, "x", 0.0, True), []),
    ("randn_like", _call(aten.randn_like.default, "x"), ["aten.randn_like.default"]),
    ("bernoulli", _call(aten.bernoulli.p, "x", 0.0), ["aten.bernoulli.p"]),  # no drop probability: it draws
    ("rrelu_eval", _call(aten.rrelu_with_noise.default, "x", "x"), []),  # training defaults to False
    ("rrelu", _call(aten.rrelu_with_noise.default, "x", "x", training=True), ["aten.rrelu_with_noise.default"]),
    ("sdpa", _call(SDPA, "x", "x", "x"), []),  # dropout_p defaults to 0
    ("sdpa_dropout", _call(SDPA, "x", "x", "x", 0.1), [str(SDPA)]),
    ("sdpa_kwargs", _call(SDPA, "x", "x", "x", dropout_p=0.0, is_causal=True), []),
    # activation checkpointing's RNG-state wrappers draw exactly when the op they wrap does
    ("save_sdpa", _call(SAVE, SDPA, "x", "x", "x", scale=0.25), []),
    ("with_sdpa", _call(WITH, "x", SDPA, "x", "x", "x"), []),
    ("graphsafe_sdpa", _call(GRAPHSAFE, SDPA, "x", "x", "x", rng_state="x"), []),
    ("save_dropout_p0", _call(SAVE, DROPOUT, "x", 0.0, True), []),
    ("save_dropout", _call(SAVE, DROPOUT, "x", 0.1, True), [f"run_and_save_rng_state({DROPOUT})"]),
    ("with_dropout", _call(WITH, "x", DROPOUT, "x", 0.1, True), [f"run_with_rng_state({DROPOUT})"]),
    (
        "graphsafe_sdpa_dropout",
        _call(GRAPHSAFE, SDPA, "x", "x", "x", 0.1, rng_state="x"),
        [f"graphsafe_run_with_rng_state({SDPA})"],
    ),
]


@pytest.mark.parametrize(("make", "found"), [c[1:] for c in RANDOM_OP_CASES], ids=[c[0] for c in RANDOM_OP_CASES])
def test_random_ops_decides_from_the_op_and_its_arguments(
    make: Callable[[torch.fx.Graph, torch.fx.Node], torch.fx.Node], found: list[str]
) -> None:
    assert random_ops(_graph_calling(make)) == found


def test_a_call_whose_arguments_cannot_be_read_draws() -> None:
    x = torch.fx.Graph().placeholder("x")
    assert not draws_random_numbers(DROPOUT, (x, 0.0, True), {})
    # a packet has no schema to bind the arguments to: under a wrapper too
    assert draws_random_numbers(aten.native_dropout, (x, 0.0, True), {})
    assert draws_random_numbers(SAVE, (aten.native_dropout, x, 0.0, True), {})


# ---------------------------------------------------------------- the reference transformer, one process


def _transformer_batches(n: int, config: ModelConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shape = (2, config.max_seq_len)
    return [
        (
            torch.randint(0, config.vocab_size, shape, generator=gen),
            torch.randint(0, config.vocab_size, shape, generator=gen),
        )
        for _ in range(n)
    ]


def _lm_loss_fn(model: nn.Module, mb: Any) -> torch.Tensor:
    return lm_loss(model(mb[0]), mb[1])


def _eager_loop(model: nn.Module, loss_fn: LossFn, microbatches: list[Any]) -> list[torch.Tensor]:
    losses = []
    for mb in microbatches:
        loss = loss_fn(model, mb)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _assert_same(
    got_model: nn.Module, want_model: nn.Module, got: list[torch.Tensor], want: list[torch.Tensor]
) -> None:
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-5, rtol=1e-4)
    for (name, p), q in zip(got_model.named_parameters(), want_model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


Partitions = dict[str, collections.Counter[str]]


@pytest.fixture
def partitions(monkeypatch: pytest.MonkeyPatch) -> Iterator[Partitions]:
    """The op counts of helix's F and B graphs as AOTAutograd hands them over (the first graph of
    each phase: the merged graphs go through the same compiler later); an RNG-state wrapper
    counts as itself and as the op it wraps."""
    seen: Partitions = {}
    compile_partition = strand_handoff.compile_partition

    def recording(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        counts: collections.Counter[str] = collections.Counter()
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            name = op_name(node)
            counts[name] += 1
            if name in RNG_STATE_WRAPPERS:
                counts[op_name(node.args[RNG_STATE_WRAPPERS[name]])] += 1
        seen.setdefault("bwd" if kwargs.get("is_backward") else "fwd", counts)
        return compile_partition(gm, example_inputs, **kwargs)

    monkeypatch.setattr(strand_handoff, "compile_partition", recording)
    yield seen


@pytest.mark.parametrize("kind", CHECKPOINT_KINDS)
def test_checkpointed_blocks_equal_eager_loop_and_recompute_in_the_backward(
    kind: CheckpointKind, partitions: Partitions
) -> None:
    config = ModelConfig(n_layers=1)
    model = Transformer(config)
    checkpoint_blocks(model.layers, kind)
    reference = copy.deepcopy(model)
    mbs = _transformer_batches(2, config)  # F0 | B0+F1 | B1: a merged graph
    losses = dhelix_compile.helix(model, _lm_loss_fn, **EAGER)(mbs)
    _assert_same(model, reference, losses, _eager_loop(reference, _lm_loss_fn, mbs))

    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    in_blocks = sum(isinstance(m, nn.Linear) for m in model.layers.modules())
    forward, backward = partitions["fwd"], partitions["bwd"]
    assert forward["mm"] == linears
    # each linear's two gradient matmuls, and the blocks' forward matmuls again unless saved
    assert backward["mm"] == 2 * linears + (0 if kind == "selective" else in_blocks)
    # attention is recomputed in every kind: in the backward, under the forward's RNG state
    assert forward["run_and_save_rng_state"] == backward["run_with_rng_state"] == config.n_layers
    assert backward["_scaled_dot_product_flash_attention_for_cpu"] == config.n_layers


def test_backend_accepts_checkpointed_blocks() -> None:
    config = ModelConfig(n_layers=1)
    model = Transformer(config)
    checkpoint_blocks(model.layers, "checkpoint")
    reference = copy.deepcopy(model)
    mbs = _transformer_batches(2, config)
    compiled: Any = torch.compile(model, backend="dhelix", options=EAGER)
    losses = _eager_loop(compiled, _lm_loss_fn, mbs)
    _assert_same(model, reference, losses, _eager_loop(reference, _lm_loss_fn, mbs))


@pytest.mark.parametrize(
    ("kind", "options", "want_ratio"),
    [
        (None, {}, 1.25),
        ("checkpoint", {}, merged_candidates.RECOMPUTE_MEMORY_BUDGET_RATIO),
        ("selective", {}, merged_candidates.RECOMPUTE_MEMORY_BUDGET_RATIO),
        ("checkpoint", {"interleave_memory_budget_ratio": 2.0}, 2.0),  # set by the user: as given
        ("checkpoint", {"interleave_memory_budget_ratio": 1.25}, 1.25),  # the plain models' budget, asked for
    ],
    ids=["plain", "checkpoint", "selective", "checkpoint_option_set", "checkpoint_plain_budget_set"],
)
def test_merged_graph_of_a_recomputing_backward_gets_the_recompute_budget(
    kind: CheckpointKind | None, options: dict[str, Any], want_ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default options, the merged graph of a checkpointed model is planned and compiled
    with the recompute budget (its backward strand recomputes); a model without checkpointing,
    or a budget the user set, keeps ``interleave_memory_budget_ratio``."""
    ratios: list[float] = []
    compile_partition = merged_candidates.compile_partition

    def recording(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        ratios.append(kwargs["config"].interleave_budget_ratio)
        return compile_partition(gm, example_inputs, **kwargs)

    monkeypatch.setattr(merged_candidates, "compile_partition", recording)
    config = ModelConfig(n_layers=1)
    model = Transformer(config)
    if kind is not None:
        checkpoint_blocks(model.layers, kind)
    reference = copy.deepcopy(model)
    mbs = _transformer_batches(2, config)  # F0 | B0+F1 | B1: one merged graph
    losses = dhelix_compile.helix(model, _lm_loss_fn, **EAGER, **options)(mbs)
    _assert_same(model, reference, losses, _eager_loop(reference, _lm_loss_fn, mbs))
    assert ratios == [want_ratio]


def test_recomputes_counts_checkpointed_ops_but_not_parameter_regathers() -> None:
    """``recomputes`` reads the partitioner's ``meta["recompute"]`` tags: a checkpointing tag
    counts, ``data_parallel``'s regathers (their own ``ac_graph_id``) and a saved op do not."""

    def graph_tagged(policy: CheckpointPolicy | None, ac_graph_id: int) -> torch.fx.GraphModule:
        gm = _graph_calling(_call(aten.mm.default, "x", "x"))
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        if policy is not None:
            node.meta["recompute"] = policy
            node.meta["ac_graph_id"] = ac_graph_id
        return gm

    assert merged_candidates.recomputes(graph_tagged(CheckpointPolicy.PREFER_RECOMPUTE, 0))
    assert merged_candidates.recomputes(graph_tagged(CheckpointPolicy.MUST_RECOMPUTE, 1))
    assert not merged_candidates.recomputes(graph_tagged(CheckpointPolicy.MUST_RECOMPUTE, REGATHER_AC_GRAPH_ID))
    assert not merged_candidates.recomputes(graph_tagged(CheckpointPolicy.MUST_SAVE, 0))
    assert not merged_candidates.recomputes(graph_tagged(None, 0))


# ---------------------------------------------------------------- dropout in a checkpointed region


def _dropout_model(p: float) -> nn.Module:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 8), nn.Dropout(p), nn.Linear(8, 8))
    return nn.Sequential(nn.Linear(8, 8), Checkpointed(inner), nn.Linear(8, 1)).train()


def _mean_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).mean()


@pytest.mark.parametrize(
    "fallback_random",
    [False, True],  # dropout as Inductor's seeded random prims; native_dropout under the RNG-state wrappers
    ids=["decomposed", "fallback_random"],
)
def test_dropout_in_a_checkpointed_region_equals_the_loop_of_the_same_code(fallback_random: bool) -> None:
    """The recompute draws the forward's mask: a step equals dhelix's accumulation loop with the
    same (eager) code, which draws each micro-batch's mask once (tests/test_helix_dropout.py reads
    the masks off the numbers)."""
    model = _dropout_model(0.5)
    reference = copy.deepcopy(model)
    mbs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    with torch._inductor.config.patch(fallback_random=fallback_random):
        compiled = torch.compile(reference, backend=dhelix_compile.backend(**EAGER))
        torch.manual_seed(11)
        want = _eager_loop(compiled, _mean_loss, mbs)
        torch.manual_seed(11)
        losses = dhelix_compile.helix(model, _mean_loss, **EAGER)(mbs)
    _assert_same(model, reference, losses, want)


def test_dropout_with_p_0_in_a_checkpointed_region_runs() -> None:
    model = _dropout_model(0.0)
    reference = copy.deepcopy(model)
    mbs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    losses = dhelix_compile.helix(model, _mean_loss, **EAGER)(mbs)
    _assert_same(model, reference, losses, _eager_loop(reference, _mean_loss, mbs))


# ---------------------------------------------------------------- Hugging Face Llama, one process


def test_hf_llama_with_gradient_checkpointing_equals_eager_loop(partitions: Partitions) -> None:
    pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")
    from dhelix_compile.models.hf_llama import build_hf_llama, hf_llama_batches, hf_llama_loss

    model = build_hf_llama("tiny", n_layers=1)
    # transformers 5 names it activation_checkpointing_enable; gradient_checkpointing_enable is its older alias
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    reference = copy.deepcopy(model)
    mbs = hf_llama_batches("tiny", 2, torch.Generator().manual_seed(0))
    losses = dhelix_compile.helix(model, hf_llama_loss, **EAGER)(copy.deepcopy(mbs))
    _assert_same(model, reference, losses, _eager_loop(reference, hf_llama_loss, mbs))
    assert partitions["bwd"]["run_with_rng_state"] == 1  # the decoder layer's attention, recomputed


# ---------------------------------------------------------------- tensor parallel, 2 gloo ranks


def _check_checkpointed_tp(rank: int, world_size: int, kind: CheckpointKind) -> list[float]:
    from dhelix_compile.testing.checks import CheckConfig
    from dhelix_compile.testing.helix_checks import build_helix_case, local_grads

    config = CheckConfig(model=ModelConfig(n_layers=1))
    case = build_helix_case("functional_sp", rank, world_size, 2, config=config)
    for model in (case.eager_model, case.helix_model):
        checkpoint_blocks(model.layers, kind)  # type: ignore[arg-type]
    want = _eager_loop(case.eager_model, case.loss_fn, case.microbatches)
    got = dhelix_compile.helix(case.helix_model, case.loss_fn, **EAGER)(case.microbatches)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-5, rtol=1e-4)
    want_grads, got_grads = local_grads(case.eager_model), local_grads(case.helix_model)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    return [float(loss) for loss in got]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "kind",
    [
        "checkpoint",
        *(pytest.param(kind, marks=pytest.mark.full) for kind in ("checkpoint_wrapper", "selective")),
    ],
)
def test_checkpointed_tensor_parallel_blocks_equal_eager_loop_on_2_ranks(kind: CheckpointKind) -> None:
    losses = run_on_ranks(_check_checkpointed_tp, 2, kind, timeout_s=300)
    assert all(len(r) == 2 for r in losses)
