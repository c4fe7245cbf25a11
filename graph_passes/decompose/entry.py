"""The decompose pass's entry point: ``decompose_pass(gm, ctx)`` walks the sites and counts every decision.

Contract
    Input: an annotated AOTAutograd partition (functional aten IR, ``meta["val"]`` on every
    node) and ``ctx.pass_options["decompose"]`` (``DecomposeOptions``; none, or mode ``"off"``:
    nothing happens but ``ctx.stats["decompose"]["off"]``). For each pattern in
    ``options.patterns`` (``CHAIN`` first when enabled), for each match ``collective_matches``
    finds, in graph order: build the site (``site.Site``), build and price its variants and
    choose (``selection``), commit the choice or leave the site as it was. When anything was
    rewritten the pass re-runs ``annotate`` (its counts go to a scratch context), so every
    node, new or old, carries ``meta["dhelix"]`` with comm ids numbered in graph order again.
    New nodes take the strand of the collective they replace.

    - Semantics: the result equals the original up to the order of floating-point additions
      (a reduce-scatter's sum is formed in another order). Shapes that do not split evenly,
      unknown process groups, non-contiguous operands, or consumers other than the matmuls
      (and graph outputs) leave the site alone with a counted reason.
    - Functional: new transfers are ``dhelix::exchange`` (``emit``) and ``all_gather_into_tensor``
      / ``reduce_scatter_tensor`` / ``all_reduce``; every issue is followed by a
      ``wait_tensor`` on each of its outputs. No in-place op is added.
    - Rank consistency: peers depend on the rank, everything else (which sites, which variant,
      tags, the order) only on the graph and the agreed costs, so every rank makes the same
      choices; a rank that did not would issue other collectives, which the compile-time
      collective-sequence check reports.
    - Order: issues come before the compute they should hide, waits right before the first use.
      ``reorder`` may move them further (it keeps a valid order; every rank the same).

Reason codes (``ctx.stats["decompose"]``; the detail of each skip -- which site, which sizes --
is in ``ctx.notes["decompose"][code]``)::

    off                                   the pass is off (mode "off")
    <pattern>: <variant>                  rewritten: per_peer, per_peer_<P>, chunked_<k>
    <pattern>: skipped: <SkipCode>        the site does not apply (``site.SkipCode``)
    <pattern>: skipped: group of one rank
    <pattern>: skipped: no estimator      mode "auto" without a cost model
    <pattern>: skipped: no variant applies
    <pattern>: <family> skipped: <SkipCode>   one family (per_peer, chunked) does not apply
    <pattern>: kept: no gain              mode "auto": no variant beats the original by min_gain_ratio
    <chain>: left to the single sites     (all_gather_chain, all_to_all_chain) the two sites save
                                          more, as measured where every candidate was run, else
                                          the graph predicts less with them
    not matched: <finder code>            a collective no pattern matched (``collective_matches``)

``ctx.records["decompose"]``: ``<site>_original_s``, ``<site>_<variant>_s`` (predicted),
``<site>_original_measured_s``, ``<site>_<variant>_measured_s`` (run on the live group, where
there was a choice and the estimator measures), ``<site>_chosen_s``,
``<site>_chain_saved_measured_s`` / ``<site>_sites_saved_measured_s`` or, unmeasured,
``<site>_graph_chain_s`` / ``<site>_graph_single_sites_s`` (chains), ``predicted_saved_s`` and
``sites_rewritten``; ``<site>`` is the pattern and the site's index (``all_gather_matmul0``).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable

import torch
import torch.fx

from cost_model.comm_nodes import resolve_group_size
from graph_passes._torch_compat import fake_mode_of
from graph_passes.annotate import annotate_pass
from graph_passes.collective_matches import (
    AllGatherChain,
    AllGatherMatmul,
    MatmulReduceScatter,
    find_all_gather_chains,
    find_all_gather_matmuls,
    find_all_to_all_chains,
    find_all_to_all_computes,
    find_bmm_all_to_alls,
    find_matmul_all_reduces,
    find_matmul_reduce_scatters,
)
from graph_passes.context import PassContext
from graph_passes.decompose.all_gather_site import AllGatherSite
from graph_passes.decompose.all_reduce_site import AllReduceSite
from graph_passes.decompose.all_to_all_chain import AllToAllChainSite
from graph_passes.decompose.all_to_all_sites import AllToAllSite, BmmAllToAllSite
from graph_passes.decompose.chain import ChainSite
from graph_passes.decompose.options import A2A_CHAIN, CHAIN, PASS, DecomposeOptions
from graph_passes.decompose.reduce_scatter_site import ReduceScatterSite
from graph_passes.decompose.selection import Selection
from graph_passes.decompose.site import TAG_BASE, TAG_STRIDE, Site, SkipSite, discard_all_but


def _group_size(match: object, group_name: str) -> int | None:
    """The match's group size: the collective's own argument where it has one, else the named group's."""
    if isinstance(match, (AllGatherMatmul, MatmulReduceScatter, AllGatherChain)):
        return match.group_size
    return resolve_group_size(group_name)


class _Decomposer:
    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext, options: DecomposeOptions) -> None:
        self.gm, self.ctx, self.options = gm, ctx, options
        self.graph = gm.graph
        vals = [n.meta.get("val") for n in self.graph.nodes if n.op == "placeholder"]
        fake_mode = fake_mode_of([v for v in vals if isinstance(v, torch.Tensor)])
        self.selection = Selection(ctx, options, self.graph, fake_mode)
        self.sites = 0
        self.saved_s = 0.0
        self.rewritten = 0  # sites committed to a variant

    def run(self) -> None:
        skipped: Counter[str] = Counter()
        graph = self.graph
        kinds = (  # pattern, its finder, its site (given the match and the group size)
            (CHAIN, find_all_gather_chains, lambda m, n: ChainSite(m, graph)),
            (A2A_CHAIN, find_all_to_all_chains, lambda m, n: AllToAllChainSite(m, graph, n)),
            ("all_gather_matmul", find_all_gather_matmuls, lambda m, n: AllGatherSite(m, graph)),
            ("matmul_reduce_scatter", find_matmul_reduce_scatters, lambda m, n: ReduceScatterSite(m, graph)),
            ("matmul_all_reduce", find_matmul_all_reduces, lambda m, n: AllReduceSite(m, graph, n)),
            ("all_to_all_compute", find_all_to_all_computes, lambda m, n: AllToAllSite(m, graph, n)),
            ("bmm_all_to_all", find_bmm_all_to_alls, lambda m, n: BmmAllToAllSite(m, graph, n)),
        )
        for label, find, make in kinds:
            if label not in self.options.patterns:
                continue
            for m in find(graph, skipped):
                size = _group_size(m, m.group_name)
                if size is None:
                    self.ctx.explain(
                        PASS,
                        f"{label}: skipped: unknown group",
                        f"{label} at {m.issue.name}: process group {m.group_name!r} unknown to torch.distributed",
                    )
                    continue
                self._site(label, functools.partial(make, m, size), m.group_name, size, m.issue)
        for code, n in sorted(skipped.items()):
            self.ctx.count(PASS, f"not matched: {code}", n)
        self.ctx.record(PASS, predicted_saved_s=self.saved_s, sites_rewritten=float(self.rewritten))

    def _site(
        self, label: str, make: Callable[[], Site], group_name: str, group_size: int, issue: torch.fx.Node
    ) -> None:
        """One site: build it, price its variants, commit the chosen one; count what happened."""
        index = self.sites
        self.sites += 1
        name = f"{label}{index}"
        try:
            site = make()
        except SkipSite as why:
            self.ctx.explain(PASS, f"{label}: skipped: {why.code}", f"{name}: {why.detail}")
            return
        if group_size < 2:
            self.ctx.count(PASS, f"{label}: skipped: group of one rank")
            return
        if self.options.mode == "auto" and self.selection.estimator is None:
            self.ctx.count(PASS, f"{label}: skipped: no estimator")
            return
        strand = issue.meta.get("dhelix", {}).get("strand")
        selection = self.selection
        # a chain competes with its two collectives decomposed on their own (built first, on the
        # graph as it is)
        chain = site if isinstance(site, (ChainSite, AllToAllChainSite)) and selection.estimator is not None else None
        rivals = selection.single_site_rivals(chain, group_name, strand) if chain is not None else []

        def variant_skipped(family: str, why: SkipSite) -> None:
            self.ctx.explain(PASS, f"{label}: {family} skipped: {why.code}", f"{name}: {why.detail}")

        variants, original_s, original_measured_s = selection.variants(
            site, group_name, TAG_BASE + index * TAG_STRIDE, strand, variant_skipped
        )
        if not variants:
            for rival in rivals:
                rival.variant.discard()
            self.ctx.count(PASS, f"{label}: skipped: no variant applies")
            return
        self.ctx.record(
            PASS, **{f"{name}_original_s": original_s}, **{f"{name}_{v.name}_s": v.predicted_s for v in variants}
        )
        measured = {
            candidate: t
            for candidate, t in [*((v.name, v.measured_s) for v in variants), ("original", original_measured_s)]
            if not math.isnan(t)
        }
        self.ctx.record(PASS, **{f"{name}_{candidate}_measured_s": t for candidate, t in measured.items()})
        best = selection.choose(variants, original_s, original_measured_s)
        why_not = "kept: no gain"
        detail = f"{name}: the original predicts {original_s:.4g} s, the fastest variant {min(v.predicted_s for v in variants):.4g} s"
        if measured:
            detail += f" (measured: {', '.join(f'{candidate} {t:.4g} s' for candidate, t in measured.items())})"
        if chain is not None and best is not None and rivals:
            numbers, lost = selection.chain_loses(best, chain, variants, rivals, original_measured_s)
            self.ctx.record(PASS, **{f"{name}_{key}": t for key, t in numbers.items()})
            if lost is not None:
                best, why_not, detail = None, "left to the single sites", f"{name}: {lost}"
        for rival in rivals:
            rival.variant.discard()
        discard_all_but(variants, best)
        if best is None:
            self.ctx.explain(PASS, f"{label}: {why_not}", detail)
            return
        site.commit(best)
        self.rewritten += 1
        if not math.isnan(original_s):
            self.saved_s += original_s - best.predicted_s
        self.ctx.count(PASS, f"{label}: {best.name}")
        self.ctx.record(PASS, **{f"{name}_chosen_s": best.predicted_s})


def decompose_pass(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Decompose collectives next to their matmuls; see the module docstring."""
    options = ctx.pass_options.get(PASS, DecomposeOptions(mode="off"))  # not asked for: off
    assert isinstance(options, DecomposeOptions)
    options.validate()
    if options.mode == "off":
        ctx.count(PASS, "off")
        return gm
    decomposer = _Decomposer(gm, ctx, options)
    decomposer.run()
    if decomposer.rewritten:  # new nodes (and new comm ids): annotate again, counting into a scratch context
        annotate_pass(gm, PassContext(ctx.graph_name, ctx.phase, ctx.example_inputs, strand=ctx.strand))
    return gm
