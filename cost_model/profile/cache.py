"""The profiler's disk cache: measured seconds of compute signatures, one JSON file per device.

Contract
--------
``<cache_dir>/<device key>.json`` holds::

    {"version": 1, "device": "<device key>", "entries": {"<signature>": seconds, ...}}

* the device key is the GPU's product name, or the CPU's model and thread count
  (:func:`device_key`); the file name is the key with anything but ``[A-Za-z0-9-_.]`` as ``_``;
* :meth:`MeasurementCache.load` returns ``{}`` for a missing file, one that is not JSON, and a
  foreign one (another version, another device);
* :meth:`MeasurementCache.store` replaces the file atomically (a temporary file, then
  ``os.replace``), entries sorted, so concurrent ranks never read half a file.

What goes in is the caller's choice; :class:`cost_model.profile.ProfiledEstimator` stores compute
signatures and contention factors, never a collective's time (it depends on the link, which the
key does not name).
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import tempfile

import torch

#: 2: op times measured before dhelix waited for Inductor's compile workers to start could be
#: 1.4-2.2x slow on a machine with few cores (dhelix_compile._torch_compat.wait_for_compile_workers)
CACHE_VERSION: int = 2


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

    def load(self, key: str) -> dict[str, float]:
        """The entries of device ``key`` (``{}`` when there is no valid file)."""
        path = self.path(key)
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        if data.get("version") != CACHE_VERSION or data.get("device") != key:
            return {}
        return {str(k): float(v) for k, v in data.get("entries", {}).items()}

    def store(self, key: str, entries: dict[str, float]) -> None:
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


__all__ = ["CACHE_VERSION", "MeasurementCache", "device_key"]
