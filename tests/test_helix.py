"""``dhelix_compile.helix`` in one process: equals the eager accumulation loop; bad input fails clearly."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import dhelix_compile
from cost_model import compile_clock
from dhelix_compile import _torch_compat as compat
from dhelix_compile.config import DHelixConfig
from dhelix_compile.helix_runtime.merged_candidates import leanest_of_the_fastest
from dhelix_compile.helix_runtime.schedule import SCHEDULE_KINDS, merged_graph_dirs
from dhelix_compile.helix_runtime.step import HelixError
from dhelix_compile.models.llama import ModelConfig, Transformer, lm_loss
from dhelix_compile.observe.report import report
from dhelix_compile.testing.moe import MoEConfig, ReferenceMoE

EAGER = {"codegen": "eager", "fallback": "error"}


def _eager_loop(model: nn.Module, loss_fn, microbatches) -> list[torch.Tensor]:
    losses = []
    for mb in microbatches:
        loss = loss_fn(model, mb)
        loss.backward()
        losses.append(loss.detach())
    return losses


def _assert_same(helix_model: nn.Module, eager_model: nn.Module, got, want, atol=1e-5, rtol=1e-4) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == () and not g.requires_grad
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol)
    for (name, p), (_, q) in zip(helix_model.named_parameters(), eager_model.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=atol, rtol=rtol, msg=name)


def _transformer_batches(n: int, config: ModelConfig, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, config.max_seq_len)
    return [
        (
            torch.randint(0, config.vocab_size, shape, generator=gen),
            torch.randint(0, config.vocab_size, shape, generator=gen),
        )
        for _ in range(n)
    ]


def _lm_loss_fn(model: nn.Module, mb) -> torch.Tensor:
    return lm_loss(model(mb[0]), mb[1])


@pytest.mark.parametrize(
    ("n", "dtype", "schedule"),
    [
        *((n, dtype, "forward_backward") for n in (1, 2, 5) for dtype in (torch.float32, torch.bfloat16)),
        *((n, torch.float32, schedule) for n in (2, 5) for schedule in ("paired_ends", "same_phase")),
    ],
)
def test_transformer_equals_eager_loop(n: int, dtype: torch.dtype, schedule: str) -> None:
    config = ModelConfig(n_layers=1)
    model = Transformer(config).to(dtype)
    reference = copy.deepcopy(model)
    mbs = _transformer_batches(n, config)
    losses = dhelix_compile.helix(model, _lm_loss_fn, helix_schedule=schedule, **EAGER)(mbs)
    tol = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    _assert_same(model, reference, losses, _eager_loop(reference, _lm_loss_fn, mbs), **tol)


@pytest.mark.parametrize("schedule", SCHEDULE_KINDS)
def test_gradients_accumulate_onto_existing_grads_and_across_steps(schedule: str) -> None:
    config = ModelConfig(n_layers=1)
    model = Transformer(config)
    reference = copy.deepcopy(model)
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    step = dhelix_compile.helix(model, _lm_loss_fn, helix_schedule=schedule, **EAGER)
    for seed, n in ((0, 3), (1, 4)):
        mbs = _transformer_batches(n, config, seed)
        _assert_same(model, reference, step(mbs), _eager_loop(reference, _lm_loss_fn, mbs))


@pytest.mark.parametrize("schedule", SCHEDULE_KINDS)
def test_each_backward_accumulates_in_micro_batch_order(schedule: str) -> None:
    """B0 ⊕ B1 hands both gradients over at once; B0's must land on .grad first, as in eager."""
    config = ModelConfig(n_layers=1)
    model = Transformer(config)
    reference = copy.deepcopy(model)
    seen: dict[str, list[torch.Tensor]] = {"helix": [], "eager": []}
    model.output.weight.register_post_accumulate_grad_hook(lambda p: seen["helix"].append(p.grad.clone()))
    reference.output.weight.register_post_accumulate_grad_hook(lambda p: seen["eager"].append(p.grad.clone()))
    mbs = _transformer_batches(4, config)
    dhelix_compile.helix(model, _lm_loss_fn, helix_schedule=schedule, **EAGER)(mbs)
    _eager_loop(reference, _lm_loss_fn, mbs)
    assert len(seen["helix"]) == len(seen["eager"]) == 4
    for got, want in zip(seen["helix"], seen["eager"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_moe_without_communication() -> None:
    moe = ReferenceMoE(MoEConfig())
    reference = copy.deepcopy(moe)
    gen = torch.Generator().manual_seed(3)
    mbs = [torch.randn(2, 8, 32, generator=gen) for _ in range(3)]

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    losses = dhelix_compile.helix(moe, loss_fn, **EAGER)(mbs)
    _assert_same(moe, reference, losses, _eager_loop(reference, loss_fn, mbs))


@dataclasses.dataclass
class _Output:
    """A Hugging Face-style model output: the loss is an attribute."""

    loss: torch.Tensor
    logits: torch.Tensor


class _HFStyleModel(nn.Module):
    """Takes keyword inputs (``model(**batch)``) and returns an object with ``.loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Transformer(ModelConfig(n_layers=1))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> _Output:
        logits = self.body(input_ids)
        return _Output(loss=lm_loss(logits, labels), logits=logits)


def test_model_returning_loss_attribute_with_dict_microbatches() -> None:
    model = _HFStyleModel()
    reference = copy.deepcopy(model)
    mbs = [{"input_ids": t, "labels": y} for t, y in _transformer_batches(3, ModelConfig(n_layers=1))]
    losses = dhelix_compile.helix(model, **EAGER)(mbs)
    _assert_same(model, reference, losses, _eager_loop(reference, lambda m, mb: m(**mb).loss, mbs))


def test_hugging_face_model_if_installed() -> None:
    transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    mbs = [
        {"input_ids": t, "labels": t} for t, _ in _transformer_batches(2, ModelConfig(vocab_size=64, max_seq_len=16))
    ]
    losses = dhelix_compile.helix(model, **EAGER)(mbs)
    _assert_same(model, reference, losses, _eager_loop(reference, lambda m, mb: m(**mb).loss, mbs))


class _ScalarLossModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.lin(x)
        return (out - y).square().mean() if y is not None else out.square().mean()


def test_tensor_and_tuple_microbatches() -> None:
    gen = torch.Generator().manual_seed(0)
    for make in (
        lambda: torch.randn(4, 8, generator=gen),
        lambda: (torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)),
    ):
        model = _ScalarLossModel()
        reference = copy.deepcopy(model)
        mbs = [make() for _ in range(3)]
        losses = dhelix_compile.helix(model, **EAGER)(mbs)

        def call(m, mb):
            return m(*mb) if isinstance(mb, tuple) else m(mb)

        _assert_same(model, reference, losses, _eager_loop(reference, call, mbs))


@pytest.mark.parametrize("schedule", SCHEDULE_KINDS)
def test_microbatches_of_different_shapes_recompile_and_stay_exact(schedule: str) -> None:
    """Calls of two graphs do not merge: the parked one runs first, then the other."""
    model = _ScalarLossModel()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    mbs = [torch.randn(rows, 8, generator=gen) for rows in (4, 4, 6, 4, 6)]
    losses = dhelix_compile.helix(model, helix_schedule=schedule, **EAGER)(mbs)
    _assert_same(model, reference, losses, _eager_loop(reference, lambda m, x: m(x), mbs))


@pytest.mark.parametrize("schedule", SCHEDULE_KINDS)
@pytest.mark.parametrize("failing", [0, 1])
def test_an_error_in_either_call_of_a_pair_is_raised_not_hung(schedule: str, failing: int) -> None:
    """F0 runs on the partner thread in F0+F1, F1 here: an error in either reaches the caller."""
    gen = torch.Generator().manual_seed(0)
    mbs = [torch.randn(6 if k == failing else 4, 8, generator=gen) for k in range(4)]

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model.lin(x)
        return out.sum(0) if x.shape[0] == 6 else out.square().mean()  # not a scalar for the bad one

    step = dhelix_compile.helix(_ScalarLossModel(), loss_fn, helix_schedule=schedule, **EAGER)
    with pytest.raises(HelixError, match="scalar loss"):
        step(mbs)


@pytest.mark.inductor
@pytest.mark.parametrize("in_graph", [True, False])
def test_backward_graphs_add_parameter_gradients_into_grad(monkeypatch: pytest.MonkeyPatch, in_graph: bool) -> None:
    """``helix_grads_in_graph``: every backward graph (alone and merged) routes each parameter's
    gradient through ``dhelix::grad_total``; the step still equals the eager loop, onto existing
    gradients and across steps, and a tensor hook still sees each micro-batch's gradient alone."""
    import dhelix_compile.helix_runtime.merged_candidates as merged_candidates

    routed: list[int] = []
    original = merged_candidates.add_grads_in_graph
    monkeypatch.setattr(
        merged_candidates, "add_grads_in_graph", lambda gm, parts: routed.append(original(gm, parts)) or routed[-1]
    )
    config = ModelConfig(n_layers=1)
    model = Transformer(config)
    reference = copy.deepcopy(model)
    seen: dict[str, list[torch.Tensor]] = {"helix": [], "eager": []}
    model.norm.weight.register_hook(lambda g: seen["helix"].append(g.clone()))
    reference.norm.weight.register_hook(lambda g: seen["eager"].append(g.clone()))
    step = dhelix_compile.helix(model, _lm_loss_fn, helix_grads_in_graph=in_graph, **EAGER)
    for seed in (0, 1):
        mbs = _transformer_batches(4, config, seed)
        _assert_same(model, reference, step(mbs), _eager_loop(reference, _lm_loss_fn, mbs))
    n_params = len(list(model.parameters()))
    assert routed == ([n_params, n_params] if in_graph else [])  # B alone, then B ⊕ F
    assert len(seen["helix"]) == len(seen["eager"]) == 8
    for got, want in zip(seen["helix"], seen["eager"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_gradients_kept_in_a_flat_buffer_stay_there() -> None:
    """``.grad`` as views into one buffer (DDP's gradient_as_bucket_view): helix adds into it as
    autograd does, so the buffer holds the gradients after the step."""
    config = ModelConfig(n_layers=1)
    model = Transformer(config)
    reference = copy.deepcopy(model)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    views = flat.split([p.numel() for p in model.parameters()])
    for p, view in zip(model.parameters(), views, strict=True):
        p.grad = view.view_as(p)
    mbs = _transformer_batches(3, config)
    _assert_same(
        model,
        reference,
        dhelix_compile.helix(model, _lm_loss_fn, **EAGER)(mbs),
        _eager_loop(reference, _lm_loss_fn, mbs),
    )
    for p, view in zip(model.parameters(), views, strict=True):
        assert p.grad.data_ptr() == view.data_ptr()


def test_inductor_codegen_equals_eager_loop(tmp_path: Path) -> None:
    config = ModelConfig(n_layers=1)
    model = Transformer(config)
    reference = copy.deepcopy(model)
    mbs = _transformer_batches(3, config)
    step = dhelix_compile.helix(model, _lm_loss_fn, codegen="inductor", fallback="error", dump_dir=str(tmp_path))
    _assert_same(model, reference, step(mbs), _eager_loop(reference, _lm_loss_fn, mbs))
    merged = [json.loads((p / "summary.json").read_text()) for p in merged_graph_dirs(tmp_path)]
    assert merged and merged[0]["stats"]["interleave"]["sequential: no estimator"] == 1
    # the merged graph takes over B's saved activations: Inductor may reuse their buffers
    pictures = [(p / "graph.dot").read_text() for p in merged_graph_dirs(tmp_path)]
    assert pictures and all(compat.DONATED_SUFFIX in text for text in pictures)


# ---------------------------------------------------------------------- bad input


def test_a_helix_step_with_dumps_keeps_its_compile_clock_beside_them(tmp_path: Path) -> None:
    config = ModelConfig(n_layers=1)
    graphs = compile_clock.counts()["graphs"]
    step = dhelix_compile.helix(Transformer(config), _lm_loss_fn, dump_dir=str(tmp_path), **EAGER)
    step(_transformer_batches(2, config))  # F0 | B0+F1 | B1: F, B and the merged graph compiled
    clock = json.loads((tmp_path / "compile_clock.json").read_text())
    assert clock["counts"]["graphs"] == graphs + 3, "written after the merged graph, the last compile"
    assert clock["seconds"]["capture"] > 0 and clock["seconds"]["passes"] > 0 and clock["seconds"]["dumps"] > 0
    assert "\nCompile time: " in report(tmp_path)


def test_empty_list_is_refused() -> None:
    with pytest.raises(HelixError, match="at least one micro-batch"):
        dhelix_compile.helix(_ScalarLossModel(), **EAGER)([])


def test_a_single_tensor_instead_of_a_list_is_refused() -> None:
    with pytest.raises(HelixError, match="list of micro-batches"):
        dhelix_compile.helix(_ScalarLossModel(), **EAGER)(torch.randn(4, 8))


def test_microbatch_of_unknown_type_is_refused() -> None:
    with pytest.raises(HelixError, match="micro-batch 1 is a str"):
        dhelix_compile.helix(_ScalarLossModel(), **EAGER)([torch.randn(4, 8), "x"])


def test_non_scalar_loss_is_refused() -> None:
    step = dhelix_compile.helix(nn.Linear(8, 4), **EAGER)
    with pytest.raises(HelixError, match=r"scalar loss.*\(4, 4\)"):
        step([torch.randn(4, 8), torch.randn(4, 8)])


def test_model_without_trainable_parameters_is_refused() -> None:
    model = _ScalarLossModel().requires_grad_(False)
    with pytest.raises(HelixError, match="no parameter that requires grad"):
        dhelix_compile.helix(model, **EAGER)([torch.randn(4, 8)])


def test_dropout_in_eval_mode_runs() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1)).eval()
    reference = copy.deepcopy(model)
    mbs = [torch.randn(4, 8) for _ in range(2)]
    losses = dhelix_compile.helix(model, lambda m, x: m(x).mean(), **EAGER)(mbs)
    _assert_same(model, reference, losses, _eager_loop(reference, lambda m, x: m(x).mean(), mbs))


def test_bad_options_fail_at_helix() -> None:
    with pytest.raises(dhelix_compile.ConfigError, match="did you mean 'codegen'"):
        dhelix_compile.helix(_ScalarLossModel(), codgen="eager")


def test_helix_starts_inductors_compile_workers_when_it_generates_inductor_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``helix`` starts Inductor's compile workers (without waiting) when its codegen is
    Inductor, so they start while the first call traces; with eager codegen it does not."""
    started: list[bool] = []
    monkeypatch.setattr(compat, "start_compile_workers", lambda: started.append(True) or True)
    dhelix_compile.helix(_ScalarLossModel(), **EAGER)
    assert started == []
    dhelix_compile.helix(_ScalarLossModel(), codegen="inductor")
    assert started == [True]


def test_not_a_module_is_refused() -> None:
    with pytest.raises(HelixError, match=r"torch.nn.Module"):
        dhelix_compile.helix(lambda x: x)


def test_the_merged_candidate_compiled_is_the_leanest_of_the_fastest_within_the_budget() -> None:
    """Of a merged graph's candidates (rewritten, plain, ...): none whose peak exceeds the budget
    over the leanest sequential order; of the rest, the leanest of those within the minimum gain
    of the fastest."""
    config = DHelixConfig()  # merged budget 1.25 (interleave_memory_budget_ratio None), decompose_min_gain_ratio 0.02
    nan = float("nan")
    # (planned peak, sequential peak) per candidate
    assert leanest_of_the_fastest([1.0, 1.5], [(100.0, 100.0), (90.0, 90.0)], config) == 0  # clearly faster
    assert leanest_of_the_fastest([1.0, 1.01], [(100.0, 100.0), (90.0, 90.0)], config) == 1  # a tie: the leaner
    assert leanest_of_the_fastest([1.0, 1.01], [(90.0, 90.0), (90.0, 90.0)], config) == 0  # equals: the first
    # the faster holds more than 1.25x the plain strands' sequential order: out
    assert leanest_of_the_fastest([1.0, 1.5], [(130.0, 100.0), (95.0, 100.0)], config) == 1
    assert leanest_of_the_fastest([1.0, 1.5], [(130.0, 110.0), (95.0, 105.0)], config) == 0  # 130 <= 1.25 x 105
    # peaks not predicted count against no one
    assert leanest_of_the_fastest([1.0, 1.5], [(nan, nan), (90.0, 90.0)], config) == 0
    assert leanest_of_the_fastest([float("inf"), 1.5], [(nan, nan), (90.0, 90.0)], config) == 1
