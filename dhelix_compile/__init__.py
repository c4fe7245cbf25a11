"""dhelix: a ``torch.compile`` backend that hides communication behind computation.

    model = torch.compile(model, backend="dhelix")                       # no import needed
    model = torch.compile(model, backend="dhelix", options={"dump_dir": "dhelix_dump"})
    model = torch.compile(model, backend=dhelix_compile.backend(codegen="eager"))
"""

from __future__ import annotations

import logging

from dhelix_compile.compiler import backend, dhelix_backend
from dhelix_compile.config import ConfigError, DHelixConfig

logging.getLogger("dhelix").addHandler(logging.NullHandler())

__all__ = ["ConfigError", "DHelixConfig", "backend", "dhelix_backend"]
__version__ = "0.1.0"
