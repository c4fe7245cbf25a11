"""Hardware tables: compute devices, with their sources; the links are ``cost_model.links``'.

Contract
--------
* :class:`Device` holds dense (no structured sparsity) peak FLOP/s per dtype, memory
  bandwidth, a per-kernel launch overhead and the compute slowdown factor while a
  collective is in flight (``contention_factor``).
* ``DEVICES`` is an ordered registry; ``register_device`` adds user entries,
  ``load_hardware_file`` reads devices and links from JSON/TOML. ``get_device`` raises
  :class:`UnknownHardwareError` (a ``KeyError``) naming the valid entries.
* The link table (:class:`Link`, ``LINKS``, ``register_link``, ``get_link``) is
  ``cost_model.links``, which loads without torch; it is importable from here too.
* ``"cpu"`` is not a datasheet entry: :func:`measure_cpu_device` times a small matmul,
  a memcpy and a tiny kernel on this machine (about a second, once per process) and
  ``get_device("cpu")`` registers the result on first use.

Units: FLOP/s, bytes/s, seconds. Vendor "TB/s" and "GB/s" are decimal (1e12, 1e9;
``cost_model.datasheets``). Datasheets quote tensor-core FLOP/s "with sparsity"; the numbers
here are the dense ones (half of those). ``torch.float32`` is the non-tensor-core FP32 rate
because PyTorch leaves TF32 matmul off by default (``torch.backends.cuda.matmul.allow_tf32``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from cost_model.datasheets import (
    A40_DATASHEET,
    A100_DATASHEET,
    A800_DATASHEET,
    GIGA,
    H100_SXM_DATASHEET,
    H200_DATASHEET,
    TERA,
)
from cost_model.links import LINKS, Link, UnknownHardwareError, get_link, register_link
from cost_model.timing import median_run_s, time_samples_s

aten = torch.ops.aten

#: Default compute slowdown on GPUs while a collective runs concurrently: NCCL kernels
#: occupy SMs and HBM bandwidth. Overlap studies report GEMM slowdowns of the order of
#: 10% (e.g. T3, Pati et al., ASPLOS 2024, arXiv 2401.16677; DHelix, arXiv 2411.15871).
#: A default only: profile mode measures the real factor on the live group.
GPU_CONTENTION_FACTOR: float = 1.1

#: Kernel launch + inter-kernel gap on a CUDA stream: "a few microseconds" per launch
#: (PyTorch blog, "Accelerating PyTorch with CUDA Graphs", 2021,
#: https://pytorch.org/blog/accelerating-pytorch-with-cuda-graphs/).
GPU_LAUNCH_OVERHEAD_S: float = 4e-6


@dataclass(frozen=True)
class Device:
    """A compute device.

    Attributes:
        name: registry key, e.g. ``"h100_sxm"``.
        peak_flops_per_s: dense peak FLOP/s per dtype (matmul-class throughput).
        mem_bandwidth_bytes_per_s: device-memory bandwidth.
        launch_overhead_s: fixed time added to every compute kernel.
        source: where the numbers come from (datasheet URL or "measured ...").
        contention_factor: compute runs this many times slower while a collective is in
            flight (>= 1.0).
    """

    name: str
    peak_flops_per_s: Mapping[torch.dtype, float] = field(hash=False)
    mem_bandwidth_bytes_per_s: float
    launch_overhead_s: float
    source: str
    contention_factor: float = 1.0

    def __post_init__(self) -> None:
        # Freeze the table too: a read-only, insertion-ordered view of a private copy.
        object.__setattr__(self, "peak_flops_per_s", MappingProxyType(dict(self.peak_flops_per_s)))
        if self.mem_bandwidth_bytes_per_s <= 0:
            raise ValueError(f"Device {self.name!r}: mem_bandwidth_bytes_per_s must be > 0")
        if not self.peak_flops_per_s or min(self.peak_flops_per_s.values()) <= 0:
            raise ValueError(f"Device {self.name!r}: peak_flops_per_s needs positive entries")
        if self.launch_overhead_s < 0:
            raise ValueError(f"Device {self.name!r}: launch_overhead_s must be >= 0")
        if self.contention_factor < 1.0:
            raise ValueError(f"Device {self.name!r}: contention_factor must be >= 1.0")

    def flops_per_s(self, dtype: torch.dtype | None) -> float:
        """Peak FLOP/s for ``dtype``; falls back to the float32 entry, then the slowest."""
        table = self.peak_flops_per_s
        if dtype is not None and dtype in table:
            return table[dtype]
        if torch.float32 in table:
            return table[torch.float32]
        return min(table.values())

    def replace(self, **changes: Any) -> Device:
        """A copy with some fields changed (e.g. a calibrated ``contention_factor``)."""
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- devices

_FP8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def _table(
    fp64: float, fp32: float, bf16: float, int8: float | None = None, fp8: float | None = None
) -> dict[torch.dtype, float]:
    """Peak table in TFLOP/s -> FLOP/s. fp16 runs at the bf16 rate on all these parts."""
    table: dict[torch.dtype, float] = {
        torch.float64: fp64 * TERA,
        torch.float32: fp32 * TERA,
        torch.bfloat16: bf16 * TERA,
        torch.float16: bf16 * TERA,
    }
    if int8 is not None:
        table[torch.int8] = int8 * TERA
    if fp8 is not None:
        for dtype in _FP8:
            table[dtype] = fp8 * TERA
    return table


_BUILTIN_DEVICES: tuple[Device, ...] = (
    # H100 SXM5: FP64 TC 67, FP32 67, BF16/FP16 TC 989.5 dense (1979 sparse),
    # FP8/INT8 1979 dense, HBM3 3.35 TB/s.
    Device(
        name="h100_sxm",
        peak_flops_per_s=_table(fp64=67.0, fp32=67.0, bf16=989.5, int8=1979.0, fp8=1979.0),
        mem_bandwidth_bytes_per_s=3.35 * TERA,
        launch_overhead_s=GPU_LAUNCH_OVERHEAD_S,
        source=H100_SXM_DATASHEET,
        contention_factor=GPU_CONTENTION_FACTOR,
    ),
    # H200 SXM: same Hopper die as H100 SXM5 (989.5 dense BF16), HBM3e 4.8 TB/s.
    Device(
        name="h200",
        peak_flops_per_s=_table(fp64=67.0, fp32=67.0, bf16=989.5, int8=1979.0, fp8=1979.0),
        mem_bandwidth_bytes_per_s=4.8 * TERA,
        launch_overhead_s=GPU_LAUNCH_OVERHEAD_S,
        source=H200_DATASHEET,
        contention_factor=GPU_CONTENTION_FACTOR,
    ),
    # A100 80GB SXM: FP64 TC 19.5, FP32 19.5, BF16/FP16 TC 312, INT8 624, HBM2e 2039 GB/s.
    Device(
        name="a100_80gb",
        peak_flops_per_s=_table(fp64=19.5, fp32=19.5, bf16=312.0, int8=624.0),
        mem_bandwidth_bytes_per_s=2039 * GIGA,
        launch_overhead_s=GPU_LAUNCH_OVERHEAD_S,
        source=A100_DATASHEET,
        contention_factor=GPU_CONTENTION_FACTOR,
    ),
    # A800 80GB SXM: A100 compute and memory; NVLink cut to 400 GB/s (link "nvlink3_a800").
    Device(
        name="a800",
        peak_flops_per_s=_table(fp64=19.5, fp32=19.5, bf16=312.0, int8=624.0),
        mem_bandwidth_bytes_per_s=2039 * GIGA,
        launch_overhead_s=GPU_LAUNCH_OVERHEAD_S,
        source=A800_DATASHEET,
        contention_factor=GPU_CONTENTION_FACTOR,
    ),
    # A40: FP64 0.585 (1/64 of FP32), FP32 37.4, BF16/FP16 TC 149.7 dense, INT8 299.3,
    # GDDR6 696 GB/s.
    Device(
        name="a40",
        peak_flops_per_s=_table(fp64=0.585, fp32=37.4, bf16=149.7, int8=299.3),
        mem_bandwidth_bytes_per_s=696 * GIGA,
        launch_overhead_s=GPU_LAUNCH_OVERHEAD_S,
        source=A40_DATASHEET,
        contention_factor=GPU_CONTENTION_FACTOR,
    ),
)

DEVICES: dict[str, Device] = {d.name: d for d in _BUILTIN_DEVICES}

_ALIASES: dict[str, str] = {
    "h100": "h100_sxm",
    "h200_sxm": "h200",
    "a100": "a100_80gb",
    "a800_80gb": "a800",
}


def register_device(device: Device, *, overwrite: bool = False) -> Device:
    """Add a device to :data:`DEVICES`; refuses to replace one unless ``overwrite``."""
    if device.name in DEVICES and not overwrite and DEVICES[device.name] != device:
        raise ValueError(f"device {device.name!r} already registered (pass overwrite=True)")
    DEVICES[device.name] = device
    return device


def get_device(name: str | Device) -> Device:
    """Look a device up by name (``"cpu"`` is measured on first use)."""
    if isinstance(name, Device):
        return name
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES and key == "cpu":
        register_device(measure_cpu_device())
    if key not in DEVICES:
        valid = ", ".join(sorted({*DEVICES, "cpu"}))
        raise UnknownHardwareError(f"unknown device {name!r}; valid devices: {valid}")
    return DEVICES[key]


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in hardware file")
    return dtype


def load_hardware_file(path: str | pathlib.Path, *, overwrite: bool = False) -> None:
    """Register devices and links from a JSON or TOML file.

    Format (JSON shown; TOML uses ``[[devices]]`` / ``[[links]]`` tables)::

        {"devices": [{"name": "my_gpu", "peak_flops_per_s": {"bfloat16": 4e14},
                      "mem_bandwidth_bytes_per_s": 1.5e12, "launch_overhead_s": 4e-6,
                      "source": "vendor sheet", "contention_factor": 1.1}],
         "links":   [{"name": "my_link", "bandwidth_bytes_per_s": 5e10,
                      "latency_s": 5e-6, "source": "measured"}]}
    """
    p = pathlib.Path(path)
    text = p.read_text()
    data: dict[str, Any]
    if p.suffix != ".toml":
        data = json.loads(text)
    elif sys.version_info >= (3, 11):
        import tomllib  # standard library from Python 3.11; the package supports 3.10

        data = tomllib.loads(text)
    else:
        raise ValueError(f"{p}: TOML hardware files need Python 3.11 or newer (tomllib); use JSON on Python 3.10")
    for entry in data.get("devices", []):
        peaks = {_dtype_from_name(k): float(v) for k, v in entry["peak_flops_per_s"].items()}
        register_device(
            Device(
                name=entry["name"],
                peak_flops_per_s=peaks,
                mem_bandwidth_bytes_per_s=float(entry["mem_bandwidth_bytes_per_s"]),
                launch_overhead_s=float(entry.get("launch_overhead_s", GPU_LAUNCH_OVERHEAD_S)),
                source=str(entry.get("source", str(p))),
                contention_factor=float(entry.get("contention_factor", 1.0)),
            ),
            overwrite=overwrite,
        )
    for entry in data.get("links", []):
        register_link(
            Link(
                name=entry["name"],
                bandwidth_bytes_per_s=float(entry["bandwidth_bytes_per_s"]),
                latency_s=float(entry["latency_s"]),
                source=str(entry.get("source", str(p))),
            ),
            overwrite=overwrite,
        )


# --------------------------------------------------------------------------- cpu


def _best_time_s(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The fastest run: a peak (FLOP/s, bandwidth) is what the machine can do, and a busy
    machine (a compile in the background, the other rank) only ever makes runs slower."""
    return min(time_samples_s(fn, repeats, warmup))


@dataclass
class _Copier:
    """Background memcpy loop standing in for gloo's transfer threads."""

    nbytes: int
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        src = torch.empty(self.nbytes // 4, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        while not self.stop.is_set():
            dst.copy_(src)  # releases the GIL


@functools.cache
def measure_cpu_device(name: str = "cpu") -> Device:
    """Measure this machine's CPU as a :class:`Device` (about a second; cached per process).

    * FLOP/s per dtype: the fastest of 5 runs of a 384x384 matmul (``2*n**3`` FLOPs) for float32,
      float64 and bfloat16 (float16 uses the bfloat16 number).
    * memory bandwidth: a 32 MiB ``copy_`` moves 64 MiB (read + write); fastest of 5 runs.
    * launch overhead: a one-element ``add`` (dispatcher + kernel call).
    * contention factor: the float32 matmul timed while a second thread runs ``copy_``
      loops, as gloo's transfer threads do during a collective (>= 1.0).

    Raises RuntimeError where a tensor mode makes its tensors anything but eager ones (a
    compiler's fake-tensor mode, whose dispatch it would time instead).
    """
    if type(torch.empty(0)) is not torch.Tensor:
        raise RuntimeError(
            "measure_cpu_device needs eager tensors: a tensor mode is active in this thread (a "
            "compiler's fake-tensor mode?), where the probes would time its dispatch, not the "
            "CPU; call it outside the compilation"
        )
    n = 384
    peaks: dict[torch.dtype, float] = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        t = _best_time_s(functools.partial(torch.mm, a, b), repeats=5)
        peaks[dtype] = 2 * n**3 / max(t, 1e-9)
    peaks[torch.float16] = peaks[torch.bfloat16]

    nbytes = 32 * 2**20
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t_copy = _best_time_s(lambda: dst.copy_(src), repeats=5)
    bandwidth = 2 * nbytes / max(t_copy, 1e-9)

    x = torch.ones(1)
    y = torch.ones(1)
    out = torch.empty(1)
    t_launch = median_run_s(lambda: torch.add(x, y, out=out), warmup=20, repeats=200, device=None)

    a32 = torch.randn(n, n)
    t_alone = median_run_s(lambda: torch.mm(a32, a32), warmup=1, repeats=5, device=None)
    copier = _Copier(nbytes=8 * 2**20)
    thread = threading.Thread(target=copier.run, daemon=True)
    thread.start()
    try:
        t_busy = median_run_s(lambda: torch.mm(a32, a32), warmup=1, repeats=5, device=None)
    finally:
        copier.stop.set()
        thread.join()
    contention = max(1.0, t_busy / max(t_alone, 1e-9))

    return Device(
        name=name,
        peak_flops_per_s=peaks,
        mem_bandwidth_bytes_per_s=bandwidth,
        launch_overhead_s=t_launch,
        source=(f"measured by cost_model.hardware.measure_cpu_device ({torch.get_num_threads()} threads)"),
        contention_factor=contention,
    )


__all__ = [
    "DEVICES",
    "GIGA",
    "GPU_CONTENTION_FACTOR",
    "GPU_LAUNCH_OVERHEAD_S",
    "LINKS",
    "TERA",
    "Device",
    "Link",
    "UnknownHardwareError",
    "get_device",
    "get_link",
    "load_hardware_file",
    "measure_cpu_device",
    "register_device",
    "register_link",
]
