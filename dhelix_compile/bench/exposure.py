"""Where a step's communication is exposed, part by part, and why (emulated link, CPU).

The step drivers name the parts of a step (``dhelix_compile.step_phases``: ``F0``, ``B0+F1``,
... for ``helix``; ``F0``, ``B0``, ... for an accumulation loop), and the emulated process group
times each transfer on the CPU clock (``emulation.group.TransferTimes``). Per part, the medians
over the repeats of::

    step      its wall time on the link
    compute   its wall time with the link free
    comm      the link time of the transfers it issued (the busier side of the link: receives
              run on the inbound side beside the sends, as ``emulation.group.link_time_s``)
    exposed   how long its waits blocked (each transfer charged to the part that first waited),
              in all and by kind of operation (the mean over the repeats)
    busy      of that, the time those transfers spent queued behind earlier ones on the link
    slowed    step - compute - exposed: how much longer its own work took on the link than with
              it free (on CPU the emulated link writes each output on a helper thread, as gloo's
              threads copy, beside the compute; and runs differ)

and a reason, the first that holds:

    hidden              exposed and slowed each under 5% of the part's step (or under 1 ms)
    slowed              slowed > exposed: the part lost more to its compute running slower
                        beside the transfers than to waiting for them
    communication-bound comm > compute: no order hides more than compute of it
    link busy           most of the exposed time is queueing behind earlier transfers
    one strand          a single strand call (the step's ends under ``helix``, every part of a loop):
                        its ops need each transfer's result soon after issuing it
    used soon           two strands, yet a transfer's result is needed before it arrives: the
                        other strand's compute between issue and use runs out (the dependency
                        order, or the plan's placement)

Transfers issued outside every named part (a data-parallel hook after the last backward, a
pipeline schedule, which names no parts) go to the part ``"-"``.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from dhelix_compile.emulation.group import link_side
from dhelix_compile.step_phases import PhaseSpan

OUTSIDE = "-"

#: Exposed and slowed time each below this share of a part's step, or below :data:`HIDDEN_ABS_S`,
#: read "hidden".
HIDDEN_SHARE = 0.05
HIDDEN_ABS_S = 1e-3


@dataclasses.dataclass(frozen=True)
class TimedTransfer:
    """What the exposure table needs of one emulated transfer."""

    op: str
    seconds: float
    phase: str | None
    waited_phase: str | None
    blocked_s: float
    queued_s: float
    nbytes: int = 0
    issued_s: float = 0.0
    wait_called_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Repeat:
    """One repeat of a variant: its parts on the link, with the link free, and its transfers."""

    on_link: Sequence[PhaseSpan]
    link_free: Sequence[PhaseSpan]
    transfers: Sequence[TimedTransfer]


@dataclasses.dataclass(frozen=True)
class PartRow:
    """One part of a variant's step: the module docstring's medians, its operations (first
    repeat), exposed seconds by kind and the reason."""

    name: str
    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    busy_s: float
    ops: dict[str, int]
    exposed_by_op: dict[str, float]
    reason: str
    exposed_transfers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The transfers whose waits blocked in this part, in the last repeat (the warmest): kind,
    MB, ms from the part's start to the issue, link ms, ms of work between issue and wait,
    ms blocked."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _strands(name: str) -> int:
    return name.count("+") + 1


def _small(seconds: float, step_s: float) -> bool:
    return seconds < HIDDEN_ABS_S or seconds < HIDDEN_SHARE * step_s


def reason(name: str, step_s: float, compute_s: float, comm_s: float, exposed_s: float, busy_s: float) -> str:
    """The first reason of the module docstring's list that holds."""
    slowed = step_s - compute_s - exposed_s if name != OUTSIDE else 0.0  # "-" has no span of its own
    if _small(exposed_s, step_s) and _small(slowed, step_s):
        return "hidden"
    if slowed > exposed_s:
        return "slowed"
    if comm_s > compute_s:
        return "communication-bound"
    if busy_s > 0.5 * exposed_s:
        return "link busy"
    if name != OUTSIDE and _strands(name) == 1:
        return "one strand"
    return "used soon"


def _seconds_by_name(spans: Sequence[PhaseSpan]) -> dict[str, float]:
    totals: dict[str, float] = collections.defaultdict(float)
    for span in spans:
        totals[span.name] += span.seconds
    return totals


def part_rows(repeats: Sequence[Repeat]) -> list[PartRow]:
    """One row per named part (in the order the first repeat ran them, ``"-"`` last), each the
    median over ``repeats``."""
    if not repeats:
        return []
    names = list(dict.fromkeys(span.name for span in repeats[0].on_link))
    if any(t.phase is None or t.waited_phase is None for r in repeats for t in r.transfers):
        names.append(OUTSIDE)
    samples: dict[str, dict[str, list[float]]] = {
        n: {k: [] for k in ("step", "compute", "comm", "exposed", "busy")} for n in names
    }
    ops: dict[str, collections.Counter[str]] = {n: collections.Counter() for n in names}
    by_op: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for index, repeat in enumerate(repeats):
        on_link, free = _seconds_by_name(repeat.on_link), _seconds_by_name(repeat.link_free)
        comm: dict[tuple[str, str], float] = collections.defaultdict(float)  # (part, side of the link)
        exposed: dict[str, float] = collections.defaultdict(float)
        busy: dict[str, float] = collections.defaultdict(float)
        exposed_op: dict[tuple[str, str], float] = collections.defaultdict(float)
        for t in repeat.transfers:
            issued_in, waited_in = t.phase or OUTSIDE, t.waited_phase or OUTSIDE
            comm[issued_in, link_side(t.op)] += t.seconds
            exposed[waited_in] += t.blocked_s
            busy[waited_in] += min(t.blocked_s, t.queued_s)
            exposed_op[waited_in, t.op] += t.blocked_s
            if index == 0 and issued_in in ops:
                ops[issued_in][t.op] += 1
        for key, seconds in exposed_op.items():
            by_op[key].append(seconds)
        for name in names:
            got = samples[name]
            got["step"].append(on_link.get(name, 0.0))
            got["compute"].append(free.get(name, 0.0))
            got["comm"].append(max(comm.get((name, "out"), 0.0), comm.get((name, "in"), 0.0)))
            got["exposed"].append(exposed.get(name, 0.0))
            got["busy"].append(busy.get(name, 0.0))
    rows = []
    for name in names:
        step, compute, comm_s, exposed_s, busy_s = (
            statistics.median(samples[name][k]) for k in ("step", "compute", "comm", "exposed", "busy")
        )
        rows.append(
            PartRow(
                name,
                step,
                compute,
                comm_s,
                exposed_s,
                busy_s,
                dict(sorted(ops[name].items())),
                {
                    op: sum(v) / len(repeats)  # a repeat with none of it exposed counts as 0
                    for (part, op), v in sorted(by_op.items())
                    if part == name and sum(v) / len(repeats) >= 1e-4
                },
                reason(name, step, compute, comm_s, exposed_s, busy_s),
                _exposed_transfers(repeats[-1], name),
            )
        )
    return rows


def _exposed_transfers(repeat: Repeat, name: str) -> list[dict[str, Any]]:
    """Each transfer that blocked in part ``name`` of ``repeat`` (more than 0.1 ms)."""
    start = next((span.start_s for span in repeat.on_link if span.name == name), None)
    rows = []
    for t in repeat.transfers:
        if (t.waited_phase or OUTSIDE) != name or t.blocked_s < 1e-4:
            continue
        rows.append(
            {
                "op": t.op,
                "mb": round(t.nbytes / 1e6, 3),
                "issued_ms": None if start is None else round((t.issued_s - start) * 1e3, 2),
                "link_ms": round(t.seconds * 1e3, 2),
                "work_before_wait_ms": None
                if t.wait_called_s is None
                else round((t.wait_called_s - t.issued_s) * 1e3, 2),
                "blocked_ms": round(t.blocked_s * 1e3, 2),
            }
        )
    return rows


def markdown_parts(variant: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    """A variant's parts as table rows (``variant | part | step | compute | comm | exposed | busy | why``)."""
    lines = []
    for k, row in enumerate(rows):
        ops = ", ".join(f"{n} {op}" for op, n in row["ops"].items()) or "none"
        slowed = "-" if row["name"] == OUTSIDE else f"{(row['step_s'] - row['compute_s'] - row['exposed_s']) * 1e3:.1f}"
        by_op = ", ".join(f"{op} {s * 1e3:.1f}" for op, s in row.get("exposed_by_op", {}).items())
        lines.append(
            f"| {variant if k == 0 else ''} | {row['name']} | {row['step_s'] * 1e3:.1f} | {row['compute_s'] * 1e3:.1f} | "
            f"{row['comm_s'] * 1e3:.1f} ({ops}) | {row['exposed_s'] * 1e3:.1f}{f' ({by_op})' if by_op else ''} | {row['busy_s'] * 1e3:.1f} | "
            f"{slowed} | "
            f"{row['reason']} |"
        )
    return lines


PARTS_HEADER = [
    "| variant | part | step ms | compute ms | comm ms (issued) | exposed ms (by kind, mean) | of it link busy | slowed ms | why |",
    "|---|---|---:|---:|---:|---:|---:|---:|---|",
]
