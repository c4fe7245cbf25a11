"""``dhelix_compile.own_code``: a method with its own Dynamo cache (``with_own_code``), a frame
Dynamo compiles around torch's own code (``in_own_frame``)."""

from __future__ import annotations

import pytest
import torch

from dhelix_compile.own_code import in_own_frame, with_own_code


def test_each_copy_of_a_method_compiles_for_itself() -> None:
    """The same module's forward, twice through one backend: Dynamo compiles each copy (its own
    cache); without the copies the second call reuses the first's entry."""
    compiled: list[str] = []

    def backend(gm: torch.fx.GraphModule, _: object) -> object:
        compiled.append(gm.code)
        return gm.forward

    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    plain = torch.compile(model.forward, backend=backend)
    plain(x), plain(x)
    assert len(compiled) == 1
    for name in ("first", "second"):
        own = with_own_code(model.forward, name)
        assert own.__code__ is not model.forward.__code__ and own.__code__.co_name.startswith(name)
        torch.testing.assert_close(torch.compile(own, backend=backend)(x), model(x))
    assert len(compiled) == 3


def test_a_module_of_torchs_own_class_compiles_in_place_from_its_own_frame() -> None:
    """``Module.compile(fullgraph=True)`` of an ``nn.Sequential`` finds no frame to compile (its
    ``_call_impl`` and forward are in Dynamo's skipfiles); with its forward called from
    ``in_own_frame``, one graph holds the whole module, equal to eager."""
    compiled: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, _: object) -> object:
        compiled.append(gm)
        return gm.forward

    def sequential() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    x = torch.randn(3, 4)
    torch._dynamo.reset()
    plain = sequential()
    plain.compile(backend=backend, fullgraph=True)
    with pytest.raises(RuntimeError, match="found no compiled frames"):
        plain(x)
    model = sequential()
    want = model(x)
    model.forward = in_own_frame(model.forward, "sequential_forward")
    model.compile(backend=backend, fullgraph=True)
    torch.testing.assert_close(model(x), want)
    (graph,) = compiled
    calls = [getattr(n.target, "__name__", str(n.target)) for n in graph.graph.nodes if n.op == "call_function"]
    assert calls == ["linear", "relu", "linear"]
    assert in_own_frame(model.forward, "f").__code__ is not in_own_frame(model.forward, "f").__code__
