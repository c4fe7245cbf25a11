"""Names for the parts of a training step: which strand calls run now ("F0", "B0+F1", ...).

A step driver (``helix``'s schedule, a benchmark's accumulation loop) enters
:func:`step_phase` around each part of a step; anything that runs meanwhile, on any thread,
reads the name with :func:`current_step_phase` (the emulated process group tags each transfer
with it), and :func:`recording_phases` collects each part's start and end (``perf_counter``
seconds). The name is process-wide, not per thread: helix runs a merged pair's strands on two
threads under the one name of their schedule step. Outside a recording the cost is setting one
global.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class PhaseSpan:
    """One part of a step: its name and its ``perf_counter`` start and end in seconds."""

    name: str
    start_s: float
    end_s: float

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


_current: str | None = None
_recording: list[PhaseSpan] | None = None


def current_step_phase() -> str | None:
    """The name of the step part running now, or None outside every :func:`step_phase`."""
    return _current


@contextlib.contextmanager
def step_phase(name: str) -> Iterator[None]:
    """Run the block as the step part ``name`` (nested: the innermost name counts)."""
    global _current
    outer, _current = _current, name
    start = time.perf_counter()
    try:
        yield
    finally:
        _current = outer
        if _recording is not None:
            _recording.append(PhaseSpan(name, start, time.perf_counter()))


@contextlib.contextmanager
def recording_phases() -> Iterator[list[PhaseSpan]]:
    """Collect the spans of the step parts that end inside the block, in the order they end."""
    global _recording
    outer = _recording
    spans: list[PhaseSpan] = []
    _recording = spans
    try:
        yield spans
    finally:
        _recording = outer
