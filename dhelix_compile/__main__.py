"""``python -m dhelix_compile``: the ``dhelix`` command line (``dhelix_compile.cli``)."""

import sys

from dhelix_compile.cli import main

sys.exit(main())
