"""The benchmark's step variants: each hands the user's dhelix options on, plus its own."""

from __future__ import annotations

import json

import pytest
import torch

import dhelix_compile
from dhelix_compile.bench.steps import HELIX_VARIANTS, STEP_VARIANTS, step_function


@pytest.mark.parametrize("name", sorted(HELIX_VARIANTS))
def test_helix_variants_pass_user_options_and_their_own(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict = {}

    def fake_helix(model, loss_fn, **options):
        seen.update(options)
        return lambda microbatches: [torch.zeros(()) for _ in microbatches]

    monkeypatch.setattr(dhelix_compile, "helix", fake_helix)
    step = step_function(name, torch.nn.Linear(2, 2), lambda m, mb: m(mb).sum(), {"cost_model": "profile"})
    step([torch.randn(1, 2)])
    assert seen == {"cost_model": "profile", **HELIX_VARIANTS[name]}
    assert name in STEP_VARIANTS


def test_unknown_variant_is_named() -> None:
    with pytest.raises(ValueError, match="unknown benchmark variant 'nope'"):
        step_function("nope", torch.nn.Linear(2, 2), lambda m, mb: m(mb).sum())


def test_variant_names_carry_their_own_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from dhelix_compile.bench.steps import parse_variants, split_variant

    spec = "inductor, helix[cost_model=analytic,decompose=off],dhelix[decompose_pieces=0]"
    assert parse_variants(spec) == [
        "inductor",
        "helix[cost_model=analytic,decompose=off]",
        "dhelix[decompose_pieces=0]",
    ]
    assert split_variant("helix[cost_model=analytic,decompose=off]") == (
        "helix",
        {"cost_model": "analytic", "decompose": "off"},
    )
    assert split_variant("dhelix[decompose_pieces=0,decompose_chains=true]") == (
        "dhelix",
        {"decompose_pieces": 0, "decompose_chains": True},
    )
    seen: dict = {}
    monkeypatch.setattr(dhelix_compile, "helix", lambda model, loss_fn, **options: seen.update(options))
    step_function("helix_decompose[decompose_pieces=2]", torch.nn.Linear(2, 2), lambda m, mb: m(mb).sum(), {"a": 1})
    assert seen == {"a": 1, "decompose": "per_peer", "decompose_pieces": 2}


@pytest.mark.parametrize("bad", ["helix[decompose]", "nope[decompose=off]", "helix[=off]", "helix[a=1"])
def test_bad_variant_names_are_named(bad: str) -> None:
    from dhelix_compile.bench.steps import split_variant

    with pytest.raises(ValueError, match="variant"):
        split_variant(bad)


@pytest.mark.parametrize(
    "text",
    [
        '{"dump_dir": "/tmp/d", "profile_steps": 2}',
        "dump_dir=/tmp/d,profile_steps=2",
        " dump_dir=/tmp/d, profile_steps=2 ",
    ],
)
def test_dhelix_options_are_json_or_key_value_pairs(text: str) -> None:
    from dhelix_compile.bench.run import _check, dhelix_options, parse_args

    assert dhelix_options(text) == {"dump_dir": "/tmp/d", "profile_steps": 2}
    args = parse_args(["--dhelix-options", text])
    assert _check(args) is None
    assert json.loads(args.dhelix_options) == {"dump_dir": "/tmp/d", "profile_steps": 2}  # as the workers read it


@pytest.mark.parametrize(
    ("text", "words"), [("[1, 2]", "not a JSON object"), ("{nope", "not a JSON object"), ("decompose", "key=value")]
)
def test_bad_dhelix_options_are_named(text: str, words: str) -> None:
    from dhelix_compile.bench.run import _check, parse_args

    problem = _check(parse_args(["--dhelix-options", text]))
    assert problem is not None and problem.startswith("--dhelix-options") and words in problem
