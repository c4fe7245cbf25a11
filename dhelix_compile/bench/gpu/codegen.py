"""``codegen``: helix's merged graph through Inductor on the device, against the eager loop (the package docstring)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from cost_model.timing import median_run_s, synchronize

Report = dict[str, Any]


def _workload(
    name: str, mesh: Any, device: torch.device, microbatches: int
) -> tuple[Callable[[], Any], Any, list[Any]]:
    """(make, loss_fn, micro-batches on ``device``) of a bench workload, built on the CPU and moved
    before it is parallelized (buffers such as rotary tables move with it)."""
    from dhelix_compile.bench import workloads
    from dhelix_compile.models import hf_llama
    from dhelix_compile.models.llama import Transformer, lm_loss
    from dhelix_compile.models.tensor_parallel import parallelize_tp_sp

    gen = torch.Generator().manual_seed(0)
    if name in workloads.HF_LLAMA_SIZES:
        size = workloads.HF_LLAMA_SIZES[name]

        def make_hf() -> Any:
            model = hf_llama.build_hf_llama(size).to(device)
            return hf_llama.parallelize_hf_llama(model, mesh, sequence_parallel=False)

        data = [{k: v.to(device) for k, v in mb.items()} for mb in hf_llama.hf_llama_batches(size, microbatches, gen)]
        return make_hf, hf_llama.hf_llama_loss, data
    if name not in workloads.MODEL_SIZES:
        known = ", ".join([*workloads.HF_LLAMA_SIZES, *workloads.MODEL_SIZES])
        raise ValueError(
            f"the codegen check runs Hugging Face Llama (TP) or the reference transformer (TP+SP): {known}"
        )
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
    synchronize(device)
    first_s = time.perf_counter() - t0
    got = local_grads(helix_model)
    loss_diff = _worst(abs(float(g) - float(w)) for g, w in zip(helix_losses, eager_losses))
    grad_diff = _max_grads_diff(got, want)
    helix_step_s = median_run_s(lambda: step(mbs), 0, steps, device)
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
        "step_s": helix_step_s,
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
        synchronize(device)
        first = time.perf_counter() - t0
        grads = local_grads(model)
        report[variant] = {
            "first_step_s": first,
            "step_s": median_run_s(run, 0, steps, device),
            "losses": [float(v) for v in losses],
            "max_grad_rel_diff_vs_helix": _max_grads_diff(grads, got),
        }
    eager_step_s = median_run_s(loop(eager), 0, steps, device)
    report["eager"] = {
        "step_s": eager_step_s,
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
    from dhelix_compile.testing.multirank import run_on_ranks

    args = (name, str(device), microbatches, steps, str(dump_root), options)
    return run_on_ranks(codegen_on_rank, 2, *args, timeout_s=300)[0]
