"""The few SVG pieces the pictures share (timelines, graph pictures): one way to write text and
to tell how wide it will be.

:func:`text_width_px` errs wide: its per-character widths are those of DejaVu Sans (the widest
of the sans-serif fonts a browser picks for ``Helvetica, Arial, sans-serif``; Liberation Sans,
Arial's metric twin, is narrower), so text it says fits does fit, whichever of them renders it.
``tests/test_observe_browser.py`` measures the rendered text against it in Chromium.
"""

from __future__ import annotations

import html

#: Advance widths in em (DejaVu Sans, rounded up) for the characters that differ from the rest.
_NARROW_EM = {c: 0.32 for c in "ijl.,:;'|!"} | {c: 0.42 for c in "ftrI()[]-/ "}
_WIDE_EM = {c: 1.0 for c in "mMW%@"} | {c: 0.84 for c in "w+=<>⊕→"}
_LOWER_EM = 0.64
_UPPER_EM = 0.79
_BOLD_FACTOR = 1.1
_MONO_EM = 0.61


def text_width_px(content: str, size: float, *, weight: str = "normal", mono: bool = False) -> float:
    """How wide ``content`` renders at font size ``size`` px, at most (see the module docstring)."""
    if mono:
        return len(content) * _MONO_EM * size
    em = sum(_NARROW_EM.get(c) or _WIDE_EM.get(c) or (_UPPER_EM if c.isupper() else _LOWER_EM) for c in content)
    return em * size * (_BOLD_FACTOR if weight == "bold" else 1.0)


def text(
    x: float, y: float, content: str, *, size: int, weight: str = "normal", fill: str = "#222", mono: bool = False
) -> str:
    """A ``<text>`` element at ``(x, y)`` (the baseline's left end), escaped, whitespace kept."""
    family = ' font-family="DejaVu Sans Mono, monospace"' if mono else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" font-weight="{weight}" fill="{fill}"{family} '
        f'xml:space="preserve">{html.escape(content)}</text>'
    )
