"""The pass pipeline: one ordered list of named passes and the one driver that runs them.

Contract
    A pass is a function ``name_pass(gm: GraphModule, ctx: PassContext) -> GraphModule``.
    It may rewrite ``gm`` in place and return it, or return a new module. It keeps the
    graph functional (no new mutation), and it either proves its rewrite safe or leaves
    the graph alone and counts why in ``ctx.stats``. It raises only when a contract is broken.

Driver (``run_pipeline``): ``gm.recompile()``, then for each pass in ``PASSES`` order, unless
disabled by name::

    before = observer.snapshot(gm)      # only when an observer (dumps) is attached
    t0 = perf_counter()
    code = code_of(gm)
    gm = pass(gm, ctx); gm.graph.lint()
    if the pass returned another module or code_of(gm) changed: gm.recompile()
    log  "<graph>: <pass> 1.2 ms, 120 -> 131 nodes"
    observer.after_pass(i, name, before, gm, seconds)

A pass that raises is re-raised as :class:`PassError`, which names the pass and the graph;
the caller (``dhelix_compile.codegen``) decides between falling back and failing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch.fx

from graph_passes.annotate import annotate_pass
from graph_passes.bucket_collectives import bucket_collectives_pass
from graph_passes.collapse_waits import collapse_waits_pass
from graph_passes.combine_all_reduces import combine_all_reduces_pass
from graph_passes.context import PassContext
from graph_passes.decompose import decompose_pass
from graph_passes.gloo_collectives import gloo_collectives_pass
from graph_passes.interleave import interleave_pass
from graph_passes.reorder import reorder_pass
from graph_passes.verify import verify_pass

log = logging.getLogger("dhelix.passes")

GraphPassFn = Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]


@dataclasses.dataclass(frozen=True)
class GraphPass:
    name: str
    fn: GraphPassFn
    doc: str


class PassError(RuntimeError):
    """A pass raised; names the pass and the graph, chains the original exception."""

    def __init__(self, pass_name: str, graph_name: str, cause: BaseException) -> None:
        super().__init__(f"dhelix pass '{pass_name}' failed on graph '{graph_name}': {type(cause).__name__}: {cause}")
        self.pass_name = pass_name
        self.graph_name = graph_name


class UnknownPassError(ValueError):
    """``disable_passes`` names a pass that does not exist."""


#: The pipeline, in order. Add a pass by inserting a ``GraphPass`` at the right position.
PASSES: tuple[GraphPass, ...] = (
    GraphPass(
        "collapse_waits",
        collapse_waits_pass,
        "wait_tensor of a tensor already waited on (funcol waits when traced) -> that tensor",
    ),
    GraphPass(
        "combine_all_reduces",
        combine_all_reduces_pass,
        "all-reduces whose results are only summed -> one all-reduce of the summed partials",
    ),
    GraphPass(
        "bucket_collectives",
        bucket_collectives_pass,
        "parameter all-gathers and gradient reductions of one group and dtype -> one per bucket of <= bucket_mb",
    ),
    GraphPass("annotate", annotate_pass, "tag every node with meta['dhelix'] (kind, phase, strand)"),
    GraphPass("decompose", decompose_pass, "all-gather/reduce-scatter next to matmuls -> per-peer or chunked steps"),
    GraphPass("interleave", interleave_pass, "order a merged helix graph's two strands by the DHelix DP"),
    GraphPass("reorder", reorder_pass, "issue collectives early, wait late, within a memory budget"),
    GraphPass(
        "gloo_collectives",
        gloo_collectives_pass,
        "all-gathers and reduce-scatters on gloo groups -> all-to-alls (gloo's all-gather in flight corrupts the heap;"
        " its reduce-scatter sends twice the bytes)",
    ),
    GraphPass("verify", verify_pass, "lint, topological order, every collective has its wait"),
)


def pass_names(passes: Sequence[GraphPass] | None = None) -> tuple[str, ...]:
    """Names of ``passes`` (default: the pipeline), in order."""
    return tuple(p.name for p in (PASSES if passes is None else passes))


def check_pass_names(names: Sequence[str], passes: Sequence[GraphPass] | None = None) -> None:
    """Raise :class:`UnknownPassError` if any of ``names`` is not a pass of the pipeline."""
    known = pass_names(passes)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UnknownPassError(
            f"cannot disable unknown dhelix pass(es) {', '.join(map(repr, unknown))}; passes: {', '.join(known)}"
        )


def code_of(gm: torch.fx.GraphModule) -> list[tuple[object, ...]]:
    """What ``gm``'s generated code is made of: each node's name, opcode, target, arguments and
    type, in order, and the graph's output structure. Equal lists generate equal code, so a pass
    that left them equal needs no ``recompile`` (FX's code generation is most of a pass's time
    on a large graph)."""
    codegen = gm.graph._codegen
    nodes: list[tuple[object, ...]] = [(n, n.name, n.op, n.target, n.args, n.kwargs, n.type) for n in gm.graph.nodes]
    nodes.append((type(codegen), getattr(codegen, "pytree_info", None)))
    return nodes


def _same_code(a: list[tuple[object, ...]], b: list[tuple[object, ...]]) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (an argument whose == is not a bool, a tensor: recompile)
        return False


def run_pipeline(
    gm: torch.fx.GraphModule,
    ctx: PassContext,
    *,
    passes: Sequence[GraphPass] | None = None,
    disabled: Sequence[str] = (),
) -> torch.fx.GraphModule:
    """Run ``passes`` (default: ``PASSES``) in order on ``gm``, skipping ``disabled``.

    See the module docstring for what the driver does around each pass.
    """
    passes = PASSES if passes is None else passes
    check_pass_names(disabled, passes)
    gm.recompile()  # the code matches the graph from the first pass on
    for index, graph_pass in enumerate(passes):
        if graph_pass.name in disabled:
            log.info("%s: pass %s disabled", ctx.graph_name, graph_pass.name)
            continue
        before = ctx.observer.snapshot(gm) if ctx.observer is not None else None
        nodes_before = len(gm.graph.nodes)
        start_s = time.perf_counter()
        try:
            module, code = gm, code_of(gm)
            gm = graph_pass.fn(gm, ctx)
            gm.graph.lint()
            if gm is not module or not _same_code(code_of(gm), code):
                gm.recompile()
        except Exception as exc:
            raise PassError(graph_pass.name, ctx.graph_name, exc) from exc
        seconds = time.perf_counter() - start_s
        log.info(
            "%s: pass %s %.1f ms, %d -> %d nodes",
            ctx.graph_name,
            graph_pass.name,
            seconds * 1e3,
            nodes_before,
            len(gm.graph.nodes),
        )
        if ctx.observer is not None:
            ctx.observer.after_pass(index, graph_pass.name, before, gm, seconds)
    return gm
