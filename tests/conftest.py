"""Every test runs with ``DHELIX_FALLBACK=error`` unless it asks for another fallback: a dhelix pass
that raises fails the test instead of falling back to plain Inductor with a warning, which would
pass it silently (data_parallel's and reshard's compiled graphs once did, for weeks).

The suite keeps dhelix's caches (measured op costs, the measurement logs a second process
replays) in a folder of its own, new for each run, unless ``DHELIX_CACHE_DIR`` is set: the
measurement logs in the user's ``~/.cache/dhelix`` would change the path a compile takes.

The ranks that ``run_on_ranks`` starts inherit the environment.

A test marked ``@pytest.mark.full`` runs in the full suite only (``DHELIX_TEST_FULL=1``, what CI
runs): the default suite keeps to its time budget."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("DHELIX_FALLBACK", "error")
os.environ.setdefault("DHELIX_CACHE_DIR", tempfile.mkdtemp(prefix="dhelix-tests-"))


FULL = bool(os.environ.get("DHELIX_TEST_FULL"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``full`` unless ``DHELIX_TEST_FULL`` is set (module docstring)."""
    if FULL:
        return
    skip = pytest.mark.skip(reason="DHELIX_TEST_FULL=1: the default suite's time budget")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)
