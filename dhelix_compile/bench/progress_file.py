"""Progress of launched ranks, drawn by the parent: rank 0 writes ``done total item`` to a file after
each step, the parent draws the project's progress bar (``cost_model.progress``) from it.

    rank 0:   progress = ProgressFile(path, total); ...; progress.step("helix")
    parent:   with progress_from_file(path, "   link steps"):
                  launch_ranks(...)

The bar appears with the first step written (before it, the ranks compile and warm up) and
closes when the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from cost_model.progress import item_label, progress_bar

#: How often the parent reads the file.
POLL_S: float = 0.5


class ProgressFile:
    """Writes ``done total item`` to ``path`` after each step (nothing when ``path`` is None: the
    ranks other than 0)."""

    def __init__(self, path: str | Path | None, total: int) -> None:
        self.path, self.total, self.done = path, total, 0

    def step(self, item: str) -> None:
        self.done += 1
        if self.path:
            Path(self.path).write_text(f"{self.done} {self.total} {item}\n")


@contextlib.contextmanager
def progress_from_file(path: Path, label: str) -> Iterator[None]:
    """The progress bar on stderr, fed from the file a :class:`ProgressFile` rewrites, while the block runs."""
    done = threading.Event()

    def draw() -> None:
        bar = None
        while not done.wait(POLL_S):
            try:
                count, total, item = path.read_text().split()
            except (OSError, ValueError):
                continue  # compiling and warming up: no step written yet
            if bar is None:
                bar = progress_bar(int(total), label, enabled=True, stream=sys.stderr)
            bar.set_postfix_str(item_label(item), refresh=False)
            bar.update(int(count) - bar.n)
        if bar is not None:
            bar.close()

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
