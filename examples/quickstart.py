"""Quick start: train a tiny GPT a few steps with backend="dhelix", beside eager PyTorch.

    python examples/quickstart.py                 # Inductor codegen, dumps in ./dhelix_dump
    python examples/quickstart.py --codegen eager --steps 3

Prints each step's loss for eager and for dhelix, and where the graph dumps went.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from dhelix_compile.models import GPT, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--codegen", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--dump-dir", default="dhelix_dump")
    args = parser.parse_args()

    torch.manual_seed(0)
    eager_model = GPT(vocab=64, dim=32, n_heads=4, n_layers=2)
    dhelix_model = copy.deepcopy(eager_model)
    # No import of dhelix_compile is needed: "dhelix" is found through its entry point.
    compiled = torch.compile(
        dhelix_model,
        backend="dhelix",
        options={"dump_dir": args.dump_dir, "codegen": args.codegen, "fallback": "error"},
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_model, dhelix_model)]

    print(f"{'step':>4}  {'eager loss':>11}  {'dhelix loss':>11}  {'|diff|':>9}  {'dhelix s':>8}")
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        losses = []
        for model, opt, _label in ((eager_model, optimizers[0], "eager"), (compiled, optimizers[1], "dhelix")):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            opt.step()
            losses.append((loss.item(), time.perf_counter() - start))
        (eager_loss, _), (dhelix_loss, dhelix_s) = losses
        print(
            f"{step:>4}  {eager_loss:>11.6f}  {dhelix_loss:>11.6f}  {abs(eager_loss - dhelix_loss):>9.2e}  {dhelix_s:>8.3f}"
        )

    dump = Path(args.dump_dir).resolve()
    graphs = sorted(p.name for p in dump.iterdir() if p.is_dir()) if dump.exists() else []
    print(f"\ngraph dumps ({args.codegen} codegen) in {dump}: {', '.join(graphs)}")
    print("each holds per-pass graphs, a timeline (timeline.svg) and index.html; summary table and compile time:")
    print(f"    python -m dhelix_compile report {args.dump_dir}")
    print("(step 0 of dhelix includes compilation)")


if __name__ == "__main__":
    main()
