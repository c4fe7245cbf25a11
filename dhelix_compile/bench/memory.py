"""Peak memory of a training step, measured from the allocator (CPU or CUDA), and the helix check.

    python -m dhelix_compile.bench.memory --model small --microbatches 4 --ranks 2
    python -m dhelix_compile.bench.memory --model small --microbatches 8 --pipeline dualpipev,1f1b
    python -m dhelix_compile.bench.memory --model small --microbatches 4 --data-parallel shard
    python -m dhelix_compile.bench.memory --model moe_medium --microbatches 4 --rate 613mbit
    python -m dhelix_compile.bench.memory --model small --parallel functional_sp --checkpoint checkpoint

runs a benchmark workload (``--model``: ``bench.workloads``, TP+SP or ``--parallel tp``; the
TP+SP reference model by default; ``functional_sp``: its TP+SP written with functional
collectives) on gloo ranks (``testing.multirank``; on loopback, or with
``--rate`` over a rate-limited link, where the profiled cost model plans as it does in ``dhelix
bench``'s run at that rate: a plan, and its memory, follows the link) and prints, per variant,
the peak bytes resident during one step above what was resident before it (sampled, see
``peak_allocated_bytes``): the eager accumulation loop, the Inductor loop, dhelix single
strand, and helix. With ``--checkpoint KIND`` every transformer block runs under activation
checkpointing (``testing.checkpointing``: ``checkpoint``, ``checkpoint_wrapper``, ``selective``)
in every variant, so ``vs eager`` compares with the eager checkpointed loop (``--parallel
functional_sp``: torch's compile refuses DTensors in checkpointed regions). With
``--pipeline``, the model as a pipeline (``bench.pipeline_parallel``) under each schedule named:
torch's schedule eager, with Inductor-compiled stages, and ``helix_pipeline``.
With ``--data-parallel shard`` (or ``replicate``), the reference model data-parallel over the
ranks: torch's own eager FSDP2 ``fully_shard`` (DDP for ``replicate``) beside ``data_parallel``
run eagerly, through ``backend="dhelix"`` and by ``helix``; bracket options as ``dhelix bench``'s
(``--variants 'dhelix[reshard_after_forward=true]'`` gathers the weights again in the backward).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dhelix_compile.testing.checkpointing import CHECKPOINT_KINDS, CheckpointKind, checkpoint_blocks

MEMORY_VARIANTS = ("eager", "inductor", "dhelix", "helix")
#: ``--data-parallel``: torch's own (FSDP2 for shard, DDP for replicate), then ``data_parallel`` under these.
DATA_PARALLEL_VARIANTS = ("torch", "eager", "dhelix", "helix")


def peak_allocated_bytes(fn: Callable[[], Any], interval_s: float = 2e-4) -> int:
    """Peak resident bytes while ``fn`` runs, above the resident size when it started.

    CPU tensors have no allocator counters, and ``torch.profiler``'s allocator events are
    recorded only on threads that started profiling (a helix step frees micro-batch i's
    gradients on its backward thread), so this samples the process's resident set size
    (``/proc/self/statm``) from a background thread every ``interval_s``. It needs glibc to
    return freed tensors to the OS at once: run with ``MALLOC_MMAP_THRESHOLD_=65536`` (``main``
    sets it for the ranks it spawns), which gives every allocation of 64 KiB or more its own
    mapping. On CUDA use ``torch.cuda.max_memory_allocated`` instead.
    """
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    gc.collect()
    base = rss()
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss())
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, name="dhelix-rss-sampler", daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak, rss()) - base


def _rank_peaks(
    rank: int,
    world_size: int,
    model: str,
    parallel: str,
    microbatches: int,
    checkpoint: CheckpointKind | None,
    variants: list[str],
) -> dict[str, int]:
    from dhelix_compile.bench.steps import step_function
    from dhelix_compile.bench.workloads import build_workload

    mesh = torch.distributed.device_mesh.DeviceMesh("cpu", list(range(world_size)))
    workload = build_workload(model, parallel, mesh, world_size, microbatches, torch.Generator().manual_seed(1234))
    mbs = workload.microbatches
    peaks = {}
    for name in variants:
        module = workload.make()
        if checkpoint is not None:
            checkpoint_blocks(module.layers, checkpoint)  # type: ignore[arg-type]
        step = step_function(name, module, workload.loss_fn)
        step(mbs)  # compile, and the gradients exist: later steps accumulate into them
        peaks[name] = peak_allocated_bytes(functools.partial(step, mbs))
    return peaks


def _pipeline_peaks(
    rank: int, world_size: int, model: str, microbatches: int, kinds: list[str], variants: list[str]
) -> dict[str, int]:
    from dhelix_compile.bench.pipeline_parallel import PIPELINE_VARIANTS, build_pipeline
    from dhelix_compile.bench.steps import split_variant

    peaks = {}
    for kind in kinds:
        pipeline = build_pipeline(kind, model, rank, world_size, microbatches, torch.Generator().manual_seed(1234))
        for name in variants:
            base, options = split_variant(name, PIPELINE_VARIANTS)  # helix_pipeline[order=eager_1f1b]
            step = pipeline.step_function(base, options)
            step()  # compile
            torch.distributed.barrier()
            peaks[f"{kind} {name}"] = peak_allocated_bytes(step)
            del step
    return peaks


def _data_parallel_peaks(
    rank: int, world_size: int, model: str, microbatches: int, mode: str, variants: list[str]
) -> dict[str, int]:
    from torch.distributed.device_mesh import init_device_mesh

    from dhelix_compile.bench.data_parallel import wrapper_options
    from dhelix_compile.bench.steps import split_variant, step_function
    from dhelix_compile.bench.workloads import build_workload
    from dhelix_compile.data_parallelism import data_parallel
    from dhelix_compile.own_code import with_own_code
    from dhelix_compile.testing.data_parallel_checks import sync_on_last, torch_data_parallel

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    # each rank its own data: the model as written, data-parallel over the ranks
    gen = torch.Generator().manual_seed(1234 + rank)
    workload = build_workload(model, "none", mesh, world_size, microbatches, gen)
    mbs, loss_fn = workload.microbatches, workload.loss_fn
    peaks = {}
    for name in variants:
        runner, options = split_variant(name, DATA_PARALLEL_VARIANTS)
        wrap, options = wrapper_options(options)
        module: torch.nn.Module = workload.make()
        module.forward = with_own_code(module.forward)  # each variant its own Dynamo cache (own_code.py)
        if runner == "torch":
            module = torch_data_parallel(module, list(module.layers), mesh, mode)  # type: ignore[arg-type]
        else:
            data_parallel(module, mesh, mode, **wrap)  # type: ignore[arg-type]
        sync = sync_on_last(module)  # gradients reduced once per step (DDP: no_sync before the last)
        step = step_function("eager" if runner == "torch" else runner, module, loss_fn, options, gradient_sync=sync)
        step(mbs)  # compile, and the gradients exist: later steps accumulate into them
        torch.distributed.barrier()
        peaks[name] = peak_allocated_bytes(functools.partial(step, mbs))
        del step, module
    return peaks


def _eager_of(name: str) -> str:
    """The eager variant a variant is compared with: ``"dualpipev helix_pipeline"`` ->
    ``"dualpipev pipeline_eager"`` (the same schedule), ``"helix"`` -> ``"eager"``."""
    kind, _, _ = name.rpartition(" ")
    if kind in ("shard", "replicate"):
        return f"{kind} torch"
    return f"{kind} pipeline_eager" if kind else "eager"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument(
        "--parallel",
        choices=("tp_sp", "tp", "functional_sp"),
        default="tp_sp",
        help="as dhelix bench's; functional_sp: TP+SP written with functional collectives",
    )
    parser.add_argument(
        "--checkpoint",
        choices=CHECKPOINT_KINDS,
        default=None,
        help="every transformer block under activation checkpointing of this kind (the reference transformer)",
    )
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--variants", default=None, help=f"default: {', '.join(MEMORY_VARIANTS)}, or every pipeline variant"
    )
    parser.add_argument(
        "--pipeline", default=None, help="comma-separated schedules (bench.pipeline_parallel.SCHEDULE_KINDS)"
    )
    parser.add_argument("--data-parallel", choices=("shard", "replicate"), default=None)
    parser.add_argument(
        "--rate",
        default=None,
        help="run the ranks over a link of this tc rate (e.g. 613mbit: the rate a dhelix bench run chose), "
        "since the profiled plans, and so their memory, follow the link; default: loopback",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from dhelix_compile.bench import memory  # the ranks import the functions by module name, not __main__
    from dhelix_compile.bench.steps import parse_variants
    from dhelix_compile.bench.workloads import MOE_SIZES
    from dhelix_compile.launch.link import LinkSpec
    from dhelix_compile.testing.multirank import run_on_ranks

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors leave the RSS at once
    # the ranks start cold (forked=False), as a user's processes do, not forked from a server's heap
    run = functools.partial(run_on_ranks, timeout_s=args.timeout_s, forked=False, link=LinkSpec(rate=args.rate))
    if args.pipeline:
        from dhelix_compile.bench.pipeline_parallel import PIPELINE_VARIANTS

        kinds = [k for k in args.pipeline.split(",") if k]
        variants = parse_variants(args.variants or ",".join(PIPELINE_VARIANTS))
        per_rank = run(memory._pipeline_peaks, args.ranks, args.model, args.microbatches, kinds, variants)
        what = f"pipeline {', '.join(kinds)}"
    elif args.data_parallel:
        variants = parse_variants(args.variants or ",".join(DATA_PARALLEL_VARIANTS))
        per_rank = run(
            memory._data_parallel_peaks, args.ranks, args.model, args.microbatches, args.data_parallel, variants
        )
        per_rank = [{f"{args.data_parallel} {name}": peak for name, peak in rank.items()} for rank in per_rank]
        what = f"data-parallel {args.data_parallel} (torch: {'DDP' if args.data_parallel == 'replicate' else 'FSDP2'})"
    else:
        variants = parse_variants(args.variants or ",".join(MEMORY_VARIANTS))
        per_rank = run(
            memory._rank_peaks, args.ranks, args.model, args.parallel, args.microbatches, args.checkpoint, variants
        )
        what = (
            ""
            if args.model in MOE_SIZES
            else {"tp_sp": "TP+SP", "tp": "TP", "functional_sp": "functional TP+SP"}[args.parallel]
        )
        what += f", blocks under {args.checkpoint}" if args.checkpoint else ""
    peaks = {name: max(rank[name] for rank in per_rank) for name in per_rank[0]}
    print(
        f"peak resident bytes in one step (the busiest rank): {what + ' ' if what else ''}{args.model}, "
        f"{args.ranks} ranks, {args.microbatches} micro-batches, {f'a {args.rate} link' if args.rate else 'loopback'}"
    )
    print("| variant | peak MiB | vs eager |")
    print("|---|---:|---:|")
    for name, peak in peaks.items():
        eager = peaks.get(_eager_of(name))
        ratio = f"{peak / eager:.2f}x" if eager else "-"
        print(f"| {name} | {peak / 2**20:.1f} | {ratio} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "ranks": args.ranks,
                    "microbatches": args.microbatches,
                    "parallel": args.parallel,
                    "checkpoint": args.checkpoint,
                    "peak_bytes": peaks,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
