"""Numbers as text, with their units: seconds shown in milliseconds, fractions in percent, ratios as ``1.31x``.

Contract
--------
Every cost in the project is kept in SI units (seconds, bytes, FLOPs) and a fraction in [0, 1];
these functions are the one place that turns them into the text of tables and reports. Each
returns the number alone, without the unit's name, so that a table can name it once in its
header (``step (ms)``); ``None`` -- a value that does not exist -- is written as ``none``::

    format_ms(0.01234)            "12.3"         format_ms(None)        "-"
    format_ms(0.01234, digits=3)  "12.340"       format_pct(0.5834)     "58.3%"
    format_ratio(1.3051)          "1.31x"        format_pct(None, none="n/a")  "n/a"

Rounding is Python's ``format`` (round half to even on the binary value).
"""

from __future__ import annotations

MS_PER_S: float = 1e3


def format_ms(seconds: float | None, digits: int = 1, none: str = "-") -> str:
    """``seconds`` in milliseconds with ``digits`` decimals; ``none`` for None."""
    return none if seconds is None else f"{seconds * MS_PER_S:.{digits}f}"


def format_pct(fraction: float | None, digits: int = 1, none: str = "-") -> str:
    """``fraction`` (1.0 = all) in percent with ``digits`` decimals and a ``%``; ``none`` for None."""
    return none if fraction is None else f"{100 * fraction:.{digits}f}%"


def format_ratio(ratio: float | None, digits: int = 2, none: str = "-") -> str:
    """A ratio such as a speedup, with ``digits`` decimals and an ``x``; ``none`` for None."""
    return none if ratio is None else f"{ratio:.{digits}f}x"


__all__ = ["MS_PER_S", "format_ms", "format_pct", "format_ratio"]
