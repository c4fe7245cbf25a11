"""``ops``: a Llama layer's compute nodes, the analytic estimate against each one's measured time (the package docstring)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from cost_model.timing import time_each_s

Report = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A Llama decoder layer as one rank of tensor parallelism holds it (its heads and MLP
    columns), and the tokens it runs. The defaults: Llama-3-8B's shard on 2 ranks, 4096 tokens."""

    hidden: int = 4096
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    ffn: int = 7168
    seq: int = 4096


def _llama_layer(shape: LayerShape, device: torch.device, dtype: torch.dtype) -> Callable[[torch.Tensor], Any]:
    import transformers
    from transformers.models.llama import modeling_llama

    fields: dict[str, Any] = {
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": 1,
        "max_position_embeddings": shape.seq,
        "attention_dropout": 0.0,
        "attn_implementation": "sdpa",
    }
    config = transformers.LlamaConfig(**fields)
    torch.manual_seed(0)
    layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=0).to(device=device, dtype=dtype)
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(device)
    positions = torch.arange(shape.seq, device=device)[None]
    probe = torch.empty(1, shape.seq, shape.hidden, device=device, dtype=dtype)
    cos_sin = rotary(probe, positions)

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out

    return forward


def _capture_joint(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> dict[str, torch.fx.GraphModule]:
    """The forward and backward graphs AOTAutograd partitions ``fn`` into (nodes carry fake values).

    Through Dynamo, which lifts the layer's parameters into graph inputs: ``cost_model.testing.
    aot_partitions`` traces a function of its arguments only, and a closure's parameters stay real."""
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


def check_ops(shape: LayerShape, device: torch.device, dtype: torch.dtype) -> Report:
    """Every compute node's estimate against its measured time (module docstring)."""
    from cost_model import AnalyticEstimator
    from cost_model.profile.running import real_args, run_node
    from dhelix_compile.config import DHelixConfig
    from dhelix_compile.estimation import resolve_device

    layer = _llama_layer(shape, device, dtype)
    x = torch.randn(1, shape.seq, shape.hidden, device=device, dtype=dtype, requires_grad=True)
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
    print(f"\n== ops: one Llama layer shard on {table.name} (seq {shape.seq}, {dtype}) ==")
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
