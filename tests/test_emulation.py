"""The emulated cluster: one process as rank r of N, collectives timed by the link model.

Timing-free: outputs (shapes, values, finiteness), the ledger (bytes and the link model's seconds
per operation), N-rank meshes built and trained eagerly and compiled, the refusals. Whether an
operation *lasts* its link time is measured by the bench (``dhelix_compile.bench.emulated``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dhelix_compile
from cost_model.collectives import collective_bytes_on_wire, collective_time_s
from cost_model.hardware import get_link
from dhelix_compile import _torch_compat as compat
from dhelix_compile.bench.choices import compiled_by_dhelix
from dhelix_compile.bench.emulated import _measure_variants, balanced_link, parse_emulated_link
from dhelix_compile.emulation import EmulationError, LinkSpecError, describe_presets, parse_link
from dhelix_compile.emulation.clock import CpuQueues
from dhelix_compile.emulation.group import EmulatedWork, Transfer


@pytest.fixture
def cluster() -> Iterator[dhelix_compile.emulation.Emulation]:
    if dist.is_initialized():
        dist.destroy_process_group()
    emulation = dhelix_compile.emulate(8, rank=3, link="ib400")
    try:
        yield emulation
    finally:
        emulation.close()


# -- links ---------------------------------------------------------------------------------------


def test_presets_are_the_cost_models_links() -> None:
    assert parse_link("ib400") == get_link("ib_ndr")
    assert parse_link("NVLink4") == get_link("nvlink4")
    assert parse_link("eth100").bandwidth_bytes_per_s == pytest.approx(12.5e9)
    for name in ("nvlink4", "pcie5", "ib100", "ib200", "ib400", "eth400"):
        assert name in describe_presets()


def test_a_custom_link_reads_its_units() -> None:
    link = parse_link("alpha=5us,bandwidth=40GB/s")
    assert link.latency_s == pytest.approx(5e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(40e9)
    assert parse_link("alpha=0.01ms,bandwidth=400Gbit/s").bandwidth_bytes_per_s == pytest.approx(50e9)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("ib800", "expected a preset"),
        ("alpha=5us", "expected a preset"),
        ("alpha=5,bandwidth=40GB/s", "needs a number and one of the units"),
        ("alpha=5us,bandwidth=40GB", "needs a number and one of the units"),
    ],
)
def test_a_bad_link_is_named(spec: str, words: str) -> None:
    with pytest.raises(LinkSpecError, match=words):
        parse_link(spec)


def test_bench_link_spec() -> None:
    assert parse_emulated_link("gloo") is None
    spec = parse_emulated_link("emulated:alpha=5us,bandwidth=40GB/s,ranks=4,traffic")
    assert spec is not None and (spec.link, spec.ranks, spec.traffic) == ("alpha=5us,bandwidth=40GB/s", 4, True)
    assert parse_emulated_link("emulated:ib400") == parse_emulated_link("emulated:ib400,ranks=8")
    for bad, words in [("emulated:", "name a link"), ("emulated:ib400,ranks=x", "integer"), ("emulated:ib9", "preset")]:
        with pytest.raises(ValueError, match=words):
            parse_emulated_link(bad)


def test_balanced_link_makes_the_transfers_take_the_compute_time() -> None:
    transfers = [Transfer("all_reduce", 4 << 20, 8, "0", 0.0), Transfer("all_gather", 1 << 20, 4, "1", 0.0)]
    link = balanced_link(transfers, 0.010, 9.6e-6)
    assert sum(collective_time_s(t.op, t.nbytes, t.group_size, link) for t in transfers) == pytest.approx(0.010)
    with pytest.raises(ValueError, match="latency alone"):
        balanced_link(transfers, 1e-6, 9.6e-6)


@pytest.mark.parametrize(
    ("link", "comm_s", "off"), [("balanced", 0.77, True), ("balanced", 0.40, False), ("ib400", 0.77, False)]
)
def test_a_balanced_link_off_balance_is_said(link: str, comm_s: float, off: bool) -> None:
    """The bandwidth comes from the first variant's link-free steps: measured on a busy moment it
    is too low for the rest of the run, and the table says so."""
    from dhelix_compile.bench.emulated import EmulatedLink, VariantTimes, markdown_emulated, variant_row

    row = variant_row(VariantTimes(step_s=[1.2], host_s=[1.2], compute_s=[0.38], comm_s=[comm_s], wire_bytes=[1]))
    summary = {
        "emulated": dataclasses.asdict(EmulatedLink(link, ranks=2)),
        "link": {"name": link, "bandwidth_bytes_per_s": 1e7, "alpha_s": 9.6e-6},
        "model": "moe_medium",
        "parallel": "tp_sp",
        "device": "cpu",
        "dtype": "float32",
        "microbatches": 4,
        "repeats": 1,
        "torch": torch.__version__,
        "variants": {"inductor": row, "helix": row},
    }
    table = markdown_emulated(summary)
    assert ("off balance: inductor's own communication is 2.03x its own compute" in table) is off
    assert ("off balance" in table) is off


@pytest.mark.parametrize(("first", "made_on_balanced"), [("helix", 2), ("inductor", 1)])
def test_a_dhelix_variant_that_sets_the_balanced_link_is_compiled_again_on_it(
    cluster: dhelix_compile.emulation.Emulation, first: str, made_on_balanced: int
) -> None:
    """The first variant runs with the link free to find the bandwidth; a dhelix variant's plan
    prices the link, so its step is made again once the balanced link is set."""
    made: list[tuple[str, str | None]] = []
    tensor = torch.ones(1 << 16)

    def make_step(name: str) -> Callable[[], None]:
        made.append((name, cluster.link.name))

        def step() -> None:
            time.sleep(0.002)
            dist.all_reduce(tensor)

        return step

    spec = parse_emulated_link("emulated:balanced,ranks=8")
    assert (
        spec is not None and compiled_by_dhelix("helix[decompose=off]") and not compiled_by_dhelix("inductor_overlap")
    )
    times, done = _measure_variants(
        cluster, spec, parse_link("ib400"), [first, "dhelix"], make_step, torch.device("cpu"), 1, 0, 60.0
    )
    balanced = cluster.link.name
    assert balanced.startswith("balanced_") and done == 1
    assert made.count((first, balanced)) == made_on_balanced - 1 and made[0] == (first, "ib_ndr")
    assert made[-1] == ("dhelix", balanced)
    assert times[first].compile_s > 0


# -- the group -----------------------------------------------------------------------------------


def test_emulate_refuses_bad_arguments_and_a_live_group(cluster: dhelix_compile.emulation.Emulation) -> None:
    with pytest.raises(EmulationError, match="already initialized"):
        dhelix_compile.emulate(4)
    assert dist.get_world_size() == 8 and dist.get_rank() == 3
    for kwargs, words in [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 4, "rank": 4}, r"rank must be in \[0, 4\)"),
    ]:
        with pytest.raises(EmulationError, match=words):
            dhelix_compile.emulate(**kwargs)


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_have_the_right_shapes_and_this_ranks_values(
    cluster: dhelix_compile.emulation.Emulation, device: str
) -> None:
    rank, n = 3, 8
    torch.set_default_device(device)  # every tensor below; on CUDA read after the compute stream's wait
    try:
        _check_outputs(rank, n)
    finally:
        torch.set_default_device(None)


def _check_outputs(rank: int, n: int) -> None:
    x = torch.arange(16, dtype=torch.float32).reshape(4, 4) + 1

    reduced = x.clone()
    dist.all_reduce(reduced)
    torch.testing.assert_close(reduced, x)  # as if every rank held x; never n * x

    gathered = torch.full((4 * n, 4), float("nan"))
    compat.all_gather_into_tensor(gathered, x)
    torch.testing.assert_close(gathered, x.repeat(n, 1))

    chunks = torch.arange(n * 4, dtype=torch.float32).reshape(n * 2, 2)
    scattered = torch.full((2, 2), float("nan"))
    compat.reduce_scatter_tensor(scattered, chunks)
    torch.testing.assert_close(scattered, chunks[2 * rank : 2 * rank + 2])

    exchanged = torch.full((8, 4), float("nan"))
    dist.all_to_all_single(exchanged, x.repeat(2, 1))
    torch.testing.assert_close(exchanged, x.repeat(2, 1))
    uneven = torch.full((11,), float("nan"))  # MoE splits: another size out than in
    dist.all_to_all_single(uneven, torch.arange(8.0), [2] * 8, [1] * 8)
    assert torch.isfinite(uneven).all()

    received = torch.full((3,), float("nan"))
    dist.recv(received, src=0)
    torch.testing.assert_close(received, torch.ones(3))

    listed = [torch.full((4, 4), float("nan")) for _ in range(n)]
    dist.all_gather(listed, x)
    for out in listed:
        torch.testing.assert_close(out, x)

    not_root = torch.full((2,), float("nan"))
    dist.scatter(not_root, None, src=0)
    torch.testing.assert_close(not_root, torch.zeros(2))


def test_the_ledger_holds_each_operation_on_the_link_model(cluster: dhelix_compile.emulation.Emulation) -> None:
    link = get_link("ib_ndr")
    cluster.ledger.clear()
    x = torch.ones(1024)
    dist.all_reduce(x)
    compat.all_gather_into_tensor(torch.empty(8 * 1024), x)
    dist.send(x, dst=4)
    dist.recv(x, src=2)
    ops = [(t.op, t.nbytes, t.group_size) for t in cluster.ledger.transfers()]
    assert ops == [("all_reduce", 4096, 8), ("all_gather", 8 * 4096, 8), ("send", 4096, 8), ("recv", 4096, 8)]
    for t in cluster.ledger.transfers():
        assert t.seconds == pytest.approx(collective_time_s(t.op, t.nbytes, t.group_size, link))
    sent = sum(collective_bytes_on_wire(op, nbytes, size) for op, nbytes, size in ops[:3])
    assert cluster.ledger.wire_bytes() == sent  # a receive sends nothing
    cluster.ledger.clear()
    with cluster.link_free():
        dist.all_reduce(x)
    assert [t.seconds for t in cluster.ledger.transfers()] == [0.0]


def test_the_ledger_times_each_transfer_in_the_step_part_that_issued_and_waited_for_it(
    cluster: dhelix_compile.emulation.Emulation,
) -> None:
    from dhelix_compile.step_phases import current_step_phase, recording_phases, step_phase

    cluster.set_link("alpha=0us,bandwidth=0.02GB/s")  # 4 MB: 0.2 s per all-reduce of 8 ranks, each way
    x, y = torch.ones(2**20), torch.ones(2**20)
    cluster.ledger.clear()
    with recording_phases() as spans:
        with step_phase("F0"):
            first = dist.all_reduce(x, async_op=True)
            second = dist.all_reduce(y, async_op=True)  # queued behind the first on the link
            assert current_step_phase() == "F0"
        with step_phase("B0"):
            assert first is not None and second is not None
            first.wait()
            second.wait()
    assert current_step_phase() is None
    assert [span.name for span in spans] == ["F0", "B0"]
    timed = [times for _, times in cluster.ledger.timed()]
    assert [(t.phase, t.waited_phase) for t in timed] == [("F0", "B0"), ("F0", "B0")]
    assert timed[1].queued_s > 0 and timed[1].start_s >= timed[0].end_s
    assert timed[0].blocked_s > 0 and spans[1].seconds >= timed[0].blocked_s + timed[1].blocked_s


def test_a_queue_runs_its_operations_in_order() -> None:
    queues = CpuQueues()
    first = queues.schedule("tp", 0.5)
    second = queues.schedule("tp", 0.25)
    other = queues.schedule("dp", 0.25)
    assert second >= first + 0.25  # the second starts when the first ends
    assert other < first  # another queue does not wait
    before = time.perf_counter()
    from dhelix_compile.emulation.clock import wait_until

    wait_until(before + 0.01)
    assert time.perf_counter() >= before + 0.01


# -- meshes and training on them -----------------------------------------------------------------


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(8,), (2, 4)], ids=["tp8", "dp2xtp4"])
def test_tensor_parallel_training_runs_eager_and_compiled(
    cluster: dhelix_compile.emulation.Emulation, shape: tuple[int, ...], device: str
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = ("tp",) if len(shape) == 1 else ("dp", "tp")
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    assert mesh["tp"].size() == shape[-1] and mesh.get_coordinate() is not None
    torch.manual_seed(0)
    model = parallelize_module(_MLP().to(device), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(4, 32, device=device)
    for backend in (None, "inductor", "dhelix"):
        # a cross-rank check that waited for ranks that do not exist would fail after 5 s
        options: dict[str, str | int | bool | Callable[..., Any]] | None = (
            {"consistency_timeout_s": 5} if backend == "dhelix" else None
        )
        run = model if backend is None else torch.compile(model, backend=backend, options=options)
        cluster.ledger.clear()
        out = run(x)
        out.sum().backward()
        assert out.shape == (4, 32) and torch.isfinite(out).all()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(isinstance(g, DTensor) and torch.isfinite(g.to_local()).all() for g in grads)
        assert [t.op for t in cluster.ledger.transfers()].count("all_reduce") >= 1  # the row-parallel output


def test_the_planner_prices_collectives_on_the_emulated_link(cluster: dhelix_compile.emulation.Emulation) -> None:
    from dhelix_compile import estimation
    from dhelix_compile.config import DHelixConfig

    gm = torch.fx.symbolic_trace(_MLP())
    config = DHelixConfig(device="h100_sxm")  # a table entry: nothing measured, nothing cached for later tests
    estimator = estimation.build_estimator(config, gm, [torch.randn(4, 32)])
    assert estimation.resolve_cost_model(config, gm) == "analytic"  # nothing to profile against
    assert getattr(estimator, "link", None) == get_link("ib_ndr")
    cluster.set_link("alpha=2us,bandwidth=10GB/s")
    assert getattr(estimation.build_estimator(config, gm, []), "link", None) == cluster.link


def test_the_planner_prices_compute_beside_a_transfer_as_the_emulator_slows_it(
    cluster: dhelix_compile.emulation.Emulation,
) -> None:
    """A CPU transfer is a timer (no core taken: the measured device's factor is gloo's copies);
    a CUDA transfer is a delay kernel on one SM, or with ``traffic`` a copy as NCCL's."""
    from cost_model.cluster.emulated import EMULATED_CONTENTION_FACTOR
    from cost_model.hardware import get_device
    from dhelix_compile import estimation
    from dhelix_compile.config import DHelixConfig

    gloo_like = get_device("h100_sxm").replace(name="busy_cpu", contention_factor=2.7)
    assert cluster.contention_factor(gloo_like, cuda=False) == 1.0
    assert cluster.contention_factor(gloo_like, cuda=True) == EMULATED_CONTENTION_FACTOR
    cluster._state.traffic = True
    try:
        assert cluster.contention_factor(gloo_like, cuda=True) == 2.7
    finally:
        cluster._state.traffic = False
    gm = torch.fx.symbolic_trace(_MLP())
    config = DHelixConfig(device="h100_sxm")  # its table factor is NCCL's on a GPU, not 1
    assert get_device("h100_sxm").contention_factor > 1.0
    assert estimation.build_estimator(config, gm, [torch.randn(4, 32)]).contention_factor == 1.0
    dist.destroy_process_group()  # no emulation: the device's own factor
    assert estimation.build_estimator(config, gm, []).contention_factor == get_device("h100_sxm").contention_factor


@pytest.mark.parametrize(
    ("variants", "data_parallel"),
    [(["eager", "helix"], None), (["torch_eager", "eager"], "shard")],
    ids=["tensor_parallel", "data_parallel"],
)
def test_the_bench_puts_each_variant_beside_its_own_limit(variants: list[str], data_parallel: str | None) -> None:
    from dhelix_compile.bench.emulated import EmulatedLink, markdown_emulated, measure_emulated

    if dist.is_initialized():
        dist.destroy_process_group()
    summary = measure_emulated(
        EmulatedLink("ib100", ranks=4),
        "tiny",
        "tp",
        variants,
        microbatches=2,
        repeats=2,
        warmup=1,
        data_parallel=data_parallel,
    )
    assert not dist.is_initialized(), "the bench leaves no process group behind"
    assert list(summary["variants"]) == variants
    for row in summary["variants"].values():
        assert row["t_compute_s"] > 0 and row["t_comm_s"] > 0 and row["wire_bytes_per_step"] > 0
        assert row["limit_s"] == max(row["t_compute_s"], row["t_comm_s"])
        assert len(row["step_s_all"]) == 2
        # the parts of the step carry every transfer's link time (each part's issued ones)
        assert sum(part["comm_s"] for part in row["parts"]) == pytest.approx(row["t_comm_s"])
        assert all(part["exposed_s"] >= part["busy_s"] >= 0 for part in row["parts"])
    parts = {name: [part["name"] for part in row["parts"]] for name, row in summary["variants"].items()}
    if data_parallel is None:
        assert parts == {"eager": ["F0", "B0", "F1", "B1"], "helix": ["F0", "B0+F1", "B1"]}
    assert all(name in markdown_emulated(summary) for name in variants)


def test_sends_to_several_peers_share_the_ranks_link(cluster: dhelix_compile.emulation.Emulation) -> None:
    from dhelix_compile.emulation.group import link_time_s

    cluster.set_link("alpha=10us,bandwidth=1GB/s")  # 4 MiB: 4 ms each way
    cluster.ledger.clear()
    x = torch.ones(1 << 20)
    works = [dist.isend(x, dst=peer) for peer in (1, 2)]
    received = dist.irecv(torch.empty_like(x), src=4)
    assert all(isinstance(w, EmulatedWork) for w in works) and isinstance(received, EmulatedWork)
    deadlines = [w._deadline_s for w in (*works, received) if isinstance(w, EmulatedWork)]
    send_s, _, recv_s = (t.seconds for t in cluster.ledger.transfers())
    assert deadlines[1] >= deadlines[0] + send_s - cluster._state.cpu.host_overhead_s  # one NIC: in turn
    assert deadlines[2] < deadlines[1]  # the inbound side runs beside the outbound one
    assert link_time_s(cluster.ledger.transfers()) == pytest.approx(max(2 * send_s, recv_s))
    for work in (*works, received):
        assert work is not None
        work.wait()


@pytest.mark.parametrize("rank", [0, 2], ids=["first_stage", "last_stage"])
def test_a_pipeline_with_declared_shapes_runs_on_a_pp_x_tp_mesh(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if dist.is_initialized():
        dist.destroy_process_group()
    with dhelix_compile.emulate(4, rank=rank, link="ib400") as emulated:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        stage_index = coordinate[0]
        shape = torch.empty(2, 16)  # torch's pipelining sends undeclared shapes as pickled objects
        stage = PipelineStage(
            torch.nn.Linear(16, 16),
            stage_index,
            2,
            torch.device("cpu"),
            group=mesh["pp"].get_group(),
            input_args=shape,
            output_args=shape,
            output_grads=shape,
            input_grads=shape if stage_index > 0 else None,
        )
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda y, target: (y - target).square().mean())
        losses: list[torch.Tensor] = []
        if stage_index == 0:
            schedule.step(torch.randn(8, 16))
        else:
            schedule.step(target=torch.zeros(8, 16), losses=losses)
            assert len(losses) == 4 and all(torch.isfinite(loss) for loss in losses)
        ops = [t.op for t in emulated.ledger.transfers()]
        assert ops.count("send") >= 4 and ops.count("recv") >= 4  # activations one way, gradients the other
        grads = [p.grad for p in stage.submod.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_a_step_that_beats_its_own_limit_reads_no_hidden_share() -> None:
    from dhelix_compile.bench.emulated import VariantTimes, variant_row

    def row(step: float, compute: float, comm: float) -> dict[str, Any]:
        return variant_row(
            VariantTimes(step_s=[step], host_s=[step], compute_s=[compute], comm_s=[comm], wire_bytes=[1])
        )

    assert row(0.110, 0.100, 0.050)["hidden_share"] == pytest.approx(0.8)
    assert row(0.150, 0.100, 0.050)["hidden_share"] == pytest.approx(0.0)
    assert row(0.100, 0.100, 0.050)["hidden_share"] == pytest.approx(1.0)
    assert row(0.095, 0.100, 0.050)["hidden_share"] is None  # faster than its link-free repeats: noise
    assert row(0.100, 0.100, 0.0)["hidden_share"] is None  # nothing to hide
    assert row(0.095, 0.100, 0.050)["step_over_limit"] == pytest.approx(0.95)
