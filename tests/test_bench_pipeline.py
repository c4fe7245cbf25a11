"""The pipeline benchmark workload (``bench.pipeline_parallel``): its transfers follow the schedule's stage
layout, and on two gloo ranks every variant trains the same gradients and the P2P replay completes. Each
variant's own transfers on the gloo bench: its recorded sends and receives are the declared ones, paired
up across the ranks (``bench.measure.pair_transfers``) and replayed without a deadlock, and the summary
sets each variant beside its own limit and bytes."""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch

from dhelix_compile.bench.measure import SentCollective, SentReplay, pair_transfers
from dhelix_compile.bench.pipeline_parallel import P2PReplay, Transfer, build_pipeline, run_pipeline_variants
from dhelix_compile.bench.run import markdown, summarize
from dhelix_compile.testing.multirank import run_on_ranks


@pytest.mark.parametrize(
    ("kind", "crossings"),
    [
        ("dualpipev", [(0, 1), (1, 0), (1, 0), (0, 1)]),  # stage 0 -> 1 and back, 2 -> 3 and back
        ("1f1b", [(0, 1), (1, 0)]),
        ("interleaved_1f1b", [(0, 1), (1, 0), (1, 0), (0, 1), (0, 1), (1, 0)]),
    ],
)
def test_transfers_are_the_activations_and_gradients_that_cross_ranks(kind: str, crossings: list) -> None:
    """DualPipeV folds stages 1 and 2 onto rank 1 (no transfer between them); interleaved 1F1B
    loops 0, 2 on rank 0 and 1, 3 on rank 1 (every stage boundary crosses)."""
    pipeline = build_pipeline(kind, "tiny", 0, 2, microbatches=3, gen=torch.Generator().manual_seed(0))
    per_microbatch = len(pipeline.transfers) // 3
    assert [(t.src, t.dst) for t in pipeline.transfers[:per_microbatch]] == crossings
    assert pipeline.transfers == pipeline.transfers[:per_microbatch] * 3
    assert all(t.shape == (2, 32, 64) for t in pipeline.transfers)  # tiny: batch 2, seq 32, dim 64


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("kind", ["1f1b", "interleaved_1f1b", "dualpipev"])
def test_transfers_pair_the_ranks_torchs_schedule_runs_the_stages_on(kind: str, pp: int) -> None:
    """The replay's ranks are the pipeline group's ranks that torch's schedule maps each stage to
    (``stage_index_to_group_rank``, read from the schedule itself on each rank of a fake world);
    the bench's group is the default one, where a group rank is the global rank that
    ``dist.isend`` takes."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from cost_model.testing import fake_world
    from dhelix_compile.testing.pipeline_checks import build_schedule, stage_layout

    owners = []
    for rank in range(pp):
        with fake_world(pp, rank):
            stages = [
                PipelineStage(
                    nn.Linear(2, 2),
                    i,
                    pp * len(stage_layout(kind, pp, rank)),
                    torch.device("cpu"),
                    input_args=torch.zeros(1, 2),
                    output_args=torch.zeros(1, 2),
                )
                for i in stage_layout(kind, pp, rank)
            ]
            build_schedule(kind, stages, 2 * pp, lambda y, _: y.sum())
            owners.append(dict(stages[0].stage_index_to_group_rank))
    assert owners == [owners[0]] * pp
    owner = owners[0]
    crossing = [
        pair
        for stage in range(len(owner) - 1)
        if owner[stage] != owner[stage + 1]
        for pair in ((owner[stage], owner[stage + 1]), (owner[stage + 1], owner[stage]))
    ]
    pipeline = build_pipeline(kind, "tiny", 0, pp, microbatches=1, gen=torch.Generator().manual_seed(0))
    assert [(t.src, t.dst) for t in pipeline.transfers] == crossing


def test_replay_keeps_only_this_ranks_transfers() -> None:
    transfers = [Transfer(0, 1, (2,)), Transfer(2, 3, (2,)), Transfer(3, 0, (4,))]
    replay = P2PReplay(transfers, rank=0)
    assert len(replay) == 2 and [b.shape for b in replay.buffers] == [(2,), (4,)]


def test_unknown_schedule_and_variant_are_named() -> None:
    with pytest.raises(ValueError, match="gpipe"):
        build_pipeline("gpipe", "tiny", 0, 2, 2, torch.Generator())
    pipeline = build_pipeline("1f1b", "tiny", 0, 2, 2, torch.Generator())
    with pytest.raises(ValueError, match="helix_pipeline"):
        pipeline.step_function("helix", {})


@pytest.mark.multirank
@pytest.mark.full
def test_every_variant_trains_the_same_gradients_on_two_ranks() -> None:
    """Inductor-compiled stages under the looped schedule (torch runs DualPipeV's split backward on
    them with other gradients: BENCHMARKS.md), helix_pipeline under the folded one."""
    runs = {
        "interleaved_1f1b": ["pipeline_eager", "pipeline_inductor"],
        "dualpipev": ["pipeline_eager", "helix_pipeline"],
    }
    for kind, variants in runs.items():
        sums = run_on_ranks(
            run_pipeline_variants, 2, kind, "tiny", 4, variants, timeout_s=300, options={"codegen": "eager"}
        )
        for rank, per_variant in enumerate(sums):
            eager = per_variant["pipeline_eager"]
            for name, value in per_variant.items():
                assert value == pytest.approx(eager, rel=1e-4, abs=1e-5), f"{kind} rank {rank}: {name}"


# ------------------------------------------------------------------ each variant's own transfers


def _calls(ops: str, peer: int, shape: tuple[int, ...] = (2, 32, 64)) -> list[SentCollective]:
    """``"s r a"``: a send to ``peer``, a receive from it, an all-reduce; float32 of ``shape``."""
    nbytes = 4 * math.prod(shape)
    kinds = {"s": ("send", nbytes, peer), "r": ("recv", 0, peer), "a": ("all_reduce", nbytes, None)}
    return [SentCollective(kinds[op][0], shape, "float32", kinds[op][1], peer=kinds[op][2]) for op in ops.split()]


def _check_pairs_within_each_transfer(every_rank: list[list[SentCollective]], plan: list) -> None:
    """Each rank's calls in its recorded order, once each; every send's receive in its transfer;
    every rank in every collective's transfer: no transfer waits for a later one."""
    for rank, calls in enumerate(every_rank):
        assert [i for transfer in plan for i in transfer[rank]] == list(range(len(calls)))
    for transfer in plan:
        channels: Counter = Counter()
        for rank, indices in enumerate(transfer):
            for c in (every_rank[rank][i] for i in indices):
                if c.op == "send":
                    channels[(rank, c.peer)] += 1
                elif c.op == "recv":
                    channels[(c.peer, rank)] -= 1
                else:
                    assert all(part for part in transfer), "a collective's transfer holds every rank"
        assert not +channels and not -channels, channels


def test_a_1f1b_steps_sends_pair_into_the_transfers_its_schedule_kept_in_flight() -> None:
    """Two ranks of 1F1B over 4 micro-batches, as the process group recorded them (rank 0 sends F1
    before it receives B0, rank 1 sends B0 before it receives F1): each steady-state pair is one
    transfer, so neither rank waits for a send its peer has not yet received."""
    every_rank = [_calls("s s r s r s r r", peer=1), _calls("r s r s r s r s", peer=0)]
    plan = pair_transfers(every_rank)
    assert plan == [[[0], [0]], [[1, 2], [1, 2]], [[3, 4], [3, 4]], [[5, 6], [5, 6]], [[7], [7]]]
    _check_pairs_within_each_transfer(every_rank, plan)
    replay = SentReplay(every_rank[0], 2, [transfer[0] for transfer in plan])
    assert len(replay) == 5 and replay.transfers[1] == [1, 2]


def test_transfers_on_four_ranks_leave_out_the_ranks_that_take_no_part() -> None:
    """A 4-stage chain (F0 down, B0 up) with a collective on every rank between: the ranks a
    transfer does not involve have an empty part, and the collective waits for every rank."""
    every_rank = [
        _calls("s a r", peer=1),
        [*_calls("r", 0), *_calls("s", 2), *_calls("a", 0), *_calls("r", 2), *_calls("s", 0)],
        [*_calls("r", 1), *_calls("s", 3), *_calls("a", 0), *_calls("r", 3), *_calls("s", 1)],
        _calls("r a s", peer=2),
    ]
    plan = pair_transfers(every_rank)
    _check_pairs_within_each_transfer(every_rank, plan)
    assert plan[0] == [[0], [0], [], []]  # F0 from stage 0 to 1, which ranks 2 and 3 do not see
    assert [len(part) for part in plan[1]] == [1, 2, 3, 2]  # up to and with the all-reduce
    assert SentReplay(every_rank[3], 4, [transfer[3] for transfer in plan]).issue(0) == []


@pytest.mark.parametrize(
    ("every_rank", "message"),
    [
        ([_calls("s s", 1), _calls("r", 0)], "rank 0's call 1 .* has no peer: rank 0 sent 2 tensors to rank 1"),
        ([_calls("s", 1), _calls("r", 0, shape=(3,))], r"meets rank 1's call 0 \(recv of 3 float32\)"),
        ([_calls("a", 0), _calls("a a", 0)], "different numbers of collectives"),
        ([_calls("s", 0), _calls("r", 0)], "names peer 0"),
    ],
)
def test_calls_that_do_not_pair_up_are_named(every_rank: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pair_transfers(every_rank)


def test_the_summary_sets_each_pipeline_variant_beside_its_own_limit_and_bytes() -> None:
    """Each pipeline variant's own sends and receives (the worker's ``own``), against its own
    T_compute, and no ceiling shared by every variant."""

    def own(t_comm_s: float, wire: int) -> dict:
        return {
            "t_comm_s": [t_comm_s] * 3,
            "wire_bytes_per_step": wire,
            "transfers_per_step": 8,
            "collectives": {"recv": 4, "send": 4},
            "ceiling": None,
        }

    link = {
        "model": "tiny",
        "parallel": "tp_sp",
        "pipeline": "1f1b",
        "world_size": 2,
        "repeats": 3,
        "step_s": {"pipeline_inductor": [0.200] * 3, "helix_pipeline": [0.180] * 3},
        "own": {"pipeline_inductor": own(0.060, 524_288), "helix_pipeline": own(0.050, 524_288)},
        "errors": {"pipeline_eager": "recording its collectives: ..."},
    }
    compute = {"step_s": {"pipeline_inductor": [0.150] * 3, "helix_pipeline": [0.160] * 3, "pipeline_eager": [0.3]}}
    summary = summarize(link, compute, "veth")
    helix = summary["variants"]["helix_pipeline"]
    assert (helix["t_compute_s"], helix["t_comm_s"], helix["limit_s"]) == (0.160, 0.050, 0.160)
    assert helix["hidden_share"] == pytest.approx((0.160 + 0.050 - 0.180) / 0.050)
    assert (helix["wire_bytes_per_step"], helix["transfers_per_step"]) == (524_288, 8)
    assert summary["t_comm_variant"] == "pipeline_inductor" and summary["ceiling"] is None
    assert "pipeline_eager" in summary["errors"]
    rows = {line.split("|")[1].strip(): line for line in markdown(summary).splitlines() if line.startswith("| ")}
    cells = [c.strip() for c in rows["helix_pipeline"].strip("|").split("|")]
    assert cells[4:8] == ["160.0", "50.0", "160.0", "1.12"] and cells[10:12] == ["0.52", "8"]
    assert "*ceiling*" not in rows


def _own_pipeline_bounds(rank: int, world_size: int, runs: dict[str, list[str]]) -> dict[str, dict]:
    """Per schedule of ``runs`` (schedule -> variants): this rank's declared transfers, each
    variant's recorded calls, and the worker's own bounds (its transfers paired up, replayed alone
    and under 20 ms of compute)."""
    from dhelix_compile.bench.measure import record_sent_collectives
    from dhelix_compile.bench.worker import _own_bounds

    found: dict[str, dict] = {}
    for kind, variants in runs.items():
        gen = torch.Generator().manual_seed(0)  # DualPipeV: a micro-batch per stage at least
        pipeline = build_pipeline(kind, "tiny", rank, world_size, 2 * world_size, gen)
        steps = {}
        for variant in variants:
            steps[variant] = pipeline.step_function(variant, {"codegen": "eager", "cost_model": "analytic"})
            steps[variant]()  # compiles
        recorded = {
            variant: [(c.op, c.peer, c.shape, c.wire_bytes) for c in record_sent_collectives(step, rank, world_size)]
            for variant, step in steps.items()
        }
        own, errors = _own_bounds(steps, dict.fromkeys(variants, 0.020), 0.0, 20.0, 3, rank)
        declared = [(t.src, t.dst, t.shape) for t in pipeline.transfers if rank in (t.src, t.dst)]
        found[kind] = {"declared": declared, "recorded": recorded, "own": own, "errors": errors}
    return found


def _check_own_pipeline_bounds(results: list[dict[str, dict]], runs: dict[str, list[str]]) -> None:
    for rank, per_kind in enumerate(results):
        assert per_kind.keys() == runs.keys()
        for kind, found in per_kind.items():
            assert found["errors"] == {}, (kind, found["errors"])
            declared = Counter(
                ("send", dst, shape) if src == rank else ("recv", src, shape) for src, dst, shape in found["declared"]
            )
            sent_bytes = sum(4 * math.prod(shape) for src, _, shape in found["declared"] if src == rank)
            for variant in runs[kind]:
                calls = found["recorded"][variant]
                assert Counter((op, peer, shape) for op, peer, shape, _ in calls) == declared, (kind, rank, variant)
                assert sum(wire for *_, wire in calls) == sent_bytes
                own = found["own"][variant]  # the replay completed, alone and under compute
                assert min(own["t_comm_s"]) > 0 and own["ceiling"]["in_flight"].keys() == {1, 2}
                assert own["collectives"].keys() == {"send", "recv"} and own["wire_bytes_per_step"] >= sent_bytes


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_each_variants_own_transfers_are_the_declared_ones_and_replay_on_two_ranks() -> None:
    """On 2 gloo ranks, every schedule: the sends and receives each variant's step made (recorded at
    the process group) are the workload's declared transfers, bytes and peers; the worker pairs
    them up across the ranks and replays them alone and under compute without a deadlock (the
    group's timeout fails a mistake). The quick suite runs 1F1B (several transfers in flight) and
    DualPipeV (helix_pipeline's merged F and B graphs), the full suite every schedule;
    pipeline_inductor's stages send what pipeline_eager's send (its compiled stages are the same
    modules), so neither suite spends Inductor's compile on it here."""
    kinds = ["1f1b", "interleaved_1f1b", "dualpipev"] if os.environ.get("DHELIX_TEST_FULL") else ["1f1b", "dualpipev"]
    runs = {kind: ["pipeline_eager"] for kind in kinds}
    runs["dualpipev"].append("helix_pipeline")
    if os.environ.get("DHELIX_TEST_FULL"):
        runs = {kind: ["pipeline_eager", "helix_pipeline"] for kind in kinds}
    results = run_on_ranks(_own_pipeline_bounds, 2, runs, timeout_s=280, pg_timeout_s=120)
    _check_own_pipeline_bounds(results, runs)


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.full
def test_each_schedules_own_transfers_replay_on_four_ranks() -> None:
    """On 4 gloo ranks the middle ranks send and receive on both sides, several in flight."""
    runs = {kind: ["pipeline_eager"] for kind in ("1f1b", "interleaved_1f1b", "dualpipev")}
    results = run_on_ranks(_own_pipeline_bounds, 4, runs, timeout_s=280, pg_timeout_s=120)
    _check_own_pipeline_bounds(results, runs)
