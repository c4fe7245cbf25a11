"""Every test runs with ``DHELIX_FALLBACK=error`` unless it asks for another fallback: a dhelix pass
that raises fails the test instead of falling back to plain Inductor with a warning, which would
pass it silently (data_parallel's and reshard's compiled graphs once did, for weeks). The ranks
that ``run_on_ranks`` starts inherit the environment."""

from __future__ import annotations

import os

os.environ.setdefault("DHELIX_FALLBACK", "error")
