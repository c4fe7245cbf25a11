"""What only a GPU shows: ``python -m dhelix_compile.bench.gpu [--out DIR]``.

Three checks, each reported on its own (one failing does not hide the others), in this order:

``contention``  the slowdown of bf16 matmuls (8192^3, and a Llama MLP shard's 4096x4096x7168) and
                of an fp32 add (memory-bound) while bytes move on a side stream: host-to-device
                and device-to-host copies (the copy engines) and a device-to-device copy (a kernel
                on the SMs, as NCCL's are). Each op is timed alone and beside the copies in
                alternation. One GPU has no peer to send to; this is the closest stand-in for
                NCCL's contention, which the cost model prices as ``Device.contention_factor``.
``ops``         one Llama decoder layer, as a rank of 2-way tensor parallelism holds it
                (``--hidden`` 4096, ``--heads`` 16 of 128, ``--kv-heads`` 4, ``--ffn`` 7168:
                Llama-3-8B's shard), forward and backward captured through AOTAutograd; every
                compute node's analytic estimate on the device's table entry against its
                measured time (CUDA events, the op alone on random inputs), and the layer
                compiled by Inductor against the sum of the estimates.
``codegen``     ``helix`` with its defaults (or ``--options``) on a bench workload (``--workloads``): Inductor's code
                for the merged graph (compiled, run, the Triton kernels counted) and its losses
                and gradients against the eager loop's; beside it, Inductor and
                ``torch.compile(backend="dhelix")`` loops, first step (compile) and step times.
                ``--group gloo`` (the default): 2 gloo ranks sharing the one device, real
                collectives, so the numerics mean something. ``--group fake``: the fake
                process group in this process, compute only; torch 2.11's fake collectives
                leave their outputs unwritten on CUDA, so its numerics are noise there.

Prints a table per check and writes ``gpu.json`` under ``--out``. Runs on the CPU too
(``--device cpu``, small sizes: how the tests keep it working), where ``contention`` is skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

Report = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_each_s(fn: Callable[[], object], device: torch.device, reps: int = 10, trials: int = 3) -> float:
    """Median over ``trials`` of the mean time of ``reps`` back-to-back calls (CUDA events on a GPU)."""
    fn()
    _sync(device)
    samples = []
    for _ in range(trials):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def time_steps_s(step: Callable[[], object], device: torch.device, steps: int) -> list[float]:
    """Wall time of each of ``steps`` calls, the device synchronized after each."""
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------------------------
# contention


def _window_s(main: Callable[[], object], reps: int, device: torch.device) -> float:
    """Mean time of ``main`` over ``reps`` back-to-back calls, timed with events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # the window starts with work queued behind it, not from an idle stream
    start.record()
    for _ in range(reps):
        main()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / reps


def alone_and_beside_s(
    main: Callable[[], object],
    side: Callable[[], object],
    side_s: float,
    reps: int,
    device: torch.device,
    trials: int = 7,
) -> tuple[float, float]:
    """Median time of ``main`` alone and while a side stream runs ``side`` throughout, the two
    measured in alternation (trial by trial), so that the clocks, which fall under a long
    full-power load, are the same for both."""
    stream = torch.cuda.Stream(device)
    main_s = _window_s(main, reps, device)
    queued = max(2, int(2 * main_s * reps / side_s) + 2)  # outlasts the timed window
    alone, beside = [], []
    for _ in range(trials):
        alone.append(_window_s(main, reps, device))
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(queued):
                side()
        beside.append(_window_s(main, reps, device))
        torch.cuda.synchronize(device)
    return statistics.median(alone), statistics.median(beside)


def check_contention(device: torch.device, gib: float = 1.0) -> Report:
    """Matmul and add slowdowns while copies move bytes beside them (module docstring)."""
    if device.type != "cuda":
        return {"skipped": "needs a CUDA device"}
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    # a Llama-3-8B MLP matmul of a 2-way tensor-parallel shard: 4096 tokens, 4096 -> 7168
    tokens, w = (
        torch.randn(4096, 4096, device=device, dtype=torch.bfloat16),
        torch.randn(4096, 7168, device=device, dtype=torch.bfloat16),
    )
    h = torch.empty(4096, 7168, device=device, dtype=torch.bfloat16)
    elems = int(gib * 2**30) // 4
    x, y = (torch.randn(elems // 4, device=device) for _ in range(2))
    z = torch.empty_like(x)
    host_src = torch.randn(elems, pin_memory=True)
    host_dst = torch.empty(elems, pin_memory=True)
    dev_buf = torch.empty(elems, device=device)
    dev_src = torch.randn(elems, device=device)

    mains: dict[str, tuple[Callable[[], object], float, str]] = {  # the op, its FLOPs or bytes, the unit
        "matmul bf16 8192^3": (lambda: torch.mm(a, b, out=c), 2 * n**3, "TFLOP/s"),
        "matmul bf16 4096x4096x7168": (lambda: torch.mm(tokens, w, out=h), 2 * 4096 * 4096 * 7168, "TFLOP/s"),
        f"add fp32 {gib / 4:g} GiB": (lambda: torch.add(x, y, out=z), 3 * x.numel() * 4, "TB/s"),
    }
    sides: dict[str, Callable[[], object]] = {
        "host->device (copy engine)": lambda: dev_buf.copy_(host_src, non_blocking=True),
        "device->host (copy engine)": lambda: host_dst.copy_(dev_buf, non_blocking=True),
        "device->device (SM kernel)": lambda: dev_buf.copy_(dev_src),
    }
    for main, _, _ in mains.values():
        main()
    side_alone = {name: time_each_s(fn, device, reps=3) for name, fn in sides.items()}
    rows: list[dict[str, Any]] = []
    for main_name, (main, work, unit) in mains.items():
        reps = 20 if "matmul" in main_name else 50
        for side_name, side in sides.items():
            alone, beside = alone_and_beside_s(main, side, side_alone[side_name], reps, device)
            rows.append(
                {
                    "main": main_name,
                    "side": side_name,
                    "alone_s": alone,
                    "beside_s": beside,
                    "slowdown": beside / alone,
                    "rate_alone": work / alone / 1e12,
                    "unit": unit,
                }
            )
    print("\n== contention: main-stream op time while a side stream moves bytes (alone and beside, alternated) ==")
    for name, t in side_alone.items():
        print(f"  side alone: {name:28s} {t * 1e3:8.3f} ms per {gib:g} GiB ({gib * 2**30 / t / 1e9:7.1f} GB/s)")
    for row in rows:
        print(
            f"  {row['main']:27s} beside {row['side']:28s} alone {row['alone_s'] * 1e3:7.3f} ms "
            f"({row['rate_alone']:6.1f} {row['unit']}), beside {row['beside_s'] * 1e3:7.3f} ms: x{row['slowdown']:.3f}"
        )
    return {"side_alone_s": side_alone, "rows": rows}


# ---------------------------------------------------------------------------------------------
# ops: the cost model against measured kernels


def _llama_layer(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Callable[[torch.Tensor], Any]:
    import transformers
    from transformers.models.llama import modeling_llama

    fields: dict[str, Any] = {
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "num_hidden_layers": 1,
        "max_position_embeddings": args.seq,
        "attention_dropout": 0.0,
        "attn_implementation": "sdpa",
    }
    config = transformers.LlamaConfig(**fields)
    torch.manual_seed(0)
    layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to(device=device, dtype=dtype)
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(device)
    positions = torch.arange(args.seq, device=device)[None]
    probe = torch.empty(1, args.seq, args.hidden, device=device, dtype=dtype)
    cos_sin = rotary(probe, positions)

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    return forward


def _capture_joint(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> dict[str, torch.fx.GraphModule]:
    """The forward and backward graphs AOTAutograd partitions ``fn`` into (nodes carry fake values)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs: dict[str, torch.fx.GraphModule] = {}

    def grab(name: str) -> Callable[..., Any]:
        def compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        return aot_module_simplified(gm, inputs, fw_compiler=grab("fwd"), bw_compiler=grab("bwd"))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend)
    compiled(x).float().sum().backward()
    return graphs


def _op_class(node: torch.fx.Node, flops: float) -> str:
    name = str(node.target)
    if "attention" in name:
        return "attention"
    if flops > 0 and any(k in name for k in ("mm", "matmul", "linear", "addmm", "bmm")):
        return "matmul"
    return "other"


def check_ops(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Report:
    """Every compute node's estimate against its measured time (module docstring)."""
    from cost_model import AnalyticEstimator
    from cost_model.profile.running import real_args, run_node
    from dhelix_compile.config import DHelixConfig
    from dhelix_compile.estimation import resolve_device

    layer = _llama_layer(args, device, dtype)
    x = torch.randn(1, args.seq, args.hidden, device=device, dtype=dtype, requires_grad=True)
    graphs = _capture_joint(layer, x)
    table = resolve_device(DHelixConfig(), [x])
    estimator = AnalyticEstimator(table, "nvlink4", world_size=2)
    rows = []
    for phase, gm in graphs.items():
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            cost = estimator.node_cost(node)
            if cost.kind != "compute" or cost.time_s <= 0:
                continue
            call_args, call_kwargs = real_args(node, {})
            try:
                measured = time_each_s(functools.partial(run_node, node, call_args, call_kwargs), device)
            except Exception as exc:  # noqa: BLE001 (an op that cannot run alone is reported, not fatal)
                rows.append({"phase": phase, "node": node.name, "target": str(node.target), "error": repr(exc)})
                continue
            rows.append(
                {
                    "phase": phase,
                    "node": node.name,
                    "target": str(node.target),
                    "class": _op_class(node, cost.flops),
                    "predicted_s": cost.time_s,
                    "measured_s": measured,
                    "flops": float(cost.flops),
                    "bytes": float(cost.bytes_accessed),
                }
            )
    timed = [r for r in rows if "error" not in r]
    summary: dict[str, dict[str, float]] = {}
    for cls in ("matmul", "attention", "other"):
        members = [r for r in timed if r["class"] == cls]
        if members:
            summary[cls] = {
                "nodes": len(members),
                "predicted_s": sum(r["predicted_s"] for r in members),
                "measured_s": sum(r["measured_s"] for r in members),
            }
    torch._dynamo.reset()
    inductor_layer = torch.compile(layer)

    def fwd_bwd() -> None:
        inductor_layer(x).float().sum().backward()

    compiled_s = time_each_s(fwd_bwd, device, reps=5)
    predicted_total = sum(r["predicted_s"] for r in timed)
    measured_total = sum(r["measured_s"] for r in timed)
    print(f"\n== ops: one Llama layer shard on {table.name} (seq {args.seq}, {dtype}) ==")
    print(f"  {'class':10s} {'nodes':>5s} {'predicted ms':>13s} {'measured ms':>12s} {'pred/meas':>9s}")
    for cls, s in summary.items():
        ratio = s["predicted_s"] / s["measured_s"]
        print(
            f"  {cls:10s} {s['nodes']:5.0f} {s['predicted_s'] * 1e3:13.3f} {s['measured_s'] * 1e3:12.3f} {ratio:9.2f}"
        )
    print(f"  every node alone: predicted {predicted_total * 1e3:.3f} ms, measured {measured_total * 1e3:.3f} ms")
    print(f"  the layer through Inductor (fwd+bwd): {compiled_s * 1e3:.3f} ms")
    worst = sorted(timed, key=lambda r: max(r["predicted_s"], r["measured_s"]), reverse=True)[:12]
    print("  largest nodes:")
    for r in worst:
        print(
            f"    {r['phase']} {r['target'][:48]:48s} pred {r['predicted_s'] * 1e3:8.3f} "
            f"meas {r['measured_s'] * 1e3:8.3f} ms ({r['predicted_s'] / r['measured_s']:.2f})"
        )
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"  {len(errors)} nodes could not run alone, e.g. {errors[0]['target']}: {errors[0]['error'][:120]}")
    return {
        "device_table": table.name,
        "rows": rows,
        "summary": summary,
        "predicted_total_s": predicted_total,
        "measured_total_s": measured_total,
        "inductor_layer_s": compiled_s,
    }


# ---------------------------------------------------------------------------------------------
# codegen: helix's merged graph through Inductor on the device


def _workload(
    name: str, mesh: Any, device: torch.device, microbatches: int
) -> tuple[Callable[[], Any], Any, list[Any]]:
    """(make, loss_fn, micro-batches on ``device``) of a bench workload, built on the CPU and moved
    before it is parallelized (buffers such as rotary tables move with it)."""
    from dhelix_compile.bench import workloads
    from dhelix_compile.testing import hf_llama
    from dhelix_compile.testing.llama import Transformer, lm_loss
    from dhelix_compile.testing.tensor_parallel import parallelize_tp_sp

    gen = torch.Generator().manual_seed(0)
    if name in workloads.HF_LLAMA_SIZES:
        size = workloads.HF_LLAMA_SIZES[name]

        def make_hf() -> Any:
            model = hf_llama.build_hf_llama(size).to(device)
            return hf_llama.parallelize_hf_llama(model, mesh, sequence_parallel=False)

        data = [{k: v.to(device) for k, v in mb.items()} for mb in hf_llama.hf_llama_batches(size, microbatches, gen)]
        return make_hf, hf_llama.hf_llama_loss, data
    config, seq, batch = workloads.model_config(name)

    def make_ref() -> Any:
        return parallelize_tp_sp(Transformer(config).to(device), mesh)

    def loss_ref(model: Any, mb: Any) -> torch.Tensor:
        return lm_loss(model(mb[0]), mb[1])

    tokens_and_targets: list[Any] = [
        tuple(torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device) for _ in range(2))
        for _ in range(microbatches)
    ]
    return make_ref, loss_ref, tokens_and_targets


def _max_rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _worst(values: Iterable[float]) -> float:
    """The largest of ``values``, NaN if any is (``max`` keeps or drops a NaN by its position)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _max_grads_diff(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> float:
    diffs = [0.0]
    for name, w in want.items():
        g = got.get(name)
        if g is not None and w is not None:
            diffs.append(_max_rel_diff(g, w))
    return _worst(diffs)


def check_codegen(
    name: str, device: torch.device, microbatches: int, steps: int, dump_root: Path, options: dict[str, Any]
) -> Report:
    """helix with defaults against the eager loop, beside Inductor and dhelix loops (module docstring),
    on the live default group of 2 ranks (every rank calls it)."""
    from torch._inductor.utils import run_and_get_code

    import dhelix_compile
    from dhelix_compile.helix_runtime.schedule import merged_graph_dirs
    from dhelix_compile.testing.helix_checks import local_grads

    mesh = torch.distributed.device_mesh.DeviceMesh(device.type, [0, 1])
    make, loss_fn, mbs = _workload(name, mesh, device, microbatches)

    def loop(forward: Callable[..., Any]) -> Callable[[], list[torch.Tensor]]:
        """One step of the gradient-accumulation loop through ``forward`` (a model or its compiled form)."""

        def run() -> list[torch.Tensor]:
            losses = []
            for mb in mbs:
                loss = loss_fn(forward, mb)
                loss.backward()
                losses.append(loss.detach())
            return losses

        return run

    torch._dynamo.reset()
    eager = make()
    eager_losses = loop(eager)()
    want = local_grads(eager)
    report: Report = {
        "workload": name,
        "microbatches": microbatches,
        "group": torch.distributed.get_backend(),
        "device": str(device),
        "options": options,
    }

    helix_model = make()
    dump = dump_root / f"{name}_helix"
    step = dhelix_compile.helix(helix_model, loss_fn, **{"dump_dir": str(dump), "fallback": "error", **options})
    t0 = time.perf_counter()
    helix_losses, codes = run_and_get_code(step, mbs)
    _sync(device)
    first_s = time.perf_counter() - t0
    got = local_grads(helix_model)
    loss_diff = _worst(abs(float(g) - float(w)) for g, w in zip(helix_losses, eager_losses))
    grad_diff = _max_grads_diff(got, want)
    helix_times = time_steps_s(lambda: step(mbs), device, steps)
    summaries = {p.name: json.loads((p / "summary.json").read_text()) for p in merged_graph_dirs(dump / "rank0")}
    # every graph's rewritten sites ("all_gather_matmul: per_peer": 4); merged graphs join graphs
    # their strands decomposed already
    decomposed: dict[str, int] = {}
    for path in sorted((dump / "rank0").glob("*/summary.json")):
        for code, n in json.loads(path.read_text())["stats"].get("decompose", {}).items():
            if ": per_peer" in code or ": chunked" in code:
                decomposed[f"{path.parent.name} {code}"] = n
    kernels = sum(code.count("@triton.jit") for code in codes)
    cpp = sum(code.count("cpp_fused") for code in codes)
    report["helix"] = {
        "first_step_s": first_s,
        "step_s": statistics.median(helix_times),
        "max_loss_abs_diff": loss_diff,
        "max_grad_rel_diff": grad_diff,
        "losses": [float(v) for v in helix_losses],
        "max_grad_rel_diff_vs_helix": 0.0,
        "generated_modules": len(codes),
        "triton_kernels": kernels,
        "cpp_kernels": cpp,
        "merged_graphs": {
            k: {
                "interleaved": v["stats"].get("interleave", {}).get("interleaved"),
                "predicted_makespan_s": v["records"].get("interleave", {}).get("predicted_makespan_s"),
            }
            for k, v in summaries.items()
        },
        "decomposed_sites": decomposed,
        "schedule": getattr(step, "schedule_kind", None),
    }

    for variant, compile_fn in (
        ("inductor", lambda m: torch.compile(m)),
        ("dhelix", lambda m: torch.compile(m, backend="dhelix", options=dict(options))),
    ):
        torch._dynamo.reset()
        model = make()
        compiled = compile_fn(model)
        run = loop(compiled)
        t0 = time.perf_counter()
        losses = run()
        _sync(device)
        first = time.perf_counter() - t0
        grads = local_grads(model)
        report[variant] = {
            "first_step_s": first,
            "step_s": statistics.median(time_steps_s(run, device, steps)),
            "losses": [float(v) for v in losses],
            "max_grad_rel_diff_vs_helix": _max_grads_diff(grads, got),
        }
    eager_times = time_steps_s(loop(eager), device, steps)
    report["eager"] = {
        "step_s": statistics.median(eager_times),
        "losses": [float(v) for v in eager_losses],
        "max_grad_rel_diff_vs_helix": grad_diff,
    }

    return report


def print_codegen(report: Report) -> None:
    """The table of one :func:`check_codegen` report."""
    h = report["helix"]
    print(
        f"\n== codegen: {report['workload']}, {report['microbatches']} micro-batches, "
        f"{report['group']} 2-rank group on {report['device']}, options {report['options'] or 'none'} =="
    )
    print(
        f"  helix: {h['generated_modules']} modules, {h['triton_kernels']} Triton kernels "
        f"({h['cpp_kernels']} C++); merged graphs {h['merged_graphs']}; decomposed sites {h['decomposed_sites']}"
    )
    print(
        f"  helix vs eager loop: losses max abs diff {h['max_loss_abs_diff']:.2e}, "
        f"grads max rel diff {h['max_grad_rel_diff']:.2e}"
    )
    print(
        f"  {'variant':10s} {'first step s':>12s} {'step ms':>9s} {'loss diff vs helix':>18s} {'grad diff vs helix':>18s}"
    )
    for variant in ("eager", "inductor", "dhelix", "helix"):
        r = report[variant]
        first = f"{r['first_step_s']:12.1f}" if "first_step_s" in r else f"{'':>12s}"
        loss_vs = _worst(abs(a - b) for a, b in zip(r["losses"], h["losses"]))
        print(
            f"  {variant:10s} {first} {r['step_s'] * 1e3:9.2f} {loss_vs:18.2e} {r['max_grad_rel_diff_vs_helix']:18.2e}"
        )


def codegen_on_rank(
    rank: int,
    world_size: int,
    name: str,
    device: str,
    microbatches: int,
    steps: int,
    dump_root: str,
    options: dict[str, Any],
) -> Report:
    """:func:`check_codegen` on one of the ranks ``run_on_ranks`` starts (every rank on ``device``)."""
    on = torch.device(device)
    if on.type == "cuda":
        torch.cuda.set_device(on)
    return check_codegen(name, on, microbatches, steps, Path(dump_root), options)


def codegen_on_gloo_ranks(
    name: str, device: torch.device, microbatches: int, steps: int, dump_root: Path, options: dict[str, Any]
) -> Report:
    """:func:`check_codegen` on 2 gloo ranks sharing ``device``: rank 0's report."""
    from dhelix_compile.bench import gpu  # by reference, not as __main__: the ranks unpickle it
    from dhelix_compile.testing.multirank import run_on_ranks

    args = (name, str(device), microbatches, steps, str(dump_root), options)
    return run_on_ranks(gpu.codegen_on_rank, 2, *args, timeout_s=300)[0]


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for gpu.json (default: a temporary one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checks", default="contention,ops,codegen")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=7168)
    parser.add_argument("--seq", type=int, default=4096)
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
        jobs.append(("ops", lambda: check_ops(args, device, getattr(torch, args.dtype))))
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
