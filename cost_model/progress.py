"""The project's one progress bar: tqdm, drawn the same way everywhere.

Contract
--------
``progress_bar(total, label, enabled=..., stream=None)`` returns a ``tqdm`` bar on ``stream``
(stderr by default) that reads::

    dhelix calibrate cpu-...-8t [##########....................] 4/12 [00:03<00:06, aten.mm.default]

Advance it with ``bar.set_postfix_str(item)`` (the item in progress, cut to 40 characters)
and ``bar.update()``; close it (or use it as a context manager): a bar that was shown ends
with a newline. It is silent -- writes nothing -- unless ``enabled`` and ``total > 0``.
Whether to show it at all (which rank, a terminal, enough work) is the caller's rule.
"""

from __future__ import annotations

from typing import TextIO

from tqdm import tqdm

#: ``label [#####.....] done/total [elapsed<remaining, item]`` (tqdm writes the item as ", item")
BAR_FORMAT: str = "{desc} [{bar:30}] {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
ITEM_CHARS: int = 40


def progress_bar(total: int, label: str, *, enabled: bool, stream: TextIO | None = None) -> tqdm:
    """A bar of ``total`` steps named ``label`` (module docstring)."""
    return tqdm(
        total=max(total, 0),
        desc=label,
        file=stream,
        disable=not (enabled and total > 0),
        bar_format=BAR_FORMAT,
        ascii=".#",
    )


def item_label(item: str) -> str:
    """``item`` cut to the width the bar gives it."""
    return item[:ITEM_CHARS]


__all__ = ["BAR_FORMAT", "item_label", "progress_bar"]
