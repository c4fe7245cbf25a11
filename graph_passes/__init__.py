"""dhelix graph passes: ``(gm, ctx) -> gm`` functions run in order by one driver.

See ``graph_passes/README.md`` for the ``node.meta`` contract and the invariants every pass keeps.
"""

from __future__ import annotations

from graph_passes.context import PassContext, PassObserver, Phase
from graph_passes.pass_list import (
    PASSES,
    GraphPass,
    PassError,
    UnknownPassError,
    check_pass_names,
    pass_names,
    run_pipeline,
)

__all__ = [
    "PASSES",
    "GraphPass",
    "PassContext",
    "PassError",
    "PassObserver",
    "Phase",
    "UnknownPassError",
    "check_pass_names",
    "pass_names",
    "run_pipeline",
]
