"""The measurement log: what a process's profiled estimator measured, call by call, for the next
process of the same program on the same link to replay instead of measuring.

Contract
--------
A compile's plan is a function of the numbers its estimator answers, and the estimator's state
changes only in its measuring calls (``calibrate``, ``segment_pair_times``, ``segment_times``).
:class:`MeasurementLog` records, per call in the order made, the call's *key* (its kind and the
agreed signatures it was asked for) and its *delta*: every state entry the call set (the
estimator's :meth:`~cost_model.profile.ProfiledEstimator.state`). A later process whose calls
make the same keys in the same order applies each delta instead of measuring, so its
estimator answers the numbers the first process's did at the same point, its passes plan the
same graphs (passes are deterministic given their costs: DESIGN.md, rank consistency), and
Inductor's FX graph cache finds the code it generated for them::

    <cache_dir>/replay/<link key>/<first call's key>.json
        {"version": 1, "link": "<link key>", "calls": [{"key": "...", "delta": {...}}, ...]}

* the link key names what the times depend on beyond the signatures (device, link option,
  world size, backend, host); the file is chosen by the first call, so programs that begin
  with different graphs keep their own logs;
* a call replays only where the next unreplayed entry has its key, on every rank (agreed); the
  first call that differs ends the replay for the process, which measures from there on and
  writes its own log (the replayed entries, then its own calls) over the file;
* the first replayed call that holds a collective measures the slowest of them again: when it
  is outside :data:`LINK_TOLERANCE` of the logged time (agreed by MAX), the link is not the one
  logged and nothing is replayed (:meth:`MeasurementLog.reject`);
* every rank must hold the same log: at load, the ranks agree on its digest, and a difference
  replays nothing;
* the file is replaced atomically after each recorded call (a temporary file, then
  ``os.replace``).

Replaying skips the re-measurements a second calibration makes of the disk cache's compute
times (``cache.settled``): the second process plans with the first process's numbers, which
it can reproduce without measuring.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from cost_model.rank_agreement import agree_max

#: Format of a log file; another version reads as no log.
LOG_VERSION: int = 1

#: A replayed link's slowest logged collective measured again within this factor of its logged
#: time (either way) keeps the replay. On this project's 2-core CPU machine at load 8-10 one
#: measurement of a loopback all-gather ran 1.5x and more from the next (the check at 1.5
#: refused a replay of the same link); links another rate apart differ by larger factors
#: (loopback against the 1 Gbit/s bench link).
LINK_TOLERANCE: float = 3.0

#: A state entry's value (a float, a bool, or an op's dict of ratios) as JSON holds it.
Value = Any
#: The state a call changes: attribute -> {encoded key: value}, or, for a list, the items appended.
Delta = dict[str, Any]


def call_key(kind: str, signatures: Sequence[str]) -> str:
    """The key of a measuring call: its kind and the agreed signatures it was asked for."""
    return hashlib.sha256("\n".join([kind, *signatures]).encode()).hexdigest()[:32]


def state_delta(before: dict[str, Any], after: dict[str, Any]) -> Delta:
    """What changed from ``before`` to ``after`` (two :meth:`ProfiledEstimator.state` results):
    dict entries added or set to another value, list items appended, other values replaced."""
    delta: Delta = {}
    for name, now in after.items():
        old = before.get(name)
        if isinstance(now, dict):
            old = old or {}
            changed = {k: v for k, v in now.items() if k not in old or not _same(old[k], v)}
            if changed:
                delta[name] = changed
        elif isinstance(now, list):
            old = old or []
            if now[len(old) :]:
                delta[name] = now[len(old) :]
        elif not _same(old, now):
            delta[name] = now
    return delta


def _same(a: Value, b: Value) -> bool:
    """Equal, NaN equal to NaN (a failed measurement's value)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


class MeasurementLog:
    """One process's log under ``cache_dir / "replay" / link`` (module docstring).

    ``group`` is the agreement group (None: a single process, nothing agreed)."""

    def __init__(self, cache_dir: str | os.PathLike[str], link: str, group: Any) -> None:
        self.folder = pathlib.Path(cache_dir) / "replay" / _safe(link)
        self.link = link
        self.group = group
        self.calls: list[dict[str, Any]] = []  # this process's calls, replayed or recorded
        self._logged: list[dict[str, Any]] | None = None  # the file's calls; None: not loaded yet
        self._path: pathlib.Path | None = None
        self.replaying = True
        #: whether a replayed collective was measured again against the log (module docstring)
        self.link_checked = False

    def next_delta(self, key: str) -> Delta | None:
        """The logged delta of the next call when it has ``key`` on every rank, else None (and
        no call of this process replays from then on)."""
        if self._logged is None:
            self._logged = self._load(key)
        entry = self._logged[len(self.calls)] if self.replaying and len(self.calls) < len(self._logged) else None
        hit = entry is not None and entry.get("key") == key
        if self.replaying and agree_max([0.0 if hit else 1.0], self.group)[0]:
            self.replaying = False
        if not self.replaying or entry is None:
            return None
        self.calls.append(entry)
        return dict(entry["delta"])

    def record(self, key: str, delta: Delta) -> None:
        """A measured call: appended, and the log written."""
        self.replaying = False
        self.calls.append({"key": key, "delta": delta})
        if self._path is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        payload = {"version": LOG_VERSION, "link": self.link, "calls": self.calls}
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=self._path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, sort_keys=True)
        os.replace(tmp, self._path)

    def reject(self) -> None:
        """The link measured otherwise than logged: replay nothing more (the call that found it
        measures, and the log is written anew from it)."""
        self.replaying = False
        self.calls.pop()

    def check_link(self, measure: Callable[[], tuple[float, float] | None]) -> bool:
        """Once per process: ``measure()`` gives (logged, measured now) seconds of a replayed
        collective, agreed across ranks (None: nothing to measure, checked later); whether the
        link is the one logged."""
        if self.link_checked:
            return True
        pair = measure()
        if pair is None:
            return True
        self.link_checked = True
        logged, now = pair
        ok = logged > 0 and 1.0 / LINK_TOLERANCE <= now / logged <= LINK_TOLERANCE
        return not agree_max([0.0 if ok else 1.0], self.group)[0]

    def _load(self, first_key: str) -> list[dict[str, Any]]:
        """The calls logged for a program whose first call has ``first_key``, when every rank
        holds the same ones; else none."""
        self._path = self.folder / f"{first_key}.json"
        try:
            data = json.loads(self._path.read_text())
        except (OSError, ValueError):
            data = {}
        ok = isinstance(data, dict) and data.get("version") == LOG_VERSION and data.get("link") == self.link
        calls: list[dict[str, Any]] = data.get("calls", []) if ok else []
        digest = hashlib.sha256(json.dumps(calls, sort_keys=True).encode()).digest()
        h = float(int.from_bytes(digest[:6], "little"))  # exact in float64
        high, low = agree_max([h, -h], self.group)
        return calls if high == h and -low == h else []


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "link"


__all__ = ["LINK_TOLERANCE", "LOG_VERSION", "MeasurementLog", "call_key", "state_delta"]
