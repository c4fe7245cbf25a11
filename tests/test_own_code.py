"""``dhelix_compile.own_code.with_own_code``: a method with its own Dynamo cache."""

from __future__ import annotations

import torch

from dhelix_compile.own_code import with_own_code


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
