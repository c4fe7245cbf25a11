"""decompose: all-gather->matmul, matmul->reduce-scatter, matmul->all-reduce and all-to-all<->bmm as per-peer or chunked steps over partitioned compute.

The pass is ``decompose_pass(gm, ctx)`` (contract and reason codes: ``entry``), configured by
``DecomposeOptions`` (``options``). Per site where the cost model predicts a gain (mode
``"auto"``), or wherever it applies (modes ``"per_peer"`` / ``"chunked"``), a collective next to
its matmuls becomes P2P exchanges with each peer (``dhelix::exchange``), or k smaller
collectives, interleaved with the matmul on the blocks already there.

Modules, in the order they build on each other (no module imports a later one)::

    options              DecomposeOptions, the pattern names (CHAIN, A2A_CHAIN), MAX_PIECES / AUTO_PIECES
    emit                 Emitter: inserts nodes with meta["val"]; the exchange op by its name
    site                 the Site protocol every site implements, Variant, SkipSite and its codes,
                         transfer tags, the graph edits sites share (hoist, erase)
    row_blocks           a matmul computed block of rows by block; the per-peer sum over ranks
    all_gather_site      all-gather -> matmul(s) (and weight gradients)
    reduce_scatter_site  matmul(s) -> reduce-scatter
    all_reduce_site      matmul -> all-reduce
    all_to_all_sites     all-to-all -> bmm (dispatch) and bmm -> all-to-all (combine)
    row_region           the row-wise compute between two collectives, emitted block by block
    chain                all-gather -> row-wise compute -> reduce-scatter as one pipeline
    all_to_all_chain     dispatch all-to-all -> experts -> combine all-to-all as one pipeline
    selection            variants built, priced with cost_model.simulate, one chosen (or none)
    entry                decompose_pass: finds the sites (collective_matches), drives the
                         selection per site, commits, counts

Sites are found by ``graph_passes.collective_matches`` (find first, rewrite second).
"""

from __future__ import annotations

from graph_passes.decompose.entry import decompose_pass
from graph_passes.decompose.options import (
    A2A_CHAIN,
    AUTO_PIECES,
    CHAIN,
    DEFAULT_PATTERNS,
    MAX_PIECES,
    MODES,
    PASS,
    SINGLE_SITE_PATTERNS,
    DecomposeOptions,
    Mode,
)
from graph_passes.decompose.site import TAG_BASE, TAG_STRIDE

__all__ = [
    "A2A_CHAIN",
    "AUTO_PIECES",
    "CHAIN",
    "DEFAULT_PATTERNS",
    "MAX_PIECES",
    "MODES",
    "PASS",
    "SINGLE_SITE_PATTERNS",
    "TAG_BASE",
    "TAG_STRIDE",
    "DecomposeOptions",
    "Mode",
    "decompose_pass",
]
