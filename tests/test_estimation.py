"""Which estimator a compile gets: cost_model 'auto', and one profiled estimator per process and link."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import torch

from cost_model import AnalyticEstimator, Device, ProfiledEstimator
from dhelix_compile.config import DHelixConfig
from dhelix_compile.estimation import build_estimator, resolve_cost_model


def _graph() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(lambda x: torch.mm(x, x))


def test_auto_is_analytic_without_a_live_multi_rank_group() -> None:
    config = DHelixConfig.from_options({"device": "cpu"}, environ={})
    assert config.cost_model == "auto" and resolve_cost_model(config) == "analytic"
    assert isinstance(build_estimator(config, _graph(), [torch.ones(2, 2)]), AnalyticEstimator)
    assert resolve_cost_model(config.patch(cost_model="profile")) == "profile"


def test_the_cpu_device_is_measured_on_eager_tensors_inside_a_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The partition compiler resolves the device under AOTAutograd's fake-tensor mode; the CPU
    is measured outside it (on fake tensors the probes timed the mode's dispatch: a 1.46 ms
    launch, 204 GB/s), and the measurement itself refuses to run under such a mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cost_model.hardware import measure_cpu_device
    from dhelix_compile import estimation

    eager: list[bool] = []

    def spy(name: str = "cpu") -> Device:
        eager.append(type(torch.empty(0)) is torch.Tensor)
        return Device(name, {torch.float32: 1e10}, 1e10, 1e-6, "spy")

    monkeypatch.setattr(estimation, "_AGREED_DEVICE", [])
    monkeypatch.setattr(estimation, "measure_cpu_device", spy)
    with FakeTensorMode():
        device = estimation.resolve_device(DHelixConfig.from_options({"device": "cpu"}, environ={}), [])
        with pytest.raises(RuntimeError, match="needs eager tensors"):
            measure_cpu_device.__wrapped__()  # the cached function's own body, measured afresh
    assert device.source == "spy" and eager == [True]


def test_profiled_compiles_share_one_estimator_per_process(tmp_path) -> None:
    """What one graph measured serves the next: a helix merged graph of per-peer strands has no
    collective left to measure, and prices its exchanges by the link scale the strands measured."""
    config = DHelixConfig.from_options(
        {"device": "cpu", "cost_model": "profile", "cache_dir": str(tmp_path)}, environ={}
    )
    first = build_estimator(config, _graph(), [torch.ones(2, 2)])
    second = build_estimator(config, _graph(), [torch.ones(2, 2)])
    assert isinstance(first, ProfiledEstimator) and first is second
    other = build_estimator(config.patch(cache_dir=str(tmp_path / "other")), _graph(), [torch.ones(2, 2)])
    assert other is not first


def _cpu_devices(rank: int, world_size: int) -> list[tuple[float, ...]]:
    from dhelix_compile.estimation import resolve_device

    devices = [resolve_device(DHelixConfig.from_options({"device": d}, environ={}), []) for d in ("cpu", "auto")]
    return [(*d.peak_flops_per_s.values(), d.mem_bandwidth_bytes_per_s, d.launch_overhead_s) for d in devices]


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_a_measured_cpu_device_is_one_ranks_on_every_rank() -> None:
    """device="cpu", like "auto" on the CPU, plans with one rank's measurement: each rank's own
    differs a little, and different costs mean a different order of collectives on each rank."""
    from dhelix_compile.testing.multirank import run_on_ranks

    (rank0, rank1) = run_on_ranks(_cpu_devices, 2, timeout_s=120)
    assert rank0 == rank1 and rank0[0] == rank0[1]


#: Scenarios of ``_ask_for_the_device`` (the key each rank waits on is set by the other rank)
_CLAIMED = "dhelix_test/rank 1 claimed the measurement"
_DONE = "dhelix_test/rank 1 is done"
_GAVE_UP = "dhelix_test/rank 0 gave up waiting"
_WAIT = timedelta(seconds=30)


_Outcome = tuple[str, tuple[float, ...] | None]


def _ask_for_the_device(rank: int, world_size: int, scenario: str) -> tuple[str, tuple[float, ...] | None, int]:
    """One rank's side of ``scenario``; each rank's CPU measurement is a fake whose numbers name
    the rank (FLOP/s and bandwidth 1e9 x (rank + 1)). Returns the agreed device's source (or the
    error this rank met), its FLOP/s and bandwidth, and how many times this rank measured."""
    from dhelix_compile import _torch_compat as compat
    from dhelix_compile import estimation

    store = compat.default_store()
    measured: list[int] = []

    def fake_measurement(name: str = "cpu") -> Device:
        measured.append(rank)
        if scenario == "claimant stuck":  # dead or hung, to the ranks that wait
            store.set(_CLAIMED, "1")
            store.wait([_GAVE_UP], _WAIT)
        if scenario == "claimant fails":
            raise RuntimeError("no cores left to measure")
        rate = 1e9 * (rank + 1)
        return Device(name, {torch.float32: rate}, rate, 1e-6, f"rank {rank}'s fake measurement")

    def ask(timeout_s: float) -> _Outcome:
        try:
            device = estimation.agreed_cpu_device(timeout_s)
        except Exception as exc:  # noqa: BLE001 - what each scenario's rank met is the result
            return f"{type(exc).__name__}: {exc}", None
        return device.source, (*device.peak_flops_per_s.values(), device.mem_bandwidth_bytes_per_s)

    with mock.patch.object(estimation, "measure_cpu_device", fake_measurement):
        outcome = _play(rank, scenario, store, ask)
    return (*outcome, len(measured))


def _play(rank: int, scenario: str, store: Any, ask: Callable[[float], _Outcome]) -> _Outcome:
    if scenario == "only rank 1 asks":
        if rank == 0:  # alive, never compiling a graph that needs the device
            store.wait([_DONE], _WAIT)
            return "did not ask", None
        outcome = ask(20)
        store.set(_DONE, "1")
        return outcome
    if scenario == "both ask":
        return ask(20)
    # "claimant stuck", "claimant fails": rank 1 claims first, rank 0 asks after it
    if rank == 1:
        outcome = ask(20)
        store.set(_CLAIMED, "1")  # (claimant stuck: set already, and rank 0 has given up)
        return outcome
    store.wait([_CLAIMED], _WAIT)
    outcome = ask(1)
    store.set(_GAVE_UP, "1")
    return outcome


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_the_cpu_device_is_measured_by_the_first_rank_to_ask() -> None:
    """A rank whose graphs hold no collective may never ask for the device: the rank that does
    asks without waiting for it (rank 0, which waits until rank 1 has its device here). When
    both ask, one measures, and both plan with its numbers."""
    from dhelix_compile.testing.multirank import run_on_ranks

    rank0, rank1 = run_on_ranks(_ask_for_the_device, 2, "only rank 1 asks", timeout_s=60)
    assert rank0 == ("did not ask", None, 0)
    assert rank1 == ("rank 1's fake measurement (rank 1's measurement)", (2e9, 2e9), 1)

    rank0, rank1 = run_on_ranks(_ask_for_the_device, 2, "both ask", timeout_s=60)
    assert rank0[:2] == rank1[:2] and rank0[2] + rank1[2] == 1
    claimant = 0 if rank0[2] else 1
    assert rank0[:2] == (
        f"rank {claimant}'s fake measurement (rank {claimant}'s measurement)",
        (1e9 * (claimant + 1),) * 2,
    )


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_a_rank_waiting_for_the_claimed_cpu_device_fails_naming_the_claimant() -> None:
    """The rank that claimed the measurement hangs (or died): the others wait ``timeout_s``, then
    fail naming it, never hang. Its measurement raises: they fail at once, saying why."""
    from dhelix_compile.testing.multirank import run_on_ranks

    rank0, rank1 = run_on_ranks(_ask_for_the_device, 2, "claimant stuck", timeout_s=60)
    assert rank0[0].startswith("DeviceAgreementError: rank 1 took on measuring the CPU device")
    assert "did not publish it within 1 s: it died or is stuck" in rank0[0]
    assert rank0[1:] == (None, 0)
    assert rank1 == ("rank 1's fake measurement (rank 1's measurement)", (2e9, 2e9), 1)  # it published late

    rank0, rank1 = run_on_ranks(_ask_for_the_device, 2, "claimant fails", timeout_s=60)
    assert rank0 == (
        "DeviceAgreementError: rank 1 could not measure the CPU device for every rank: "
        "RuntimeError: no cores left to measure",
        None,
        0,
    )
    assert rank1 == ("RuntimeError: no cores left to measure", None, 1)
