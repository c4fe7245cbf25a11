"""Selection: build a site's variants, price them with the cost model, and choose one (or none).

Contract
    ``Selection(ctx, options, graph, fake_mode)`` reads ``ctx.estimator`` (``None``: no costs)
    and never builds one. ``variants(site, ...)`` emits the site's variants of the configured
    mode next to the site (not committed), lets a profiled estimator measure their new ops,
    and prices each with ``cost_model.simulate`` (memoized); the caller commits the one
    ``choose`` returns and discards the rest (``site.discard_all_but``). A variant family that
    does not apply is reported to the caller (``skipped(family, SkipSite)``), never raised.
    Deterministic: the same graph and the same agreed costs give the same choice on every
    rank, and a profiled estimator is asked to measure the same new ops in the same order on
    every rank (only peers and slice offsets differ between ranks, not op signatures).

Variants per mode::

    per_peer   per_peer(pieces) for pieces = options.pieces, or each of AUTO_PIECES when it is 0
    chunked    chunked(k) for k = 2 .. max_chunks
    auto       per_peer, and chunked too with ``options.auto_chunked``

Measured candidates: where there is a choice (``auto``: the original against its variants;
a forced mode with several variants), the estimator also runs each candidate on the live group
with its dataflow (``Estimator.segment_times``; the profiled estimator does, others measure
nothing). When every candidate was measured, the choice goes by the measured times: on a
machine whose transfers take CPU from the compute, a transfer in flight and each extra piece
cost more than the per-op model sees (``cost_model.profile.segments``).

Choice (by measured times where every candidate has one, else by predicted times)::

    no estimator (forced modes only)   chunked: the largest k; per_peer: the first (fewest pieces)
    forced mode                        of the variants within min_gain_ratio of the least time, the
                                       first (fewest pieces: per-peer before chunked, fewer before more)
    auto                               that variant only if its time < original's x (1 - min_gain_ratio)

A chain (``chain.ChainSite``, ``all_to_all_chain.AllToAllChainSite``) competes with its two
collectives decomposed on their own: each single site at the variant ``choose`` picks for it
(``single_site_rivals``, emitted, not committed). Where the chain's variant, its original and
each single site's variant and original were all run, the chain is rewritten only if it saves
more on its original than the two sites save on theirs, together (``chain_loses``). Otherwise
the whole graph in its current order is simulated once with the chain's best variant and once
with the single sites' (every other emitted node left out, readers of a replaced node counted
as reading a ready input), and the chain is rewritten only if it predicts less. When it is not,
the single-site patterns rewrite the two collectives later, on their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch.fx

from cost_model import compile_clock
from cost_model.comm_nodes import resolve_group_rank
from cost_model.estimator import MemoizedEstimator
from cost_model.simulator import simulate
from graph_passes.context import PassContext
from graph_passes.decompose.all_to_all_chain import AllToAllChainSite
from graph_passes.decompose.chain import ChainSite
from graph_passes.decompose.emit import Emitter
from graph_passes.decompose.options import AUTO_PIECES, DecomposeOptions
from graph_passes.decompose.site import TAG_BASE, Site, SkipSite, Variant, discard_all_but

#: A variant, emitted, and the nodes it would replace.
Replacement = tuple[Variant, Sequence[torch.fx.Node]]


class Rival(NamedTuple):
    """A chain's single site at its chosen variant, emitted, and the nodes it would replace."""

    variant: Variant
    old_nodes: Sequence[torch.fx.Node]
    saved_measured_s: float
    """The site's original measured time minus the variant's (NaN when either was not measured)."""


#: Told each variant family that does not apply: ``(family, why)``.
OnSkip = Callable[[str, SkipSite], None]


class Selection:
    """Builds, prices and chooses variants for the sites of one graph (see the module docstring)."""

    def __init__(self, ctx: PassContext, options: DecomposeOptions, graph: torch.fx.Graph, fake_mode: Any) -> None:
        self.ctx, self.options, self.graph, self.fake_mode = ctx, options, graph, fake_mode
        self.estimator = MemoizedEstimator(ctx.estimator) if ctx.estimator is not None else None

    def _measure(self, nodes: Sequence[torch.fx.Node]) -> None:
        """Let a profiled estimator measure the variants' new ops (same sites, same order on every rank)."""
        if self.ctx.estimator is not None:
            self.ctx.estimator.measure_new(nodes)

    def simulate_s(self, nodes: Sequence[torch.fx.Node]) -> float:
        """Predicted makespan of ``nodes`` in this order (NaN without an estimator)."""
        if self.estimator is None:
            return math.nan
        return simulate(nodes, self.estimator).makespan_s

    def variants(
        self, site: Site, group_name: str, tag: int, strand: int | None, skipped: OnSkip | None = None
    ) -> tuple[list[Variant], float, float]:
        """The site's variants for the configured mode, emitted (not committed), their new ops
        measured and each priced (``predicted_s``, and ``measured_s`` where there is a choice
        and the estimator measures); the original's predicted time (NaN without an estimator)
        and its measured time (NaN when not measured). Variants priced where there is a choice
        count as ``cost_model.compile_clock``'s ``variants``."""
        mode = self.options.mode
        variants: list[Variant] = []

        def skip(family: str, why: SkipSite) -> None:
            if skipped is not None:
                skipped(family, why)

        def build(family: str, builder: Callable[..., Variant], *args: Any) -> None:
            emitter = Emitter(self.graph, site.anchor, self.fake_mode, strand)
            try:
                variants.append(builder(emitter, *args))
            except SkipSite as why:
                Variant(family, emitter, []).discard()  # whatever was emitted before the skip
                skip(family, why)

        if mode in ("auto", "per_peer"):
            rank = resolve_group_rank(group_name)
            if rank is None:
                skip(
                    "per_peer",
                    SkipSite("unknown group", f"process group {group_name!r}: this rank's place in it is unknown"),
                )
            else:
                for pieces in (self.options.pieces,) if self.options.pieces else AUTO_PIECES:
                    build("per_peer", site.per_peer, rank, tag, pieces)
        if mode == "chunked" or (mode == "auto" and self.options.auto_chunked):
            for k in range(2, self.options.max_chunks + 1):
                build("chunked", site.chunked, k)
        if not variants:
            return [], math.nan, math.nan
        self._measure([n for v in variants for n in v.emitter.nodes])
        for v in variants:
            v.predicted_s = self.simulate_s(v.emitter.nodes)
        if self.estimator is not None and (mode == "auto" or len(variants) > 1):  # weighed, not forced
            compile_clock.count("variants", len(variants))
        original_measured_s = self._run_candidates(site, variants)
        return variants, self.simulate_s(site.old_nodes), original_measured_s

    def _run_candidates(self, site: Site, variants: Sequence[Variant]) -> float:
        """Where there is a choice, each candidate run on the live group (``measured_s``); the
        original's measured time (NaN when not measured)."""
        auto = self.options.mode == "auto"
        if self.ctx.estimator is None or not (auto or len(variants) > 1):
            return math.nan
        segments = [v.emitter.nodes for v in variants] + ([list(site.old_nodes)] if auto else [])
        times = [math.nan if t is None else t for t in self.ctx.estimator.segment_times(segments)]
        for v, t in zip(variants, times[: len(variants)], strict=True):
            v.measured_s = t
        return times[-1] if auto else math.nan

    def choose(
        self, variants: Sequence[Variant], original_s: float, original_measured_s: float = math.nan
    ) -> Variant | None:
        """The variant to commit, or None to keep the original (``auto`` and no gain); by measured
        times where every candidate has one, else by predicted times (module docstring)."""
        if self.estimator is None:  # forced mode without costs: the largest k, or per-peer in one piece
            return variants[-1] if self.options.mode == "chunked" else variants[0]
        auto = self.options.mode == "auto"
        measured = all(not math.isnan(v.measured_s) for v in variants) and not (
            auto and math.isnan(original_measured_s)
        )
        time_of = (lambda v: v.measured_s) if measured else (lambda v: v.predicted_s)
        original = original_measured_s if measured else original_s
        fastest = time_of(min(variants, key=time_of))
        # of the candidates within min_gain_ratio of the fastest, the first: the fewest pieces (the
        # variants come in that order), so that the measurements' noise does not flip the plan
        best = next(v for v in variants if time_of(v) <= fastest * (1.0 + self.options.min_gain_ratio))
        if not auto or time_of(best) < original * (1.0 - self.options.min_gain_ratio):
            return best
        return None

    def single_site_rivals(
        self, chain: ChainSite | AllToAllChainSite, group_name: str, strand: int | None
    ) -> list[Rival]:
        """The chain's two collectives as single sites, each at the variant
        ``choose`` picks (none when it keeps the original), with the nodes it would replace:
        emitted, not committed (the caller discards them; if the chain loses, the single-site
        patterns build them again)."""
        rivals: list[Rival] = []
        for _, site in chain.single_sites():
            variants, original_s, original_measured_s = self.variants(site, group_name, TAG_BASE, strand)
            best = self.choose(variants, original_s, original_measured_s) if variants else None
            discard_all_but(variants, best)
            if best is not None:
                rivals.append(Rival(best, site.old_nodes, original_measured_s - best.measured_s))
        return rivals

    def chain_loses(
        self,
        best: Variant,
        chain: ChainSite | AllToAllChainSite,
        variants: Sequence[Variant],
        rivals: Sequence[Rival],
        original_measured_s: float,
    ) -> tuple[dict[str, float], str | None]:
        """Whether the chain's ``best`` variant loses to its single sites' ``rivals`` (module
        docstring): the numbers it was decided on (record name suffix -> seconds), and why it
        loses (None when the chain wins)."""
        chain_saved = original_measured_s - best.measured_s
        sites_saved = sum(r.saved_measured_s for r in rivals)
        if not (math.isnan(chain_saved) or math.isnan(sites_saved)):  # every candidate was run
            numbers = {"chain_saved_measured_s": chain_saved, "sites_saved_measured_s": sites_saved}
            why = f"measured, the single sites save {sites_saved:.4g} s, the chain {chain_saved:.4g} s"
            return numbers, why if sites_saved >= chain_saved else None
        chain_s, sites_s = self._chain_and_single_sites_s(best, chain, variants, rivals)
        numbers = {"graph_chain_s": chain_s, "graph_single_sites_s": sites_s}
        why = f"the graph predicts {sites_s:.4g} s with the single sites, {chain_s:.4g} s with the chain"
        return numbers, why if sites_s <= chain_s else None

    def _chain_and_single_sites_s(
        self, best: Variant, chain: ChainSite | AllToAllChainSite, variants: Sequence[Variant], rivals: Sequence[Rival]
    ) -> tuple[float, float]:
        """The whole graph's predicted makespan with the chain's ``best`` variant, and with the
        single sites' ``rivals`` instead (every other emitted variant left out of both)."""
        emitted = {n for v in [*variants, *(r.variant for r in rivals)] for n in v.emitter.nodes}
        sites = [(r.variant, r.old_nodes) for r in rivals]
        return self._graph_s([(best, chain.old_nodes)], emitted), self._graph_s(sites, emitted)

    def _graph_s(self, chosen: Sequence[Replacement], emitted: set[torch.fx.Node]) -> float:
        """The whole graph's predicted makespan in its current order with each ``chosen`` variant
        in place of the nodes it replaces, and every other ``emitted`` (uncommitted) node left out.
        Nodes after a rewrite that read a replaced node count as reading a ready input."""
        keep = {n for v, _ in chosen for n in v.emitter.nodes}
        skip = (emitted - keep).union(*(old for _, old in chosen))
        return self.simulate_s([n for n in self.graph.nodes if n not in skip])
