"""Every private torch API dhelix touches, in one place.

Private APIs change between torch releases (we support ``torch>=2.11,<2.14``). Anything from
``torch._inductor``, ``torch._functorch``, ``torch._dynamo`` or ``torch._guards`` is imported
here and nowhere else, so an upgrade breaks this module and its test
(``tests/test_torch_compat.py``), not the passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from torch._functorch import config as _functorch_config
from torch._functorch.aot_autograd import make_boxed_func as _make_boxed_func
from torch._inductor import config as _inductor_config
from torch._inductor.compile_fx import compile_fx as _compile_fx
from torch._inductor.compile_fx import compile_fx_inner as _compile_fx_inner

#: An inner compiler: ``(gm, example_inputs, **inductor_kwargs) -> boxed callable``.
InnerCompile = Callable[..., Any]


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
        return _compile_fx(
            gm, example_inputs, inner_compile=inner_compile, config_patches=inductor_config_patches
        )


def inductor_compile_partition(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **inductor_kwargs: Any
) -> Callable[..., Any]:
    """Inductor code generation for one partition (``compile_fx_inner``)."""
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


def current_compile_id() -> str | None:
    """Dynamo's id of the frame being compiled, e.g. ``"0/1"``; ``None`` outside Dynamo."""
    context = torch._guards.CompileContext.try_get()
    compile_id = getattr(context, "compile_id", None)
    return None if compile_id is None else str(compile_id)


def list_dynamo_backends() -> list[str]:
    """Names ``torch.compile(backend=...)`` accepts (includes entry-point backends)."""
    return list(torch._dynamo.list_backends())
