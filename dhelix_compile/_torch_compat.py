"""Every private torch API the backend touches, in one place per layer.

Private APIs change between torch releases (we support ``torch>=2.11,<2.14``). Anything from
``torch._inductor``, ``torch._functorch``, ``torch._dynamo``, ``torch._guards`` or ``torch._C``
that ``dhelix_compile`` uses is imported here and nowhere else, so an upgrade breaks this module
and its test (``tests/test_torch_compat.py``), not the backend. The layers below keep their own,
so that they import nothing of the backend: ``graph_passes/_torch_compat.py`` (the fake mode of a
graph, ``OpOverload``) and ``cost_model.comm_nodes.resolve_process_group`` (process groups by
name). ``dhelix_compile.testing`` uses Dynamo's debug backends and counters in its test helpers.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch
import torch.fx
from torch._functorch import config as _functorch_config
from torch._functorch.aot_autograd import make_boxed_func as _make_boxed_func
from torch._inductor import config as _inductor_config
from torch._inductor import ir as _inductor_ir
from torch._inductor.choices import InductorChoices as _InductorChoices
from torch._inductor.compile_fx import compile_fx as _compile_fx
from torch._inductor.compile_fx import compile_fx_inner as _compile_fx_inner
from torch._inductor.custom_graph_pass import CustomGraphPass as _CustomGraphPass
from torch._inductor.graph import GraphLowering as _GraphLowering
from torch._inductor.virtualized import V as _V

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

#: An inner compiler: ``(gm, example_inputs, **inductor_kwargs) -> boxed callable``.
InnerCompile = Callable[..., Any]

_F = TypeVar("_F", bound=Callable[..., Any])


def compile_with_aot_autograd(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    inner_compile: InnerCompile,
    *,
    inductor_config_patches: dict[str, Any] | None = None,
    joint_pass: Callable[[torch.fx.Graph], object] | None = None,
) -> Callable[..., Any]:
    """Capture ``gm`` exactly as Inductor does and hand each partition to ``inner_compile``.

    ``compile_fx`` runs AOTAutograd on the Dynamo graph: it traces the joint forward-backward
    graph with Inductor's decompositions, runs Inductor's joint-graph passes, partitions it
    with the min-cut rematerialization partitioner, and calls ``inner_compile`` once for the
    forward and once (lazily, at the first backward) for the backward graph — or once for an
    inference graph when no input requires grad. Using Inductor's own capture keeps dhelix's
    graphs identical to plain Inductor's up to our passes, which is what we compare against.

    ``inner_compile`` receives ``compile_fx_inner``'s keyword arguments (``is_backward``,
    ``is_inference``, ``static_input_idxs``, ``cudagraphs``, ``graph_id``,
    ``boxed_forward_device_index``) and must return a boxed callable (list of args in).

    AOTAutograd's cache is off for these compiles: its key covers the Dynamo graph and torch's
    configs but not ``inner_compile``, so a hit would return code compiled without (or with
    other) dhelix passes. Inductor's FX-graph cache stays on: its key is the graph we pass it.

    ``joint_pass(graph)``: run on the joint graph before it is partitioned (Inductor's
    ``joint_custom_pre_pass``, after any the user set), e.g. to mark nodes for recompute.
    :func:`tie_opaque_tangents` runs on it first, always.
    """
    patches = dict(inductor_config_patches or {})
    passes = (tie_opaque_tangents,) if joint_pass is None else (tie_opaque_tangents, joint_pass)
    patches["joint_custom_pre_pass"] = _JointPass(passes, _inductor_config.joint_custom_pre_pass)
    with _functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
        compiled = _compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
    # compile_fx returns source paths or weights only when compiling ahead of time (AOTInductor)
    assert callable(compiled), f"compile_fx returned {type(compiled).__name__}, not a callable"
    return compiled


class _JointPass(_CustomGraphPass):
    """Joint-graph passes in Inductor's custom-pass form (its ``uuid`` keys Inductor's caches):
    ``before`` (the user's), then ``fns`` in order."""

    def __init__(self, fns: Sequence[Callable[[torch.fx.Graph], object]], before: Any) -> None:
        self.fns, self.before = tuple(fns), before

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.before is not None:
            self.before(graph)
        for fn in self.fns:
            fn(graph)

    def uuid(self) -> Any:
        before = self.before.uuid() if isinstance(self.before, _CustomGraphPass) else self.before
        return (tuple(_pass_key(fn) for fn in self.fns), before)


def _pass_key(fn: Callable[[torch.fx.Graph], object]) -> Any:
    """What names a joint pass in Inductor's cache key: its own ``uuid()`` (a list of passes), or
    the function's qualified name."""
    uuid = getattr(fn, "uuid", None)
    return uuid() if callable(uuid) else f"{fn.__module__}.{fn.__qualname__}"


def tie_opaque_tangents(graph: torch.fx.Graph) -> int:
    """Give every use of a tangent placeholder holding an opaque object (a ``DeviceMesh``) the
    primal placeholder holding an equal one; returns how many tangents it tied.

    torch 2.13 traces a ``DeviceMesh`` into the joint graph as an opaque object: the forward
    output of a DTensor takes its mesh from whichever placeholder holds that very mesh object,
    and where the tangent's is the object and the primal's an equal copy, the forward returns the
    tangent (``return [tanh, tangents_2, ...]``) and the partitioner fails ("Node tangents_2 was
    invalid, but is output"). Which object each side holds depends on the DeviceMesh objects the
    process made before: on 4 gloo ranks, a two-stage pipeline whose stage 0 hands over a
    ``Shard(2)`` DTensor compiled (plain Inductor too) after one whose stage modules were only
    built, and not after none (``tests/test_helix_pipeline.py``). An opaque object carries no
    gradient, and the two are equal: the forward and backward then read the primal's.
    """
    from torch._library.fake_class_registry import FakeScriptObject

    def opaque(node: torch.fx.Node) -> Any:
        value = node.meta.get("val")
        return object.__getattribute__(value, "real_obj") if isinstance(value, FakeScriptObject) else None

    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    tangents = [node for node in placeholders if "tangents" in str(node.target)]  # AOTAutograd's names
    primals = [(node, opaque(node)) for node in placeholders if node not in tangents and opaque(node) is not None]
    tied = 0
    for tangent in tangents:
        value = opaque(tangent)
        if value is None:
            continue
        equal = next((node for node, held in primals if type(held) is type(value) and held == value), None)
        if equal is not None and tangent.users:
            tangent.replace_all_uses_with(equal)
            tied += 1
    return tied


def annotated(annotation: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """``torch.fx.traceback.annotate``: the nodes traced inside carry ``annotation`` in
    ``meta["custom"]``, through Dynamo and AOTAutograd (into the joint graph)."""
    return torch.fx.traceback.annotate(annotation)


def into_one_fake_mode(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """Example inputs of ``gm`` as fake tensors of one fresh fake mode, and every node's
    ``meta["val"]`` propagated again in it.

    A graph merged from partitions of two Dynamo compiles (a pipeline's F of one stage and B of
    another) holds values of two fake modes; the passes' fake ops and Inductor need one. Shapes
    are static (helix compiles with ``dynamic=False``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode()

    def fake(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        with mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)

    inputs = [fake(x) for x in example_inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    return inputs


def mark_boxed(fn: _F) -> _F:
    """Mark ``fn`` as boxed (takes the argument list), as ``make_boxed_func`` does, without wrapping it."""
    fn._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's private marker, in no torch type
    return fn


#: Which part of a graph an FX node belongs to (a merged graph's strand), or None: no part.
FusionGroup = Callable[[torch.fx.Node], object]


def inductor_compile_partition(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    fusion_group: FusionGroup | None = None,
    **inductor_kwargs: Any,
) -> Callable[..., Any]:
    """Inductor code generation for one partition (``compile_fx_inner``). With ``fusion_group``
    no fused kernel joins nodes of two groups (:class:`_DhelixFusionChoices`)."""
    choices = _V.set_choices_handler(_DhelixFusionChoices(True, fusion_group)) if fusion_group else None
    wait_for_vec_isa_check()
    with tracing_for_graph_cache(example_inputs), stable_mesh_cache_keys(), choices or contextlib.nullcontext():
        return _compile_fx_inner(gm, example_inputs, **inductor_kwargs)


@contextlib.contextmanager
def stable_mesh_cache_keys() -> Iterator[None]:
    """Inductor's FX graph cache (and AOTAutograd's) keys a graph's ``DeviceMesh`` inputs (a
    DTensor graph's) by what it describes -- device type, ranks, shape, dimension names and
    process-group names -- instead of by pickling the mesh object, within the block.

    torch 2.13 pickles the real mesh with the pickler's memo on (``_reduce_fake_script_object``
    turns fast mode off for opaque types), so the bytes depend on which equal objects the
    process happened to share, and a DTensor graph keyed otherwise in every process: the
    Hugging Face Llama with PyTorch's TP plan found none of its graphs, Inductor's own
    included, in a warm cache. The description names everything the generated code depends
    on of the mesh."""
    from torch._inductor.codecache import FxGraphCachePickler, _ident
    from torch.distributed.device_mesh import DeviceMesh

    original = FxGraphCachePickler._reduce_fake_script_object

    def reduce(self: Any, t: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        real = getattr(t, "real_obj", None)
        if isinstance(real, DeviceMesh):
            groups = tuple(getattr(real, "_dim_group_names", None) or ())
            described = (
                real.device_type,
                tuple(real.mesh.flatten().tolist()),
                tuple(real.mesh.shape),
                real.mesh_dim_names,
                groups,
            )
            return (_ident, (t.script_class_name, described))
        return original(self, t)

    FxGraphCachePickler._reduce_fake_script_object = reduce  # type: ignore[method-assign]
    try:
        yield
    finally:
        FxGraphCachePickler._reduce_fake_script_object = original  # type: ignore[method-assign]


def tracing_for_graph_cache(example_inputs: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """Outside any compile's tracing context (helix's merged graphs are compiled while a step
    runs), a tracing context of the example inputs' fake mode: Inductor's FX graph cache reads
    the shape environment from it, and without one bypasses the cache ("No shape env"), so a
    merged graph was compiled anew in every process. Inside a context, or without a fake mode
    that has a shape environment: nothing."""
    if torch._guards.TracingContext.try_get() is not None:
        return contextlib.nullcontext()
    fake_mode = torch._guards.detect_fake_mode(list(example_inputs))
    if fake_mode is None or fake_mode.shape_env is None:
        return contextlib.nullcontext()
    return torch._guards.tracing(torch._guards.TracingContext(fake_mode))


#: Inductor settings that would move collectives, waits or the compute around them after
#: dhelix scheduled the graph (torch 2.13; file:line refer to torch/_inductor/):
#: - reorder_for_peak_memory (on by default, every graph; scheduler.py, memory.py): picks the
#:   lowest-peak of several topological orders -- it sank backward all-gather issues below compute.
#: - reorder_for_locality (on by default, inference graphs; post_grad.py): pulls producers next
#:   to their consumers, moving compute across waits.
#: - the comm-overlap passes and FX bucketing (off by default): restated so a user's global
#:   config cannot undo dhelix's schedule behind its back.
KEEP_ORDER_CONFIG: dict[str, Any] = {
    "reorder_for_peak_memory": False,
    "reorder_for_locality": False,
    "reorder_for_compute_comm_overlap": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "bucket_all_gathers_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_reduces_fx": "none",
}


class _DhelixFusionChoices(_InductorChoices):
    """Inductor's fusion heuristics, except that no fused kernel straddles a collective (or a
    ``dhelix::exchange`` P2P step) with ``across_collectives=False``, and none joins nodes of two
    groups of ``group`` (a merged graph's strands).

    A fused kernel is emitted at its first member's position and pulls its other members'
    inputs with it; fusing a kernel before a collective issue or wait with one after it would
    move compute across the wait (or the issue) and undo the overlap dhelix scheduled. A kernel
    of two strands would tie the strands' positions together as well, and it is a kernel
    neither strand compiled alone: kept apart, a merged graph's kernels are its strands' own,
    which Inductor's cache holds already.
    """

    def __init__(self, across_collectives: bool, group: FusionGroup | None) -> None:
        super().__init__()
        self._across_collectives = across_collectives
        self._group = group

    def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:  # type: ignore[override]
        if not self._across_collectives:
            low = min(node1.min_order, node2.min_order)
            high = max(node1.max_order, node2.max_order)
            orders = _communication_orders(scheduler)
            after_low = bisect.bisect_right(orders, low)  # the first collective after ``low``
            if after_low < len(orders) and orders[after_low] < high:
                return False
        if self._group is not None and len(self._groups(scheduler, node1) | self._groups(scheduler, node2)) > 1:
            return False
        return _InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)

    def _groups(self, scheduler: Any, node: Any) -> frozenset[object]:
        """The groups of the FX nodes a (possibly fused) scheduler node was lowered from; each
        unfused node's memoized on ``scheduler`` (``can_fuse`` is asked about every candidate pair)."""
        assert self._group is not None
        memo: dict[str, frozenset[object]] = scheduler.__dict__.setdefault(_GROUPS_ATTR, {})
        found: set[object] = set()
        for member in node.get_nodes():
            name = member.get_name()
            if name not in memo:
                origins = getattr(getattr(member, "node", None), "origins", None) or ()
                memo[name] = frozenset(g for g in map(self._group, origins) if g is not None)
            found |= memo[name]
        return frozenset(found)


#: Attribute of an Inductor scheduler: each unfused node's fusion groups by name (:class:`_DhelixFusionChoices`).
_GROUPS_ATTR = "_dhelix_fusion_groups"

#: Attribute of an Inductor scheduler: (its node list, that list's length, the sorted
#: ``min_order`` of its communication kernels), :func:`_communication_orders`' memo.
_COMM_ORDERS_ATTR = "_dhelix_communication_orders"


def _communication_orders(scheduler: Any) -> list[int]:
    """The sorted ``min_order`` of the communication kernels among ``scheduler.nodes``.

    Inductor asks ``can_fuse`` about every candidate pair of every fusion round; scanning the
    node list on each call took 2.0 s of the 3.8 s the HF Llama TP+SP helix graphs spent fusing
    (F, B and M on one rank, under cProfile). Each round works on one list (``fuse_nodes_once``
    builds the next), so the orders are computed once per list."""
    nodes = scheduler.nodes
    memo = getattr(scheduler, _COMM_ORDERS_ATTR, None)
    if memo is not None and memo[0] is nodes and memo[1] == len(nodes):
        return memo[2]
    orders = sorted(n.min_order for n in nodes if _is_communication_kernel(getattr(n, "node", None)))
    setattr(scheduler, _COMM_ORDERS_ATTR, (nodes, len(nodes), orders))
    return orders


def _is_communication_kernel(ir_node: Any) -> bool:
    """A collective kernel, or the fallback kernel of dhelix's P2P exchange op."""
    if isinstance(ir_node, _inductor_ir._CollectiveKernel):
        return True
    return isinstance(ir_node, _inductor_ir.FallbackKernel) and str(getattr(ir_node, "op_overload", "")).startswith(
        "dhelix.exchange"
    )


def inductor_compile_partition_keeping_order(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    fusion_group: FusionGroup | None = None,
    **inductor_kwargs: Any,
) -> Callable[..., Any]:
    """``compile_fx_inner`` that emits collectives, waits and the kernels between them in ``gm``'s order.

    It turns off Inductor's own reorderings (``KEEP_ORDER_CONFIG``) and refuses fusions across
    a collective (and, with ``fusion_group``, across groups: :class:`_DhelixFusionChoices`).
    Pointwise ops that Inductor inlines into their consumer still run with that consumer;
    matmuls, reductions and other materialized buffers keep their place.
    """
    wait_for_vec_isa_check()
    with (
        _inductor_config.patch(KEEP_ORDER_CONFIG),
        _V.set_choices_handler(_DhelixFusionChoices(False, fusion_group)),
        tracing_for_graph_cache(example_inputs),
        stable_mesh_cache_keys(),
    ):
        return _compile_fx_inner(gm, example_inputs, **inductor_kwargs)


#: Suffix of a placeholder whose input its caller hands over (:func:`mark_donated`).
DONATED_SUFFIX = "_handed_over"


def donated_input_indices() -> tuple[int, ...]:
    """The positions of the backward graph being compiled whose inputs AOTAutograd donates: saved
    activations that alias nothing else and that it frees before the call, which Inductor may
    write the graph's outputs over (``TracingContext.fw_metadata.bw_donated_idxs``, empty with
    ``torch._functorch.config.donated_buffer`` off). Read it while the backward compiles: the
    forward's compile sees the same indices, which are not its own; () outside AOTAutograd."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None) if context is not None else None
    return tuple(getattr(metadata, "bw_donated_idxs", None) or ())


def mark_donated(gm: torch.fx.GraphModule, positions: Sequence[int]) -> None:
    """Name the placeholders at ``positions`` as donated (``DONATED_SUFFIX``): compiled under
    :func:`donated_placeholders`, Inductor may reuse their buffers for the graph's own, as it
    does a backward's saved activations. The caller must hand those inputs over (clear its
    argument list, keep no other reference). The name is in the code Inductor hashes, so a
    cached compile never serves a graph that donates to a caller that does not, or back."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position in positions:
        node = placeholders[position]
        if not node.name.endswith(DONATED_SUFFIX):
            node._rename(node.name + DONATED_SUFFIX)
            node.target = node.name
    gm.recompile()


_donating_lock = threading.Lock()
_donating_depth = 0


@contextlib.contextmanager
def donated_placeholders() -> Iterator[None]:
    """While open, Inductor lowers a placeholder named with ``DONATED_SUFFIX`` as a donated
    buffer (``ir.DonatedBuffer``), whatever the graph's phase: ``GraphLowering.placeholder``
    donates only in a backward, by AOTAutograd's indices, and helix's merged graph takes a
    backward's saved activations beside a forward's inputs."""
    global _donating_depth
    with _donating_lock:
        if _donating_depth == 0:
            _GraphLowering.placeholder = _donating_placeholder  # type: ignore[method-assign]
        _donating_depth += 1
    try:
        yield
    finally:
        with _donating_lock:
            _donating_depth -= 1
            if _donating_depth == 0:
                _GraphLowering.placeholder = _lowering_placeholder  # type: ignore[method-assign]


_lowering_placeholder = _GraphLowering.placeholder


def _donating_placeholder(self: Any, target: str, args: Any, kwargs: Any) -> Any:
    if not (isinstance(target, str) and target.endswith(DONATED_SUFFIX)):
        return _lowering_placeholder(self, target, args, kwargs)
    saved = self.is_backward, self.bw_donated_idxs
    self.is_backward, self.bw_donated_idxs = True, [self.placeholder_idx + 1]  # the index it is about to take
    try:
        return _lowering_placeholder(self, target, args, kwargs)
    finally:
        self.is_backward, self.bw_donated_idxs = saved


def eager_partition(gm: torch.fx.GraphModule | Callable[..., Any]) -> Callable[..., Any]:
    """Run the FX graph as is (or a function of its inputs), with AOTAutograd's boxed calling
    convention; a graph's Inductor random prims draw from their seeds (:func:`seeded_random_prims`)."""
    if isinstance(gm, torch.fx.GraphModule):
        return _make_boxed_func(seeded_random_prims(gm).forward)
    return _make_boxed_func(gm)


def seeded_random_prims(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm``, or a copy of it whose ``prims.inductor_random`` / ``prims.inductor_randint`` calls
    draw from a generator seeded with their seed argument.

    Inductor's joint-graph passes (the capture is ``compile_fx``'s) turn every random op into
    ``inductor_random(size, seed, mode)`` with a seed the forward draws and saves, and a backward
    that recomputes the op (activation checkpointing; the partitioner's recompute) calls it again
    with that seed. Inductor's kernels are a function of the seed; torch 2.13's eager
    implementations of these prims ignore it and draw from the default generator, so a graph run
    eagerly would recompute another dropout mask than its forward drew.
    """
    targets = _seeded_prims()
    if not any(node.op == "call_function" and node.target in targets for node in gm.graph.nodes):
        return gm
    seeded = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for node in seeded.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = targets[node.target]
    seeded.recompile()
    return seeded


def _seeded_prims() -> dict[Any, Callable[..., torch.Tensor]]:
    import torch._inductor.inductor_prims

    return {
        torch.ops.prims.inductor_random.default: _seeded_random,
        torch.ops.prims.inductor_randint.default: _seeded_randint,
    }


def _seeded_generator(seed: torch.Tensor) -> torch.Generator:
    generator = torch.Generator(device=seed.device)
    generator.manual_seed(int(seed.item()))
    return generator


def _seeded_random(size: Sequence[int], seed: torch.Tensor, mode: str, *, align_dtype: Any = None) -> torch.Tensor:
    draw = torch.rand if mode == "rand" else torch.randn
    return draw(list(size), device=seed.device, dtype=torch.float32, generator=_seeded_generator(seed))


def _seeded_randint(low: int, high: int, size: Sequence[int], seed: torch.Tensor) -> torch.Tensor:
    return torch.randint(low, high, list(size), device=seed.device, generator=_seeded_generator(seed))


def inductor_mode_options(mode: str | None) -> dict[str, Any]:
    """Inductor config patches of a ``torch.compile(mode=...)`` name (``{}`` for default)."""
    if mode in (None, "default"):
        return {}
    return dict(torch._inductor.list_mode_options(mode))


@contextlib.contextmanager
def inductor_config_patch(patches: dict[str, Any]) -> Iterator[None]:
    """``torch._inductor.config.patch`` as a context manager (no-op for ``{}``)."""
    if not patches:
        yield
        return
    with _inductor_config.patch(patches):
        yield


_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "critical", "exception", "warning_once", "info_once")


@contextlib.contextmanager
def logging_calls_ignored_by_dynamo() -> Iterator[None]:
    """Dynamo skips ``logging.Logger`` calls (instead of failing a ``fullgraph`` capture on them):
    models log -- Hugging Face's ``logger.warning_once`` among others -- and a log line is no
    reason to refuse a model. ``torch._dynamo.config.ignore_logging_functions``."""
    import logging

    import torch._dynamo.config as dynamo_config

    methods = {getattr(logging.Logger, name) for name in _LOGGER_METHODS if hasattr(logging.Logger, name)}
    with dynamo_config.patch(ignore_logging_functions=dynamo_config.ignore_logging_functions | methods):
        yield


def current_compile_id() -> str | None:
    """Dynamo's id of the frame being compiled, e.g. ``"0/1"``; ``None`` outside Dynamo."""
    context = torch._guards.CompileContext.try_get()
    compile_id = getattr(context, "compile_id", None)
    return None if compile_id is None else str(compile_id)


def list_dynamo_backends() -> list[str]:
    """Names ``torch.compile(backend=...)`` accepts (includes entry-point backends)."""
    return list(torch._dynamo.list_backends())


def default_store() -> torch.distributed.Store:
    """The c10d key-value store of the default process group (for out-of-graph agreement)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def dim_group_order(ranks: Sequence[int]) -> tuple[int, ...]:
    """The order of the ranks in the process group a ``DeviceMesh`` makes for one line of a mesh dim
    (``ranks``, as the mesh lists them): their group ranks, which torch's collectives place tiles
    by. torch 2.13 sorts them (``new_group`` and ``split_group`` sort ``ranks``; a dim as large as
    the world uses the default group, ranks 0..N-1); ``dhelix_compile.mesh_positions`` checks it
    against the groups a rank has, and ``reshard`` refuses a torch that orders them otherwise."""
    return tuple(sorted(int(r) for r in ranks))


def group_ranks(group_name: str) -> list[int]:
    """Global ranks of the process group a functional collective names (``group_name`` arg)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return list(dist.get_process_group_ranks(_resolve_process_group(_as_group_name(group_name))))


#: Inductor's own communication/computation overlap scheduler (torch>=2.10), the baseline
#: dhelix is compared with. On CPU it needs an analytical compute estimator: the default one
#: benchmarks on a GPU (torch 2.11 has no such option: its scheduler runs on CUDA only).
_INDUCTOR_OVERLAP_OPTIONS: dict[str, Any] = {
    "aten_distributed_optimizations.enable_overlap_scheduling": True,
    "aten_distributed_optimizations.compute_estimator": "analytical",
}


def inductor_overlap_config() -> dict[str, Any]:
    """``torch.compile`` options that turn on Inductor's overlap scheduler: the ones this torch has."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    return {k: v for k, v in _INDUCTOR_OVERLAP_OPTIONS.items() if k in known}


@contextlib.contextmanager
def cpu_roofline_for_inductor(tflops: float, dram_gbps: float) -> Iterator[None]:
    """Make Inductor's roofline estimator usable without a GPU (it asks triton for GPU specs).

    ``torch.utils._runtime_estimation`` reads peak TFLOP/s and DRAM GB/s of "the GPU"; on a
    CPU-only build that import fails. While the context is active it gets ``tflops`` and
    ``dram_gbps`` (use this machine's measured numbers) instead.
    """
    import torch.utils._runtime_estimation as runtime_estimation

    def device_tflops(dtype: torch.dtype | None = None) -> float:
        return tflops

    def gpu_dram_gbps() -> float:
        return dram_gbps

    saved = runtime_estimation.get_device_tflops, runtime_estimation.get_gpu_dram_gbps
    # Monkeypatching a private module: its functions' declared types are not the stand-ins'.
    runtime_estimation.get_device_tflops = device_tflops  # type: ignore[assignment]  # torch's is functools.cache'd
    runtime_estimation.get_gpu_dram_gbps = gpu_dram_gbps  # type: ignore[assignment]  # torch's: cached, int GB/s
    try:
        yield
    finally:
        runtime_estimation.get_device_tflops, runtime_estimation.get_gpu_dram_gbps = saved


def real_process_group_initialized() -> bool:
    """``torch.distributed`` is initialized with a backend that talks to other processes.

    The "fake" backend (tests, compute-only benchmarks) sends nothing, and its store holds
    nothing another rank wrote: cross-rank agreement must be skipped there.
    """
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() not in ("fake", "emulated")


def start_compile_workers() -> bool:
    """Start Inductor's pool of compile worker processes without waiting for it, where this
    process uses one (True); a no-op where Inductor compiles in-process (False).

    Inductor starts the pool at its first compile on CPU (``maybe_warm_pool`` warms it only
    with Triton), and the profiled cost model then waits for it before it measures
    (:func:`wait_for_compile_workers`): on 2 cores the workers took 7 s to start. Started
    when a model is handed to dhelix, they start while Dynamo and AOTAutograd trace."""
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    if get_compile_threads() <= 1:
        return False
    AsyncCompile.use_process_pool()
    return AsyncCompile._ready_future is not None


_vec_isa_lock = threading.Lock()
_vec_isa_check: threading.Thread | None = None


def start_vec_isa_check(tensors: Iterable[Any]) -> None:
    """Where any of ``tensors`` lives on the CPU, start Inductor's check of which vector
    instructions the CPU's kernels may use on a background thread, once a process;
    :func:`wait_for_vec_isa_check` waits for it.

    Inductor runs the check at the first CPU kernel it generates and keeps the answer for the
    process (``cpu_vec_isa.pick_vec_isa``): it compiles a probe library with the ISA's flags
    (cached in Inductor's cache folder) and loads it in a child Python. On the 2-core machine
    that took 14.3 s of a cold ZeRO-3 ``helix`` first step (build 7.1 s, load 7.2 s; 0.7 s with
    the library cached, idle): waiting on a compiler and a child process, while this process
    can trace the model."""
    global _vec_isa_check
    from torch._inductor import cpu_vec_isa

    if not any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors):
        return
    with _vec_isa_lock:
        if _vec_isa_check is None:
            _vec_isa_check = threading.Thread(target=cpu_vec_isa.pick_vec_isa, name="dhelix-vec-isa", daemon=True)
            _vec_isa_check.start()


def wait_for_vec_isa_check() -> None:
    """Wait for the check :func:`start_vec_isa_check` started (if it did): Inductor's own call
    then finds the answer instead of running the check a second time."""
    with _vec_isa_lock:
        check = _vec_isa_check
    if check is not None:
        check.join()


def wait_for_compile_workers(timeout_s: float = 120.0) -> None:
    """Wait until Inductor's pool of compile worker processes has started (starting it if this
    process uses one and it has not), so that nothing measured afterwards shares the cores with
    workers importing torch. A no-op where Inductor compiles in-process (one compile thread).

    Profiled op times measured beside a starting pool ran 1.4-2.2x slow on 2 cores and stayed
    in the disk cache (BENCHMARKS.md, 2026-11-25)."""
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.wait_pool_ready(timeout=timeout_s)


def run_outside_compilation(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with none of the compiler's thread-local state, and return its result.

    Inductor calls our partition compiler inside AOTAutograd's fake-tensor mode, with the
    Python dispatcher on; measuring ops or collectives there traces fake tensors, and a
    collective's ``wait_tensor`` was seen to block forever. Dispatch modes and tracing contexts
    are thread-local, so a fresh thread sees plain eager PyTorch. The caller waits for it.
    """
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="dhelix-outside-compilation")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def profiler_running() -> bool:
    """Whether a ``torch.profiler`` / autograd profiler session is on (torch has no public query)."""
    return bool(torch._C._autograd._profiler_enabled())


def resolve_group(group_name: str) -> Any:
    """The live process group a functional collective's ``group_name`` names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(_as_group_name(group_name))


def group_backend(group_name: str) -> str | None:
    """The backend (``"gloo"``, ``"nccl"``, ``"fake"``, ...) of the live process group named
    ``group_name``; ``None`` without one (no process group, or a name that resolves to none)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return str(dist.get_backend(resolve_group(group_name)))
    except (RuntimeError, ValueError, KeyError):
        return None


def group_timeout_s(group: Any) -> float | None:
    """How long a transfer on the live process group ``group`` waits for a peer, in seconds: its
    backend's timeout (``None`` for a backend that exposes none, such as the fake one)."""
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return float(timeout.total_seconds())
    return None


def default_group_timeout_s() -> float | None:
    """:func:`group_timeout_s` of the default process group: ``init_process_group``'s ``timeout``."""
    from torch.distributed.distributed_c10d import _get_default_group

    return group_timeout_s(_get_default_group())


def set_group_timeout(group: Any, timeout_s: float) -> None:
    """Give the live process group ``group`` (gloo or NCCL) the timeout ``timeout_s`` (every later
    transfer on it has it: torch keeps one per group)."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=timeout_s), group)


def group_name(group: Any) -> GroupName:
    """The name functional collectives take for the live process group ``group``."""
    return _as_group_name(group.group_name)


def _as_group_name(name: str) -> GroupName:
    """A group name from a graph argument (a plain str) as torch's ``GroupName``.

    ``GroupName`` is a ``NewType`` of str in torch 2.13's distributed_c10d, imported for type
    checking only: a cast, unlike calling it, does not need that name in every supported release.
    """
    return cast("GroupName", name)


def register_work(tensor: torch.Tensor, work: Any) -> None:
    """Make ``_c10d_functional.wait_tensor(tensor)`` wait for ``work`` (how functional collectives complete)."""
    torch._C._distributed_c10d._register_work(tensor, work)


# ---------------------------------------------------------------------------------------------
# torch.distributed.pipelining: the schedules' runtime (helix_pipeline)
#
# ``_PipelineScheduleRuntime`` runs a per-rank list of ``_Action``s; a compute-only order is
# lowered to sends and receives by ``_prepare_schedule_with_comms``. ``register_custom_function``
# replaces one computation type's step, but the default steps live in a closure of
# ``_step_microbatches`` that a custom function cannot call: ``pipeline_runtime.steps`` does what
# that closure does, through the shims below (every underscore name of the runtime and of
# ``PipelineStage`` it needs); ``pipeline_runtime.stage_transfers`` replaces a stage's sends and
# receives through them.
# ---------------------------------------------------------------------------------------------

#: (kind, stage, micro-batch, sub-actions) of a compute action; kind is "F", "B", "I", "W" or
#: "OVERLAP_F_B" (then stage and micro-batch are None and the sub-actions are given).
PipelineActionFields = tuple[str, int | None, int | None, tuple[Any, ...] | None]


def _pipelining_schedules() -> Any:
    from torch.distributed.pipelining import schedules

    return schedules


def is_runtime_schedule(schedule: object) -> bool:
    """Whether ``schedule`` runs a per-rank action list (``_PipelineScheduleRuntime``)."""
    return isinstance(schedule, _pipelining_schedules()._PipelineScheduleRuntime)


def pipeline_action_fields(action: Any) -> PipelineActionFields:
    """The fields of a torch pipeline action (see :data:`PipelineActionFields`)."""
    kind = action.computation_type.value
    if action.sub_actions is not None:
        return kind, None, None, tuple(action.sub_actions)
    return kind, action.stage_index, action.microbatch_index, None


def pipeline_action(kind: str, stage: int, microbatch: int) -> Any:
    """A torch compute action (``"F"``, ``"B"``, ``"I"``, ``"W"``) of ``stage`` on ``microbatch``."""
    schedules = _pipelining_schedules()
    return schedules._Action(stage, schedules._ComputationType(kind), microbatch)


def pipeline_overlap_action(forward: Any, backward: Any) -> Any:
    """An ``OVERLAP_F_B`` action of a forward and a backward action (DualPipeV's form)."""
    schedules = _pipelining_schedules()
    return schedules._Action(-1, schedules.OVERLAP_F_B, None, (forward, backward))


def pipeline_compute_order(schedule: Any) -> dict[int, list[Any]]:
    """A runtime schedule's compute-only order, every rank (empty slots dropped)."""
    return {rank: [a for a in actions if a is not None] for rank, actions in schedule.pipeline_order.items()}


def set_pipeline_compute_order(schedule: Any, order: dict[int, list[Any]]) -> None:
    """Make a runtime schedule run ``order`` (compute-only; sends and receives are added by torch)."""
    schedule.pipeline_order = order
    schedule._prepare_schedule_with_comms(order)


def single_stage_runtime(schedule: Any) -> Any:
    """A ``_PipelineScheduleRuntime`` over the one stage of a single-stage schedule (Schedule1F1B),
    with its micro-batch count, loss, chunking and gradient scaling."""
    return _pipelining_schedules()._PipelineScheduleRuntime(
        stages=[schedule._stage],
        n_microbatches=schedule._n_microbatches,
        loss_fn=schedule._loss_fn,
        args_chunk_spec=schedule._args_chunk_spec,
        kwargs_chunk_spec=schedule._kwargs_chunk_spec,
        output_merge_spec=schedule._output_merge_spec,
        scale_grads=schedule.scale_grads,
    )


def schedule_stages(schedule: Any) -> list[Any]:
    """The stages a schedule runs on this rank."""
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def schedule_microbatches(schedule: Any) -> int:
    return int(schedule._n_microbatches)


def splits_batch_on_dim0(schedule: Any) -> bool:
    """Whether ``schedule`` splits every input and the target on dim 0 (no chunk specs of its own)."""
    return schedule._args_chunk_spec is None and schedule._kwargs_chunk_spec is None


def schedule_num_stages(schedule: Any) -> int:
    return int(schedule._num_stages)


def install_pipeline_steps(
    schedule: Any,
    forward: Callable[..., None],
    backward: Callable[..., None],
    overlap: Callable[..., None],
    around_step: Callable[[bool, dict[str, Any] | None], contextlib.AbstractContextManager[None]],
) -> None:
    """Make ``forward``, ``backward`` and ``overlap`` a runtime schedule's FORWARD, FULL_BACKWARD
    and OVERLAP_F_B steps, and run each ``step``'s micro-batches within
    ``around_step(return_outputs, loss_kwargs)`` (the custom functions' context does not carry them)."""
    schedules = _pipelining_schedules()
    schedule.register_custom_function(schedules.FORWARD, forward)
    schedule.register_custom_function(schedules.FULL_BACKWARD, backward)
    schedule.register_custom_function(schedules.OVERLAP_F_B, overlap)
    step_microbatches = schedule._step_microbatches

    def recording(
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        losses: Any = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        with around_step(return_outputs, loss_kwargs):
            return step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)

    schedule._step_microbatches = recording


@contextlib.contextmanager
def pipeline_transfer_waits(wait: Callable[[list[Any]], None]) -> Iterator[None]:
    """Within: torch's runtime waits for its transfers (``_wait_batch_p2p``, process-wide) with ``wait``."""
    schedules = _pipelining_schedules()
    torchs = schedules._wait_batch_p2p
    schedules._wait_batch_p2p = wait
    try:
        yield
    finally:
        schedules._wait_batch_p2p = torchs


def wait_pipeline_transfers(works: list[Any]) -> None:
    """Wait for transfers as torch's runtime does (``_wait_batch_p2p``)."""
    _pipelining_schedules()._wait_batch_p2p(works)


def runtime_stages(schedule: Any) -> dict[int, Any]:
    """The stages a runtime schedule runs on this rank, by stage index."""
    return {stage.stage_index: stage for stage in schedule._stages}


def check_stage_unsharded(schedule: Any, stage: Any) -> None:
    """The runtime's check that an FSDP stage module's parameters are gathered."""
    schedule._assert_unsharded(stage)


def compute_stage_loss(
    schedule: Any, stage: Any, output: Any, target_mbs: Any, microbatch: int, loss_kwargs: dict[str, Any] | None
) -> None:
    """The runtime's loss of a last stage's output (kept by the runtime; nothing on other stages)."""
    schedule._maybe_compute_loss(stage, output, target_mbs, microbatch, loss_kwargs)


def stage_loss(schedule: Any, stage: Any, microbatch: int) -> Any:
    """The loss the runtime kept for a last stage's micro-batch (``None`` on other stages)."""
    return schedule._maybe_get_loss(stage, microbatch)


class DeclaredDTensor(NamedTuple):
    """A DTensor a ``PipelineStage`` was given as static metadata (``input_args``, ``output_args``,
    ``input_grads``, ``output_grads``): its global shape and dtype, mesh and placements."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: Any
    placements: tuple[Any, ...]


#: The four kinds of a stage's static metadata, as ``PipelineStage`` names its arguments.
STAGE_METADATA_KINDS = ("inputs", "outputs", "input_grads", "output_grads")


def stage_declarations(stage: Any) -> dict[str, tuple[DeclaredDTensor | None, ...] | None]:
    """Per kind (:data:`STAGE_METADATA_KINDS`): the stage's declared tensors, ``None`` for a
    plain tensor (or no gradient), or ``None`` for the kind when it was not given."""
    from torch.distributed.pipelining._utils import _DTensorMeta

    user_meta = getattr(stage, "_user_meta", None)
    declared: dict[str, tuple[DeclaredDTensor | None, ...] | None] = {}
    for kind in STAGE_METADATA_KINDS:
        metas = getattr(user_meta, kind, None)
        if metas is None:
            declared[kind] = None
            continue
        declared[kind] = tuple(
            DeclaredDTensor(
                tuple(int(n) for n in m.global_shape),
                m.dtype,
                stage._mesh_cache.get_mesh(m.mesh_cache_key),
                tuple(m.placements),
            )
            if isinstance(m, _DTensorMeta)
            else None
            for m in metas
        )
    return declared


def stage_group(stage: Any) -> Any:
    """The process group a stage sends and receives on (its pipeline's, the default group if none)."""
    import torch.distributed as dist

    return stage.group or dist.distributed_c10d._get_default_group()


def stage_recv_ops(stage: Any, infos: tuple[Any, ...]) -> Any:
    """A ``PipelineStage``'s receive ops for ``infos`` (its ``args_recv_info`` or ``grad_recv_info``)."""
    return stage._get_recv_ops(infos)


def stage_grad_send_info(stage: Any) -> Any:
    """Where a ``PipelineStage`` sends its input gradients (made from its inputs' receive info at
    the first call, as the stage does)."""
    if stage.grad_send_info is None:
        stage.grad_send_info = stage._create_grad_send_info(stage.args_recv_info[0])
    return stage.grad_send_info


RetrieveReceived = Callable[[int], Any]


def stage_retrievals(stage: Any) -> tuple[RetrieveReceived, RetrieveReceived]:
    """How a ``PipelineStage`` reads a micro-batch's received activations and gradients."""
    return stage._retrieve_recv_activations, stage._retrieve_recv_grads


def set_stage_retrievals(stage: Any, activations: RetrieveReceived, grads: RetrieveReceived) -> None:
    """Make ``stage`` read a micro-batch's received activations and gradients with these."""
    stage._retrieve_recv_activations, stage._retrieve_recv_grads = activations, grads


def compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is, or was made, a ``torch.compile``d module (``torch.compile(m)`` or ``m.compile()``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def trust_static_stage_shapes(stages: Sequence[Any]) -> None:
    """Skip the P2P vote by which ``PipelineStage``s agree on static shapes: every stage says
    static. For a pipeline whose every stage on every rank was given ``input_args`` and
    ``output_args`` (plain tensors), where the vote's answer is known; on the fake process group
    (whose receives deliver nothing) the vote would say dynamic and the shape exchange would fail."""

    def static_vote(*_: Any, **__: Any) -> torch.Tensor:
        return torch.ones(1, dtype=torch.int32)

    for stage in stages:
        stage._warmup_forward_vote = static_vote
        stage._warmup_backward_result = static_vote


def without_donated_buffers() -> contextlib.AbstractContextManager[None]:
    """AOTAutograd compiling backwards that may run with ``retain_graph=True``: what Inductor-compiled
    stages need under a schedule that splits the backward into input and weight gradients
    (DualPipeV's ``I`` then ``W``), as torch's own error message advises."""
    return cast("contextlib.AbstractContextManager[None]", _functorch_config.patch(donated_buffer=False))


def local_shape_and_offset(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and global offset of the tile at ``coordinate`` of a mesh: what
    ``compute_local_shape_and_global_offset`` gives that rank, from plain data (no mesh object)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, offset = _compute_local_shape_and_global_offset(
        list(global_shape), list(mesh_shape), list(coordinate), list(placements)
    )
    return tuple(int(n) for n in shape), tuple(int(o) for o in offset)


def new_member_group(ranks: Sequence[int], name: str) -> Any:
    """``new_group(ranks, use_local_synchronization=True)`` (only the members call it) named ``name``.

    torch 2.13 names such a group by hashing its ranks together with the number of groups the
    calling process already has (``_hash_ranks_to_str``). Members that joined different groups
    before compute different names, rendezvous under different store keys and wait forever
    (seen with two groups ``(0, 2, 3)`` then ``(1, 2, 3)``: ranks 2 and 3 count one group more
    than rank 1). The caller gives a name every member computes the same. The group times out
    as the default group does: ``new_group``'s own default is torch's (30 minutes on gloo),
    whatever ``init_process_group``'s ``timeout`` (``group_timeouts``).
    """
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    hashed_name = c10d._process_group_name

    def agreed_name(*_: Any, **__: Any) -> Any:
        return _as_group_name(name)

    timeout_s = default_group_timeout_s()
    c10d._process_group_name = agreed_name
    try:
        return dist.new_group(
            list(ranks),
            timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
            use_local_synchronization=True,
        )
    finally:
        c10d._process_group_name = hashed_name


def constant_while_tracing(fn: _F) -> _F:
    """``fn`` run by Dynamo while tracing, its result a constant of the graph (``assume_constant_result``):
    for work on shapes, meshes and placements only (a plan), which must not be traced op by op."""
    from torch._dynamo import assume_constant_result

    return cast("_F", assume_constant_result(fn))


def concatenate_meshes(meshes: Sequence[Any]) -> Any:
    """One device mesh whose dims are the dims of ``meshes`` (sub-meshes of one root mesh, such as
    ``mesh["dp"]`` and ``mesh["tp"]``), in that order: ``mesh["dp", "tp"]`` rebuilt from its parts.
    Raises ``RuntimeError`` for meshes of different roots or overlapping dims."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(list(meshes))


def strided_shard(dim: int, split_factor: int) -> Any:
    """The placement FSDP2 gives a data-parallel shard of a tensor-parallel shard of the same dim
    (``_StridedShard``): sharded over the right mesh dim first, then over this one."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def has_tensor_hooks(tensor: torch.Tensor) -> bool:
    """Whether hooks were registered on ``tensor`` with ``register_hook`` (``Tensor._backward_hooks``)."""
    return bool(getattr(tensor, "_backward_hooks", None))


def aot_flat_inputs(value: Any) -> list[Any]:
    """What AOTAutograd makes of one graph input: a traceable tensor subclass (a DTensor) as its
    inner tensors (``__tensor_flatten__``, recursively), anything else as itself; the joint
    graph's primals, and the backward graph's outputs, follow the inputs in this order."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(value):
        return [value]
    names, _ = value.__tensor_flatten__()
    return [leaf for name in names for leaf in aot_flat_inputs(getattr(value, name))]


def register_process_group_backend(
    name: str, create: Callable[[int, int, str, list[int]], Any], devices: Sequence[str]
) -> None:
    """Register ``create(group_rank, group_size, group_name, global_ranks)`` -- a function that
    returns a ``torch.distributed.ProcessGroup`` subclass written in Python -- as the c10d
    backend ``name`` (once per process; a second call keeps the first creator).

    torch takes a ProcessGroup returned by a backend's creator as the group itself
    (``_new_process_group_helper``); the "extended" creator API passes the group's name and
    global ranks, which the group needs for ``group_name`` (torch's setter does not reach a
    Python subclass)."""
    import torch.distributed as dist

    if name.upper() in dist.Backend._plugins:
        return

    def creator(options: Any, _backend_options: Any) -> Any:
        return create(
            int(options.group_rank), int(options.group_size), str(options.group_id), list(options.global_ranks_in_group)
        )

    dist.Backend.register_backend(name, creator, extended_api=True, devices=list(devices))


def all_gather_into_tensor(output: Any, input: Any, **kwargs: Any) -> Any:
    """``torch.distributed``'s all-gather into one tensor: ``all_gather_single`` in torch 2.13,
    ``all_gather_into_tensor`` in 2.11 (2.13 still takes that name, with a warning)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, **kwargs)


def reduce_scatter_tensor(output: Any, input: Any, **kwargs: Any) -> Any:
    """``torch.distributed``'s reduce-scatter of one tensor: ``reduce_scatter_single`` in torch
    2.13, ``reduce_scatter_tensor`` in 2.11."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, **kwargs)


def cuda_delay(cycles: int) -> None:
    """Enqueue a kernel on the current CUDA stream that spins ``cycles`` GPU clock cycles."""
    torch.cuda._sleep(cycles)


def attach_placeholder_backend(group: Any) -> None:
    """Give a Python ``ProcessGroup`` a backend object for CPU and CUDA: a one-rank gloo group
    that reports no time estimates. Inductor asks a group's backend for CUDA about NCCL time
    estimates (``comm_analysis``; torch 2.11 fails the compile where a group has none). The
    group's own methods still run every collective: a Python subclass overrides them."""
    import datetime

    import torch.distributed as dist

    placeholder = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=60))
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, placeholder)
    group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)


class ProcessGroupCall(NamedTuple):
    """One ``c10d::`` op a call made on a process group (:func:`process_group_calls`).

    ``op``: its name without the namespace (``allreduce_``, ``alltoall_base_``, ``send``, ...).
    ``args``: its arguments in order, a tensor as ``(shape, dtype name)``, a tensor list as a
    list of them, an integer or integer list as itself, anything else (the process group, a
    reduce op) None."""

    op: str
    args: tuple[Any, ...]


def process_group_calls(fn: Callable[[], Any]) -> list[ProcessGroupCall]:
    """The ``c10d::`` ops ``fn()`` issued on any thread, in the order they started: what the process
    groups were asked to send, whoever asked (eager DTensor, a compiled graph's functional
    collectives, ``dhelix::exchange``, a strand's thread, DDP's reducer). An op another ``c10d::``
    op called from inside counts once, as the outer one.

    torch's profiler with every thread profiled: its event tree gives each tensor list's shapes,
    its flat events the integer lists (an all-to-all's splits), joined by correlation id."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=config) as prof:
        fn()
    concrete = {event.id: event.concrete_inputs for event in prof.events() if event.name.startswith("c10d::")}
    found: list[tuple[int, ProcessGroupCall]] = []

    def described(value: Any, given: Any) -> Any:
        if isinstance(value, list):
            return [described(v, None) for v in value]
        if hasattr(value, "sizes") and hasattr(value, "dtype"):
            return (tuple(int(s) for s in value.sizes), str(value.dtype).removeprefix("torch."))
        if given is not None:
            return given
        return value if isinstance(value, (bool, int, float, str)) else None

    def visit(event: Any, inside: bool) -> None:
        own = event.name.startswith("c10d::")
        if own and not inside:
            given = list(concrete.get(event.correlation_id) or [])
            inputs = list(event.extra_fields.inputs)
            given += [None] * (len(inputs) - len(given))
            args = tuple(described(v, g) for v, g in zip(inputs, given, strict=False))
            found.append((event.start_time_ns, ProcessGroupCall(event.name.removeprefix("c10d::"), args)))
        for child in event.children:
            visit(child, inside or own)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        visit(root, False)
    return [call for _, call in sorted(found, key=lambda item: item[0])]
