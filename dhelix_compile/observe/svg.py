"""The few SVG pieces the pictures share (timelines, graph pictures): one way to write text."""

from __future__ import annotations

import html


def text(
    x: float, y: float, content: str, *, size: int, weight: str = "normal", fill: str = "#222", mono: bool = False
) -> str:
    """A ``<text>`` element at ``(x, y)`` (the baseline's left end), escaped, whitespace kept."""
    family = ' font-family="DejaVu Sans Mono, monospace"' if mono else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" font-weight="{weight}" fill="{fill}"{family} '
        f'xml:space="preserve">{html.escape(content)}</text>'
    )
