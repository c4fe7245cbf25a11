"""Aliasing and liveness: which node owns which bytes, and the peak of live bytes in an order.

Contract
--------
* :func:`alias_source` says whether a node's output *shares storage* with one of its
  inputs: views and metadata ops, ``getitem`` of a multi-output node, ``wait_tensor``
  (its output is the collective's buffer), and ops whose schema returns an alias of an
  argument (``add_``, ``*_out`` variants, ``diagonal``...). Such nodes allocate nothing.
* :func:`storage_root` follows aliases back to the node that allocated the storage.
* :func:`live_bytes_profile` sweeps an order::

      live = bytes of graph inputs (placeholders, get_attr)     -- live throughout
      for node i in order:
          live += bytes allocated by node i                     -- output_bytes of a root, unless
                                                                   fused, or written in place
          peak = max(peak, live)                                -- inputs and outputs coexist
          free every root whose last use (over all its aliases, and through the fused
          nodes that read it) is node i

  A root used by the graph output, or by a node outside ``order``, lives to the end;
  a root nobody uses is freed right after it is allocated. Outputs at the positions the
  output node's ``meta[RELEASED_OUTPUTS]`` names are handed over as they are made (helix's
  backward adds each parameter gradient into ``.grad`` in the graph): the output does not
  keep them live. ``freeable_inputs`` are graph
  inputs the caller hands over (a backward's saved activations, whose argument list the
  generated code clears): they are live at the start and freed after their last use.
* Fusion (:func:`fused_pointwise`): a pointwise node whose only reader is pointwise too
  allocates nothing: Inductor computes it inside its reader's kernel. What it reads is read,
  in effect, by that reader, and lives until then.
* In place (:func:`in_place_input`): a pointwise node whose input of its output's size is read
  by nothing after it writes its output into that input's buffer, as Inductor's kernels do.
  Without these two, the MLP block's backward with per-peer steps was predicted at a peak 3 MiB
  above the buffers Inductor allocates, and a reordering that added 6 MiB (measured) at 1 MiB
  less than the original order.

Bytes per node come from a callback (``NodeCost.output_bytes`` in practice) so this module
knows nothing of estimators.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from cost_model.op_kinds import kind_of

aten = torch.ops.aten

#: ``meta`` key of a graph's output node: the positions (in ``output.args[0]``) of outputs the
#: graph hands over as they are made, which the output therefore does not keep live.
RELEASED_OUTPUTS = "dhelix_released_outputs"


def released_nodes(nodes: Sequence[torch.fx.Node]) -> frozenset[torch.fx.Node]:
    """The nodes of ``nodes``' graph that its output node returns only at the positions its
    ``meta[RELEASED_OUTPUTS]`` names: handed over as they are made, not kept live to the end."""
    if not nodes:
        return frozenset()
    output = nodes[0].graph.output_node()
    released = output.meta.get(RELEASED_OUTPUTS)
    values = output.args[0] if output.args else ()
    if not released or not isinstance(values, (list, tuple)):
        return frozenset()
    held = {n for i, value in enumerate(values) if i not in released for n in _nodes_of(value)}
    return frozenset(n for i in released if i < len(values) for n in _nodes_of(values[i]) if n not in held)


def _nodes_of(value: object) -> list[torch.fx.Node]:
    if isinstance(value, torch.fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in _nodes_of(item)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in _nodes_of(item)]
    return []


def _schema_alias_arg(node: torch.fx.Node) -> torch.fx.Node | None:
    """The argument a node's first return aliases according to its op schema, if any."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return None
    ret_alias = schema.returns[0].alias_info
    if ret_alias is None:
        return None
    ret_sets = set(ret_alias.before_set)
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not (set(info.before_set) & ret_sets):
            continue
        if arg.kwarg_only or i >= len(node.args):
            value = node.kwargs.get(arg.name)
        else:
            value = node.args[i]
        if isinstance(value, torch.fx.Node):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.fx.Node):
            return value[0]
    return None


def is_pointwise(node: torch.fx.Node) -> bool:
    """An aten op tagged pointwise that writes no input (``add``, ``exp``, ``sigmoid``...)."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and _pointwise_op(node.target)


@functools.cache
def _pointwise_op(target: torch._ops.OpOverload) -> bool:
    return torch.Tag.pointwise in target.tags and not target._schema.is_mutable


def fused_pointwise(order: Sequence[torch.fx.Node]) -> frozenset[torch.fx.Node]:
    """The nodes of ``order`` Inductor computes inside their reader: pointwise, read by exactly
    one node, itself pointwise and in ``order``. (A pointwise node of several readers counts as a
    buffer: Inductor keeps one where the computation is not cheap to repeat.)"""
    members = set(order)
    fused = set()
    for node in order:
        if len(node.users) == 1 and is_pointwise(node):
            (reader,) = node.users
            if reader in members and is_pointwise(reader):
                fused.add(node)
    return frozenset(fused)


def in_place_input(
    node: torch.fx.Node, dying: Sequence[torch.fx.Node], output_bytes: Callable[[torch.fx.Node], int]
) -> torch.fx.Node | None:
    """The buffer among ``dying`` (roots whose last reader is ``node``, directly or through the
    nodes fused into it) that Inductor writes ``node``'s output into: a pointwise kernel reuses
    an input of its output's size that nothing reads after it (the first such); None when
    ``node`` allocates."""
    if not is_pointwise(node):
        return None
    size = output_bytes(node)
    return next((r for r in dying if output_bytes(r) == size), None)


def alias_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input whose storage ``node``'s output shares, or None if it allocates its own."""
    if node.op != "call_function":
        return None
    kind = kind_of(node)
    if kind in ("view", "wait") or node.target is operator.getitem:
        inputs = node.all_input_nodes
        return inputs[0] if inputs else None
    return _schema_alias_arg(node)


def is_schema_view(node: torch.fx.Node) -> bool:
    """True for non-mutating ops whose output aliases an input (views not in VIEW_OPS)."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return False
    return not schema.returns[0].alias_info.is_write


def memoized_storage_root() -> Callable[[torch.fx.Node], torch.fx.Node]:
    """:func:`storage_root` with a memo of its own, for one sweep over an order."""
    return functools.cache(storage_root)


def storage_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node that allocated the storage ``node``'s output lives in."""
    seen = 0
    while True:
        src = alias_source(node)
        if src is None:
            return node
        node = src
        seen += 1
        if seen > 100_000:  # pragma: no cover - a cycle would be a malformed graph
            raise RuntimeError("alias chain does not terminate")


@dataclass(frozen=True)
class LiveProfile:
    """Result of :func:`live_bytes_profile`.

    Attributes:
        live_after_alloc_bytes: live bytes right after each node of the order allocated
            its output (the moment of that node's peak), aligned with the order.
        live_after_free_bytes: live bytes after each node, once what it used last is freed.
        input_bytes: bytes of graph inputs (placeholders/get_attr) live at the start,
            freeable ones included.
        peak_bytes: the maximum over the order (at least ``input_bytes``).
        held_input_bytes: ``input_bytes`` less the freeable inputs': the inputs the order never
            frees (its parameters, a forward's micro-batch).
    """

    live_after_alloc_bytes: tuple[int, ...]
    live_after_free_bytes: tuple[int, ...]
    input_bytes: int
    peak_bytes: int
    held_input_bytes: int

    @property
    def held_peak_bytes(self) -> int:
        """The peak above :attr:`held_input_bytes`: what running the order adds to the memory the
        step already holds."""
        return self.peak_bytes - self.held_input_bytes


def live_bytes_profile(
    order: Sequence[torch.fx.Node],
    output_bytes: Callable[[torch.fx.Node], int],
    *,
    freeable_inputs: Collection[torch.fx.Node] = (),
) -> LiveProfile:
    """Live bytes through ``order`` (see module docstring for the rules)."""
    position = {node: i for i, node in enumerate(order)}
    end = len(order)
    freeable = set(freeable_inputs)
    root_of = memoized_storage_root()

    # Graph inputs: placeholders/get_attr in the order, or read by it.
    inputs: dict[torch.fx.Node, None] = {}
    for node in order:
        if node.op in ("placeholder", "get_attr"):
            inputs[node] = None
        for inp in node.all_input_nodes:
            root = root_of(inp)
            if root.op in ("placeholder", "get_attr"):
                inputs[root] = None
    input_bytes = sum(output_bytes(n) for n in inputs)

    last_use: dict[torch.fx.Node, int] = {}
    released = released_nodes(order)
    for node in order:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        root = root_of(node)
        last_use[root] = max(last_use.get(root, -1), position[node])
        for user in node.users:
            if user.op == "output" and node in released:
                continue
            if user.op == "output" or user not in position:
                last_use[root] = end
            else:
                last_use[root] = max(last_use[root], position[user])
    for node in order:
        for inp in node.all_input_nodes:
            root = root_of(inp)
            if root in freeable:
                used_at = end if node.op == "output" else position[node]
                last_use[root] = max(last_use.get(root, -1), used_at)
    fused = fused_pointwise(order)
    for node in reversed(order):  # readers before what they read: a fused chain extends back
        if node in fused:
            for inp in node.all_input_nodes:
                root = root_of(inp)
                last_use[root] = max(last_use.get(root, -1), last_use.get(node, position[node]))
    frees_at: dict[int, list[torch.fx.Node]] = {}
    for root, pos in last_use.items():
        frees_at.setdefault(pos, []).append(root)

    live = input_bytes
    peak = input_bytes
    profile: list[int] = []
    after_free: list[int] = []

    def frees(root: torch.fx.Node) -> bool:
        return root in freeable or (
            root.op not in ("placeholder", "get_attr") and root in position and root not in fused
        )

    for i, node in enumerate(order):
        dying = [r for r in frees_at.get(i, ()) if frees(r)]
        if node.op not in ("placeholder", "get_attr", "output") and root_of(node) is node and node not in fused:
            taken = in_place_input(node, dying, output_bytes)
            if taken is None:
                live += output_bytes(node)
            else:
                dying.remove(taken)  # its buffer becomes the output's
        profile.append(live)
        peak = max(peak, live)
        live -= sum(output_bytes(r) for r in dying)
        after_free.append(live)
    held_input_bytes = input_bytes - sum(output_bytes(n) for n in freeable)
    return LiveProfile(tuple(profile), tuple(after_free), input_bytes, peak, held_input_bytes)


def held_peak_bytes(
    order: Sequence[torch.fx.Node],
    output_bytes: Callable[[torch.fx.Node], int],
    *,
    freeable_inputs: Collection[torch.fx.Node] = (),
) -> int:
    """:attr:`LiveProfile.held_peak_bytes` of ``order``: what running it adds to the memory the
    step already holds. Memory budgets scale this, not the peak: counting the parameters let an
    order that added 78% to the MoE layer's held bytes pass a 1.25 budget (its experts' 12 MiB
    per rank diluted the ratio)."""
    return live_bytes_profile(order, output_bytes, freeable_inputs=freeable_inputs).held_peak_bytes


def peak_memory_bytes(order: Sequence[torch.fx.Node], output_bytes: Callable[[torch.fx.Node], int]) -> int:
    """Peak of :func:`live_bytes_profile`."""
    return live_bytes_profile(order, output_bytes).peak_bytes
