"""Every test runs with ``DHELIX_FALLBACK=error`` unless it asks for another fallback: a dhelix pass
that raises fails the test instead of falling back to plain Inductor with a warning, which would
pass it silently (data_parallel's and reshard's compiled graphs once did, for weeks).

The suite keeps dhelix's caches (measured op costs, the measurement logs a second process
replays) in a folder of its own, new for each run, unless ``DHELIX_CACHE_DIR`` is set: the
measurement logs in the user's ``~/.cache/dhelix`` would change the path a compile takes.

The ranks that ``run_on_ranks`` starts inherit the environment."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("DHELIX_FALLBACK", "error")
os.environ.setdefault("DHELIX_CACHE_DIR", tempfile.mkdtemp(prefix="dhelix-tests-"))
