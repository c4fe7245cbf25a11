"""The decompose pass's knobs: :class:`DecomposeOptions` and the names it takes.

Contract
    ``DecomposeOptions`` is frozen; ``validate()`` raises ``ValueError`` naming the bad field and
    returns the options. ``pass_options()["decompose"]`` (built by the backend from its config)
    is one; a missing entry means the pass is not asked for and does nothing. The defaults are
    the backend's (``DHelixConfig``'s ``decompose*`` fields; ``tests/test_config.py`` checks
    that every pass's options default to the config's).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

#: The pass's name: its key in ``PassContext.stats``, ``notes``, ``records`` and ``pass_options``.
PASS = "decompose"
#: The cross-site pattern (``chain``), opt-in.
CHAIN = "all_gather_chain"
#: Expert parallelism's cross-site pattern (``all_to_all_chain``), on by default.
A2A_CHAIN = "all_to_all_chain"
#: The single-site patterns, in the order the pass tries them (after the chains that are enabled).
SINGLE_SITE_PATTERNS: tuple[str, ...] = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "all_to_all_compute",
    "bmm_all_to_all",
)
#: The patterns the pass tries by default, in order.
DEFAULT_PATTERNS: tuple[str, ...] = (A2A_CHAIN, *SINGLE_SITE_PATTERNS)
Mode = Literal["auto", "per_peer", "chunked", "off"]
MODES: tuple[str, ...] = ("auto", "per_peer", "chunked", "off")

#: Largest ``pieces``: with ``site.TAG_STRIDE`` tags per site, a per-peer site's transfers keep
#: distinct tags for groups of up to 32 ranks.
MAX_PIECES = 16
#: The piece counts the cost model chooses from when ``DecomposeOptions.pieces`` is 0.
AUTO_PIECES: tuple[int, ...] = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class DecomposeOptions:
    """Knobs of the decompose pass (``pass_options()["decompose"]``)."""

    mode: Mode = "auto"
    """``"auto"``: per site, the cheapest per-peer variant (and chunked(k) with ``auto_chunked``),
    only if the cost model predicts a gain; ``"per_peer"`` / ``"chunked"``: that family wherever
    it applies, gain or not (tests, benchmarks); ``"off"``: the pass does nothing."""
    auto_chunked: bool = False
    """``"auto"`` also tries chunked(k). Off by default: k smaller collectives cost more than
    the site model sees (each is a whole collective call, with its CPU and latency, that the
    step pays where the site alone does not), and on the TP+SP reference model ``auto`` with
    chunked variants picked chunked(4) for a few percent predicted and measured about 12%
    slower than per-peer (BENCHMARKS.md)."""
    max_chunks: int = 4
    """Largest k tried by the chunked variant (k = 2..max_chunks that divide the shape)."""
    pieces: int = 0
    """How many pieces each per-peer transfer is split into: ``P >= 1`` forces P, ``0`` lets the
    cost model pick among ``AUTO_PIECES`` (those that divide the shape). The compute on piece p
    of a peer's shard runs while piece p+1 is in flight, and a remote partial's piece is sent as
    soon as it is computed. Measured, pieces pay on the dim-512 MLP block and cost more than they
    hide on the dim-256 TP+SP model, where the per-op model misses what transfers in pieces cost
    on CPU cores; with an estimator that measures (``Estimator.segment_times``) the candidates
    are run and the measurements decide (``selection``)."""
    min_gain_ratio: float = 0.02
    """``"auto"`` rewrites a site only if its time drops by at least this fraction; of variants
    within this fraction of the fastest, the one with the fewest pieces is chosen."""
    patterns: tuple[str, ...] = DEFAULT_PATTERNS
    """Which patterns may be rewritten. ``A2A_CHAIN`` (an MoE layer's dispatch, experts and
    combine as one pipeline, ``all_to_all_chain``) is tried before the single sites and priced
    against them. Add ``CHAIN`` (an all-gather and a reduce-scatter with
    row-wise compute between them as one pipeline, ``chain``; tried before the single
    sites, whose two collectives stay sites of their own when it is not rewritten). Not by
    default: measured slower than the two sites in pieces on the MLP block, and the whole-graph
    comparison is within the cost model's error there (BENCHMARKS.md)."""

    def validate(self) -> DecomposeOptions:
        if self.mode not in MODES:
            raise ValueError(f"decompose mode {self.mode!r}: choose one of {MODES}")
        if self.max_chunks < 1:
            raise ValueError(f"decompose max_chunks={self.max_chunks}: must be >= 1")
        if not 0 <= self.pieces <= MAX_PIECES:
            raise ValueError(f"decompose pieces={self.pieces}: must be in [0, {MAX_PIECES}] (0: the cost model picks)")
        if not 0.0 <= self.min_gain_ratio < 1.0:
            raise ValueError(f"decompose min_gain_ratio={self.min_gain_ratio}: must be in [0, 1)")
        return self
