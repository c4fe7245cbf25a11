"""A helix step's schedule at run time: its merged graphs' kinds, and the record a dump keeps.

The schedules themselves (F0 | B0+F1 | ..., ``helix_schedule(n, kind)``) are
``cost_model.helix_schedule``'s, where the cluster model prices them too; this module re-exports
them for the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

from cost_model.helix_schedule import (
    SCHEDULE_KINDS,
    B,
    F,
    HelixScheduleKind,
    ScheduleStep,
    StrandCall,
    describe,
    helix_schedule,
)

__all__ = [
    "MERGED_GRAPH_KINDS",
    "SCHEDULE_FILE",
    "SCHEDULE_KINDS",
    "B",
    "F",
    "HelixScheduleKind",
    "ScheduleStep",
    "StrandCall",
    "describe",
    "graph_calls",
    "helix_schedule",
    "merged_graph_dirs",
    "merged_graph_kind",
    "read_schedule_kind",
    "write_schedule",
]


def merged_graph_kind(first: str, second: str) -> str:
    """The name suffix of the merged graph of a ``first``-phase call that takes a parked
    ``second``-phase call: ``merged`` (F ⊕ B, as the "forward_backward" schedule has always
    named it), ``fwdpair`` (F ⊕ F) or ``bwdpair`` (B ⊕ B)."""
    return f"{first}pair" if first == second else "merged"


def graph_calls(steps: list[ScheduleStep]) -> dict[str, int]:
    """How many times a step calls each graph kind: ``fwd`` / ``bwd`` (a call alone) and the
    merged kinds of :func:`merged_graph_kind` (the second call of a step takes the first)."""
    calls: dict[str, int] = {}
    for step in steps:
        kind = step[0].phase if len(step) == 1 else merged_graph_kind(step[1].phase, step[0].phase)
        calls[kind] = calls.get(kind, 0) + 1
    return calls


#: The name suffixes of merged graphs (their dump folders: ``<graph>_<kind>``).
MERGED_GRAPH_KINDS = ("merged", "fwdpair", "bwdpair")


def merged_graph_dirs(root: Path) -> list[Path]:
    """The dump folders of merged graphs under ``root`` (a rank's dump folder), sorted."""
    return sorted(p for kind in MERGED_GRAPH_KINDS for p in root.glob(f"*_{kind}") if p.is_dir())


#: The file a helix step with ``dump_dir`` writes into its rank's dump folder: the schedule it ran.
SCHEDULE_FILE = "helix_schedule.json"


def write_schedule(folder: Path, kind: HelixScheduleKind, steps: list[ScheduleStep]) -> None:
    """Record the schedule of a helix step in ``folder`` (a rank's dump folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SCHEDULE_FILE).write_text(json.dumps({"kind": kind, "steps": describe(steps)}) + "\n")


def read_schedule_kind(folder: Path) -> HelixScheduleKind | None:
    """The schedule kind :func:`write_schedule` recorded in ``folder`` (None: none recorded)."""
    path = folder / SCHEDULE_FILE
    if not path.exists():
        return None
    kind = json.loads(path.read_text())["kind"]
    assert kind in SCHEDULE_KINDS, kind
    return kind
