"""dhelix's whole stack at once: data parallelism in the graph, tensor parallelism, bf16 mixed
precision and ``helix``, beside eager FSDP2 + TP with activation checkpointing.

    torchrun --nproc-per-node 4 examples/whole_stack.py            # DP=2 x TP=2, gloo on CPU
    torchrun --nproc-per-node 4 examples/whole_stack.py --steps 5 --microbatches 4

The model is examples/torchtitan_pattern.py's (TP + sequence parallelism written with functional
collectives). dhelix's way:

    model = dhelix_compile.data_parallel(model, mesh["dp"], mode="shard", param_dtype=torch.bfloat16)
    step = dhelix_compile.helix(model, loss_fn)
    losses = step(microbatches); optimizer.step()

``data_parallel`` stores each parameter as a shard on the DP ranks and gathers it in bf16 inside
the graph, so ``helix`` sees the whole step: micro-batch i's gradient reduce-scatters run in one
graph with micro-batch i+1's forward and its all-gathers. The eager copy is torchtitan's: FSDP2
``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, the same micro-batches
accumulated, every block under activation checkpointing (which changes no number).

``--checkpoint`` checkpoints the blocks on dhelix's side too, and torch 2.13 refuses it, with
Inductor as with dhelix: ``data_parallel``'s parameters are DTensors, and AOTAutograd saves their
device mesh among a checkpointed region's tensors ("expected all tensors_saved_with_vc_check to
be Tensors, got ... DeviceMesh").

Rank 0 prints both mean losses per step; the script exits non-zero when they differ
by more than bf16 rounding.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torchtitan_pattern import Transformer, batch, loss_fn, sync_replicated_grads, torchtitan_parallelize

import dhelix_compile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; the rest of the ranks is DP")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument(
        "--checkpoint", action="store_true", help="checkpoint the blocks under helix too (torch refuses)"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    try:
        return train(args)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # ranks share this machine's cores
    mesh = init_device_mesh("cpu", (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    ours = Transformer(mesh["tp"])
    eager = copy.deepcopy(ours)
    torchtitan_parallelize(eager, mesh, None, MixedPrecisionPolicy(param_dtype=torch.bfloat16))

    if args.checkpoint:
        for i, block in enumerate(ours.layers):
            ours.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    dhelix_compile.data_parallel(ours, mesh["dp"], mode="shard", param_dtype=torch.bfloat16)

    def loss(model: torch.nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return loss_fn(model, *mb, args.tp)

    helix_step = dhelix_compile.helix(ours, loss)
    optimizers = {
        "helix": torch.optim.AdamW(ours.parameters(), lr=1e-2),  # after data_parallel: its DTensors
        "eager": torch.optim.AdamW(eager.parameters(), lr=1e-2),
    }

    def eager_step(microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        losses = []
        for mb in microbatches:
            value = loss(eager, mb)
            value.backward()
            losses.append(value.detach())
        return losses

    runs = {"helix": (ours, helix_step), "eager": (eager, eager_step)}
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"DP={mesh['dp'].size()} x TP={args.tp}, bf16, {args.microbatches} micro-batches a step")
    worst = 0.0
    for step in range(args.steps):
        microbatches = [batch(mesh, args.microbatches * step + k) for k in range(args.microbatches)]
        means = {}
        for name, (model, run) in runs.items():
            optimizers[name].zero_grad()
            means[name] = statistics.fmean(float(value) for value in run(microbatches))
            sync_replicated_grads(model, mesh["tp"])
            optimizers[name].step()
        worst = max(worst, abs(means["helix"] - means["eager"]))
        if rank0:
            print(f"step {step + 1}: helix loss {means['helix']:.5f}, eager FSDP2 loss {means['eager']:.5f}")
    ok = worst <= 2e-2 * max(1.0, abs(means["eager"]))  # bf16 keeps 8 mantissa bits: 0.4% per rounding
    if rank0:
        print("losses agree with eager FSDP2" if ok else f"LOSSES DIFFER from eager FSDP2 by up to {worst:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
