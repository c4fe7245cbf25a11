"""Is the emulated cluster right about time? ``python -m dhelix_compile.bench.emulated_timing``.

Two checks, on CPU or CUDA, each printed as a table and written as JSON:

* **Collectives alone**: every kind (all-reduce, all-gather, reduce-scatter, all-to-all,
  broadcast, send, recv) at sizes from 4 KiB to 256 MiB on the emulated link, issued and waited
  for alone, against the link model's time (``cost_model.collectives.collective_time_s``). On
  CUDA the time is the compute stream's, between CUDA events around issue and wait.
* **Compute beside the emulator**: a chain of matmuls timed with no process group, and again on
  the emulated group with a large collective in flight: the emulator must leave the compute its
  resources (the ratio is the slowdown).

Timing is measured here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cost_model.collectives import collective_time_s
from cost_model.timing import one_call_s
from dhelix_compile import _torch_compat as compat

SIZES_BYTES: tuple[int, ...] = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


def _issue(op: str, nbytes: int, n: int, device: torch.device) -> Callable[[], Any]:
    """A function that issues ``op`` on ``nbytes`` (the full buffer S) and returns its work."""
    numel = max(n, nbytes // 2 // n * n)  # bfloat16 elements, a multiple of n
    full = torch.ones(numel, dtype=torch.bfloat16, device=device)
    part = torch.ones(numel // n, dtype=torch.bfloat16, device=device)
    other = torch.empty_like(full)
    calls: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(full, async_op=True),
        "all_gather": lambda: compat.all_gather_into_tensor(other, part, async_op=True),
        "reduce_scatter": lambda: compat.reduce_scatter_tensor(part, full, async_op=True),
        "all_to_all": lambda: dist.all_to_all_single(other, full, async_op=True),
        "broadcast": lambda: dist.broadcast(full, 0, async_op=True),
        "send": lambda: dist.isend(full, dst=1),
        "recv": lambda: dist.irecv(full, src=1),
    }
    return calls[op]


def _elapsed_s(run: Callable[[], None], device: torch.device) -> float:
    # on CUDA behind ~2 ms of GPU work: the host issues ahead, as in a training step
    return one_call_s(run, device, lead_in=functools.partial(compat.cuda_delay, 4_000_000))


def _issue_and_wait(issue: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        issue().wait()

    return run


def collectives_alone(link: Any, n: int, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for op in OPS:
        for nbytes in SIZES_BYTES:
            issue = _issue(op, nbytes, n, device)
            actual = max(n, nbytes // 2 // n * n) * 2  # what _issue's tensors hold
            model = collective_time_s(op, actual, n, link)
            times = [_elapsed_s(_issue_and_wait(issue), device) for _ in range(repeats + 2)][2:]
            measured = statistics.median(times)
            rows.append(
                {"op": op, "bytes": actual, "model_s": model, "measured_s": measured, "ratio": measured / model}
            )
    return rows


def _matmul_chain(device: torch.device) -> Callable[[], None]:
    size = 4096 if device.type == "cuda" else 384
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)

    def chain() -> None:
        x = a
        for _ in range(30):
            x = torch.tanh(x @ a)

    return chain


def compute_beside(device: torch.device, repeats: int, with_collective: Callable[[Callable[[], None]], None]) -> float:
    chain = _matmul_chain(device)
    for _ in range(2):
        chain()
    return statistics.median(_elapsed_s(lambda: with_collective(chain), device) for _ in range(repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--link", default="ib400")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--traffic", action="store_true", help="CUDA: copy each transfer's bytes in device memory")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    import dhelix_compile

    alone = compute_beside(device, args.repeats, lambda chain: chain())
    cluster = dhelix_compile.emulate(args.ranks, link=args.link, traffic=args.traffic)
    try:
        big = torch.ones(64 << 20, dtype=torch.bfloat16, device=device)

        def beside_all_reduce(chain: Callable[[], None]) -> None:
            work = dist.all_reduce(big, async_op=True)
            chain()
            work.wait()

        with cluster.link_free():
            on_group = compute_beside(device, args.repeats, lambda chain: chain())
        in_flight = compute_beside(device, args.repeats, beside_all_reduce)
        all_reduce_s = collective_time_s("all_reduce", big.numel() * 2, args.ranks, cluster.link)
        rows = collectives_alone(cluster.link, args.ranks, device, args.repeats)
    finally:
        cluster.close()
    report = {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "link": cluster.link.name,
        "ranks": args.ranks,
        "traffic": args.traffic,
        "compute_alone_s": alone,
        "compute_on_emulated_group_s": on_group,
        "compute_beside_128MiB_all_reduce_s": in_flight,
        "that_all_reduce_s": all_reduce_s,
        "collectives": rows,
    }
    print(f"# emulated timing: {report['device']}, torch {report['torch']}, link {report['link']}, {args.ranks} ranks")
    print(
        f"compute alone {alone * 1e3:.3f} ms; on the emulated group {on_group * 1e3:.3f} ms ({on_group / alone:.3f}x); "
        f"beside a {all_reduce_s * 1e3:.3f} ms all-reduce: {in_flight * 1e3:.3f} ms "
        f"(limit max = {max(alone, all_reduce_s) * 1e3:.3f} ms)"
    )
    print("| op | bytes | model us | measured us | ratio |\n|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['op']} | {row['bytes']} | {row['model_s'] * 1e6:.1f} | {row['measured_s'] * 1e6:.1f} | "
            f"{row['ratio']:.3f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
