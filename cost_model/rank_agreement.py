"""Ranks agree on measured numbers: one place for every "all ranks must plan with the same values".

Measurements differ from rank to rank (each rank times its own ops), but a plan made from them must
be the same on every rank or the ranks issue different collectives and deadlock. Every agreement is a
tensor collective on float64 values, so it needs nothing beyond torch (no pickling, no numpy):

    agree_max(values, group)        element-wise max over ranks (a step ends when its slowest rank ends)
    agree_max_s(times, group)       measured seconds the same way; failed (NaN) on every rank -> FAILED_S
    all_agree(flag, group)          True on every rank iff it is True on every rank
    gather_floats(values, group)    every rank's list, in rank order (NaN stands for "none")
    gather_texts(text, group)       every rank's string, in rank order (its UTF-8 bytes as floats)
    check_same_signatures(sigs)     raise, never hang, when ranks are about to measure different lists

``group=None``, a one-rank group and the ``fake`` backend (compute-only runs) agree trivially: each
rank keeps its own values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from cost_model.comm_nodes import resolve_group_size


def backend_name(group: Any) -> str:
    """The torch.distributed backend of ``group`` (``"unknown"`` outside a process group)."""
    try:
        import torch.distributed as dist

        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - no process group: nothing to agree with
        return "unknown"


def comm_device(group: Any, default: torch.device) -> torch.device:
    """Where a tensor sent over ``group`` must live (the current CUDA device for NCCL, else the CPU)."""
    if backend_name(group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if default.type != "cuda" else default


def _agrees_alone(group: Any) -> bool:
    if group is None:
        return True
    return resolve_group_size(group) in (None, 1) or backend_name(group) == "fake"


def agree_max(values: Sequence[float], group: Any) -> list[float]:
    """Element-wise max over the ranks of ``group`` (identity without a group)."""
    out = [float(v) for v in values]
    if not out or _agrees_alone(group):
        return out
    import torch.distributed as dist

    t = torch.tensor(out, dtype=torch.float64, device=comm_device(group, torch.device("cpu")))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.cpu().tolist()]


#: The agreed time of a measurement that failed (NaN) on every rank: below every real time.
FAILED_S: float = -1.0


def agree_max_s(times: Sequence[float], group: Any) -> list[float]:
    """Measured seconds, element-wise max over the ranks, a failed measurement (NaN) counting as
    :data:`FAILED_S`: the ranks that measured set the time, and it is ``FAILED_S`` only where
    every rank failed. Every rank gets the same list either way."""
    return agree_max([FAILED_S if math.isnan(t) else t for t in times], group)


def all_agree(flag: bool, group: Any) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (the same answer on every rank)."""
    return agree_max([0.0 if flag else 1.0], group)[0] == 0.0


def gather_floats(values: Sequence[float | None], group: Any) -> list[list[float | None]]:
    """Every rank's ``values`` (equal lengths on every rank), in rank order; ``None`` survives the trip."""
    mine = [math.nan if v is None else float(v) for v in values]
    if _agrees_alone(group):
        rows = [mine]
    else:
        import torch.distributed as dist

        size = resolve_group_size(group) or 1
        device = comm_device(group, torch.device("cpu"))
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        rows = [p.cpu().tolist() for p in parts]
    return [[None if math.isnan(v) else float(v) for v in row] for row in rows]


def gather_texts(text: str, group: Any) -> list[str]:
    """Every rank's ``text``, in rank order: its UTF-8 bytes through ``gather_floats``, padded to
    one more than the longest rank's length (any lengths on any rank, empty ones too)."""
    data = text.encode()
    longest = int(agree_max([float(len(data))], group)[0])
    rows = gather_floats([*data, *([None] * (longest + 1 - len(data)))], group)
    return [bytes(int(v) for v in row if v is not None).decode() for row in rows]


def check_same_signatures(sigs: Sequence[str], group: Any) -> None:
    """Raise (never hang) when ranks are about to measure different signature lists."""
    if _agrees_alone(group):
        return
    digest = hashlib.sha256("\n".join(sigs).encode()).digest()
    h = float(int.from_bytes(digest[:6], "little"))  # exact in float64
    n = float(len(sigs))
    agreed = agree_max([h, -h, n, -n], group)
    if agreed[0] != -agreed[1] or agreed[2] != -agreed[3]:
        raise RuntimeError(
            "ProfiledEstimator.calibrate: ranks are calibrating different graphs "
            f"(this rank has {len(sigs)} signatures); every rank must pass the same graph"
        )


__all__ = [
    "FAILED_S",
    "agree_max",
    "agree_max_s",
    "all_agree",
    "backend_name",
    "check_same_signatures",
    "comm_device",
    "gather_floats",
    "gather_texts",
]
