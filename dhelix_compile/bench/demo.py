"""``dhelix demo``: train a TP+SP workload with ``helix`` on two ranks, beside eager, Inductor and their ceilings.

    dhelix demo [--model mlp_medium] [--rate auto] [--steps 3] [--microbatches 4] [--dump-dir dhelix_demo]

The parent launches two gloo ranks (``dhelix_compile.launch.ranks.launch_ranks``): inside two network
namespaces joined by a rate-limited veth link when run as root with ``ip`` and ``tc``, on
loopback otherwise (the output says which, and why).

The workload is one of ``dhelix bench``'s (``bench.workloads``; by default a sequence-parallel
SwiGLU MLP block, where this machine's ceiling allows about 1.4x over Inductor; ``--model small``
for the reference transformer, whose gloo collectives leave a ceiling near Inductor).

1. Training: each rank builds the workload's model twice from one seed, the eager model and
   the helix one (``dhelix_compile.helix`` with its default options), each with
   its own SGD optimizer, trains both ``--steps`` steps on the same micro-batches and records
   each step's mean loss (helix's graphs dumped under ``--dump-dir``). Rank 0 writes each
   finished step to a file the parent draws its progress bar from (``bench.progress_file``), and
   the losses as JSON for the parent.
2. Speed: ``dhelix bench`` (``bench.run.measure``) with the variants eager, Inductor and helix
   (defaults): ``T_compute`` on the fake process group, then (``--rate auto``, the default) the
   link rate at which the step's collectives alone take about ``T_compute``
   (``bench.link_rate``; training ran at its probe rate), then every variant interleaved on that
   link, and each variant's own limit and *ceiling* (the collectives its step sent, alone and
   hidden under synthetic compute of its own compute time: the most this machine allows).

The parent prints the losses side by side, the step-time table beside each variant's own limit
and ceiling, and where the dumps and their report are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cost_model.units import format_ms
from dhelix_compile.bench.choices import MODEL_NAMES

#: Step-time variants of the demo, in table order.
DEMO_VARIANTS = ("eager", "inductor", "helix")
#: What the demo's default workloads are, for its output.
WHAT = {
    "mlp_medium": "a SwiGLU MLP block, dim 512, hidden 1536, 4 x 256 tokens, sequence-parallel input",
    "small": "the Llama-style reference transformer, dim 256, 4 layers",
}


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import dhelix_compile
    from dhelix_compile.bench.progress_file import ProgressFile
    from dhelix_compile.bench.workloads import build_workload

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = torch.distributed.device_mesh.DeviceMesh("cpu", list(range(world_size)))
    gen = torch.Generator().manual_seed(1234)

    def workload() -> Any:  # the same model every call; fresh micro-batches from ``gen``
        return build_workload(args.model, "tp_sp", mesh, world_size, args.microbatches, gen)

    loss_fn = workload().loss_fn
    models = {name: workload().make() for name in ("eager", "helix")}
    helix_step = dhelix_compile.helix(models["helix"], loss_fn, dump_dir=args.dump_dir)
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.05) for name, model in models.items()}

    def train(name: str, microbatches: list[Any]) -> float:
        optimizers[name].zero_grad(set_to_none=True)
        if name == "helix":
            losses = helix_step(microbatches)
        else:
            losses = []
            for mb in microbatches:
                loss = loss_fn(models[name], mb)
                loss.backward()
                losses.append(loss.detach())
        optimizers[name].step()
        return float(torch.stack(losses).mean())

    losses: dict[str, list[float]] = {"eager": [], "helix": []}
    progress = ProgressFile(args.progress_file if rank == 0 else None, total=args.steps * len(losses))
    start = time.perf_counter()
    for _ in range(args.steps):
        microbatches = workload().microbatches
        for name in losses:
            dist.barrier()
            losses[name].append(train(name, microbatches))
            progress.step(name)
    train_s = time.perf_counter() - start

    if rank == 0:
        result = {
            "model": args.model,
            "microbatches": args.microbatches,
            "losses": losses,
            "train_s": train_s,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _print_results(losses: dict[str, Any], summary: dict[str, Any], dump_dir: Path) -> None:
    from dhelix_compile.bench.run import rate_probes_line

    print(f"link: {summary['link']}")
    for line in rate_probes_line(summary):
        print(line)
    print(
        f"model: '{summary['model']}' ({WHAT.get(summary['model'], 'see dhelix bench --help')}), TP+SP, 2 ranks, "
        f"{summary['microbatches']} micro-batches per step"
    )
    print()
    print("| step | eager loss | helix loss | difference |")
    print("|---:|---:|---:|---:|")
    for step, (eager, helix) in enumerate(zip(losses["eager"], losses["helix"]), start=1):
        print(f"| {step} | {eager:.6f} | {helix:.6f} | {abs(helix - eager):.1e} |")
    print()
    t_compute, t_comm = summary["t_compute_s"], summary["t_comm_s"]
    print(
        f"T_compute {format_ms(t_compute)} ms (Inductor, no communication), T_comm {format_ms(t_comm)} ms "
        f"(its collectives alone), perfect overlap max(T_compute, T_comm) = {format_ms(max(t_compute, t_comm))} ms"
    )
    print()
    base = summary["variants"].get("inductor", {}).get("step_s_median")
    print(
        "| variant | step median (ms) | speedup vs Inductor | own limit (ms) | step / own limit | step / own ceiling |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, v in summary["variants"].items():
        step_s = v["step_s_median"]
        speedup = f"{base / step_s:.2f}x" if base else "-"
        limit = v.get("limit_s")
        vs_limit = f"{step_s / limit:.2f}" if limit else "-"
        vs_ceiling = f"{step_s / v['ceiling']['step_s_median']:.2f}" if v.get("ceiling") else "-"
        print(f"| {name} | {format_ms(step_s)} | {speedup} | {format_ms(limit)} | {vs_limit} | {vs_ceiling} |")
    print()
    print(
        "own limit: max(own T_compute, own T_comm), the variant's compute and the collectives its step sent, alone; "
        "own ceiling: those collectives, each in flight under its share of the variant's compute time of synthetic "
        "matmuls (one or two at a time, the faster) -- the most this machine can hide (its 2 cores also carry the "
        "transfers)."
    )
    print(f"helix's graphs, schedules and timelines: {dump_dir}/rank0/*_merged/index.html")
    print(f"summary table: python -m dhelix_compile report {dump_dir}")
    print("every variant, CPU and idle time, compile times: dhelix bench --help")


def _bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """The benchmark's options for the demo's speed table: its variants, model, link and micro-batches."""
    from dhelix_compile.bench.run import parse_args

    return parse_args(
        [
            *("--model", args.model, "--rate", args.rate, "--microbatches", str(args.microbatches)),
            *("--variants", ",".join(DEMO_VARIANTS), "--repeats", str(args.repeats), "--warmup", "1"),
            *("--timeout-s", str(args.timeout_s)),
        ]
    )


def run(args: argparse.Namespace) -> int:
    """The parent: launch the two ranks, print what they measured."""
    from dhelix_compile.bench.link_rate import PROBE_RATE
    from dhelix_compile.bench.progress_file import progress_from_file
    from dhelix_compile.bench.run import measure
    from dhelix_compile.launch.ranks import LinkSpec, launch_ranks

    dump_dir = Path(args.dump_dir).resolve()
    # the losses do not depend on the rate: with --rate auto, training runs at the probe rate
    rate = {"none": None, "auto": PROBE_RATE}.get(args.rate.lower(), args.rate)
    with tempfile.TemporaryDirectory(prefix="dhelix_demo_") as tmp:
        out = Path(tmp) / "demo.json"
        progress = out.with_suffix(".progress")
        argv = [
            sys.executable,
            "-m",
            "dhelix_compile.bench.demo",
            "--worker",
            "--out",
            str(out),
            "--progress-file",
            str(progress),
            "--model",
            args.model,
            "--steps",
            str(args.steps),
            "--microbatches",
            str(args.microbatches),
            "--repeats",
            str(args.repeats),
            "--dump-dir",
            str(dump_dir),
        ]
        print(
            f"[1/3] training eager and helix side by side (link rate {rate or 'none'}) ...", file=sys.stderr, flush=True
        )
        started = time.perf_counter()
        try:
            with progress_from_file(progress, label=f"{'train':>7} steps"):
                launched = launch_ranks(argv, 2, LinkSpec(rate=rate), timeout_s=args.timeout_s)
            if any(launched.returncodes) or not out.exists():
                for r, err in enumerate(launched.stderr):
                    print(f"--- rank {r} (exit {launched.returncodes[r]}) ---\n{err[-3000:]}", file=sys.stderr)
                return 1
            losses = json.loads(out.read_text())["losses"]
            summary = measure(_bench_args(args), total_stages=3)
        except ValueError as exc:  # a rate tc rejects, ...
            print(f"dhelix demo: {exc}", file=sys.stderr)
            return 2
    _print_results(losses, summary, dump_dir)
    print(f"(took {time.perf_counter() - started:.0f} s)")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``dhelix demo`` and ``python -m dhelix_compile.bench.demo``)."""
    parser.add_argument(
        "--model",
        choices=MODEL_NAMES,
        default="mlp_medium",
        metavar="NAME",
        help=f"the workload, as dhelix bench's (default mlp_medium, a SwiGLU MLP block): {', '.join(MODEL_NAMES)}",
    )
    parser.add_argument(
        "--rate",
        default="auto",
        help="tc rate of the link between the ranks ('400mbit'; 'none' for loopback); 'auto', the default, times the "
        "step's collectives and picks the rate at which they take about the step's compute time",
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps compared with eager")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--dump-dir", default="dhelix_demo", help="where helix's graph dumps go")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the ranks are killed after this")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--progress-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.steps < 1 or args.microbatches < 1 or args.repeats < 1:
        parser.error("--steps, --microbatches and --repeats must be >= 1")
    return run(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
