"""The links an emulated cluster can have: presets named for what users run, and custom ones.

Every preset is an entry of the cost model's own table (``cost_model.links``: ``LINKS``, and
``LINK_PRESETS`` naming them), so the emulator and dhelix's planner price a collective with the
same numbers
(``cost_model.collectives.collective_time_s``, NCCL's ring/tree alpha-beta model)::

    preset   cost-model link   per-direction bandwidth   alpha (per hop)
    nvlink4  nvlink4           450 GB/s                  3.4 us   (H100 / H200 SXM)
    nvlink3  nvlink3           300 GB/s                  3.4 us   (A100 SXM)
    pcie5    pcie5             63 GB/s                   5.7 us
    pcie4    pcie4             31.5 GB/s                 5.7 us
    ib400    ib_ndr            50 GB/s                   9.6 us   (one 400 Gbit/s NDR port per GPU)
    ib200    ib_hdr            25 GB/s                   9.6 us
    ib100    ib_edr            12.5 GB/s                 9.6 us
    eth400   eth_400g          50 GB/s                   25 us
    eth200   eth_200g          25 GB/s                   25 us
    eth100   eth_100g          12.5 GB/s                 25 us

(the table is printed from the registry by :func:`~cost_model.links.describe_presets`; this copy
is for reading).
A custom link is ``"alpha=<time>,bandwidth=<rate>"``: ``alpha=5us,bandwidth=40GB/s``; times take
``s``/``ms``/``us``/``ns``, rates ``GB/s``/``MB/s``/``Gbit/s`` (decimal units, as datasheets).
"""

from __future__ import annotations

import re

from cost_model.links import LINK_PRESETS, Link, describe_presets, get_link

__all__ = ["LINK_PRESETS", "LinkSpecError", "describe_presets", "parse_link"]

_TIME_UNITS_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_RATE_UNITS_BYTES_PER_S = {"gb/s": 1e9, "mb/s": 1e6, "gbit/s": 1e9 / 8, "mbit/s": 1e6 / 8}


class LinkSpecError(ValueError):
    """A link spec that names no preset and is no ``alpha=...,bandwidth=...`` pair."""


def _quantity(text: str, units: dict[str, float], what: str, spec: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([a-zA-Z/]+)\s*", text)
    if match is None or match.group(2).lower() not in units:
        raise LinkSpecError(f"link {spec!r}: {what} {text!r} needs a number and one of the units {sorted(units)}")
    return float(match.group(1)) * units[match.group(2).lower()]


def parse_link(spec: str | Link) -> Link:
    """The :class:`~cost_model.hardware.Link` a spec names: a preset, a custom
    ``alpha=...,bandwidth=...`` pair, or a ``Link`` as is."""
    if isinstance(spec, Link):
        return spec
    name = spec.strip().lower()
    if name in LINK_PRESETS:
        return get_link(LINK_PRESETS[name])
    fields = dict(part.split("=", 1) for part in name.split(",") if "=" in part)
    if set(fields) != {"alpha", "bandwidth"} or name.count("=") != 2:
        raise LinkSpecError(
            f"unknown link {spec!r}: expected a preset ({', '.join(LINK_PRESETS)}) "
            "or 'alpha=<time>,bandwidth=<rate>' such as 'alpha=5us,bandwidth=40GB/s'"
        )
    alpha_s = _quantity(fields["alpha"], _TIME_UNITS_S, "alpha", spec)
    bandwidth = _quantity(fields["bandwidth"], _RATE_UNITS_BYTES_PER_S, "bandwidth", spec)
    if bandwidth <= 0:
        raise LinkSpecError(f"link {spec!r}: bandwidth must be > 0")
    return Link(f"custom(alpha={fields['alpha']},bandwidth={fields['bandwidth']})", bandwidth, alpha_s, spec)
