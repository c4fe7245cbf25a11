"""cost_model.lazy_exports: the packages' exports load their module on first use, once."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from cost_model.lazy_exports import lazy_exports


def test_an_export_imports_its_module_once_and_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    package = types.ModuleType("lazy_demo")
    package.__path__ = []  # a package
    sub = types.ModuleType("lazy_demo.sub")
    sub.answer = 42  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lazy_demo", package)
    monkeypatch.setitem(sys.modules, "lazy_demo.sub", sub)
    package.__getattr__, package.__dir__ = lazy_exports("lazy_demo", {"answer": "sub"})  # type: ignore[attr-defined]

    assert "answer" not in vars(package)
    assert package.answer == 42  # type: ignore[attr-defined]
    assert vars(package)["answer"] == 42  # kept: later lookups never reach __getattr__
    assert "answer" in dir(package)
    with pytest.raises(AttributeError, match="module 'lazy_demo' has no attribute 'other'"):
        package.other  # type: ignore[attr-defined]  # noqa: B018


@pytest.mark.parametrize("package", ["cost_model", "dhelix_compile.models", "dhelix_compile.testing"])
def test_the_packages_import_without_torch_and_list_their_exports(package: str) -> None:
    code = (
        f"import sys, {package} as p; assert 'torch' not in sys.modules, 'torch imported';"
        "names = set(p.__all__) if hasattr(p, '__all__') else set(); assert names <= set(dir(p)), names - set(dir(p))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
