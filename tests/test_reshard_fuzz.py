"""``reshard`` fuzzed against torch on 4 gloo ranks: random meshes (1-D and 2-D, 1-4 ranks, any
rank order, disjoint, overlapping or the same ranks), random placements (``Shard(d)``,
``Replicate()``, ``Partial()`` sources), shapes with uneven and size-0 dims, several dtypes.

torch is the oracle (``dhelix_compile.testing.reshard_checks.check_fuzzed_cases``): where its own
``distribute_tensor`` and ``full_tensor()`` hold the tensor on both layouts, every tile, the full
tensor and the gradient must equal torch's; where torch loses it, ``reshard`` must refuse with a
``ReshardError``. The default suite draws 3 examples of 40 cases (hypothesis draws the simplest first) (one launch of the ranks each);
DHELIX_TEST_FULL=1 draws 12.
"""

from __future__ import annotations

import math
import os
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dhelix_compile.testing.multirank import run_on_ranks
from dhelix_compile.testing.reshard_checks import FuzzCase, check_fuzzed_cases

WORLD = 4
EXAMPLES = 12 if os.environ.get("DHELIX_TEST_FULL") else 3
DTYPES = ("float32", "float64", "bfloat16", "int64", "bool")


@st.composite
def meshes(draw: st.DrawFn) -> list[Any]:
    """A mesh as nested rank lists: 1-4 distinct ranks of the world in any order, 1-D or 2-D."""
    size = draw(st.integers(1, WORLD))
    ranks = draw(st.permutations(range(WORLD)))[:size]
    rows = draw(st.sampled_from([0, *(a for a in range(1, size + 1) if size % a == 0)]))
    if rows == 0:  # 1-D
        return list(ranks)
    cols = size // rows
    return [list(ranks[r * cols : (r + 1) * cols]) for r in range(rows)]


def _ndim(mesh: list[Any]) -> int:
    return 2 if isinstance(mesh[0], list) else 1


def _flat(mesh: list[Any]) -> list[int]:
    return [r for row in mesh for r in row] if _ndim(mesh) == 2 else list(mesh)


@st.composite
def cases(draw: st.DrawFn) -> FuzzCase:
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    src_mesh, dst_mesh = draw(meshes()), draw(meshes())
    shards = [Shard(d) for d in range(len(shape))] + [Shard(-1)]
    source_choices: list[Placement] = [*shards, Replicate()] + ([Partial()] if dtype != "bool" else [])
    src = tuple(draw(st.sampled_from(source_choices)) for _ in range(_ndim(src_mesh)))
    if sum(isinstance(p, Partial) for p in src) > 1:
        src = (*(Replicate() if isinstance(p, Partial) else p for p in src[:-1]), src[-1])
    dst = tuple(draw(st.sampled_from([*shards, Replicate()])) for _ in range(_ndim(dst_mesh)))
    return src_mesh, dst_mesh, src, dst, shape, dtype, draw(st.integers(0, 10_000))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: each try launches the ranks;
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],  # a failure names its case
)
@given(st.lists(cases(), min_size=40, max_size=40))
def test_reshard_equals_torch_on_random_meshes_placements_shapes_and_dtypes(drawn: list[FuzzCase]) -> None:
    results = run_on_ranks(check_fuzzed_cases, WORLD, drawn, timeout_s=300)
    failures = [f for per_rank in results for f in per_rank]
    assert failures == [], "\n".join(failures[:20])


def test_the_fuzzed_meshes_reach_permuted_two_dimensional_and_overlapping_layouts() -> None:
    """The strategy draws what the fuzz test is for, not only sorted 1-D meshes."""
    seen: set[str] = set()

    @settings(max_examples=200, deadline=None)
    @given(cases())
    def look(case: FuzzCase) -> None:
        src, dst, *_ = case
        for mesh in (src, dst):
            if _ndim(mesh) == 2 and math.prod((len(mesh), len(mesh[0]))) == 4:
                seen.add("2x2")
            if _flat(mesh) != sorted(_flat(mesh)):
                seen.add("permuted")
        a, b = set(_flat(src)), set(_flat(dst))
        seen.add("disjoint" if not a & b else "same" if a == b else "overlapping")

    look()
    assert {"2x2", "permuted", "disjoint", "overlapping", "same"} <= seen
