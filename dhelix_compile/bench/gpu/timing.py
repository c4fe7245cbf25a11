"""Timing a call on the device: CUDA events around back-to-back calls on a GPU, the clock on the CPU.

Whole steps (the device synchronized around each call) are timed by the profiler's own
``cost_model.profile.running.median_run_s``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from cost_model.profile.running import synchronize


def cuda_window_s(fn: Callable[[], object], reps: int, *, lead_in: bool = False) -> float:
    """Mean time of ``fn`` over ``reps`` back-to-back calls, between two CUDA events on the current
    stream. ``lead_in``: the window opens behind about 0.5 ms of spinning on the stream, so that it
    starts with the calls already queued, not from an idle stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if lead_in:
        torch.cuda._sleep(1_000_000)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def time_each_s(fn: Callable[[], object], device: torch.device, reps: int = 10, trials: int = 3) -> float:
    """Median over ``trials`` of the mean time of ``reps`` back-to-back calls (CUDA events on a GPU)."""
    fn()
    synchronize(device)
    samples = []
    for _ in range(trials):
        if device.type == "cuda":
            samples.append(cuda_window_s(fn, reps))
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)
