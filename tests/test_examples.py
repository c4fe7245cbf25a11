"""The examples users copy from run as documented, and use only dhelix's public API."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multirank
@pytest.mark.timeout(400)
@pytest.mark.full
def test_train_llama_under_torchrun_matches_eager() -> None:
    """``torchrun --nproc-per-node 2 examples/train_llama.py``: helix's losses equal eager's (the
    script exits non-zero otherwise) and rank 0 prints the table."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(ROOT / "examples" / "train_llama.py"), "--steps", "2", "--microbatches", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=360, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "losses agree with eager" in done.stdout
    assert "| 2 | " in done.stdout and "helix vs Inductor:" in done.stdout


def test_train_llama_variants_option_keeps_the_running_order_and_names_a_wrong_one() -> None:
    """``--variants``: any subset, run in the script's order; an unknown or empty one is refused by name."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "examples" / "train_llama.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.variants("inductor, helix") == ("helix", "inductor")
    assert script.variants("inductor") == ("inductor",)
    for wrong in ("inductr", "", " , "):
        with pytest.raises(argparse.ArgumentTypeError, match="choose among helix, eager, inductor"):
            script.variants(wrong)


#: Modules of the project an example may import, each with the names it may take (its ``__all__``).
PUBLIC_MODULES = (
    "dhelix_compile",
    "dhelix_compile.models",
    "dhelix_compile.models.gpt",
    "dhelix_compile.models.hf_llama",
    "dhelix_compile.models.llama",
    "dhelix_compile.models.tensor_parallel",
)
PROJECT_PACKAGES = ("dhelix_compile", "cost_model", "graph_passes")


def _private_uses(path: Path) -> list[str]:
    """Every import of a project module that is not public (``dhelix_compile.testing``, a
    ``_``-prefixed module, a name outside the module's ``__all__``), and every
    ``dhelix_compile.<name>`` outside ``dhelix_compile.__all__``."""
    public = {name: set(importlib.import_module(name).__all__) for name in PUBLIC_MODULES}
    wrong: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            used = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            used = [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "dhelix_compile":
            used = [("dhelix_compile", node.attr)]
        else:
            continue
        for module, name in used:
            if module.split(".")[0] not in PROJECT_PACKAGES:
                continue
            if module not in public:
                wrong.append(f"line {node.lineno}: {module}")
            elif name is not None and name not in public[module]:
                wrong.append(f"line {node.lineno}: {module}.{name}")
    return wrong


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_examples_import_only_the_public_api(path: Path) -> None:
    """What a user copies must not lean on test helpers or private modules: the models they
    train come from ``dhelix_compile.models``."""
    assert _private_uses(path) == [], f"{path.name} uses names outside {', '.join(PUBLIC_MODULES)}"


def test_the_public_api_check_sees_private_imports(tmp_path: Path) -> None:
    example = tmp_path / "example.py"
    example.write_text(
        "import dhelix_compile\n"
        "from dhelix_compile.testing.checks import build_case\n"
        "from dhelix_compile.models import _EXPORTS, GPT\n"
        "from dhelix_compile import _torch_compat\n"
        "dhelix_compile.helix(None, None)\n"
        "dhelix_compile.compiler.compile_graph\n"
    )
    assert _private_uses(example) == [
        "line 2: dhelix_compile.testing.checks",
        "line 3: dhelix_compile.models._EXPORTS",
        "line 4: dhelix_compile._torch_compat",
        "line 6: dhelix_compile.compiler",
    ]
