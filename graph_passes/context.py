"""What a pass receives besides the graph: :class:`PassContext`.

Reason codes and notes
    A pass says what it did, or why it left something alone, with a *reason code*: a short,
    stable string from the pass's own vocabulary (``graph_passes/README.md`` lists them), with
    no sizes, node names or op names in it, so that tests, dumps and scripts can key on it
    (``"matmul_reduce_scatter: per_peer skipped: indivisible"``). ``ctx.count(pass, code)`` counts
    it in ``stats``. The human sentence behind a code (which site, which sizes) goes next to it:
    ``ctx.explain(pass, code, detail)`` counts the code and keeps ``detail`` in
    ``notes[pass][code]``, a list of the distinct details in the order they came. Nothing reads
    ``notes`` but people (logs, dumps); nothing asserts its wording.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch.fx

from cost_model.estimator import Estimator

Phase = Literal["fwd", "bwd", "inference"]


class PassObserver(Protocol):
    """Watches the pipeline (``dhelix_compile.observe.dumps.GraphDumper`` implements it)."""

    def snapshot(self, gm: torch.fx.GraphModule) -> Any: ...

    def after_pass(self, index: int, name: str, before: Any, gm: torch.fx.GraphModule, seconds: float) -> None: ...


@dataclasses.dataclass
class PassContext:
    """What every pass may read, and the counters it may write.

    Attributes:
        graph_name: a stable, human-readable name of the graph (``"0_0_fwd"``), used in logs/dumps.
        phase: which partition this is; ``annotate`` copies it onto every node.
        example_inputs: the partition's example inputs (fake or real tensors, SymInts).
        estimator: the cost model (a ``cost_model.estimator.Estimator``) or ``None``; passes
            never build one.
        strand: the strand id ``annotate`` assigns to nodes that have none (0 outside helix).
        stats: ``stats[pass_name][code] += 1`` -- what passes did or why they skipped, by reason
            code (see the module docstring).
        notes: ``notes[pass_name][code] = [detail, ...]`` -- the human-readable details behind
            the codes ``explain`` counted (distinct, in order of arrival).
        records: ``records[pass_name][name] = value`` -- numbers a pass reports (predictions).
        pass_options: per-pass options objects, keyed by pass name (e.g. ``ReorderOptions``).
        observer: dump writer, or ``None``.
    """

    graph_name: str
    phase: Phase
    example_inputs: Sequence[Any] = ()
    estimator: Estimator | None = None
    strand: int = 0
    stats: dict[str, Counter[str]] = dataclasses.field(default_factory=dict)
    notes: dict[str, dict[str, list[str]]] = dataclasses.field(default_factory=dict)
    records: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    pass_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    observer: PassObserver | None = None

    def count(self, pass_name: str, code: str, n: int = 1) -> None:
        """Record that ``pass_name`` did (or skipped) something, by reason code."""
        self.stats.setdefault(pass_name, Counter())[code] += n

    def explain(self, pass_name: str, code: str, detail: str, n: int = 1) -> None:
        """``count(pass_name, code, n)``, and keep ``detail`` (the sentence for people) under the code."""
        self.count(pass_name, code, n)
        details = self.notes.setdefault(pass_name, {}).setdefault(code, [])
        if detail not in details:
            details.append(detail)

    def record(self, pass_name: str, **values: float) -> None:
        """Record numbers a pass computed (e.g. predicted makespans), for dumps and reports."""
        self.records.setdefault(pass_name, {}).update(values)
