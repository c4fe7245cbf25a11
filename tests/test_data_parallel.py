"""``dhelix_compile.data_parallel`` on gloo ranks against PyTorch's own DDP and FSDP2: losses,
gradients and the parameters after an optimizer step, eager, through ``backend="dhelix"`` and
through ``helix``; with tensor parallelism on a 2-D mesh; mixed precision; checkpoints; errors.

The rank side is ``dhelix_compile.testing.data_parallel_checks``. DHELIX_TEST_FULL=1 adds the
4-rank helix runs, Hugging Face Llama and the remaining combinations (the default suite's budget).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dhelix_compile.testing.data_parallel_checks import (
    check_checkpoint,
    check_data_parallel_cases,
    check_uneven_tensor_parallel,
    data_parallel_errors,
    graph_collectives,
    permuted_mesh_errors,
)
from dhelix_compile.testing.multirank import run_on_ranks


def _run(world_size: int, cases: list[dict[str, Any]], timeout_s: float = 600) -> None:
    reports = run_on_ranks(check_data_parallel_cases, world_size, cases, timeout_s=timeout_s)
    for rank_reports in reports:  # each rank raised on a mismatch; the reports say what ran
        assert len(rank_reports) == len(cases)
    # the DP ranks saw different data, so they hold different losses (each its own, as in eager)
    assert reports[0][0]["losses"] != reports[-1][0]["losses"]


def test_two_ranks_match_ddp_and_fsdp2_eager() -> None:
    """And helix on a replicated model: it turns gradient sync off for all micro-batches but the
    last by itself, and equals DDP with ``no_sync`` (eager codegen here; Inductor under FULL)."""
    _run(
        2,
        [
            {"mode": "shard", "runner": "eager"},
            {"mode": "replicate", "runner": "eager"},
            {"mode": "shard", "runner": "eager", "param_dtype": "bfloat16", "reduce_dtype": "float32"},
            {"mode": "replicate", "runner": "helix", "microbatches": 3, "codegen": "eager"},
        ],
    )


@pytest.mark.full  # CI measured 17:48
def test_helix_runs_a_sharded_model() -> None:
    """helix's merged graphs hold the reduce-scatters of one micro-batch beside the all-gathers of
    the next (eager codegen)."""
    _run(2, [{"mode": "shard", "runner": "helix", "codegen": "eager"}])


@pytest.mark.parametrize("mode", ["shard", pytest.param("replicate", marks=pytest.mark.full)])
def test_dp2_x_tp2_matches_fsdp2_on_the_2d_mesh(mode: str) -> None:
    _run(4, [{"mode": mode, "runner": "eager", "tp": 2}])


@pytest.mark.full
def test_dp2_x_tp2_helix_replicated() -> None:
    """Sharded, the same run is test_meshes_listed_out_of_order_through_the_compiled_paths's 4-rank
    case (the 2x2 mesh listed out of order)."""
    _run(4, [{"mode": "replicate", "runner": "helix", "tp": 2}])


def test_meshes_that_list_their_ranks_out_of_order_match_ddp_and_fsdp2() -> None:
    """A rank's shard is the one torch's collectives (and FSDP2) put at its place in the DP
    group, not at its ``get_coordinate()``: on ``[1, 0]`` rank 0 is at coordinate 1 but holds
    shard 0. Each stored parameter's ``full_tensor()`` is the unwrapped one, and training equals
    DDP's and FSDP2's on the same mesh. On ``[[3, 2], [1, 0]]`` both dims are listed down."""
    _run(2, [{"mode": mode, "runner": "eager", "mesh_ranks": [1, 0]} for mode in ("shard", "replicate")])
    _run(4, [{"mode": "shard", "runner": "eager", "tp": 2, "mesh_ranks": [[3, 2], [1, 0]]}])


@pytest.mark.full
@pytest.mark.timeout(600)
def test_meshes_listed_out_of_order_through_the_compiled_paths() -> None:
    """Compiled, the gathers and reductions are functional collectives on the DP group (all-to-alls
    on gloo: the ``gloo_collectives`` pass); the shards stay where torch puts them. The sharded
    model through ``dhelix`` and ``helix`` on 2 ranks and through ``helix`` on DP=2 x TP=2 runs
    here only: a mesh listed in order is the case with no permutation."""
    _run(2, [{"mode": "shard", "runner": runner, "mesh_ranks": [1, 0]} for runner in ("dhelix", "helix")])
    _run(4, [{"mode": "shard", "runner": "helix", "tp": 2, "mesh_ranks": [[3, 2], [1, 0]]}])


def test_uneven_tensor_parallel_shards_are_stored_alike_on_every_rank() -> None:
    """TP splits a ``[5, 4]`` weight into ``[3, 4]`` and ``[2, 4]`` tiles: the DP shard dim is one
    both tiles split evenly (dim 1), the same on every rank (each rank chose from its own tile's
    shape before: dim 1 beside dim 0), and the ``[5]`` bias stays replicated over DP; losses and
    gradients equal the unwrapped model's on every DP batch."""
    placed = {
        mode: run_on_ranks(check_uneven_tensor_parallel, 4, mode, timeout_s=180) for mode in ("shard", "replicate")
    }
    for per_rank in placed.values():  # each rank checked that the others store what it stores
        assert per_rank == [per_rank[0]] * 4
    shard, replicate = placed["shard"][0], placed["replicate"][0]
    assert shard["0.weight"] == "(Shard(dim=1), Shard(dim=0))" and shard["0.bias"] == "(Replicate(), Shard(dim=0))"
    assert replicate["0.weight"] == "(Replicate(), Shard(dim=0))"


def test_layouts_torch_does_not_hold_on_a_mesh_listed_out_of_order_are_refused() -> None:
    """``mesh_positions.layout_mismatch``: torch's own ``full_tensor()`` would not return the
    parameter. The same mesh in ``replicate`` mode holds (no DP shard for the groups to cross)."""
    errors = run_on_ranks(permuted_mesh_errors, 4, timeout_s=180)[0]
    across = errors["groups across DP positions"]
    assert across.startswith("data_parallel cannot store parameter 0.weight"), across
    assert "on the mesh [[2, 1], [3, 0]]" in across and "share a dim-1 process group" in across, across
    uneven = errors["uneven TP shards"]
    assert "on the mesh [[1, 0], [3, 2]]" in uneven and "uneven shards" in uneven, uneven


@pytest.mark.full
@pytest.mark.timeout(600)
def test_two_ranks_remaining_combinations() -> None:
    """Sharded through ``dhelix`` and ``helix`` in float32: on the mesh [1, 0]
    (test_meshes_listed_out_of_order_through_the_compiled_paths); replicated through ``helix`` in
    float32 on DP=2 x TP=2 (test_dp2_x_tp2_helix_replicated), in bfloat16 here."""
    _run(
        2,
        [
            {"mode": "replicate", "runner": "dhelix"},
            {"mode": "shard", "runner": "helix", "param_dtype": "bfloat16", "reduce_dtype": "float32"},
            {"mode": "replicate", "runner": "helix", "param_dtype": "bfloat16"},
        ],
    )


@pytest.mark.full
@pytest.mark.timeout(600)
def test_hugging_face_llama() -> None:
    """Sharded and replicated through ``helix`` on 2 ranks; DP=2 x TP=2 runs on the reference model
    (test_meshes_listed_out_of_order_through_the_compiled_paths, test_dp2_x_tp2_helix_replicated)."""
    pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")
    _run(2, [{"mode": mode, "runner": "helix", "model": "hf_llama"} for mode in ("shard", "replicate")])


def test_collectives_are_in_the_forward_and_backward_graphs() -> None:
    """Two micro-batches, gradient sync off for the first: sharded gradients are reduce-scattered
    by every backward, replicated ones all-reduced by the last only, with what the first left in
    ``param.grad`` (``dhelix::with_accumulated_grad``, one per parameter)."""
    shard, replicate = run_on_ranks(graph_collectives, 2, ["shard", "replicate"], timeout_s=180)[0]
    params = 21  # the reference model's
    assert shard["forward"] == {"all_gather_into_tensor": params}
    assert shard["backward_accumulating"] == shard["backward"] == {"reduce_scatter_tensor": params}
    assert replicate["forward"] == {}
    assert replicate["backward_accumulating"] == {}
    assert replicate["backward"] == {"all_reduce": params, "with_accumulated_grad": params}


@pytest.mark.full
def test_reshard_after_forward_gathers_again_in_the_backward_and_keeps_the_gradients() -> None:
    """``reshard_after_forward=True`` (FSDP2's name): the backward gathers every weight its
    gradients read again (all but the embedding table, whose backward needs only the token ids)
    instead of keeping the forward's; gradients and the optimizer step still equal FSDP2's."""
    (regathered,) = run_on_ranks(graph_collectives, 2, ["shard"], True, timeout_s=180)[0]
    params = 21
    assert regathered["forward"] == {"all_gather_into_tensor": params}
    for backward in ("backward_accumulating", "backward"):
        assert regathered[backward] == {"all_gather_into_tensor": params - 1, "reduce_scatter_tensor": params}
    _run(2, [{"mode": "shard", "runner": "dhelix", "codegen": "eager", "reshard_after_forward": True}])


@pytest.mark.parametrize(
    "mode,world_size,tp",
    [
        ("shard", 2, 1),
        pytest.param("replicate", 2, 1, marks=pytest.mark.full),
        pytest.param("shard", 4, 2, marks=pytest.mark.full),
    ],
)
def test_checkpoints_round_trip_and_load_into_the_unwrapped_model(
    tmp_path: Path, mode: str, world_size: int, tp: int
) -> None:
    counts = run_on_ranks(check_checkpoint, world_size, str(tmp_path / "checkpoint"), mode, tp, timeout_s=180)
    assert counts == [counts[0]] * world_size and counts[0] > 0


def test_bad_input_gets_clear_errors() -> None:
    errors = run_on_ranks(data_parallel_errors, 2, timeout_s=120)[1]
    assert "needs a DeviceMesh" in errors["not a mesh"]
    assert "1-D data-parallel mesh" in errors["2-D mesh"]
    assert "rank 1 is not in the DP mesh" in errors["rank outside the mesh"]
    assert "mode must be one of" in errors["unknown mode"]
    assert "floating-point torch.dtype" in errors["integer param_dtype"]
    assert "group_timeout_s must be a number of seconds > 0, got 0" in errors["zero group_timeout_s"]
    assert "no parameters" in errors["no parameters"]
    assert "is on meta" in errors["parameters on another device"]
    assert "already sharded by FSDP2" in errors["FSDP2 inside"]
    assert "DistributedDataParallel" in errors["DDP"]
    assert "already wrapped by data_parallel" in errors["wrapped twice"]
    for case in ("compiled by torch.compile", "compiled in place"):
        assert "already compiled" in errors[case] and "uncompiled module first" in errors[case], errors[case]
    assert "is the mesh of the tensor-parallel parameters" in errors["the TP mesh as DP mesh"]
    listed_down = errors["uneven TP shards on a mesh listed out of order"]
    assert "parameter 0.weight" in listed_down and "on the mesh [[1, 0]]" in listed_down, listed_down
