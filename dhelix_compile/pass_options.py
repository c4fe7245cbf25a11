"""Config -> the options object of each pass: every pass knob a user may set is a ``DHelixConfig`` field.

One table, :data:`FIELDS`, says which config field feeds which field of which pass's options
dataclass; :func:`pass_options` builds them all from it. ``tests/test_config.py`` checks the table
covers every field of every options class (but :data:`DERIVED`), so a knob added to a pass
without a config field fails a test instead of being unreachable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dhelix_compile.config import DHelixConfig
from graph_passes.bucket_collectives import BucketOptions
from graph_passes.decompose import A2A_CHAIN, CHAIN, SINGLE_SITE_PATTERNS, DecomposeOptions
from graph_passes.interleave import InterleaveOptions
from graph_passes.reorder import ReorderOptions

#: pass name -> (its options class, {options field: config field}).
FIELDS: dict[str, tuple[type, dict[str, str]]] = {
    "bucket_collectives": (BucketOptions, {"cap_mb": "bucket_mb"}),
    "reorder": (
        ReorderOptions,
        {
            "memory_budget_ratio": "memory_budget_ratio",
            "max_in_flight": "max_in_flight",
            "max_issue_distance": "max_issue_distance",
        },
    ),
    "decompose": (
        DecomposeOptions,
        {
            "mode": "decompose",
            "max_chunks": "decompose_max_chunks",
            "auto_chunked": "decompose_auto_chunked",
            "pieces": "decompose_pieces",
            "min_gain_ratio": "decompose_min_gain_ratio",
        },
    ),
    "interleave": (
        InterleaveOptions,
        {
            "defer_weight_grads": "interleave_defer_weight_grads",
            "refine_evals": "interleave_refine_evals",
            "timed_width": "interleave_timed_width",
            "measure_pairs": "interleave_measure_pairs",
            "slice_ratio": "interleave_slice_ratio",
        },
    ),
}

#: Options fields computed from config fields rather than copied: (pass, field) -> config fields read.
DERIVED: dict[tuple[str, str], tuple[str, ...]] = {
    ("decompose", "patterns"): ("decompose_chains", "decompose_all_to_all_chains"),
    ("interleave", "memory_budget_ratio"): ("interleave_memory_budget_ratio",),
}


def _derived(config: DHelixConfig) -> dict[str, dict[str, Any]]:
    chains = ((CHAIN,) if config.decompose_chains else ()) + (
        (A2A_CHAIN,) if config.decompose_all_to_all_chains else ()
    )
    return {
        "decompose": {"patterns": chains + SINGLE_SITE_PATTERNS},
        "interleave": {"memory_budget_ratio": config.interleave_budget_ratio},
    }


def pass_options(config: DHelixConfig) -> dict[str, Any]:
    """Per-pass options objects built from the config, keyed by pass name."""
    derived = _derived(config)
    return {
        name: cls(**{field: getattr(config, source) for field, source in fields.items()}, **derived.get(name, {}))
        for name, (cls, fields) in FIELDS.items()
    }


def unmapped_fields() -> list[str]:
    """``pass.field`` of every options field neither copied nor derived from the config (should be none)."""
    return [
        f"{name}.{f.name}"
        for name, (cls, fields) in FIELDS.items()
        for f in dataclasses.fields(cls)
        if f.name not in fields and (name, f.name) not in DERIVED
    ]
