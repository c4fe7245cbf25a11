"""Timing a call on the device: CUDA events around back-to-back calls on a GPU, the clock on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_each_s(fn: Callable[[], object], device: torch.device, reps: int = 10, trials: int = 3) -> float:
    """Median over ``trials`` of the mean time of ``reps`` back-to-back calls (CUDA events on a GPU)."""
    fn()
    sync(device)
    samples = []
    for _ in range(trials):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def time_steps_s(step: Callable[[], object], device: torch.device, steps: int) -> list[float]:
    """Wall time of each of ``steps`` calls, the device synchronized after each."""
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times
