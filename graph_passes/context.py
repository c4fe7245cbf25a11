"""What a pass receives besides the graph: :class:`PassContext`."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch.fx

Phase = Literal["fwd", "bwd", "inference"]


class PassObserver(Protocol):
    """Watches the pipeline (``dhelix_compile.observe.dumps.GraphDumper`` implements it)."""

    def snapshot(self, gm: torch.fx.GraphModule) -> Any: ...

    def after_pass(
        self, index: int, name: str, before: Any, gm: torch.fx.GraphModule, seconds: float
    ) -> None: ...


@dataclasses.dataclass
class PassContext:
    """What every pass may read, and the counters it may write.

    Attributes:
        graph_name: a stable, human-readable name of the graph (``"0_0_fwd"``), used in logs/dumps.
        phase: which partition this is; ``annotate`` copies it onto every node.
        example_inputs: the partition's example inputs (fake or real tensors, SymInts).
        estimator: the cost model (a ``cost_model.Estimator``) or ``None``; passes never build one.
        strand: the strand id ``annotate`` assigns to nodes that have none (0 outside helix).
        stats: ``stats[pass_name][reason] += 1`` — what passes did or why they skipped.
        records: ``records[pass_name][name] = value`` — numbers a pass reports (predictions).
        pass_options: per-pass options objects, keyed by pass name (e.g. ``ReorderOptions``).
        observer: dump writer, or ``None``.
    """

    graph_name: str
    phase: Phase
    example_inputs: Sequence[Any] = ()
    estimator: Any = None
    strand: int = 0
    stats: dict[str, Counter[str]] = dataclasses.field(default_factory=dict)
    records: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    pass_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    observer: PassObserver | None = None

    def count(self, pass_name: str, reason: str, n: int = 1) -> None:
        """Record that ``pass_name`` did (or skipped) something, with a reason."""
        self.stats.setdefault(pass_name, Counter())[reason] += n

    def record(self, pass_name: str, **values: float) -> None:
        """Record numbers a pass computed (e.g. predicted makespans), for dumps and reports."""
        self.records.setdefault(pass_name, {}).update(values)
