"""helix_pipeline's stage boundaries: which DTensors it moves by a resharding plan, and the errors
(pure); the numerics on 4 gloo ranks are in test_helix_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dhelix_compile.helix_runtime.strand_handoff import HelixError
from dhelix_compile.pipeline_runtime.boundaries import Declared, StageDeclarations, plan_boundaries
from dhelix_compile.resharding.plan import MeshLayout

SHAPE = (2, 5, 6)


def _on(ranks: tuple[int, ...], *placements: Placement, shape: tuple[int, ...] = SHAPE) -> Declared:
    return Declared(shape, torch.float32, "cpu", MeshLayout((len(ranks),), ranks, placements))


def _pipeline(
    out: Placement,
    inp: Placement,
    *,
    grads: bool = True,
    grad_in: Placement | None = None,
    b: tuple[int, ...] = (2, 3),
) -> dict[int, StageDeclarations]:
    a = (0, 1)
    return {
        0: {
            "inputs": (None,),
            "outputs": (_on(a, out),),
            "input_grads": (None,),
            "output_grads": (_on(a, out),) if grads else None,
        },
        1: {
            "inputs": (_on(b, inp),),
            "outputs": (None,),
            "input_grads": (_on(b, grad_in or inp),) if grads else None,
            "output_grads": (None,),
        },
    }


def test_a_declared_dtensor_moves_forward_and_its_gradient_back() -> None:
    forward, backward = plan_boundaries(_pipeline(Replicate(), Shard(1)))
    assert (forward.from_stage, forward.to_stage, forward.backward) == (0, 1, False)
    assert (backward.from_stage, backward.to_stage, backward.backward) == (1, 0, True)
    # Replicate on [0, 1] -> Shard(1) on [2, 3]: each destination gets only its rows, from a different replica
    senders = {piece.sender for piece in forward.plan.pieces}
    assert senders == {0, 1}
    assert sorted(forward.plan.dest_tiles[r].shape for r in (2, 3)) == [(2, 2, 6), (2, 3, 6)]
    assert forward.tag != backward.tag


def test_a_partial_gradient_is_planned_from_its_reduced_layout() -> None:
    (_, backward) = plan_boundaries(_pipeline(Shard(2), Replicate(), grad_in=Partial()))
    assert not backward.plan.source.has_partial


def test_plain_tensors_and_undeclared_stages_keep_torchs_sends() -> None:
    declared = _pipeline(Shard(1), Shard(2))
    declared[1]["inputs"] = (None,)
    assert plan_boundaries(declared) == []
    assert plan_boundaries({0: {"outputs": None}, 1: {"inputs": None}}) == []


def test_bad_declarations_get_errors_that_name_the_boundary() -> None:
    declared = _pipeline(Shard(1), Shard(2))
    declared[1]["inputs"] = (_on((2, 3), Shard(2), shape=(2, 5, 7)),)
    with pytest.raises(HelixError, match=r"stage 0's output 0 to stage 1: declared as \[2, 5, 6\]"):
        plan_boundaries(declared)
    with pytest.raises(HelixError, match="declare its gradient as a DTensor on both sides"):
        plan_boundaries(_pipeline(Shard(1), Shard(2), grads=False))
    with pytest.raises(HelixError, match="a received tensor holds values"):
        plan_boundaries(_pipeline(Partial(), Shard(2)))  # its gradient would arrive as Partial()
    declared = _pipeline(Shard(1), Shard(2))
    declared[1]["inputs"] = (_on((2, 3), Shard(2)), _on((2, 3), Shard(2)))
    with pytest.raises(HelixError, match="stage 0 declares 1 outputs and stage 1 2 inputs"):
        plan_boundaries(declared)


def test_a_stage_mesh_listed_out_of_order_gets_the_tiles_torchs_collectives_put_on_its_ranks() -> None:
    """Stage 1 on ``[3, 2]``: torch's collectives put tile 0 of a ``Shard`` on rank 2 (the first
    of its sorted group), though ``get_coordinate()`` lists rank 3 first; torch's own sends pair
    rank 0 with rank 3 (the pipeline group ``{0, 3}``) and would hand rank 3 tile 0. The plan
    sends rank 2 the first columns, forward and back. Uneven shards on that mesh are a layout
    torch itself does not hold (``mesh_positions.layout_mismatch``): refused, naming the mesh."""
    forward, backward = plan_boundaries(_pipeline(Shard(2), Shard(2), b=(3, 2)))
    for rank, columns in ((2, 0), (3, 3)):
        assert forward.plan.dest_tiles[rank].offset == (0, 0, columns)
        assert forward.plan.dest_tiles[rank].shape == (2, 5, 3)
        assert backward.plan.source_tiles[rank] == forward.plan.dest_tiles[rank]
    assert {(p.sender, p.receivers) for p in forward.plan.pieces} == {(0, (2,)), (1, (3,))}
    with pytest.raises(HelixError, match=r"stage 0's output 0 to stage 1: .*on the mesh \[3, 2\].*uneven shards"):
        plan_boundaries(_pipeline(Replicate(), Shard(1), b=(3, 2)))  # 5 rows over 2 ranks
