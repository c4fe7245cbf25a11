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

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.fx
from torch._functorch import config as _functorch_config
from torch._functorch.aot_autograd import make_boxed_func as _make_boxed_func
from torch._inductor import config as _inductor_config
from torch._inductor import ir as _inductor_ir
from torch._inductor.choices import InductorChoices as _InductorChoices
from torch._inductor.compile_fx import compile_fx as _compile_fx
from torch._inductor.compile_fx import compile_fx_inner as _compile_fx_inner
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
    """
    with _functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
        compiled = _compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=inductor_config_patches)
    # compile_fx returns source paths or weights only when compiling ahead of time (AOTInductor)
    assert callable(compiled), f"compile_fx returned {type(compiled).__name__}, not a callable"
    return compiled


def mark_boxed(fn: _F) -> _F:
    """Mark ``fn`` as boxed (takes the argument list), as ``make_boxed_func`` does, without wrapping it."""
    fn._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's private marker, in no torch type
    return fn


def inductor_compile_partition(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **inductor_kwargs: Any
) -> Callable[..., Any]:
    """Inductor code generation for one partition (``compile_fx_inner``)."""
    return _compile_fx_inner(gm, example_inputs, **inductor_kwargs)


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


class _NoFusionAcrossCollectives(_InductorChoices):
    """Inductor's fusion heuristics, except that no fused kernel may straddle a collective
    (or a ``dhelix::exchange`` P2P step).

    A fused kernel is emitted at its first member's position and pulls its other members'
    inputs with it; fusing a kernel before a collective issue or wait with one after it would
    move compute across the wait (or the issue) and undo the overlap dhelix scheduled.
    """

    @staticmethod
    def can_fuse(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        low = min(node1.min_order, node2.min_order)
        high = max(node1.max_order, node2.max_order)
        for other in scheduler.nodes:
            if _is_communication_kernel(getattr(other, "node", None)) and low < other.min_order < high:
                return False
        return _InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)


def _is_communication_kernel(ir_node: Any) -> bool:
    """A collective kernel, or the fallback kernel of dhelix's P2P exchange op."""
    if isinstance(ir_node, _inductor_ir._CollectiveKernel):
        return True
    return isinstance(ir_node, _inductor_ir.FallbackKernel) and str(getattr(ir_node, "op_overload", "")).startswith(
        "dhelix.exchange"
    )


def inductor_compile_partition_keeping_order(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **inductor_kwargs: Any
) -> Callable[..., Any]:
    """``compile_fx_inner`` that emits collectives, waits and the kernels between them in ``gm``'s order.

    It turns off Inductor's own reorderings (``KEEP_ORDER_CONFIG``) and refuses fusions across
    a collective. Pointwise ops that Inductor inlines into their consumer still run with that
    consumer; matmuls, reductions and other materialized buffers keep their place.
    """
    with _inductor_config.patch(KEEP_ORDER_CONFIG), _V.set_choices_handler(_NoFusionAcrossCollectives()):
        return _compile_fx_inner(gm, example_inputs, **inductor_kwargs)


def eager_partition(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """Run the FX graph as is, with AOTAutograd's boxed calling convention."""
    return _make_boxed_func(gm.forward)


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


def group_ranks(group_name: str) -> list[int]:
    """Global ranks of the process group a functional collective names (``group_name`` arg)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return list(dist.get_process_group_ranks(_resolve_process_group(_as_group_name(group_name))))


#: Inductor's own communication/computation overlap scheduler (torch>=2.10), the baseline
#: dhelix is compared with. On CPU it needs an analytical compute estimator: the default one
#: benchmarks on a GPU.
INDUCTOR_OVERLAP_CONFIG: dict[str, Any] = {
    "aten_distributed_optimizations.enable_overlap_scheduling": True,
    "aten_distributed_optimizations.compute_estimator": "analytical",
}


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

    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


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


def _as_group_name(name: str) -> GroupName:
    """A group name from a graph argument (a plain str) as torch's ``GroupName``.

    ``GroupName`` is a ``NewType`` of str in torch 2.13's distributed_c10d, imported for type
    checking only: a cast, unlike calling it, does not need that name in every supported release.
    """
    return cast("GroupName", name)


def register_work(tensor: torch.Tensor, work: Any) -> None:
    """Make ``_c10d_functional.wait_tensor(tensor)`` wait for ``work`` (how functional collectives complete)."""
    torch._C._distributed_c10d._register_work(tensor, work)
