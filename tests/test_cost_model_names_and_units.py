"""One way to name an op (``op_kinds.op_name``) and one way to write a unit (``cost_model.units``)."""

from __future__ import annotations

import operator
import random

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx

from cost_model.op_kinds import op_name
from cost_model.testing import fake_world, trace_aten
from cost_model.units import format_ms, format_pct, format_ratio

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def test_op_name_drops_namespace_and_overload() -> None:
    assert op_name(aten.add.Tensor) == op_name(aten.add.Scalar) == op_name(aten.add) == "add"
    assert op_name(aten.add.Tensor, qualified=True) == "aten.add.Tensor"
    assert op_name(c10d.all_gather_into_tensor.default) == "all_gather_into_tensor"
    assert op_name(c10d.wait_tensor.default) == "wait_tensor"
    assert op_name(operator.getitem) == "getitem"
    assert op_name("relu") == "relu"  # a call_method target


def test_op_name_of_nodes() -> None:
    with fake_world(2):
        gm = trace_aten(lambda x: funcol.all_reduce(x @ x, "sum", dist.group.WORLD).max(0), torch.randn(4, 4))
    names = [op_name(n) for n in gm.graph.nodes]
    assert names == ["placeholder", "mm", "all_reduce", "wait_tensor", "max", "getitem", "getitem", "output"]
    qualified = {op_name(n, qualified=True) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"aten.mm.default", "_c10d_functional.all_reduce.default"} <= qualified
    traced = torch.fx.symbolic_trace(lambda x: x.relu())
    assert [op_name(n) for n in traced.graph.nodes] == ["placeholder", "relu", "output"]


def test_op_name_agrees_with_the_old_spelling_for_call_functions() -> None:
    gm = trace_aten(lambda x, w: torch.nn.functional.gelu(x @ w).split(2), torch.randn(4, 4), torch.randn(4, 4))
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert op_name(node) == getattr(node.target, "__name__", str(node.target)).split(".")[0]
            assert op_name(node, qualified=True) == str(node.target)


def test_units_format_numbers_without_their_unit_name() -> None:
    assert format_ms(0.01234) == "12.3"
    assert format_ms(0.01234, digits=3) == "12.340"
    assert format_ms(None) == "-" and format_ms(None, none="n/a") == "n/a"
    assert format_pct(0.5834) == "58.3%" and format_pct(0.5834, 0) == "58%"
    assert format_pct(None) == "-" and format_pct(None, none="n/a") == "n/a"
    assert format_ratio(1.3051) == "1.31x" and format_ratio(None, none="not found") == "not found"


def test_units_write_what_the_inline_formats_wrote() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        x = rng.random() * 10 ** rng.randint(-6, 2)
        assert format_ms(x) == f"{1e3 * x:.1f}" == f"{x * 1e3:.1f}"
        assert format_pct(x) == f"{100 * x:.1f}%"
        assert format_pct(x, 0) == f"{x:.0%}"
        assert format_ratio(x) == f"{x:.2f}x"


def test_functional_ops_a_torch_lacks_are_left_out() -> None:
    """torch 2.11 has no functional point-to-point ops; the op tables list only what torch defines
    (naming one it lacks failed ``import cost_model`` there)."""
    from cost_model.op_kinds import P2P_OPS, present_c10d_ops

    assert present_c10d_ops("all_reduce", "no_such_collective") == (torch.ops._c10d_functional.all_reduce,)
    assert set(P2P_OPS) <= {getattr(torch.ops._c10d_functional, n, None) for n in ("isend", "irecv", "batch_p2p_ops")}


def test_the_packages_import_where_torch_has_no_functional_point_to_point_ops() -> None:
    """torch 2.11 (the oldest the project admits) has no ``_c10d_functional.isend``, ``irecv`` or
    ``batch_p2p_ops``; naming them at import time broke ``import dhelix_compile`` there (seen on a
    GPU machine's torch 2.11). A fresh interpreter with them hidden imports every package."""
    import subprocess
    import sys

    # torch 2.13's own modules name the ops at import: load them first, then hide the ops
    program = """
import torch
import torch.distributed._functional_collectives, torch.distributed.tensor, torch.distributed.fsdp
import torch.distributed.pipelining, torch._dynamo, torch._inductor.compile_fx, functorch.compile
ns = torch.ops._c10d_functional
hidden = ("isend", "irecv", "batch_p2p_ops")
for name in hidden:
    ns.__dict__.pop(name, None)
lookup = type(ns).__getattr__
def without_p2p(self, name):
    if self is ns and name in hidden:
        raise AttributeError(name)
    return lookup(self, name)
type(ns).__getattr__ = without_p2p
assert not any(hasattr(ns, name) for name in hidden)
import cost_model, graph_passes, dhelix_compile, dhelix_compile.compiler, dhelix_compile.helix_runtime.step
from cost_model.op_kinds import P2P_OPS
assert P2P_OPS == (), P2P_OPS
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
