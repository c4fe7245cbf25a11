"""graph_passes' only contacts with private torch APIs (``graph_passes._torch_compat``) and with the
backend's op (``dhelix::exchange``, by name): each works on this torch, and graph_passes loads no
``dhelix_compile`` module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cost_model.comm_nodes import resolve_group_rank, resolve_group_size
from cost_model.op_kinds import P2P_OP_NAMES
from cost_model.testing import aot_partitions, fake_world
from graph_passes._torch_compat import OpOverload, backward_handed_inputs, fake_mode_of
from graph_passes.decompose.emit import EXCHANGE_OP_NAME, exchange_op, registered_op

ROOT = Path(__file__).resolve().parents[1]


def test_fake_mode_of_finds_the_mode_of_a_traced_graphs_values() -> None:
    gm = make_fx(lambda x: x.relu(), tracing_mode="fake")(torch.randn(2, 3))
    vals = [n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    mode = fake_mode_of(vals)
    assert all(v.fake_mode is mode for v in vals)
    with mode:  # new values made under it live in the same mode
        assert torch.ops.aten.neg.default(vals[0]).fake_mode is mode


def test_fake_mode_of_real_or_no_tensors_is_a_fresh_mode_that_accepts_real_inputs() -> None:
    mode = fake_mode_of([torch.ones(2)])
    assert mode is not None and mode is not fake_mode_of([])
    with mode:
        out = torch.ones(2) + 1  # a real input is converted, not refused
    assert out.shape == (2,) and type(out).__name__ == "FakeTensor"


def test_op_overload_is_the_type_of_aten_ops() -> None:
    assert isinstance(torch.ops.aten.mm.default, OpOverload)
    assert not isinstance(torch.relu, OpOverload)


def test_the_exchange_op_is_found_by_its_registered_name() -> None:
    import dhelix_compile.ops.exchange  # registers dhelix::exchange  # noqa: F401

    assert EXCHANGE_OP_NAME in P2P_OP_NAMES  # the cost model classifies it as P2P
    assert exchange_op()._schema.name == EXCHANGE_OP_NAME
    with pytest.raises(RuntimeError, match="dhelix::no_such_op is not registered"):
        registered_op("dhelix::no_such_op")


def test_group_size_and_rank_resolve_by_name() -> None:
    with fake_world(4, rank=2) as group:
        assert (resolve_group_size(group.group_name), resolve_group_rank(group.group_name)) == (4, 2)
    assert resolve_group_rank("no such group") is None


def test_graph_passes_loads_no_backend_module() -> None:
    code = (
        "import sys, graph_passes, graph_passes.decompose;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dhelix_compile'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_backwards_handed_inputs_are_its_saved_activations_and_tangents_not_the_forwards_inputs() -> None:
    w, x = torch.randn(4, 4, requires_grad=True), torch.randn(3, 4)
    _, bwd = aot_partitions(lambda w, x: (x @ w).relu() @ w, w, x)
    placeholders = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    handed = backward_handed_inputs(bwd.graph)
    assert handed and any(n.name.startswith("tangents") for n in handed)
    held = [n for n in placeholders if n not in handed]
    assert held, "w is saved for the backward"
    # what is held is what the forward was given: the parameter (and the batch where saved)
    assert all(n.meta["val"].shape in (w.shape, x.shape) for n in held)
