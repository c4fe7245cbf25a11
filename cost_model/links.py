"""Communication links: the cost model's link table, and the presets users name links by.

Contract
--------
* :class:`Link` holds one direction's bandwidth and the per-hop latency used as alpha in
  alpha-beta collective models (``cost_model.collectives``), with its source.
* ``LINKS`` is an ordered registry; ``register_link`` adds user entries (``hardware.load_hardware_file``
  reads them from JSON/TOML); ``get_link`` raises :class:`UnknownHardwareError` (a ``KeyError``)
  naming the valid entries.
* ``LINK_PRESETS`` names entries for what users run (``ib400``: one 400 Gbit/s NDR port per GPU);
  an emulated cluster (``dhelix_compile.emulate(link=...)``, ``dhelix bench --link emulated:...``)
  takes these names, and :func:`describe_presets` lists them with their numbers.

No torch here (devices, with their per-dtype tables, are ``cost_model.hardware``'s), so a
command line can list the links in its ``--help`` without loading torch.

Units: bytes/s, seconds. Vendor "GB/s" is decimal (1e9).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.datasheets import A100_DATASHEET, A800_DATASHEET, GIGA, H100_SXM_DATASHEET


@dataclass(frozen=True)
class Link:
    """A communication link, one direction.

    Attributes:
        name: registry key, e.g. ``"nvlink4"``.
        bandwidth_bytes_per_s: per-direction bandwidth available to one rank.
        latency_s: per-step (per-hop) latency, the alpha of alpha-beta models.
        source: where the numbers come from.
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"Link {self.name!r}: bandwidth_bytes_per_s must be > 0")
        if self.latency_s < 0:
            raise ValueError(f"Link {self.name!r}: latency_s must be >= 0")


class UnknownHardwareError(KeyError):
    """A device or link name that is not registered; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


#: Per-hop latencies of NCCL's own cost model, Ring/Simple protocol (the one used for
#: bulk transfers): NVLink 3.4 us, PCI 5.7 us, network 9.6 us.
#: https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc (``hwLat``).
_NCCL_TUNING = "NCCL src/graph/tuning.cc hwLat Ring/Simple"
NVLINK_HOP_LATENCY_S: float = 3.4e-6
PCI_HOP_LATENCY_S: float = 5.7e-6
NET_HOP_LATENCY_S: float = 9.6e-6
#: One-way latency of a small message through the kernel TCP stack (what gloo uses). No
#: datasheet: an order-of-magnitude figure; profile mode replaces it with a measurement.
TCP_HOP_LATENCY_S: float = 25e-6

_BUILTIN_LINKS: tuple[Link, ...] = (
    # A100: 12 NVLink3 links x 25 GB/s per direction = 300 GB/s (600 GB/s bidirectional).
    Link(
        "nvlink3",
        300 * GIGA,
        NVLINK_HOP_LATENCY_S,
        f"{A100_DATASHEET}; https://www.nvidia.com/en-us/data-center/nvlink/; {_NCCL_TUNING}",
    ),
    # A800: NVLink limited to 400 GB/s bidirectional = 200 GB/s per direction.
    Link("nvlink3_a800", 200 * GIGA, NVLINK_HOP_LATENCY_S, f"{A800_DATASHEET}; {_NCCL_TUNING}"),
    # H100/H200 SXM: 18 NVLink4 links x 25 GB/s per direction = 450 GB/s (900 bidir).
    Link(
        "nvlink4",
        450 * GIGA,
        NVLINK_HOP_LATENCY_S,
        f"{H100_SXM_DATASHEET}; https://www.nvidia.com/en-us/data-center/nvlink/; {_NCCL_TUNING}",
    ),
    # PCIe 4.0 x16: 16 GT/s * 16 lanes * 128/130 encoding / 8 = 31.5 GB/s per direction.
    Link("pcie4", 31.5 * GIGA, PCI_HOP_LATENCY_S, f"PCI-SIG PCIe 4.0 base spec (16 GT/s, 128b/130b); {_NCCL_TUNING}"),
    # PCIe 5.0 x16: 32 GT/s -> 63.0 GB/s per direction.
    Link("pcie5", 63.0 * GIGA, PCI_HOP_LATENCY_S, f"PCI-SIG PCIe 5.0 base spec (32 GT/s, 128b/130b); {_NCCL_TUNING}"),
    # InfiniBand EDR 100 Gb/s per port (ConnectX-5) = 12.5 GB/s.
    Link(
        "ib_edr",
        12.5 * GIGA,
        NET_HOP_LATENCY_S,
        "https://www.nvidia.com/en-us/networking/infiniband-adapters/ (ConnectX-5 EDR 100Gb/s); " + _NCCL_TUNING,
    ),
    # InfiniBand HDR 200 Gb/s per port (ConnectX-6) = 25 GB/s.
    Link(
        "ib_hdr",
        25 * GIGA,
        NET_HOP_LATENCY_S,
        "https://www.nvidia.com/en-us/networking/infiniband-adapters/ (ConnectX-6 HDR 200Gb/s); " + _NCCL_TUNING,
    ),
    # InfiniBand NDR 400 Gb/s per port (ConnectX-7) = 50 GB/s.
    Link(
        "ib_ndr",
        50 * GIGA,
        NET_HOP_LATENCY_S,
        "https://www.nvidia.com/en-us/networking/infiniband-adapters/ (ConnectX-7 NDR 400Gb/s); " + _NCCL_TUNING,
    ),
    # Ethernet line rates (IEEE 802.3by 25GBASE, 802.3bj 100GBASE): 3.125 / 12.5 GB/s.
    Link(
        "eth_25g",
        25 / 8 * GIGA,
        TCP_HOP_LATENCY_S,
        "IEEE 802.3by 25 Gb/s line rate; latency: TCP order of magnitude (estimate)",
    ),
    Link(
        "eth_100g",
        100 / 8 * GIGA,
        TCP_HOP_LATENCY_S,
        "IEEE 802.3bj 100 Gb/s line rate; latency: TCP order of magnitude (estimate)",
    ),
    Link(
        "eth_200g",
        200 / 8 * GIGA,
        TCP_HOP_LATENCY_S,
        "IEEE 802.3bs 200 Gb/s line rate; latency: TCP order of magnitude (estimate)",
    ),
    Link(
        "eth_400g",
        400 / 8 * GIGA,
        TCP_HOP_LATENCY_S,
        "IEEE 802.3bs 400 Gb/s line rate; latency: TCP order of magnitude (estimate)",
    ),
    # Same-host TCP over lo (gloo between local processes): bounded by memcpy through the
    # socket buffers; a nominal few GB/s. Estimate; calibrate with profile mode.
    Link("loopback", 5 * GIGA, 10e-6, "estimate for Linux TCP loopback; use profile mode"),
)

LINKS: dict[str, Link] = {link.name: link for link in _BUILTIN_LINKS}
#: The names of the links this module defines (others are registered at run time).
BUILTIN_LINK_NAMES: frozenset[str] = frozenset(LINKS)

#: Preset name -> the link entry it names.
LINK_PRESETS: dict[str, str] = {
    "nvlink4": "nvlink4",
    "nvlink3": "nvlink3",
    "pcie5": "pcie5",
    "pcie4": "pcie4",
    "ib400": "ib_ndr",
    "ib200": "ib_hdr",
    "ib100": "ib_edr",
    "eth400": "eth_400g",
    "eth200": "eth_200g",
    "eth100": "eth_100g",
}


def register_link(link: Link, *, overwrite: bool = False) -> Link:
    """Add a link to :data:`LINKS`; refuses to replace one unless ``overwrite``."""
    if link.name in LINKS and not overwrite and LINKS[link.name] != link:
        raise ValueError(f"link {link.name!r} already registered (pass overwrite=True)")
    LINKS[link.name] = link
    return link


def get_link(name: str | Link) -> Link:
    """Look a link up by name."""
    if isinstance(name, Link):
        return name
    key = name.lower()
    if key not in LINKS:
        valid = ", ".join(sorted(LINKS))
        raise UnknownHardwareError(f"unknown link {name!r}; valid links: {valid}")
    return LINKS[key]


def describe_presets() -> str:
    """One line per preset with its numbers, for ``--help`` texts."""
    lines = []
    for preset, entry in LINK_PRESETS.items():
        link = get_link(entry)
        lines.append(
            f"{preset:<8} {link.bandwidth_bytes_per_s / GIGA:6.1f} GB/s per direction, "
            f"alpha {link.latency_s * 1e6:4.1f} us  (cost model: {entry})"
        )
    return "\n".join(lines)


__all__ = [
    "LINKS",
    "LINK_PRESETS",
    "NET_HOP_LATENCY_S",
    "NVLINK_HOP_LATENCY_S",
    "PCI_HOP_LATENCY_S",
    "TCP_HOP_LATENCY_S",
    "Link",
    "UnknownHardwareError",
    "describe_presets",
    "get_link",
    "register_link",
]
