"""A step against its own limit: the share of its hideable communication it hid.

Plain arithmetic, no torch: ``bench.run`` (the gloo bench, whose command line loads no torch)
and ``bench.emulated`` read it.
"""

from __future__ import annotations


def hidden_share(step_s: float, t_compute_s: float, t_comm_s: float) -> float:
    """Share of the hideable communication a step hid: 1 = perfect overlap, 0 = none."""
    hideable = t_compute_s + t_comm_s - max(t_compute_s, t_comm_s)
    return (t_compute_s + t_comm_s - step_s) / hideable if hideable > 0 else 0.0
