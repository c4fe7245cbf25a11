"""Each variant's own bound on the gloo bench: the collectives its step sent, recorded at the process
group (``bench.measure.record_sent_collectives``), and the summary's limits from its own numbers."""

from __future__ import annotations

import pytest
import torch

from dhelix_compile import _torch_compat as compat
from dhelix_compile.bench.measure import SentCollective, SentReplay, record_sent_collectives, sent_collectives
from dhelix_compile.bench.run import hidden_share, markdown, summarize
from dhelix_compile.bench.worker import sent_summary
from dhelix_compile.testing.multirank import run_on_ranks

Call = compat.ProcessGroupCall


def test_each_process_group_call_is_a_collective_with_the_bytes_gloo_puts_on_the_wire() -> None:
    f32 = "float32"
    calls = [
        Call("allreduce_", ([((256,), f32)], None, None, None, True, -1)),
        Call("allgather_into_tensor_coalesced_", ([((512,), f32)], [((256,), f32)], None, True)),
        Call("_reduce_scatter_base_", (((128,), f32), ((256,), f32), None, None, False, -1)),
        Call("alltoall_base_", (((64, 4), f32), ((64, 4), f32), None, [0, 64], [0, 64], False, -1)),
        Call("alltoall_base_", (((64, 4), "bfloat16"), ((64, 4), "bfloat16"), None, [], [], False, -1)),
        Call("send", ([((10,), "int64")], None, 1, 0)),
        Call("recv_", ([((10,), "int64")], None, 1, 0)),
        Call("barrier", ([((1,), f32)], None, [], -1)),
    ]
    sent = sent_collectives(calls, rank=0, group_size=2)
    assert [c.op for c in sent] == [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "all_to_all",
        "send",
        "recv",
    ]
    assert [c.wire_bytes for c in sent] == [
        1024,  # ring all-reduce on 2 ranks: 2 (n-1)/n of 1 KiB
        1024,  # the shard to the other rank
        1024,  # ProcessGroupGloo all-reduces the whole 1 KiB input to reduce-scatter it
        1024,  # an exchange: every row to the peer, none to itself
        256,  # an even all-to-all: half of 512 bytes stays here
        80,
        0,  # a receive sends nothing
    ]
    assert sent[3].splits == (0, 64) and sent[5].peer == 1
    assert sent_summary(sent) == {
        "wire_bytes_per_step": 4432,
        "transfers_per_step": 7,
        "collectives": {"all_gather": 1, "all_reduce": 1, "all_to_all": 2, "recv": 1, "reduce_scatter": 1, "send": 1},
    }
    with pytest.raises(ValueError, match="c10d::gather_"):
        sent_collectives([Call("gather_", ([], [], None, 0, -1))], 0, 2)


def test_a_replay_issues_consecutive_sends_and_receives_together() -> None:
    sent = [
        SentCollective("all_reduce", (4,), "float32", 32),
        SentCollective("send", (4,), "float32", 16, peer=1),
        SentCollective("recv", (4,), "float32", 0, peer=1),
        SentCollective("all_gather", (2, 3), "float32", 24),
    ]
    replay = SentReplay(sent, group_size=2)
    assert replay.transfers == [[0], [1, 2], [3]] and len(replay) == 3
    assert replay._tensors[3][0].shape == (4, 3)  # a gather goes as an all-to-all of its shard, once per rank


def _run(own: dict | None) -> dict:
    link = {
        "model": "m",
        "parallel": "tp",
        "world_size": 2,
        "repeats": 3,
        "step_s": {"inductor": [0.150, 0.140, 0.160], "dhelix": [0.120, 0.125, 0.115]},
        "t_comm_s": [0.060] * 3,
        "errors": {},
    }
    if own is not None:
        link["own"] = own
    return link


def _own(t_comm_s: float, transfers: int, wire: int, ceiling_s: float | None = None) -> dict:
    ceiling = None
    if ceiling_s is not None:
        samples = {"step_s": [ceiling_s] * 3, "cpu_s": [ceiling_s] * 3, "gloo_cpu_s": [0.001] * 3}
        ceiling = {"compute_s": [0.100] * 3, "in_flight": {"1": samples, "2": samples}}
    return {
        "t_comm_s": [t_comm_s] * 3,
        "t_comm_cpu_s": [0.01] * 3,
        "t_comm_gloo_cpu_s": [0.005] * 3,
        "wire_bytes_per_step": wire,
        "transfers_per_step": transfers,
        "collectives": {"all_reduce": transfers},
        "ceiling": ceiling,
    }


def test_the_summary_sets_each_variant_beside_its_own_limit_and_ceiling() -> None:
    compute = {"step_s": {"inductor": [0.100] * 3, "dhelix": [0.110] * 3}}
    own = {"inductor": _own(0.080, 14, 2_000_000, 0.130), "dhelix": _own(0.050, 8, 1_500_000, 0.118)}
    summary = summarize(_run(own), compute, "veth")
    inductor, dhelix = summary["variants"]["inductor"], summary["variants"]["dhelix"]
    assert (inductor["t_compute_s"], inductor["t_comm_s"], inductor["limit_s"]) == (0.100, 0.080, 0.100)
    assert (dhelix["t_compute_s"], dhelix["t_comm_s"], dhelix["limit_s"]) == (0.110, 0.050, 0.110)
    assert dhelix["step_over_limit"] == pytest.approx(0.120 / 0.110)
    assert dhelix["hidden_share"] == pytest.approx(hidden_share(0.120, 0.110, 0.050))  # against its own T_seq
    assert inductor["hidden_share"] == pytest.approx(hidden_share(0.150, 0.100, 0.080))
    assert (dhelix["wire_bytes_per_step"], dhelix["transfers_per_step"]) == (1_500_000, 8)
    # each ceiling under the variant's own T_compute: the matmuls ran 100 ms for dhelix's 110 ms
    assert dhelix["ceiling"]["step_s_median"] == pytest.approx(0.128)
    assert dhelix["step_over_ceiling"] == pytest.approx(0.120 / 0.128)
    assert inductor["ceiling"]["step_s_median"] == pytest.approx(0.130)
    # the top level is Inductor's own, and names it
    assert (summary["t_comm_s"], summary["t_comm_variant"], summary["limit_s"]) == (0.080, "inductor", 0.100)
    assert summary["ceiling"] is None
    rows: dict[str, list[str]] = {}  # the first table's rows (the ceilings' table names the variants again)
    for line in markdown(summary).splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), [c.strip() for c in line.strip("|").split("|")])
    assert rows["dhelix"][1:12] == [
        "120.0",
        "115.0-125.0",
        "1.25x",
        "110.0",
        "50.0",
        "110.0",
        "1.09",
        "80%",  # (110 + 50 - 120) / (110 + 50 - 110)
        "0.94",
        "1.50",
        "8",
    ]
    assert rows["inductor"][9:12] == ["1.15", "2.00", "14"]
    assert "| dhelix | 128.0 | 128.0 | 128.0 | 118.0 | 100.0 |" in markdown(summary)  # its ceiling's row


def test_a_run_without_recorded_collectives_sets_every_variant_beside_the_shared_replay() -> None:
    """A link run's JSON with one replay for every variant (``t_comm_s`` at its top level)."""
    compute = {"step_s": {"inductor": [0.100] * 3, "dhelix": [0.110] * 3}}
    summary = summarize(_run(None), compute, "veth")
    assert {v["t_comm_s"] for v in summary["variants"].values()} == {0.060}
    assert summary["variants"]["dhelix"]["limit_s"] == 0.110 and summary["t_comm_variant"] is None
    assert summary["variants"]["dhelix"]["wire_bytes_per_step"] is None
    assert "| dhelix | 120.0 |" in markdown(summary)


# ------------------------------------------------------------------------------ real ranks


def _sent_by_variant(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    from torch.distributed.device_mesh import DeviceMesh

    from dhelix_compile.bench.steps import step_function
    from dhelix_compile.bench.workloads import build_workload

    mesh = DeviceMesh("cpu", list(range(world_size)))
    workload = build_workload("tiny", "tp", mesh, world_size, 1, torch.Generator().manual_seed(0))
    found = {}
    for name in ("eager", "dhelix_eager"):  # Inductor's compile is a minute here; it sends eager's collectives
        step = step_function(name, workload.make(), workload.loss_fn, {"cost_model": "analytic", "fallback": "error"})
        step(workload.microbatches)  # compiles
        sent = record_sent_collectives(lambda step=step: step(workload.microbatches), rank, world_size)
        found[name] = sent_summary(sent)["collectives"]
    return found


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_dhelix_sends_fewer_all_reduces_than_pytorchs_plan_on_the_reference_tp_model() -> None:
    """PyTorch's TP plan all-reduces q/k/v's and w1/w3's input gradients apiece (eager, and
    Inductor, which sends the same collectives); dhelix's combine_all_reduces pass sums each
    group once: its step sends fewer all-reduces, recorded at the process group."""
    for found in run_on_ranks(_sent_by_variant, 2, timeout_s=240):
        assert 0 < found["dhelix_eager"]["all_reduce"] < found["eager"]["all_reduce"], found
