"""The joint-graph passes: one ordered list of rewrites of AOTAutograd's joint graph, and their driver.

Contract
    A joint pass is a function ``name(graph: torch.fx.Graph) -> int``. It runs on the aten joint
    forward-backward graph (``tangents_*`` placeholders feed the backward) before the min-cut
    partitioner splits it, rewrites ``graph`` in place, and returns how many sites it rewrote or
    marked (0: the graph is as it was). The partition passes (``graph_passes.pass_list.PASSES``)
    run later, on each partition.

Driver (:class:`JointPasses`, built by :func:`joint_passes` with the passes turned off by
name), called by the capture as Inductor's ``joint_custom_pre_pass``, for each pass in
``JOINT_PASSES`` order::

    count = pass(graph)
    log  "joint graph: <pass> 0.4 ms, 1 loss(es) over gathered logits computed from this rank's vocabulary shard"

Its ``uuid()`` names the passes it runs (Inductor's caches key on it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch.fx

from graph_passes.joint.regather import mark_regathers
from graph_passes.joint.vocab_parallel_loss import shard_gathered_losses

log = logging.getLogger("dhelix.passes")

JointPassFn = Callable[[torch.fx.Graph], int]


@dataclasses.dataclass(frozen=True)
class JointPass:
    name: str
    fn: JointPassFn
    doc: str
    counts: str  #: what the number the pass returns counts, for the log


#: The joint passes, in order. Add one by inserting a ``JointPass`` at the right position.
JOINT_PASSES: tuple[JointPass, ...] = (
    JointPass(
        "vocab_parallel_loss",
        shard_gathered_losses,
        "a cross-entropy over all-gathered logits -> computed from each rank's vocabulary shard",
        "loss(es) over gathered logits computed from this rank's vocabulary shard",
    ),
    JointPass(
        "regather",
        mark_regathers,
        "parameter all-gathers annotated REGATHER -> recomputed in the backward instead of saved",
        "node(s) marked to recompute in the backward",
    ),
)


@dataclasses.dataclass(frozen=True)
class JointPasses:
    """``passes`` run in order on a joint graph (the module docstring's driver)."""

    passes: tuple[JointPass, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for joint_pass in self.passes:
            start_s = time.perf_counter()
            count = joint_pass.fn(graph)
            if count:
                ms = (time.perf_counter() - start_s) * 1e3
                log.info("joint graph: %s %.1f ms, %d %s", joint_pass.name, ms, count, joint_pass.counts)

    def uuid(self) -> tuple[str, ...]:
        return tuple(f"{p.fn.__module__}.{p.fn.__qualname__}" for p in self.passes)


def joint_passes(disabled: Sequence[str] = ()) -> JointPasses:
    """The passes of ``JOINT_PASSES`` not named in ``disabled``, in order; an unknown name raises."""
    known = tuple(p.name for p in JOINT_PASSES)
    unknown = [name for name in disabled if name not in known]
    if unknown:
        raise ValueError(f"unknown joint pass(es) {', '.join(map(repr, unknown))}; joint passes: {', '.join(known)}")
    return JointPasses(tuple(p for p in JOINT_PASSES if p.name not in disabled))
