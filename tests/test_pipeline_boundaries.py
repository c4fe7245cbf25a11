"""helix_pipeline's stage boundaries: which DTensors it moves by a resharding plan, and the errors
(pure); the numerics on 4 gloo ranks are in test_helix_pipeline.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dhelix_compile.helix_runtime.strands import HelixError
from dhelix_compile.pipeline_runtime.boundaries import Declared, StageDeclarations, plan_boundaries
from dhelix_compile.resharding.plan import MeshLayout

SHAPE = (2, 5, 6)


def _on(ranks: tuple[int, ...], *placements: Placement, shape: tuple[int, ...] = SHAPE) -> Declared:
    return Declared(shape, torch.float32, "cpu", MeshLayout((len(ranks),), ranks, placements))


def _pipeline(
    out: Placement, inp: Placement, *, grads: bool = True, grad_in: Placement | None = None
) -> dict[int, StageDeclarations]:
    a, b = (0, 1), (2, 3)
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
