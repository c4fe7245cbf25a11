"""The command line: ``python -m dhelix_compile.bench.gpu --help``."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dhelix_compile.bench import gpu
from dhelix_compile.bench.gpu.codegen import check_codegen, codegen_on_gloo_ranks, print_codegen
from dhelix_compile.bench.gpu.contention import check_contention
from dhelix_compile.bench.gpu.layer_ops import LayerShape, check_ops

Report = dict[str, Any]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dhelix_compile.bench.gpu",
        description=gpu.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=None, help="folder for gpu.json (default: a temporary one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checks", default="contention,ops,codegen")
    for field in dataclasses.fields(LayerShape):  # --hidden, --heads, --kv-heads, ...: the ops check's layer
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    # the reference TP+SP model crashes torch 2.11's gloo all-gather of CUDA tensors (in eager DTensor)
    parser.add_argument("--workloads", default="hf_llama")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--group",
        default="gloo",
        choices=["gloo", "fake"],
        help="codegen's process group: 2 gloo ranks on the one device, or the fake one (module docstring)",
    )
    parser.add_argument(
        "--options", default="{}", help="JSON options for the helix and dhelix variants (their defaults if none)"
    )
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="skip checks that start after this")
    args = parser.parse_args(argv)

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="dhelix_gpu_"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(device)
    started = time.perf_counter()
    jobs: list[tuple[str, Callable[[], Report]]] = []
    checks = args.checks.split(",")
    if "ops" in checks:
        shape = LayerShape(**{field.name: getattr(args, field.name) for field in dataclasses.fields(LayerShape)})
        jobs.append(("ops", lambda: check_ops(shape, device, getattr(torch, args.dtype))))
    if "codegen" in checks and args.group == "fake":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    options = json.loads(args.options)
    for name in args.workloads.split(",") if "codegen" in checks else []:
        on_ranks = check_codegen if args.group == "fake" else codegen_on_gloo_ranks
        codegen = functools.partial(on_ranks, name, device, args.microbatches, args.steps, out / "dumps", options)
        jobs.append((f"codegen_{name}_{args.group}", codegen))
    if "contention" in checks:
        jobs.append(("contention", lambda: check_contention(device)))
    failed = 0
    for key, job in jobs:
        if time.perf_counter() - started > args.budget_s:
            results[key] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            print(f"\n== {key}: skipped (past the budget) ==")
            continue
        t0 = time.perf_counter()
        try:
            results[key] = job()
            if key.startswith("codegen"):
                print_codegen(results[key])
        except Exception:  # noqa: BLE001 (reported; the other checks still run)
            failed += 1
            results[key] = {"error": traceback.format_exc()}
            print(f"\n== {key}: FAILED ==\n{results[key]['error']}")
        results.setdefault(key, {})["seconds"] = time.perf_counter() - t0
        (out / "gpu.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"  ({key}: {time.perf_counter() - t0:.1f} s)", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"\nwrote {out / 'gpu.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
