"""The architecture, as the imports say it: layers import downward only, and nothing imports in a circle.

    cost_model      costs, hardware tables, simulator           imports neither of the others
    graph_passes    the passes over FX graphs                   imports cost_model
    dhelix_compile  backend core, ops, helix_runtime            imports both
                    observe/ (dumps, timelines, report)         loaded by the core only when asked for
                    bench/, testing/, cli                       the top: nothing below imports them

Read from the source with ``ast`` (no module is executed), so a lazy import inside a function
counts too; only imports under ``if TYPE_CHECKING:`` are left out (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cost_model", "graph_passes", "dhelix_compile")
#: Modules only the top may import (tests, the CLI, the bench, the test helpers).
TOP = ("dhelix_compile.bench", "dhelix_compile.testing", "dhelix_compile.cli", "dhelix_compile.__main__")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """``(imported project module, at module level?)`` for every import in ``path`` that runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, bool]] = []

    def resolve(target: str) -> str | None:  # the longest project module that ``target`` names
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (m := resolve(alias.name)) is not None:
                    found.append((m, top))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if (m := resolve(f"{base}.{alias.name}")) is not None:
                    found.append((m, top))
        nested = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, nested)

    for statement in tree.body:
        visit(statement, True)
    return [(m, top) for m, top in found if m != name]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, bool]]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _package(module: str) -> str:
    return module.split(".")[0]


def test_the_parser_sees_imports(graph: dict[str, list[tuple[str, bool]]]) -> None:
    """Guards the guard: a reader that found nothing would pass every check below."""
    assert ("dhelix_compile.config", True) in graph["dhelix_compile.compiler"]
    assert any(m.startswith("cost_model.") for m, _ in graph["graph_passes.reorder"])


def test_layers_import_downward_only(graph: dict[str, list[tuple[str, bool]]]) -> None:
    allowed = {"cost_model": {"cost_model"}, "graph_passes": {"cost_model", "graph_passes"}}
    upward = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if _package(module) in allowed
        for target, _ in targets
        if _package(target) not in allowed[_package(module)]
    ]
    assert not upward, "\n".join(upward)


def test_only_the_top_imports_bench_testing_and_cli(graph: dict[str, list[tuple[str, bool]]]) -> None:
    wrong = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if not module.startswith(TOP)
        for target, _ in targets
        if target.startswith(TOP)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_core_loads_observe_only_when_asked(graph: dict[str, list[tuple[str, bool]]]) -> None:
    eager = [
        f"{module} imports {target} at module level"
        for module, targets in graph.items()
        if not module.startswith(("dhelix_compile.observe", *TOP))
        for target, top in targets
        if top and target.startswith("dhelix_compile.observe")
    ]
    assert not eager, "\n".join(eager)


def test_no_import_cycles(graph: dict[str, list[tuple[str, bool]]]) -> None:
    edges = {m: sorted({t for t, _ in targets}) for m, targets in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in edges.get(module, []):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_importing_the_backend_loads_no_observe_module() -> None:
    code = (
        "import sys, dhelix_compile.compiler, dhelix_compile.helix_runtime.step;"
        "print(sorted(m for m in sys.modules if m.startswith('dhelix_compile.observe')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_cost_models_lazy_names_are_the_ones_it_declares() -> None:
    """``cost_model/__init__.py`` names each export three times: the ``TYPE_CHECKING`` imports (for
    mypy), ``__all__`` and ``_EXPORTS`` (what ``__getattr__`` loads on first use); they agree, and
    each name is the object its submodule defines."""
    import importlib

    import cost_model

    tree = ast.parse((ROOT / "cost_model" / "__init__.py").read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and _is_type_checking(node)]
    declared = {
        alias.name: node.module.removeprefix("cost_model.")
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    assert declared == cost_model._EXPORTS
    assert sorted(cost_model.__all__) == sorted(declared)
    for name, module in declared.items():
        assert getattr(cost_model, name) is getattr(importlib.import_module(f"cost_model.{module}"), name), name
