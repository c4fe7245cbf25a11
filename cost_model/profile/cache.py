"""The profiler's disk cache: measured seconds of compute signatures, one JSON file per device.

Contract
--------
``<cache_dir>/<device key>.json`` holds::

    {"version": 3, "device": "<device key>", "entries": {"<signature>": [seconds, ...], ...}}

* each entry holds up to :data:`CACHE_SAMPLES` measurements of the signature, each from another
  calibration (another process, or another estimator), lowest first; an entry is *settled*
  (:func:`settled`) once it has them all, and its time is the lowest (:func:`cached_seconds`).
  Why: a measurement only ever errs high (the other rank's compile, a start-up on the same
  cores), and one such time kept for good misprices every later plan: a piece's ``bmm`` cached at
  3.19 ms that takes 1.99 ms made ``dhelix``'s predicted MoE step 1.22x the measured one, against
  1.01x with the cache empty (2026-11-26, 2 gloo ranks on a 2-core AMD EPYC). A second calibration
  measures again and keeps the lower;
* a version-2 file (one number per signature) loads as entries of one measurement each, so the
  next calibration measures them again;
* the device key is the GPU's product name, or the CPU's model and thread count
  (:func:`device_key`); the file name is the key with anything but ``[A-Za-z0-9-_.]`` as ``_``;
* :meth:`MeasurementCache.load` returns ``{}`` for a missing file, one that is not JSON, and a
  foreign one (another version, another device);
* :meth:`MeasurementCache.store` replaces the file atomically (a temporary file, then
  ``os.replace``), entries sorted, so concurrent ranks never read half a file.

What goes in is the caller's choice; :class:`cost_model.profile.ProfiledEstimator` stores compute
signatures only, never a collective's time nor a contention factor (they depend on the link, which
the key does not name).
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import tempfile

import torch

#: 2: op times measured before dhelix waited for Inductor's compile workers to start could be
#: 1.4-2.2x slow on a machine with few cores (dhelix_compile._torch_compat.wait_for_compile_workers);
#: 3: a list of measurements per signature (version 2's single numbers load as lists of one)
CACHE_VERSION: int = 3
_ONE_SAMPLE_VERSION: int = 2

#: Measurements of a signature, from as many calibrations, before the cache answers for it alone.
CACHE_SAMPLES: int = 2

Samples = list[float]


def settled(samples: Samples) -> bool:
    """Whether an entry has all its measurements (the cache answers for it without measuring)."""
    return len(samples) >= CACHE_SAMPLES


def cached_seconds(samples: Samples) -> float:
    """An entry's time: its lowest measurement."""
    return min(samples)


def with_sample(samples: Samples, seconds: float) -> Samples:
    """``samples`` with ``seconds`` added, the lowest :data:`CACHE_SAMPLES` kept, lowest first."""
    return sorted([*samples, seconds])[:CACHE_SAMPLES]


def device_key(device: torch.device) -> str:
    """Cache key of a device: GPU product name, or CPU model + thread count."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return _cpu_name()


def _cpu_name() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu-{model}-{torch.get_num_threads()}t"


def _safe_filename(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "device"


class MeasurementCache:
    """The JSON files under ``cache_dir`` (created when first stored to)."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.cache_dir = pathlib.Path(cache_dir)

    def path(self, key: str) -> pathlib.Path:
        """The file of device ``key``."""
        return self.cache_dir / f"{_safe_filename(key)}.json"

    def load(self, key: str) -> dict[str, Samples]:
        """The entries of device ``key`` (``{}`` when there is no valid file)."""
        path = self.path(key)
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        version = data.get("version")
        if version not in (CACHE_VERSION, _ONE_SAMPLE_VERSION) or data.get("device") != key:
            return {}
        entries = data.get("entries", {})
        if version == _ONE_SAMPLE_VERSION:
            return {str(k): [float(v)] for k, v in entries.items()}
        return {str(k): sorted(float(t) for t in v)[:CACHE_SAMPLES] for k, v in entries.items() if v}

    def store(self, key: str, entries: dict[str, Samples]) -> None:
        """Replace the file of device ``key`` with ``entries``."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        payload = {
            "version": CACHE_VERSION,
            "device": key,
            "entries": {k: entries[k] for k in sorted(entries)},
        }
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


__all__ = [
    "CACHE_SAMPLES",
    "CACHE_VERSION",
    "MeasurementCache",
    "Samples",
    "cached_seconds",
    "device_key",
    "settled",
    "with_sample",
]
