"""torchtitan's training pattern with dhelix as the compile backend: one block compiled at a time.

    torchrun --nproc-per-node 4 examples/torchtitan_pattern.py              # DP=2 x TP=2, gloo on CPU
    torchrun --nproc-per-node 4 examples/torchtitan_pattern.py --backend inductor

torchtitan's ``parallelize_llama`` applies, in this order: tensor parallelism, activation
checkpointing of every block, ``block.compile(backend=compile.backend, fullgraph=True)`` for
every block, and FSDP2 ``fully_shard`` over the data-parallel mesh dim (every block, then the
root). This script does the same on a small Llama-style model defined here, with
``--backend dhelix`` by default, and trains an eager copy beside it on the same data: rank 0
prints both losses per step and the script exits non-zero when they differ.

Tensor parallelism is written with functional collectives (Megatron TP + sequence parallelism:
``all_gather_single`` before the column-parallel matmuls, ``reduce_scatter_single`` after the
row-parallel one), which torch compiles in checkpointed blocks. PyTorch's DTensor plans
(``parallelize_module``) in blocks compiled one at a time fail inside torch's AOTAutograd with
Inductor as with dhelix (docs/backend.md says how).

dhelix reorders each block's graph on its own (one strand: its collectives issued early and
waited late); ``dhelix_compile.helix``, which pairs one micro-batch's forward with another's
backward, needs the whole step in one graph (examples/whole_stack.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Block(nn.Module):
    """Pre-norm causal attention and SwiGLU MLP on this rank's heads and hidden columns; the
    residual stream ``[S/tp, B, D]`` holds this rank's sequence shard."""

    def __init__(self, dim: int, heads: int, hidden: int, tp: int, group: str) -> None:
        super().__init__()
        self.group, self.head_dim = group, dim // heads
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim // tp, bias=False)  # column-parallel: this rank's heads
        self.wo = nn.Linear(dim // tp, dim, bias=False)  # row-parallel
        self.w13 = nn.Linear(dim, 2 * hidden // tp, bias=False)  # column-parallel
        self.w2 = nn.Linear(hidden // tp, dim, bias=False)  # row-parallel

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_gather_single(x, 0, self.group)  # [S/tp, B, D] -> [S, B, D]

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.reduce_scatter_single(x, "sum", 0, self.group)  # partial sums -> [S/tp, B, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gather(self.attention_norm(x))
        seq, batch, _ = h.shape
        q, k, v = (t.view(seq, batch, -1, self.head_dim).permute(1, 2, 0, 3) for t in self.wqkv(h).chunk(3, -1))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)
        x = x + self.scatter(self.wo(attention.reshape(seq, batch, -1)))
        gate, up = self.w13(self.gather(self.ffn_norm(x))).chunk(2, -1)
        return x + self.scatter(self.w2(F.silu(gate) * up))


class Transformer(nn.Module):
    """Token embedding, blocks, norm and output head; the embedding, norms and head are
    replicated over the TP ranks, so their gradients are partial (``sync_replicated_grads``)."""

    def __init__(self, tp_mesh: DeviceMesh, dim: int = 64, heads: int = 4, layers: int = 2, vocab: int = 128) -> None:
        super().__init__()
        tp, group = tp_mesh.size(), tp_mesh.get_group().group_name
        torch.manual_seed(0)  # replicated weights: the same on every rank
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        torch.manual_seed(1 + tp_mesh.get_local_rank())  # TP shards: one per TP position
        self.layers = nn.ModuleList(Block(dim, heads, 3 * dim, tp, group) for _ in range(layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens).transpose(0, 1).contiguous()  # [S/tp, B, D]
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).transpose(0, 1)  # [B, S/tp, vocab]


SHARDED = ("wqkv", "wo", "w13", "w2")  # the TP-sharded Linears; every other parameter is replicated


def sync_replicated_grads(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Sum the TP-replicated parameters' gradients over the TP ranks (each saw its sequence shard)."""
    for name, param in model.named_parameters():
        if param.grad is not None and name.rsplit(".", 2)[-2] not in SHARDED:
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            dist.all_reduce(grad, group=tp_mesh.get_group())


def torchtitan_parallelize(model: Transformer, mesh: DeviceMesh, backend: str | None, mp: MixedPrecisionPolicy) -> None:
    """torchtitan's order: (TP is in the model) AC, per-block compile, FSDP2 blocks then root."""
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if backend is not None:
        for block in model.layers:
            block.compile(backend=backend, fullgraph=True)  # torchtitan's apply_compile
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)


def batch(mesh: DeviceMesh, step: int, vocab: int = 128, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's tokens and targets for ``step``, cut to this TP rank's sequence shard."""
    gen = torch.Generator().manual_seed(1000 * step + mesh["dp"].get_local_rank())
    tokens, targets = (torch.randint(0, vocab, (2, seq), generator=gen) for _ in "xy")
    tp, position = mesh["tp"].size(), mesh["tp"].get_local_rank()
    return tokens.chunk(tp, 1)[position].contiguous(), targets.chunk(tp, 1)[position].contiguous()


def loss_fn(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, tp: int) -> torch.Tensor:
    logits = model(tokens).float()  # this rank's shard; the TP ranks' losses sum to the sequence's mean
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / (targets.numel() * tp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--backend", default="dhelix", help="torch.compile backend of every block (torchtitan's compile.backend)"
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; the rest of the ranks is DP")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    try:
        return train(args)
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # ranks share this machine's cores
    mesh = init_device_mesh("cpu", (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    mp = MixedPrecisionPolicy()  # float32; torchtitan's default is param_dtype=torch.bfloat16
    models = {"compiled": Transformer(mesh["tp"])}
    models["eager"] = copy.deepcopy(models["compiled"])
    torchtitan_parallelize(models["compiled"], mesh, args.backend, mp)
    torchtitan_parallelize(models["eager"], mesh, None, mp)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"DP={mesh['dp'].size()} x TP={args.tp}, per-block torch.compile(backend={args.backend!r}), FSDP2")
    worst = 0.0
    for step in range(args.steps):
        losses = {}
        for name, model in models.items():
            optimizers[name].zero_grad()
            loss = loss_fn(model, *batch(mesh, step), args.tp)
            loss.backward()
            sync_replicated_grads(model, mesh["tp"])
            optimizers[name].step()
            losses[name] = loss.item()
        worst = max(worst, abs(losses["compiled"] - losses["eager"]))
        if rank0:
            print(f"step {step + 1}: {args.backend} loss {losses['compiled']:.6f}, eager loss {losses['eager']:.6f}")
    ok = worst <= 1e-4  # float32 rounding: the compiled blocks sum in another order
    if rank0:
        print("losses agree with eager" if ok else f"LOSSES DIFFER from eager by up to {worst:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
