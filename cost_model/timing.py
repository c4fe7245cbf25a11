"""Timing a call: the clock readings every measurement of dhelix shares (the profiler, the
hardware calibration, the emulator, the benches).

Contract
    Host wall time is ``time.perf_counter``; "until the device is done" means the device
    synchronized after the call (:func:`synchronize`, a no-op on the CPU). On CUDA, a call's GPU
    time comes from two CUDA events on the current stream (:func:`cuda_window_s`), optionally
    behind a ``lead_in`` of queued GPU work (the caller's spin kernel), so that the window starts
    with the calls already queued and times the kernels, not the launches.

    ==========================  ============================================================
    :func:`time_samples_s`      ``warmup`` untimed calls, then each of ``repeats`` calls' wall
                                time until the device is done
    :func:`median_run_s`        the median of those (the profiler's measure of one function)
    :func:`back_to_back_s`      mean host time of ``reps`` calls in a row
    :func:`cuda_window_s`       mean GPU time of ``reps`` calls in a row, between two events
    :func:`time_each_s`         median over ``trials`` of the mean of ``reps`` calls in a row
                                (GPU events on CUDA, the host clock elsewhere)
    :func:`one_call_s`          one call: GPU events on CUDA (after a synchronize), else wall
    ==========================  ============================================================
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = [
    "back_to_back_s",
    "cuda_window_s",
    "median_run_s",
    "one_call_s",
    "synchronize",
    "time_each_s",
    "time_samples_s",
]


def synchronize(device: torch.device | None) -> None:
    """Wait for the device's queued work (a no-op on the CPU, or without a device)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def time_samples_s(
    fn: Callable[[], object], repeats: int, warmup: int = 1, device: torch.device | None = None
) -> list[float]:
    """``warmup`` untimed calls of ``fn``, then the wall time of each of ``repeats`` calls, the
    device synchronized after the warm-up and after each call."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - t0)
    return samples


def median_run_s(fn: Callable[[], object], warmup: int, repeats: int, device: torch.device | None) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after ``warmup`` calls (device synchronized)."""
    return statistics.median(time_samples_s(fn, repeats, warmup, device))


def back_to_back_s(fn: Callable[[], object], reps: int) -> float:
    """Mean host wall time of ``reps`` calls of ``fn`` in a row (no synchronization)."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def cuda_window_s(fn: Callable[[], object], reps: int = 1, *, lead_in: Callable[[], object] | None = None) -> float:
    """Mean time of ``fn`` over ``reps`` back-to-back calls, between two CUDA events on the current
    stream. ``lead_in``: called first (GPU work to queue ahead of the window, e.g. a spin kernel),
    so that the window starts with the calls already queued, not from an idle stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if lead_in is not None:
        lead_in()
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
            samples.append(back_to_back_s(fn, reps))
    return statistics.median(samples)


def one_call_s(fn: Callable[[], object], device: torch.device, *, lead_in: Callable[[], object] | None = None) -> float:
    """Seconds of one call of ``fn``: on CUDA between two events, after a synchronize and
    ``lead_in`` (:func:`cuda_window_s`); elsewhere the host's wall time."""
    if device.type == "cuda":
        synchronize(device)
        return cuda_window_s(fn, lead_in=lead_in)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
