"""graph_passes.node_args: an argument read as its schema's type, TypeError otherwise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx

from graph_passes.node_args import as_int, as_ints, as_node, as_nodes

aten = torch.ops.aten


def _cat_graph() -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    cat = graph.call_function(aten.cat.default, ([a, b], 1))
    return a, b, cat


def test_reads_each_argument_as_its_schema_type() -> None:
    a, b, cat = _cat_graph()
    assert as_nodes(cat.args[0]) == [a, b]
    assert as_node(a) is a
    assert as_int(cat.args[1]) == 1
    assert as_ints([1, 0]) == [1, 0] and as_ints((2, 3)) == [2, 3]


@pytest.mark.parametrize(
    ("read", "value"),
    [(as_node, 1), (as_node, None), (as_int, "x"), (as_int, None), (as_ints, 3), (as_ints, [1, "x"]), (as_nodes, 1)],
)
def test_another_type_is_a_type_error(read: Callable[[Any], object], value: Any) -> None:
    with pytest.raises(TypeError, match="expected"):
        read(value)
