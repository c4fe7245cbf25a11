"""How long the Strand Interleaving plan takes for a deep model: ``python -m dhelix_compile.bench.plan_time``.

Traces the TP+SP reference transformer with ``--layers`` layers on a fake 2-rank process group
(one process: collectives are traced, nothing is sent), runs one helix step with dumps on, and
prints the interleave pass's record for each merged graph: segment counts and ``plan_time_s``
(segmenting + the DP; the simulator's judgement of both orders is reported apart).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from cost_model.units import format_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import dhelix_compile
    from dhelix_compile.helix_runtime.schedule import merged_graph_dirs
    from dhelix_compile.models.llama import ModelConfig, Transformer, lm_loss
    from dhelix_compile.models.tensor_parallel import parallelize_tp_sp

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    config = ModelConfig(
        dim=args.dim, n_heads=4, n_layers=args.layers, ffn_hidden=2 * args.dim, vocab_size=128, max_seq_len=args.seq_len
    )
    model = parallelize_tp_sp(Transformer(config), dist.device_mesh.DeviceMesh("cpu", [0, 1]))
    gen = torch.Generator().manual_seed(0)
    mbs = [tuple(torch.randint(0, 128, (2, args.seq_len), generator=gen) for _ in range(2)) for _ in range(2)]
    with tempfile.TemporaryDirectory(prefix="dhelix_plan_") as dump:
        step = dhelix_compile.helix(model, lambda m, mb: lm_loss(m(mb[0]), mb[1]), codegen="eager", dump_dir=dump)
        start = time.perf_counter()
        step(mbs)
        total_s = time.perf_counter() - start
        summaries = {
            path.name: json.loads((path / "summary.json").read_text())
            for path in merged_graph_dirs(Path(dump) / "rank0")
        }
    print(f"TP+SP transformer, {args.layers} layers, fake 2-rank group, helix schedule: {step.schedule_kind}")
    for name, summary in summaries.items():
        record = summary["records"]["interleave"]
        print(
            f"merged graph {name}: {record['fwd_segments']:.0f} + {record['bwd_segments']:.0f} segments "
            f"(strands 0 and 1), {record['paired_segments']:.0f} paired"
        )
        makespans = {
            k[len("predicted_makespan_") : -2] or "chosen": v
            for k, v in record.items()
            if k.startswith("predicted_makespan_") and k.endswith("_s")
        }
        print(
            "  predicted makespan per candidate order (ms): "
            + ", ".join(f"{key} {format_ms(value, 2)}" for key, value in makespans.items())
        )
        print(
            f"  plan (segments + DP + refinement): {record['plan_time_s']:.3f} s; "
            f"interleave pass: {summary['pass_seconds']['interleave']:.3f} s"
        )
    print(f"whole first step incl. compile: {total_s:.1f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
