"""Which cost model a compile uses: build the estimator passes receive from the config.

device "auto": the CUDA device's table entry (by name), else this CPU, measured once per
               process; on several ranks, one rank's measurement is shared through the c10d
               store so every rank plans with the same numbers (a measured device differs
               a little from rank to rank, and different numbers mean different schedules:
               collectives issued in another order on each rank, which exchange the wrong
               tensors when their shapes match). device "cpu" is measured the same way.
               Which rank measures: the first to ask, not a fixed one (a rank asks when it
               compiles, and a rank whose graphs hold no collective may never compile one
               that needs a cost model)::

                   claim   = store.compare_set(CLAIM, "", my rank)   # atomic: one rank wins
                   if claim == my rank: measure, publish DEVICE (or the error it raised)
                   wait for DEVICE (consistency_timeout_s, or the timeout of the compiled
                                    graph's groups where shorter) -> else DeviceAgreementError
                                                                     naming the claiming rank
                   every rank, the claiming one too, plans with the published numbers

               A claiming rank that dies or hangs before it publishes leaves the others
               an error naming it after the timeout, never a hang.
link "auto":   nvlink4 between GPUs, loopback between CPU processes.
cost_model "profile": the analytic estimator as a base, calibrated on the live device and
               process group by cost_model.ProfiledEstimator (agreed across ranks, cached).
cost_model "auto":   "profile" when a real process group of several ranks is live (there is a
               link to measure, and the tables cannot know it: a rate-limited veth, a busy
               NIC, NVLink or PCIe), "analytic" otherwise (one process, or the fake group),
               and for a graph holding a ``reshard`` (its ranks compile different graphs).
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx

from cost_model import AnalyticEstimator, Device, Estimator, ProfiledEstimator, get_device, measure_cpu_device
from cost_model.profile import device_key
from dhelix_compile import _torch_compat as compat
from dhelix_compile.config import DHelixConfig
from dhelix_compile.group_timeouts import graph_wait_s

if TYPE_CHECKING:
    from dhelix_compile.emulation import Emulation

log = logging.getLogger("dhelix")

#: torch.cuda.get_device_name() substrings -> cost_model.DEVICES keys
_CUDA_NAMES = (("H200", "h200"), ("H100", "h100_sxm"), ("A800", "a800"), ("A100", "a100_80gb"), ("A40", "a40"))

#: c10d store keys of the agreed CPU device (module docstring): the claiming rank's number, and
#: what it published ({"rank": r, "device": ...} or {"rank": r, "error": ...})
_CLAIM_KEY = "dhelix/agreed_cpu_device/claim"
_DEVICE_KEY = "dhelix/agreed_cpu_device/device"


class DeviceAgreementError(RuntimeError):
    """The ranks have no CPU device to agree on: the rank that claimed its measurement did not
    publish it in time (it died or is stuck), or its measurement raised."""


def _uses_cuda(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)


def resolve_device(config: DHelixConfig, example_inputs: Sequence[Any], wait_s: float | None = None) -> Device:
    """The cost model's device for this compile (see the module docstring); ``wait_s``: how long
    to wait for the device another rank measures (``None``: ``consistency_timeout_s``)."""
    if config.device not in ("auto", "cpu"):
        return get_device(config.device)
    if _uses_cuda(example_inputs):
        name = torch.cuda.get_device_name()
        for needle, key in _CUDA_NAMES:
            if needle in name:
                return get_device(key)
        log.warning("no cost-model entry for CUDA device %r; using h100_sxm's numbers", name)
        return get_device("h100_sxm")
    return agreed_cpu_device(config.consistency_timeout_s if wait_s is None else wait_s)


def agreed_cpu_device(timeout_s: float) -> Device:
    """This CPU, measured; on several ranks, the measurement of the first rank to ask, the same
    on every rank (module docstring). Waits up to ``timeout_s`` for it. Agreed once per process:
    a later call returns the same device, whatever its ``timeout_s`` (the claiming rank measures
    once: numbers measured again would differ from those the others hold).

    Raises:
        DeviceAgreementError: the claiming rank did not publish within ``timeout_s``, or its
            measurement raised.
    """
    if not _AGREED_DEVICE:
        _AGREED_DEVICE.append(_agree_on_cpu_device(timeout_s))
    return _AGREED_DEVICE[0]


#: The device :func:`agreed_cpu_device` agreed on in this process.
_AGREED_DEVICE: list[Device] = []


def _agree_on_cpu_device(timeout_s: float) -> Device:
    if not compat.real_process_group_initialized():
        return _measured_cpu_device()
    store = compat.default_store()
    me = str(dist.get_rank())
    claimant = store.compare_set(_CLAIM_KEY, "", me).decode()
    if claimant == me:
        _measure_and_publish(store, claimant)
    try:
        store.wait([_DEVICE_KEY], timedelta(seconds=timeout_s))
    except Exception as exc:  # the store raises on timeout (DistStoreError / RuntimeError)
        raise DeviceAgreementError(
            f"rank {claimant} took on measuring the CPU device for every rank (dhelix device "
            f"'cpu', or 'auto' on the CPU) and did not publish it within {timeout_s:g} s: it "
            f"died or is stuck. Without it this rank cannot plan with the other ranks' costs"
        ) from exc
    published = json.loads(store.get(_DEVICE_KEY))
    if "error" in published:
        raise DeviceAgreementError(
            f"rank {published['rank']} could not measure the CPU device for every rank: {published['error']}"
        )
    return _device_from_json(published["device"])


def _measured_cpu_device() -> Device:
    """This CPU measured on eager tensors: the device is resolved inside the partition compiler,
    under AOTAutograd's fake-tensor mode, where the probe's matmuls and copies would run on fake
    tensors (a rank of the ZeRO-3 bench measured a 1.46 ms launch, 204 GB/s and 255 GFLOP/s
    there, against 4 us, 12 GB/s and 33 GFLOP/s on one thread of the 2-core machine)."""
    return compat.run_outside_compilation(measure_cpu_device)


def _measure_and_publish(store: dist.Store, rank: str) -> None:
    """Measure this CPU and publish it for every rank, or publish why the measurement failed."""
    try:
        device = _measured_cpu_device()
    except Exception as exc:
        store.set(_DEVICE_KEY, json.dumps({"rank": rank, "error": f"{type(exc).__name__}: {exc}"}))
        raise
    store.set(_DEVICE_KEY, json.dumps({"rank": rank, "device": _device_to_json(device, rank)}))


def _device_to_json(device: Device, rank: str) -> dict[str, Any]:
    return {
        "name": device.name,
        "peak_flops_per_s": {str(k).removeprefix("torch."): v for k, v in device.peak_flops_per_s.items()},
        "mem_bandwidth_bytes_per_s": device.mem_bandwidth_bytes_per_s,
        "launch_overhead_s": device.launch_overhead_s,
        "source": f"{device.source} (rank {rank}'s measurement)",
        "contention_factor": device.contention_factor,
    }


def _device_from_json(data: dict[str, Any]) -> Device:
    peaks = {getattr(torch, k): float(v) for k, v in data.pop("peak_flops_per_s").items()}
    return Device(peak_flops_per_s=peaks, **data)


def resolve_cost_model(config: DHelixConfig, gm: torch.fx.GraphModule | None = None) -> str:
    """``config.cost_model`` with ``"auto"`` decided (see the module docstring) for ``gm``."""
    if config.cost_model != "auto":
        return config.cost_model
    live = compat.real_process_group_initialized() and dist.get_world_size() > 1
    if live and gm is not None and _moves_between_meshes(gm):
        log.info("cost model: analytic for a graph that reshards between meshes (its ranks hold different graphs)")
        return "analytic"
    return "profile" if live else "analytic"


def _moves_between_meshes(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` holds a ``reshard`` broadcast: its ranks then compile different graphs (a
    sender's and a receiver's), which profiling, agreed over every rank, cannot measure."""
    from dhelix_compile.resharding.groups import GROUP_PREFIX

    return any(isinstance(a, str) and a.startswith(GROUP_PREFIX) for node in gm.graph.nodes for a in node.args)


#: One profiled estimator per (cache folder, device, link, world, backend, default group) in this
#: process: what one compile measured -- collectives, the link scale P2P transfers are priced
#: by, segment pairs -- serves the next. A helix merged graph built from decomposed strands
#: holds P2P exchanges and no collective left to measure: with an estimator of its own, its
#: transfers were priced by the analytic table's link (loopback on CPU), nearly free.
_PROFILED: dict[tuple[Any, ...], ProfiledEstimator] = {}


def _profiled_estimator(config: DHelixConfig, base: AnalyticEstimator, link: str, cuda: bool) -> ProfiledEstimator:
    group = dist.group.WORLD if dist.is_initialized() else None
    key = (config.cache_dir, base.device.name, link, base.world_size, base.comm_backend, id(group))
    if key not in _PROFILED:
        wait = compat.wait_for_compile_workers if config.codegen == "inductor" else None
        _PROFILED[key] = ProfiledEstimator(
            base,
            Path(config.cache_dir).expanduser(),
            runner=compat.run_outside_compilation,
            # its compile workers would share the cores with the measurements
            before_measuring=wait,
            replay_link=replay_link(base, link, cuda),
        )
    return _PROFILED[key]


def replay_link(base: AnalyticEstimator, link: str, cuda: bool) -> str:
    """The link key of a measurement log (``cost_model.profile.replay``): this device (as the
    disk cache names it), the link option, world size, backend and host. A process replays the
    log of the last process of the same program under ``cache_dir``; another ``cache_dir``
    measures anew."""
    device = device_key(torch.device("cuda" if cuda else "cpu"))
    return f"{device}-{link}-w{base.world_size}-{base.comm_backend}-{socket.gethostname()}"


def _emulated_cluster() -> Emulation | None:
    """This process's emulated cluster (``dhelix_compile.emulate``), if one is live: the planner
    prices its collectives with the numbers the emulator times them by (NCCL's), and compute
    beside them with the emulator's contention (``Emulation.contention_factor``)."""
    from dhelix_compile import emulation

    return emulation.active()


def build_estimator(config: DHelixConfig, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Estimator:
    """The estimator for one partition: analytic, or profiled (calibrated on ``gm`` now)."""
    cuda = _uses_cuda(example_inputs)
    cluster = _emulated_cluster()
    emulated = None if cluster is None else cluster.cost_model_link
    link = config.link if config.link != "auto" else (emulated or ("nvlink4" if cuda else "loopback"))
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    device = resolve_device(config, example_inputs, graph_wait_s(gm, config.consistency_timeout_s))
    base = AnalyticEstimator(
        device,
        link,
        world_size,
        comm_backend="nccl" if cuda or emulated else "gloo",
        contention_factor=None if cluster is None else cluster.contention_factor(device, cuda),
    )
    if resolve_cost_model(config, gm) == "analytic":
        return base
    profiled = _profiled_estimator(config, base, link, cuda)
    report = compat.run_outside_compilation(lambda: profiled.calibrate(gm))
    log.info("cost model calibrated: %s", report)
    return profiled
