"""Train a tensor-parallel Llama with dhelix's ``helix``, beside eager PyTorch and Inductor.

    torchrun --nproc-per-node 2 examples/train_llama.py            # TP + sequence parallelism
    torchrun --nproc-per-node 2 examples/train_llama.py --no-sp    # TP only
    torchrun --nproc-per-node 2 examples/train_llama.py --variants inductor   # Inductor alone

gloo on CPU, NCCL with one GPU per rank. The model is a Hugging Face ``LlamaForCausalLM`` built
from a config (random weights, nothing downloaded) when ``transformers`` is installed
(``pip install -e '.[hf]'``), else the project's Llama-style reference transformer. It is
parallelized with PyTorch's own ``parallelize_module`` plan, then trained three ways from the
same weights on the same data:

* ``helix``: ``dhelix_compile.helix(model, loss_fn)`` with its default options: micro-batch
  i+1's forward and micro-batch i's backward run as one graph, each one's communication under
  the other's compute;
* eager: the plain gradient-accumulation loop;
* Inductor: the same loop over ``torch.compile(model)``.

Rank 0 prints each step's mean loss and time per variant; helix's losses and eager's agree to
float rounding (the script exits non-zero when they do not). The first step of a compiled model
includes its compilation and is reported apart. ``--variants`` trains some of them only: run
``--variants helix`` and ``--variants inductor`` apart to compare the two first steps cold
(in one process the second compiled reuses kernels of the first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import dhelix_compile


def build(size: str, sequence_parallel: bool, mesh: Any) -> tuple[Callable[[], torch.nn.Module], Callable, Callable]:
    """``(make_model, loss_fn, make_batches)``: the Hugging Face Llama, else the reference model."""
    try:
        import transformers  # noqa: F401  # the optional extra: only its presence is checked here
    except ImportError:
        return _reference(size, sequence_parallel, mesh)
    from dhelix_compile.models import build_hf_llama, hf_llama_batches, hf_llama_loss, parallelize_hf_llama

    def make() -> torch.nn.Module:
        return parallelize_hf_llama(build_hf_llama(size), mesh, sequence_parallel=sequence_parallel)

    def batches(n: int, gen: torch.Generator) -> list[Any]:
        return hf_llama_batches(size, n, gen)

    print0(f"model: Hugging Face LlamaForCausalLM ({size}), random weights")
    return make, hf_llama_loss, batches


def _reference(size: str, sequence_parallel: bool, mesh: Any) -> tuple[Callable, Callable, Callable]:
    from dhelix_compile.models import ModelConfig, Transformer, lm_loss, parallelize_tp, parallelize_tp_sp

    dim, layers, seq, batch = {"tiny": (64, 2, 32, 2), "bench": (512, 2, 256, 2)}[size]
    config = ModelConfig(dim=dim, n_heads=8, n_layers=layers, ffn_hidden=3 * dim, vocab_size=2048, max_seq_len=seq)
    parallelize = parallelize_tp_sp if sequence_parallel else parallelize_tp

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return parallelize(Transformer(config), mesh)

    def loss_fn(model: torch.nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return lm_loss(model(mb[0]), mb[1])

    def batches(n: int, gen: torch.Generator) -> list[Any]:
        return [tuple(torch.randint(0, config.vocab_size, (batch, seq), generator=gen) for _ in "xy") for _ in range(n)]

    print0(f"model: the reference Llama-style transformer ({size}); pip install -e '.[hf]' for Hugging Face's")
    return make, loss_fn, batches


#: What the script can train, in the order each step runs them.
VARIANTS: tuple[str, ...] = ("helix", "eager", "inductor")


def variants(text: str) -> tuple[str, ...]:
    """``--variants``: names of ``VARIANTS``, kept in that order; at least one."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = names - set(VARIANTS)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(VARIANTS)}")
    return tuple(n for n in VARIANTS if n in names)


def print0(*args: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "bench"], default="tiny")
    parser.add_argument("--no-sp", dest="sp", action="store_false", help="TP without sequence parallelism")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument(
        "--variants",
        type=variants,
        default=VARIANTS,
        help=f"comma-separated, of {','.join(VARIANTS)} (default: all; losses are checked where helix and eager both run)",
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    try:
        return train(args, cuda)
    finally:
        dist.destroy_process_group()  # also when a rank raises: no hung peers, no leaked sockets


def train(args: argparse.Namespace, cuda: bool) -> int:
    torch.set_num_threads(1)  # ranks share this machine's cores
    device = "cuda" if cuda else "cpu"
    torch.set_default_device(device)
    mesh = dist.device_mesh.init_device_mesh(device, (dist.get_world_size(),))
    make, loss_fn, batches = build(args.size, args.sp, mesh)
    print0(f"{'TP + sequence parallel' if args.sp else 'TP'} over {dist.get_world_size()} ranks ({device})")

    names: tuple[str, ...] = args.variants
    models = {name: make() for name in names}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    # the defaults: no tuning options
    helix_step = dhelix_compile.helix(models["helix"], loss_fn) if "helix" in models else None
    compiled = torch.compile(models["inductor"]) if "inductor" in models else None

    def step(name: str, microbatches: list[Any]) -> list[float]:
        optimizers[name].zero_grad(set_to_none=True)
        if helix_step is not None and name == "helix":
            losses = helix_step(microbatches)
        else:
            model = compiled if name == "inductor" else models[name]
            losses = []
            for mb in microbatches:
                loss = loss_fn(model, mb)
                loss.backward()
                losses.append(loss.detach())
        optimizers[name].step()
        return torch.stack(losses).tolist()  # one loss per micro-batch (waits for the device)

    compared = "helix" in names and "eager" in names
    gen = torch.Generator(device=device).manual_seed(0)  # the same data on every rank (TP shares it)
    times: dict[str, list[float]] = {name: [] for name in names}
    worst = 0.0
    losses: dict[str, float] = {}
    print0(
        "| step | "
        + " | ".join(f"{n} loss" for n in names)
        + (" | max abs diff" if compared else "")
        + " | "
        + " | ".join(f"{n} (ms)" for n in names)
        + " |"
    )
    print0("|---:|" + "---:|" * (2 * len(names) + compared))
    for i in range(args.steps):
        microbatches = batches(args.microbatches, gen)
        per_microbatch = {}
        for name in names:
            dist.barrier()
            clock = dhelix_compile.compile_seconds()
            start = time.perf_counter()
            per_microbatch[name] = step(name, microbatches)
            times[name].append(time.perf_counter() - start)
            if i == 0 and name == "helix":
                helix_phases = {k: v - clock[k] for k, v in dhelix_compile.compile_seconds().items()}
        losses = {name: statistics.fmean(values) for name, values in per_microbatch.items()}
        cells = [f"{losses[n]:.6f}" for n in names]
        if compared:  # the largest difference of one micro-batch's loss
            diff = max(abs(h - e) for h, e in zip(per_microbatch["helix"], per_microbatch["eager"]))
            worst = max(worst, diff)
            cells.append(f"{diff:.1e}")
        cells += [f"{1e3 * times[n][-1]:.1f}" for n in names]
        note = " (compiles)" if i == 0 else ""
        print0(f"| {i + 1}{note} | " + " | ".join(cells) + " |")
        if i == 0:
            compile_s = ", ".join(f"{n} {times[n][0]:.1f} s" for n in names)
            print0(f"first step, compilation included: {compile_s}")
            if "helix" in names and "inductor" in names:  # helix compiled first in these processes
                print0("(Inductor's first step reuses kernels helix compiled here: --variants inductor runs it alone)")
            if "helix" in names:
                phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in helix_phases.items())
                rest = times["helix"][0] - sum(helix_phases.values())
                print0(f"helix's first step: {phases}; the rest (Dynamo's trace, the step) {rest:.1f} s")
    if args.steps > 1:
        medians = {n: statistics.median(t[1:]) for n, t in times.items()}
        summary = ", ".join(f"{n} {1e3 * m:.1f} ms" for n, m in medians.items())
        print0(f"median step after the first: {summary}")
        if "helix" in medians and "inductor" in medians:
            print0(f"helix vs Inductor: {medians['inductor'] / medians['helix']:.2f}x")
    if not compared:
        return 0
    tolerance = 1e-3  # AdamW amplifies float-rounding differences a little each step
    ok = worst <= tolerance * max(1.0, abs(losses["helix"]))
    print0("losses agree with eager" if ok else f"LOSSES DIFFER from eager by up to {worst:.2e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
