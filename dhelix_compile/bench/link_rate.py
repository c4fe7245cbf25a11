"""The link rate at which a step's communication takes as long as its compute: ``--rate auto``.

dhelix is for steps whose collectives cost about what their compute does; a fixed rate gives that
on one machine only (the same workload computes 1.6x faster on one 2-core machine than on
another, and a rate tuned on the slower leaves the faster one's step communication-bound). So
``dhelix bench --rate auto`` (and ``dhelix demo``) first measure ``T_compute`` on the fake group,
then time the step's collectives alone (``T_comm``) over the link at a probe rate, and scale the
rate by ``T_comm / T_compute``, again until ``T_comm`` is within ``tolerance`` of ``T_compute``.

``T_comm`` is not exactly proportional to 1 / rate (TCP through ``tbf`` delivers 65-80% of the
nominal rate, every collective has a fixed cost, and above 2 Gbit/s the link was erratic: the
data-parallel step's collectives took 313 ms at 3.4 Gbit/s and 609 ms at 2.2 Gbit/s), which is
why the scaling repeats, and why once two rates bracket ``T_compute`` the next one is
interpolated between them (``T_comm`` as a power of the rate) and stays inside the bracket.

Contract
    - ``parse_rate(text) -> float``: a ``tc`` rate (``"1gbit"``, ``"400mbit"``, ``"800kbit"``,
      ``"1000000bit"``) in bit/s; ``ValueError`` naming the text otherwise.
    - ``format_rate(bits_per_s) -> str``: the rate ``tc`` reads, in whole mbit (at least 1).
    - ``next_rate(probes, t_compute_s) -> float``: from the ``(rate, T_comm)`` pairs timed so far,
      the rate to time next (see above), within ``[MIN_RATE, MAX_RATE]``.
    - ``best_rate(probes, t_compute_s) -> float``: the timed rate whose ``T_comm`` was closest to
      ``T_compute`` (by ratio): the run's rate when no probe was within the tolerance.
    - ``calibrated(t_comm_s, t_compute_s, tolerance)``: whether ``T_comm`` is within ``tolerance``
      (relative) of ``T_compute``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

#: Where ``--rate auto`` starts: the rate of the fixed-rate tables in BENCHMARKS.md.
PROBE_RATE = "1gbit"
#: Calibration stops when T_comm is within this share of T_compute ...
TOLERANCE = 0.08
#: ... or after this many timed rates.
MAX_PROBES = 4
#: The rates ``next_rate`` keeps to (bit/s): below 10 Mbit/s a step takes minutes; above
#: 20 Gbit/s ``tbf`` does not limit a veth pair on this kind of machine.
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


def next_rate(probes: Sequence[tuple[float, float]], t_compute_s: float) -> float:
    """The rate (bit/s) to time next, from the ``(rate, T_comm)`` pairs timed so far (see the
    module docstring)."""
    if not probes or t_compute_s <= 0 or any(t <= 0 for _, t in probes):
        raise ValueError(
            f"need timed rates with positive T_comm and a positive T_compute (got {probes}, {t_compute_s})"
        )
    slow = [(r, t) for r, t in probes if t > t_compute_s]  # rates too low
    fast = [(r, t) for r, t in probes if t <= t_compute_s]  # rates high enough
    if slow and fast:
        (low, t_low), (high, t_high) = max(slow), min(fast)
        if low < high:
            if t_low == t_high:
                return math.sqrt(low * high)
            exponent = math.log(t_low / t_high) / math.log(high / low)  # T_comm ~ rate ** -exponent
            guess = low * (t_low / t_compute_s) ** (1 / exponent) if exponent > 0 else math.sqrt(low * high)
            return min(max(guess, low), high)
    rate, t_comm = probes[-1]
    return min(max(rate * t_comm / t_compute_s, MIN_RATE), MAX_RATE)


def best_rate(probes: Sequence[tuple[float, float]], t_compute_s: float) -> float:
    """The timed rate whose ``T_comm`` was closest to ``T_compute``, by ratio."""
    if not probes:
        raise ValueError("no timed rates to choose from")
    return min(probes, key=lambda probe: abs(math.log(probe[1] / t_compute_s)))[0]


def calibrated(t_comm_s: float, t_compute_s: float, tolerance: float = TOLERANCE) -> bool:
    """Whether ``T_comm`` is within ``tolerance`` (relative) of ``T_compute``."""
    return abs(t_comm_s - t_compute_s) <= tolerance * t_compute_s


__all__ = [
    "MAX_PROBES",
    "PROBE_RATE",
    "TOLERANCE",
    "best_rate",
    "calibrated",
    "format_rate",
    "next_rate",
    "parse_rate",
]
