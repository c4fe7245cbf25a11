"""The link rate at which a step's communication takes as long as its compute: ``--rate auto``.

dhelix is for steps whose collectives cost about what their compute does; a fixed rate gives that
on one machine only (the same workload computes 1.6x faster on one 2-core machine than on
another, and a rate tuned on the slower leaves the faster one's step communication-bound). So
``dhelix bench --rate auto`` (and ``dhelix demo``) first measure ``T_compute`` on the fake group,
then time the step's collectives alone (``T_comm``) over the link at a probe rate, and scale the
rate by ``T_comm / T_compute``, again until ``T_comm`` is within ``tolerance`` of ``T_compute``.

``T_comm`` is not exactly proportional to 1 / rate (TCP through ``tbf`` delivers 65-80% of the
nominal rate, and every collective has a fixed cost), which is why the scaling repeats.

Contract
    - ``parse_rate(text) -> float``: a ``tc`` rate (``"1gbit"``, ``"400mbit"``, ``"800kbit"``,
      ``"1000000bit"``) in bit/s; ``ValueError`` naming the text otherwise.
    - ``format_rate(bits_per_s) -> str``: the rate ``tc`` reads, in whole mbit (at least 1).
    - ``next_rate(rate, t_comm_s, t_compute_s) -> float``: the rate at which ``T_comm`` would
      equal ``T_compute`` if it were proportional to 1 / rate, within ``[MIN_RATE, MAX_RATE]``.
    - ``calibrated(t_comm_s, t_compute_s, tolerance)``: whether ``T_comm`` is within ``tolerance``
      (relative) of ``T_compute``.
"""

from __future__ import annotations

import re

#: Where ``--rate auto`` starts: the rate of most of BENCHMARKS.md's tables.
PROBE_RATE = "1gbit"
#: Calibration stops when T_comm is within this share of T_compute ...
TOLERANCE = 0.08
#: ... or after this many timed rates.
MAX_PROBES = 3
#: The rates ``next_rate`` keeps to (bit/s): below 10 Mbit/s a step takes minutes; above
#: 20 Gbit/s ``tbf`` no longer limits a veth pair on this kind of machine.
MIN_RATE, MAX_RATE = 10e6, 20e9

_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """A ``tc`` rate in bit/s (see the module docstring)."""
    match = _RATE.match(text)
    if match is None:
        raise ValueError(f"not a link rate: {text!r} (expected a number and bit, kbit, mbit, gbit or tbit: '400mbit')")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def format_rate(bits_per_s: float) -> str:
    """``bits_per_s`` as ``tc`` reads it, in whole mbit."""
    return f"{max(round(bits_per_s / 1e6), 1)}mbit"


def next_rate(rate: float, t_comm_s: float, t_compute_s: float) -> float:
    """The rate (bit/s) that would make ``T_comm`` equal ``T_compute``, were it proportional to 1 / rate."""
    if t_comm_s <= 0 or t_compute_s <= 0:
        raise ValueError(f"T_comm and T_compute must be positive to scale a rate (got {t_comm_s}, {t_compute_s})")
    return min(max(rate * t_comm_s / t_compute_s, MIN_RATE), MAX_RATE)


def calibrated(t_comm_s: float, t_compute_s: float, tolerance: float = TOLERANCE) -> bool:
    """Whether ``T_comm`` is within ``tolerance`` (relative) of ``T_compute``."""
    return abs(t_comm_s - t_compute_s) <= tolerance * t_compute_s


__all__ = ["MAX_PROBES", "PROBE_RATE", "TOLERANCE", "calibrated", "format_rate", "next_rate", "parse_rate"]
