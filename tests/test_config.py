"""DHelixConfig: defaults < env vars < options; typos and bad values are clear errors."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import dhelix_compile
from dhelix_compile.config import ConfigError, DHelixConfig, experimental_option_names, option_names, option_summary


def test_defaults() -> None:
    config = DHelixConfig.from_options({}, environ={})
    assert config == DHelixConfig()
    assert config.codegen == "inductor" and config.fallback == "inductor"
    assert config.dump_dir is None and config.disable_passes == ()


def test_env_vars_are_read() -> None:
    env = {"DHELIX_DUMP_DIR": "/tmp/d", "DHELIX_CODEGEN": "eager", "DHELIX_DISABLE_PASSES": "verify, annotate"}
    config = DHelixConfig.from_options(None, environ=env)
    assert config.dump_dir == "/tmp/d"
    assert config.codegen == "eager"
    assert config.disable_passes == ("verify", "annotate")


def test_options_win_over_env_vars() -> None:
    env = {"DHELIX_CODEGEN": "eager", "DHELIX_DUMP_DIR": "/tmp/env"}
    config = DHelixConfig.from_options({"codegen": "inductor", "dump_dir": "/tmp/opt"}, environ=env)
    assert (config.codegen, config.dump_dir) == ("inductor", "/tmp/opt")


def test_empty_env_var_means_unset() -> None:
    assert DHelixConfig.from_options(None, environ={"DHELIX_CODEGEN": ""}).codegen == "inductor"


def test_unknown_option_lists_valid_ones_and_suggests() -> None:
    with pytest.raises(ConfigError) as info:
        DHelixConfig.from_options({"dump_dirr": "x"}, environ={})
    message = str(info.value)
    assert "'dump_dirr'" in message and "did you mean 'dump_dir'" in message
    for name in option_names():
        assert name in message


@pytest.mark.parametrize(
    ("option", "value"),
    [("codegen", "triton"), ("fallback", "ignore"), ("cost_model", "magic")],
)
def test_bad_literal_value_lists_choices(option: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"{option}='{value}' is not valid; choose one of"):
        DHelixConfig.from_options({option: value}, environ={})


def test_bad_env_value_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="codegen='cuda'"):
        DHelixConfig.from_options(None, environ={"DHELIX_CODEGEN": "cuda"})


def test_disable_passes_accepts_list_and_rejects_garbage() -> None:
    assert DHelixConfig.from_options({"disable_passes": ["verify"]}, environ={}).disable_passes == ("verify",)
    with pytest.raises(ConfigError, match="disable_passes"):
        DHelixConfig.from_options({"disable_passes": 3}, environ={})


def test_unknown_pass_name_is_rejected_by_the_backend() -> None:
    from graph_passes.pass_list import pass_names

    names = ", ".join(pass_names())
    assert "reorder" in pass_names()
    with pytest.raises(ConfigError, match=re.escape(f"unknown dhelix pass(es) 'reorderr'; passes: {names}")):
        dhelix_compile.backend(disable_passes=["reorderr"])


def test_config_is_frozen_and_patch_validates() -> None:
    config = DHelixConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.codegen = "eager"  # type: ignore[misc]  # assigning to the frozen dataclass on purpose
    assert config.patch(codegen="eager").codegen == "eager"
    assert config.codegen == "inductor"
    with pytest.raises(ConfigError):
        config.patch(codegen="nope")
    with pytest.raises(ConfigError, match="unknown dhelix option"):
        config.patch(nope=1)


def test_backend_factory_validates_immediately() -> None:
    with pytest.raises(ConfigError, match="unknown dhelix option 'codegenn'"):
        dhelix_compile.backend(codegenn="eager")
    assert callable(dhelix_compile.backend(codegen="eager"))


def test_readme_options_table_is_current() -> None:
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert DHelixConfig.describe(brief=True) in readme, "regenerate the README table: DHelixConfig.describe(brief=True)"
    options_page = (root / "docs" / "options.md").read_text()
    assert DHelixConfig.describe() in options_page, "regenerate docs/options.md's table: DHelixConfig.describe()"


def test_experimental_options_are_marked_and_listed_last() -> None:
    """The options whose own docs measure them slower or level with the default: one flag marks
    them, and both tables list them last, marked."""
    assert experimental_option_names() == (
        "bucket_mb",
        "decompose_auto_chunked",
        "decompose_chains",
        "helix_strand_rewrites",
        "helix_strand_kernels",
        "interleave_measure_pairs",
        "interleave_timed_width",
    )
    for brief in (True, False):
        rows = DHelixConfig.describe(brief=brief).splitlines()[2:]
        names = [row.split("`")[1] for row in rows]
        count = len(experimental_option_names())
        assert sorted(names[-count:]) == sorted(experimental_option_names())
        for row, name in zip(rows, names):
            assert ("| (experimental) " in row) == (name in experimental_option_names()), row


def test_each_option_summary_is_one_short_sentence() -> None:
    """The README's table gives each option's first sentence: one line, not a paragraph."""
    for f in dataclasses.fields(DHelixConfig):
        summary = option_summary(f.metadata["doc"])
        assert summary.endswith(".") and len(summary) <= 160, f"{f.name}: {summary!r}"


def test_dhelix_env_vars_are_read_only_in_config_module() -> None:
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for folder in ("dhelix_compile", "graph_passes", "cost_model"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.name == "config.py" and path.parent.name == "dhelix_compile":
                continue
            if re.search(r"(environ|getenv).*DHELIX_", path.read_text()):
                offenders.append(str(path.relative_to(root)))
    assert offenders == [], f"environment variables read outside dhelix_compile/config.py: {offenders}"


def test_option_typo_through_torch_compile_names_the_option() -> None:
    import torch

    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="dhelix", options={"dump_dirr": "x"})
    with pytest.raises(Exception, match="unknown dhelix option 'dump_dirr' \\(did you mean 'dump_dir'\\?\\)"):
        compiled(torch.randn(1, 2))


def test_non_callable_model_is_rejected_by_torch_compile() -> None:
    import torch

    with pytest.raises(Exception, match="callable"):
        torch.compile(5, backend="dhelix")  # type: ignore[call-overload]  # not callable, on purpose


# ---------------------------------------------------------------------------------- config -> passes


def test_every_pass_option_is_a_config_field() -> None:
    from dhelix_compile.pass_options import FIELDS, unmapped_fields

    assert unmapped_fields() == []
    for name, (_, fields) in FIELDS.items():
        for source in fields.values():
            assert source in option_names(), f"{name}: {source} is not a DHelixConfig field"


def test_every_pass_options_class_defaults_to_the_config() -> None:
    """One set of defaults: a pass's options built from DHelixConfig() equal the class's own
    defaults, field by field (copied and derived fields alike)."""
    from dhelix_compile.pass_options import FIELDS, pass_options

    built = pass_options(DHelixConfig())
    differ = [
        f"{name}.{f.name}: {getattr(cls(), f.name)!r} (class) != {getattr(built[name], f.name)!r} (config)"
        for name, (cls, _) in FIELDS.items()
        for f in dataclasses.fields(cls)
        if getattr(cls(), f.name) != getattr(built[name], f.name)
    ]
    assert differ == []


def test_a_pass_not_asked_for_does_nothing() -> None:
    """No options for decompose in the context: the pass is off (its class defaults to 'auto')."""
    import torch

    from graph_passes.context import PassContext
    from graph_passes.decompose import decompose_pass

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    ctx = PassContext("test", "fwd")
    decompose_pass(gm, ctx)
    assert ctx.stats["decompose"] == {"off": 1}


@pytest.mark.parametrize(
    ("option", "value", "pass_name", "field"),
    [
        ("memory_budget_ratio", 1.5, "reorder", "memory_budget_ratio"),
        ("max_in_flight", 3, "reorder", "max_in_flight"),
        ("max_issue_distance", 64, "reorder", "max_issue_distance"),
        ("decompose", "off", "decompose", "mode"),
        ("decompose_max_chunks", 2, "decompose", "max_chunks"),
        ("decompose_auto_chunked", True, "decompose", "auto_chunked"),
        ("decompose_pieces", 4, "decompose", "pieces"),
        ("decompose_min_gain_ratio", 0.1, "decompose", "min_gain_ratio"),
        ("interleave_memory_budget_ratio", 1.4, "interleave", "memory_budget_ratio"),
        ("interleave_defer_weight_grads", "1,2", "interleave", "defer_weight_grads"),
        ("interleave_refine_evals", 0, "interleave", "refine_evals"),
    ],
)
def test_an_option_reaches_its_pass(option: str, value: object, pass_name: str, field: str) -> None:
    from dhelix_compile.pass_options import pass_options

    default = getattr(pass_options(DHelixConfig())[pass_name], field)
    got = getattr(pass_options(DHelixConfig.from_options({option: value}, environ={}))[pass_name], field)
    expected = (1, 2) if option == "interleave_defer_weight_grads" else value
    assert got == expected != default


def test_decompose_chains_adds_the_chain_pattern() -> None:
    from dhelix_compile.pass_options import pass_options
    from graph_passes.decompose import CHAIN

    assert CHAIN not in pass_options(DHelixConfig())["decompose"].patterns
    assert pass_options(DHelixConfig(decompose_chains=True))["decompose"].patterns[0] == CHAIN


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("interleave_memory_budget_ratio", 0.9, "must be >= 1.0"),
        ("interleave_defer_weight_grads", "1,x", "expected integers"),
        ("interleave_defer_weight_grads", [0], "must be >= 1"),
        ("interleave_refine_evals", -1, "must be >= 0"),
    ],
)
def test_bad_interleave_options_are_clear_errors(option: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        DHelixConfig.from_options({option: value}, environ={})
