"""Names a package exports without importing their modules until first use (PEP 562).

Contract
    ``__getattr__, __dir__ = lazy_exports(__name__, {"name": "submodule", ...})`` in a package's
    ``__init__``: ``package.name`` imports ``package.submodule`` on first use, keeps the value in
    the package's namespace (later lookups never reach ``__getattr__``), and raises
    ``AttributeError`` for a name it does not export; ``dir(package)`` lists the exports too.
    Imports no torch itself, so a package that uses it stays cheap to import.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` (module docstring)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
