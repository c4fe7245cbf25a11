"""``contention``: compute beside copies on a side stream (the package docstring)."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import torch

from cost_model.timing import cuda_window_s, time_each_s
from dhelix_compile import _torch_compat as compat

Report = dict[str, Any]

#: About 0.5 ms of spinning on the stream ahead of a timed window: it opens with the calls queued.
_LEAD_IN = functools.partial(compat.cuda_delay, 1_000_000)


def alone_and_beside_s(
    main: Callable[[], object],
    side: Callable[[], object],
    side_s: float,
    reps: int,
    device: torch.device,
    trials: int = 7,
) -> tuple[float, float]:
    """Median time of ``main`` alone and while a side stream runs ``side`` throughout, the two
    measured in alternation (trial by trial), so that the clocks, which fall under a long
    full-power load, are the same for both."""
    stream = torch.cuda.Stream(device)
    main_s = cuda_window_s(main, reps, lead_in=_LEAD_IN)
    queued = max(2, int(2 * main_s * reps / side_s) + 2)  # outlasts the timed window
    alone, beside = [], []
    for _ in range(trials):
        alone.append(cuda_window_s(main, reps, lead_in=_LEAD_IN))
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(queued):
                side()
        beside.append(cuda_window_s(main, reps, lead_in=_LEAD_IN))
        torch.cuda.synchronize(device)
    return statistics.median(alone), statistics.median(beside)


def check_contention(device: torch.device, gib: float = 1.0) -> Report:
    """Matmul and add slowdowns while copies move bytes beside them (module docstring)."""
    if device.type != "cuda":
        return {"skipped": "needs a CUDA device"}
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    # a Llama-3-8B MLP matmul of a 2-way tensor-parallel shard: 4096 tokens, 4096 -> 7168
    tokens, w = (
        torch.randn(4096, 4096, device=device, dtype=torch.bfloat16),
        torch.randn(4096, 7168, device=device, dtype=torch.bfloat16),
    )
    h = torch.empty(4096, 7168, device=device, dtype=torch.bfloat16)
    elems = int(gib * 2**30) // 4
    x, y = (torch.randn(elems // 4, device=device) for _ in range(2))
    z = torch.empty_like(x)
    host_src = torch.randn(elems, pin_memory=True)
    host_dst = torch.empty(elems, pin_memory=True)
    dev_buf = torch.empty(elems, device=device)
    dev_src = torch.randn(elems, device=device)

    mains: dict[str, tuple[Callable[[], object], float, str]] = {  # the op, its FLOPs or bytes, the unit
        "matmul bf16 8192^3": (lambda: torch.mm(a, b, out=c), 2 * n**3, "TFLOP/s"),
        "matmul bf16 4096x4096x7168": (lambda: torch.mm(tokens, w, out=h), 2 * 4096 * 4096 * 7168, "TFLOP/s"),
        f"add fp32 {gib / 4:g} GiB": (lambda: torch.add(x, y, out=z), 3 * x.numel() * 4, "TB/s"),
    }
    sides: dict[str, Callable[[], object]] = {
        "host->device (copy engine)": lambda: dev_buf.copy_(host_src, non_blocking=True),
        "device->host (copy engine)": lambda: host_dst.copy_(dev_buf, non_blocking=True),
        "device->device (SM kernel)": lambda: dev_buf.copy_(dev_src),
    }
    for main, _, _ in mains.values():
        main()
    side_alone = {name: time_each_s(fn, device, reps=3) for name, fn in sides.items()}
    rows: list[dict[str, Any]] = []
    for main_name, (main, work, unit) in mains.items():
        reps = 20 if "matmul" in main_name else 50
        for side_name, side in sides.items():
            alone, beside = alone_and_beside_s(main, side, side_alone[side_name], reps, device)
            rows.append(
                {
                    "main": main_name,
                    "side": side_name,
                    "alone_s": alone,
                    "beside_s": beside,
                    "slowdown": beside / alone,
                    "rate_alone": work / alone / 1e12,
                    "unit": unit,
                }
            )
    print("\n== contention: main-stream op time while a side stream moves bytes (alone and beside, alternated) ==")
    for name, t in side_alone.items():
        print(f"  side alone: {name:28s} {t * 1e3:8.3f} ms per {gib:g} GiB ({gib * 2**30 / t / 1e9:7.1f} GB/s)")
    for row in rows:
        print(
            f"  {row['main']:27s} beside {row['side']:28s} alone {row['alone_s'] * 1e3:7.3f} ms "
            f"({row['rate_alone']:6.1f} {row['unit']}), beside {row['beside_s'] * 1e3:7.3f} ms: x{row['slowdown']:.3f}"
        )
    return {"side_alone_s": side_alone, "rows": rows}
