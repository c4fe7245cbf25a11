"""``python -m dhelix_compile.testing.smoke``: every module imports with the runtime dependencies alone.

CI runs it in a fresh virtual environment right after ``pip install -e .`` (no dev extra), so a
module that needs a package the project does not declare fails here, naming the module, instead
of on a user's machine.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

PACKAGES = ("cost_model", "graph_passes", "dhelix_compile")


def import_everything() -> list[str]:
    """Import every module of the three packages; return their names (raises on the first failure)."""
    names: list[str] = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names.append(package_name)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package_name}."):
            if info.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(info.name)
            except ImportError as error:
                raise SystemExit(
                    f"smoke: {info.name} does not import with the declared dependencies: {error}"
                ) from error
            names.append(info.name)
    return names


def main() -> int:
    names = import_everything()
    print(f"smoke: {len(names)} modules import with the runtime dependencies alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
