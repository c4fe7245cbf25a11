"""One rank of a benchmark run: ``python -m dhelix_compile.bench.worker --out F.json ...``.

Launched (by ``dhelix_compile.launch.ranks.launch_ranks``) with RANK / WORLD_SIZE / MASTER_ADDR
/ MASTER_PORT in the environment. Two modes:

    --mode link      gloo over the real (possibly rate-limited) link: every variant's step time,
                     interleaved, each step started together on all ranks (barrier); then T_comm,
                     the step's collectives replayed back to back with no compute; with
                     --t-compute-s, the ceiling too (``measure.ceiling_steps``): those
                     collectives each hidden under a share of that much synthetic compute.
    --mode compute   the "fake" process group (collectives return at once, nothing is sent):
                     the same variants' step times are T_compute, the step without communication.

A step is one forward and backward per micro-batch (``--microbatches``; gradients accumulate,
helix merges consecutive micro-batches) of the TP+SP Llama-style reference model, or,
for ``--model mlp_*``, of one TP+SP SwiGLU MLP block alone (all-gather -> w1, w3 -> w2 ->
reduce-scatter; its input sequence-sharded and requiring grad, so the backward has the mirror
pair), or, for ``--model moe_*``, of one expert-parallel MoE layer (``testing.moe``: router,
all-to-all dispatch, each rank's SwiGLU experts as bmm, all-to-all combine).
A step's time is the slowest rank's. Rank 0 writes the JSON; every rank exits 0 on success.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from cost_model.rank_agreement import agree_max, all_agree, gather_floats
from dhelix_compile.bench.measure import (
    ceiling_steps,
    record_collectives,
    replay_collectives,
    time_interleaved,
)
from dhelix_compile.bench.steps import STEP_VARIANTS, step_function
from dhelix_compile.testing.llama import FeedForward, ModelConfig, Transformer, lm_loss
from dhelix_compile.testing.tensor_parallel import parallelize_tp, parallelize_tp_sp

if TYPE_CHECKING:
    from dhelix_compile.testing.moe import MoEConfig

#: Model sizes by name: (dim, n_heads, n_layers, ffn_hidden, vocab, seq_len, batch)
MODEL_SIZES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (64, 4, 2, 128, 128, 32, 2),
    "small": (256, 8, 4, 768, 512, 128, 4),
    "medium": (512, 8, 4, 1536, 1024, 256, 4),
    "large": (1024, 16, 4, 2816, 2048, 256, 4),
}

#: MLP-block sizes by name: (dim, ffn_hidden, seq_len, batch)
MLP_SIZES: dict[str, tuple[int, int, int, int]] = {
    "mlp_small": (256, 768, 128, 4),
    "mlp_medium": (512, 1536, 256, 4),
    "mlp_large": (1024, 2816, 256, 4),
}


#: MoE-layer sizes by name: (dim, ffn_hidden, n_experts, top_k, tokens per rank)
MOE_SIZES: dict[str, tuple[int, int, int, Literal[1, 2], int]] = {
    "moe_small": (256, 512, 4, 2, 256),
    "moe_medium": (512, 1024, 4, 2, 256),
}
MODEL_NAMES: tuple[str, ...] = (*MODEL_SIZES, *MLP_SIZES, *MOE_SIZES)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--mode", choices=["link", "compute"], default="link")
    parser.add_argument("--model", choices=sorted(MODEL_NAMES), default="small")
    parser.add_argument("--parallel", choices=["tp", "tp_sp"], default="tp_sp")
    parser.add_argument("--variants", default="eager,inductor,inductor_overlap,dhelix")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches per step (gradients accumulate)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dhelix-options", default="{}", help="JSON dict of dhelix options")
    parser.add_argument("--time-limit-s", type=float, default=300.0, help="stop repeating after this")
    parser.add_argument(
        "--t-compute-s",
        type=float,
        default=0.0,
        help="link mode: also time the ceiling, the step's collectives hidden under this much synthetic compute",
    )
    parser.add_argument("--progress-file", default=None, help="rank 0 writes 'done total variant' here")
    return parser.parse_args(argv)


def model_config(size: str) -> tuple[ModelConfig, int, int]:
    dim, heads, layers, ffn, vocab, seq, batch = MODEL_SIZES[size]
    return (
        ModelConfig(dim=dim, n_heads=heads, n_layers=layers, ffn_hidden=ffn, vocab_size=vocab, max_seq_len=seq),
        seq,
        batch,
    )


class MLPBlock(torch.nn.Module):
    """One SwiGLU MLP of the reference model, parallelized as in the TP+SP plan."""

    def __init__(self, dim: int, ffn_hidden: int) -> None:
        super().__init__()
        self.feed_forward = FeedForward(ModelConfig(dim=dim, ffn_hidden=ffn_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(x)


def parallelize_mlp(block: MLPBlock, mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return parallelize_module(block, mesh, plan)


def init_process_group(mode: str) -> tuple[int, int]:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "compute":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return rank, world_size


def _predicted_step_s(dump_dir: Path, rank: int, microbatches: int) -> float | None:
    """Predicted step time from this rank's graph dumps.

    Single strand: n x (forward + backward), each the reorder pass's predicted makespan.
    Helix: forward + (n - 1) x merged + backward, the merged graph's from the interleave pass.
    """
    makespans: dict[str, float] = {}
    for summary in sorted((dump_dir / f"rank{rank}").glob("*/summary.json")):
        records = json.loads(summary.read_text()).get("records", {})
        for pass_name in ("interleave", "reorder"):
            if "predicted_makespan_s" in records.get(pass_name, {}):
                makespans[summary.parent.name.rsplit("_", 1)[-1]] = records[pass_name]["predicted_makespan_s"]
                break
    if "fwd" not in makespans or "bwd" not in makespans:
        return None
    if "merged" in makespans:
        return makespans["fwd"] + (microbatches - 1) * makespans["merged"] + makespans["bwd"]
    return microbatches * (makespans["fwd"] + makespans["bwd"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dhelix_bench_") as dump_root:
        return _run(args, Path(dump_root))


def _run(args: argparse.Namespace, dump_root: Path) -> dict[str, Any]:
    rank, world_size = init_process_group(args.mode)
    torch.set_num_threads(args.threads)
    mesh = torch.distributed.device_mesh.DeviceMesh("cpu", list(range(world_size)))
    gen = torch.Generator().manual_seed(1234)
    user_options = json.loads(args.dhelix_options)
    if user_options.get("dump_dir"):  # keep the dumps: one folder per variant under the user's
        dump_root = Path(user_options.pop("dump_dir"))
    barrier = dist.barrier if args.mode == "link" else None
    config: ModelConfig | MoEConfig  # reported with the results
    if args.model in MLP_SIZES:
        dim, ffn, seq, batch = MLP_SIZES[args.model]
        config = ModelConfig(dim=dim, ffn_hidden=ffn)
        # this rank's sequence shard (requiring grad, so the backward has the mirror pair) and a probe
        microbatches: list[tuple[torch.Tensor, ...]] = [
            (
                torch.randn(batch, seq // world_size, dim, generator=gen).requires_grad_(),
                torch.randn(batch, seq // world_size, dim, generator=gen),
            )
            for _ in range(args.microbatches)
        ]

        def make() -> torch.nn.Module:
            torch.manual_seed(0)
            return parallelize_mlp(MLPBlock(dim, ffn), mesh)

        def loss_fn(model: torch.nn.Module, mb: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return (model(mb[0]) * mb[1]).sum()
    elif args.model in MOE_SIZES:
        from dhelix_compile.testing.moe import ExpertParallelMoE, MoEConfig, ReferenceMoE

        dim, ffn, n_experts, top_k, seq = MOE_SIZES[args.model]
        moe_config = MoEConfig(dim=dim, ffn_hidden=ffn, n_experts=n_experts, top_k=top_k)
        config, batch = moe_config, 1
        moe_config.validate(world_size)
        # this rank's dispatch group of tokens and a probe
        microbatches = [
            (torch.randn(seq, dim, generator=gen), torch.randn(seq, dim, generator=gen))
            for _ in range(args.microbatches)
        ]

        def make() -> torch.nn.Module:
            return ExpertParallelMoE.from_reference(ReferenceMoE(moe_config))

        def loss_fn(model: torch.nn.Module, mb: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return (model(mb[0]) * mb[1]).sum()
    else:
        config, seq, batch = model_config(args.model)
        config.validate(world_size)
        microbatches = [
            (
                torch.randint(0, config.vocab_size, (batch, seq), generator=gen),
                torch.randint(0, config.vocab_size, (batch, seq), generator=gen),
            )
            for _ in range(args.microbatches)
        ]
        parallelize = parallelize_tp_sp if args.parallel == "tp_sp" else parallelize_tp

        def make() -> torch.nn.Module:
            return parallelize(Transformer(config), mesh)

        def loss_fn(model: torch.nn.Module, mb: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return lm_loss(model(mb[0]), mb[1])

    inputs, extra = microbatches[0][:1], microbatches[0][1]

    def loss_of(out: torch.Tensor) -> torch.Tensor:  # one micro-batch's loss, for recording collectives
        return lm_loss(out, extra) if args.model in MODEL_SIZES else (out * extra).sum()

    steps: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name in [v for v in args.variants.split(",") if v]:
        if name not in STEP_VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(STEP_VARIANTS)}")
        module = make()
        run_step = step_function(name, module, loss_fn, {**user_options, "dump_dir": str(dump_root / name)})

        def step(module: torch.nn.Module = module, run_step: Any = run_step) -> None:
            module.zero_grad(set_to_none=True)
            run_step(microbatches)

        ok = True
        try:
            with _overlap_scheduler_on_cpu(name):
                for _ in range(args.warmup):
                    if barrier:
                        barrier()
                    step()
        except Exception:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
            errors[name] = traceback.format_exc(limit=3)
            ok = False
        if all_agree(ok, dist.group.WORLD):
            steps[name] = step
        else:
            errors.setdefault(name, "failed on another rank")

    repeats = _repeats_within(args.time_limit_s, steps, args.repeats, barrier)
    progress = _Progress(args.progress_file if rank == 0 else None, total=repeats * len(steps))
    times = time_interleaved(steps, repeats, barrier, on_step=progress.step)
    result: dict[str, Any] = {
        "mode": args.mode,
        "model": args.model,
        "parallel": args.parallel,
        "model_config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
        "batch": batch,
        "seq_len": seq,
        "world_size": world_size,
        "microbatches": args.microbatches,
        "threads": args.threads,
        "repeats": repeats,
        "step_s": {name: agree_max(samples, dist.group.WORLD) for name, samples in times.wall_s.items()},
        "cpu_s": {name: agree_max(samples, dist.group.WORLD) for name, samples in times.cpu_s.items()},
        "errors": errors,
    }
    if args.mode == "link":
        # every micro-batch's collectives, back to back
        replay = replay_collectives(record_collectives(make(), inputs, loss_of) * len(microbatches))
        timed: dict[str, Any] = {"comm": replay}
        if args.t_compute_s > 0:
            ceiling_compute, ceiling = ceiling_steps(
                replay, args.t_compute_s, lambda counts: [int(c) for c in agree_max(counts, dist.group.WORLD)]
            )
            timed.update(ceiling_compute=ceiling_compute, ceiling=ceiling)
        for warm_up in timed.values():
            warm_up()
        comm_times = time_interleaved(timed, repeats, barrier)
        result["t_comm_s"] = agree_max(comm_times.wall_s["comm"], dist.group.WORLD)
        result["t_comm_cpu_s"] = agree_max(comm_times.cpu_s["comm"], dist.group.WORLD)
        if "ceiling" in timed:
            result["ceiling"] = {
                "compute_s": agree_max(comm_times.wall_s["ceiling_compute"], dist.group.WORLD),
                "step_s": agree_max(comm_times.wall_s["ceiling"], dist.group.WORLD),
                "cpu_s": agree_max(comm_times.cpu_s["ceiling"], dist.group.WORLD),
            }
        predicted = {
            name: _predicted_step_s(dump_root / name, rank, args.microbatches)
            for name in steps
            if name.startswith(("dhelix", "helix"))
        }
        names = sorted(predicted)
        per_rank = gather_floats([predicted[name] for name in names], dist.group.WORLD)
        result["predicted_step_s"] = {name: [row[i] for row in per_rank] for i, name in enumerate(names)}
    dist.barrier() if args.mode == "link" else None
    return result if rank == 0 else {}


class _Progress:
    """Writes ``done total variant`` to a file after each timed step (the parent draws the bar)."""

    def __init__(self, path: str | None, total: int) -> None:
        self.path, self.total, self.done = path, total, 0

    def step(self, variant: str) -> None:
        self.done += 1
        if self.path:
            Path(self.path).write_text(f"{self.done} {self.total} {variant}\n")


def _repeats_within(limit_s: float, steps: dict[str, Any], wanted: int, barrier: Any) -> int:
    """As many repeats as fit the time limit (judged by one probe round), at least 3."""
    start = time.perf_counter()
    time_interleaved(steps, 1, barrier)
    round_s = max(time.perf_counter() - start, 1e-6)
    fit = int(limit_s / round_s)
    fit = -int(agree_max([-fit], dist.group.WORLD)[0])  # the fewest that fit on any rank
    return max(3, min(wanted, fit))


class _overlap_scheduler_on_cpu:
    """Inductor's overlap scheduler needs GPU specs; give it this CPU's measured numbers."""

    def __init__(self, variant: str) -> None:
        self.active = variant == "inductor_overlap"
        self._context: Any = None

    def __enter__(self) -> None:
        if self.active:
            from cost_model import measure_cpu_device
            from dhelix_compile import _torch_compat as compat

            device = measure_cpu_device()
            self._context = compat.cpu_roofline_for_inductor(
                tflops=device.flops_per_s(torch.float32) / 1e12,
                dram_gbps=device.mem_bandwidth_bytes_per_s / 1e9,
            )
            self._context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if result:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
