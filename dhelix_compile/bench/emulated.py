"""The benchmark on an emulated cluster: ``dhelix bench --link emulated:<link>[,ranks=N][,rank=R][,traffic]``.

One process is rank R (default 0) of an N-rank job (``dhelix_compile.emulate``): every collective
takes the link model's time, on a timer (CPU) or a side stream (CUDA), and costs the compute
nothing, so the step time shows the schedule, not CPU contention. Each variant is measured three
ways in the same run, interleaved with the others:

    step      its step on the link
    compute   its step with the link free (every collective completes at once): own T_compute
    comm      the link time of the collectives it sent in a step, issued at once on the rank's
              link (each side busy for its operations' summed time): own T_comm
    bytes     what this rank sent over its link in a step

    limit  = max(own T_compute, own T_comm)       (a step cannot beat it)
    hidden = (T_compute + T_comm - step) / (T_compute + T_comm - limit)   (none where step < limit)

``<link>`` is a preset (``ib400``, ``nvlink4``, ...; ``dhelix bench --help`` lists them with
their numbers), ``alpha=5us,bandwidth=40GB/s``, or ``balanced``: ib400's alpha with the
bandwidth at which the first variant's collectives alone take its compute time (the regime
overlap is for). dhelix's planner prices collectives on the same link (``link="auto"``); a dhelix
variant first in the list, compiled on the link free to set the bandwidth, is compiled again on
it (its first step's time is the first compile's).

With ``--pipeline <kind>`` (:func:`measure_emulated_pipeline`) the N ranks are a PP x TP job: the
reference transformer cut into stages (``bench.pipeline_parallel``, stage shapes declared, so
torch's pipelining runs with no peers), each stage tensor-parallel over its TP group (``--tp``;
by default two pipeline ranks and TP over the rest, :func:`pipeline_tp`). The emulated rank is
``rank=R``, or by default the first TP rank of the pipeline rank that holds the last stage (the
head and the loss: the most compute). Its communication is its sends and receives on the pp
group and its stages' TP collectives. A receive completes a link time after it is posted: the
peer stages are on time, so the step holds no bubble of waiting for another stage's compute.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from cost_model import compile_clock
from cost_model.collectives import collective_time_s
from cost_model.hardware import Link
from cost_model.timing import synchronize
from cost_model.units import format_ms
from dhelix_compile.bench import exposure
from dhelix_compile.bench.bounds import hidden_share
from dhelix_compile.bench.choices import compiled_by_dhelix
from dhelix_compile.emulation.group import Transfer, TransferTimes
from dhelix_compile.step_phases import recording_phases

EMULATED_PREFIX = "emulated:"
BALANCED = "balanced"
#: Link-free steps of the first variant that the balanced link's compute time is the fastest of.
BALANCE_STEPS = 3


@dataclasses.dataclass(frozen=True)
class EmulatedLink:
    """``--link emulated:...`` parsed."""

    link: str
    ranks: int = 8
    traffic: bool = False
    rank: int | None = None
    """The rank to emulate (``rank=R``); None: rank 0, or for a pipeline the one with the most work."""


def parse_emulated_link(spec: str) -> EmulatedLink | None:
    """``"emulated:ib400,ranks=8"`` -> ``EmulatedLink("ib400", 8)``; None for a spec that is not
    an emulated one; ValueError naming what is wrong."""
    if not spec.startswith(EMULATED_PREFIX):
        return None
    link_parts, ranks, rank, traffic = [], 8, None, False

    def integer(part: str, key: str) -> int:
        try:
            return int(part.removeprefix(key))
        except ValueError:
            raise ValueError(f"--link {spec!r}: {key[:-1]} must be an integer, got {part!r}") from None

    for part in filter(None, (p.strip() for p in spec[len(EMULATED_PREFIX) :].split(","))):
        if part.startswith("ranks="):
            ranks = integer(part, "ranks=")
            if ranks < 2:
                raise ValueError(f"--link {spec!r}: ranks must be >= 2")
        elif part.startswith("rank="):
            rank = integer(part, "rank=")
        elif part == "traffic":
            traffic = True
        else:
            link_parts.append(part)
    if not link_parts:
        raise ValueError(
            f"--link {spec!r}: name a link after 'emulated:' (a preset, alpha=...,bandwidth=..., balanced)"
        )
    if rank is not None and not 0 <= rank < ranks:
        raise ValueError(f"--link {spec!r}: rank must be in [0, {ranks})")
    link = ",".join(link_parts)
    if link != BALANCED:
        from dhelix_compile.emulation import parse_link

        parse_link(link)  # a LinkSpecError (a ValueError) names the problem
    return EmulatedLink(link, ranks, traffic, rank)


def _timed(fn: Callable[[], None], device: torch.device, host: list[float] | None = None) -> float:
    """Seconds of ``fn()`` until the device is done; ``host`` gets the seconds until ``fn``
    returned (the host's own time for the step: launches, Python, waits it blocks in)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    if host is not None:
        host.append(time.perf_counter() - start)
    synchronize(device)
    return time.perf_counter() - start


def balanced_link(transfers: list[Any], t_compute_s: float, alpha_s: float) -> Link:
    """The link with latency ``alpha_s`` on which ``transfers`` alone take ``t_compute_s``.

    Time is ``sum(fixed_i) + wire_bytes / B`` (``collective_time_s`` is affine in 1/B), so B is
    solved from two evaluations at B = 1 and B = 2."""
    probe = [Link("probe1", 1.0, alpha_s, ""), Link("probe2", 2.0, alpha_s, "")]
    at = [sum(collective_time_s(t.op, t.nbytes, t.group_size, link) for t in transfers) for link in probe]
    per_inverse_b = 2 * (at[0] - at[1])  # seconds * bytes/s: the wire term at B = 1
    fixed = at[0] - per_inverse_b
    if per_inverse_b <= 0 or t_compute_s <= fixed:
        raise ValueError(
            f"no bandwidth makes this step's collectives take its compute time ({format_ms(t_compute_s)} ms): "
            f"their latency alone takes {format_ms(fixed)} ms; name a link instead of 'balanced'"
        )
    bandwidth = per_inverse_b / (t_compute_s - fixed)
    return Link(f"balanced_{bandwidth / 1e9:.3g}gbps", bandwidth, alpha_s, "bandwidth solved for T_comm = T_compute")


@dataclasses.dataclass
class VariantTimes:
    """One variant's measurements, a value per timed repeat (seconds, bytes)."""

    step_s: list[float] = dataclasses.field(default_factory=list)
    host_s: list[float] = dataclasses.field(default_factory=list)
    compute_s: list[float] = dataclasses.field(default_factory=list)
    comm_s: list[float] = dataclasses.field(default_factory=list)
    wire_bytes: list[int] = dataclasses.field(default_factory=list)
    transfers: int = 0
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    compile_s: float = 0.0
    compile_phases_s: dict[str, float] = dataclasses.field(default_factory=dict)
    parts: list[exposure.Repeat] = dataclasses.field(default_factory=list)


def _to_device(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else None
        return value.to(device=device, dtype=cast)
    if isinstance(value, dict):
        return {k: _to_device(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device, dtype) for v in value)
    return value


def measure_emulated(
    emulated: EmulatedLink,
    model: str,
    parallel: str,
    variants: list[str],
    *,
    microbatches: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    device: str = "cpu",
    dtype: str | None = None,
    dhelix_options: dict[str, Any] | None = None,
    time_limit_s: float = 600.0,
    data_parallel: str | None = None,
) -> dict[str, Any]:
    """Every variant's step, own compute, own communication and bytes on the emulated link.

    ``data_parallel``: ``"shard"`` or ``"replicate"`` runs the model as written, data-parallel
    over every rank (``bench.data_parallel``: PyTorch's FSDP2 / DDP beside ``data_parallel``)."""
    import torch.distributed.device_mesh as device_mesh

    from dhelix_compile.bench.data_parallel import data_parallel_step
    from dhelix_compile.bench.steps import step_function
    from dhelix_compile.bench.variants import overlap_scheduler_on_cpu
    from dhelix_compile.bench.workloads import build_workload

    torch_device = torch.device(device if device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    torch_dtype = getattr(torch, dtype) if dtype else None
    rank = 0 if emulated.rank is None else emulated.rank
    cluster, first_link = _emulate(emulated, rank)
    try:
        dim = "dp" if data_parallel else "tp"
        mesh = device_mesh.init_device_mesh(torch_device.type, (emulated.ranks,), mesh_dim_names=(dim,))
        built = build_workload(
            model,
            "none" if data_parallel else parallel,
            mesh,
            emulated.ranks,
            microbatches,
            torch.Generator().manual_seed(0),
        )
        workload = dataclasses.replace(
            built,
            make=lambda: built.make().to(device=torch_device, dtype=torch_dtype),
            microbatches=_to_device(built.microbatches, torch_device, torch_dtype),
        )

        def make_step(name: str) -> Callable[[], None]:
            data = workload.microbatches
            run: Callable[[Any], None]
            if data_parallel:
                run_data_parallel = data_parallel_step(name, workload, data_parallel, mesh, dhelix_options or {})
                run = lambda _data: run_data_parallel()  # noqa: E731 - the step takes its own data
            else:
                run = step_function(name, workload.make(), workload.loss_fn, dhelix_options)

            def step() -> None:
                if torch_device.type == "cuda":
                    run(data)
                    return
                with overlap_scheduler_on_cpu(name):
                    run(data)

            return step

        times, done = _measure_variants(
            cluster, emulated, first_link, variants, make_step, torch_device, repeats, warmup, time_limit_s
        )
        described = f"data-parallel {data_parallel}" if data_parallel else parallel
        return _summary(emulated, rank, cluster.link, model, described, torch_device, dtype, microbatches, times, done)
    finally:
        cluster.close()


def pipeline_tp(ranks: int, tp: int | None = None) -> int:
    """The TP degree of an emulated PP x TP job of ``ranks`` ranks: ``tp`` as asked (a divisor of
    ``ranks``), else two pipeline ranks with TP over the rest (4 ranks: PP=2 x TP=2), or TP=1
    for an odd count (every rank a pipeline rank)."""
    if tp is None:
        return ranks // 2 if ranks % 2 == 0 else 1
    if tp < 1 or ranks % tp:
        raise ValueError(f"--tp {tp} does not divide the {ranks} emulated ranks into pipeline ranks")
    return tp


def pipeline_rank(kind: str, pp: int, tp: int) -> int:
    """The rank with the most work in a PP x TP job (mesh ``(pp, tp)``, row-major): the first TP
    rank of the pipeline rank that holds the last stage (the head and the loss)."""
    from dhelix_compile.bench.choices import SCHEDULE_KINDS, ScheduleKind
    from dhelix_compile.testing.pipeline_checks import stage_layout

    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}; choose from {', '.join(SCHEDULE_KINDS)}")
    schedule_kind: ScheduleKind = kind  # type: ignore[assignment]  # checked above
    last = pp * len(stage_layout(schedule_kind, pp, 0)) - 1
    return next(r for r in range(pp) if last in stage_layout(schedule_kind, pp, r)) * tp


def measure_emulated_pipeline(
    emulated: EmulatedLink,
    kind: str,
    model: str,
    variants: list[str],
    *,
    tp: int | None = None,
    microbatches: int = 4,
    repeats: int = 5,
    warmup: int = 2,
    dhelix_options: dict[str, Any] | None = None,
    time_limit_s: float = 600.0,
) -> dict[str, Any]:
    """Every pipeline variant (``choices.PIPELINE_VARIANTS``, each optionally with options in
    brackets) on one rank of an emulated PP x TP job (module docstring): its step, own compute,
    own communication (its P2P and TP collectives) and bytes, on CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    from dhelix_compile.bench.choices import PIPELINE_VARIANTS
    from dhelix_compile.bench.pipeline_parallel import build_pipeline
    from dhelix_compile.bench.steps import split_variant

    tp = pipeline_tp(emulated.ranks, tp)
    pp = emulated.ranks // tp
    rank = pipeline_rank(kind, pp, tp) if emulated.rank is None else emulated.rank
    for name in variants:
        split_variant(name, PIPELINE_VARIANTS)  # a ValueError names a bad one before anything runs
    device = torch.device("cpu")
    cluster, first_link = _emulate(emulated, rank)
    try:
        mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp")) if tp > 1 else None
        pp_rank = rank // tp
        gen = torch.Generator().manual_seed(0)
        pipeline = build_pipeline(kind, model, pp_rank, pp, microbatches, gen, mesh)

        def make_step(name: str) -> Callable[[], None]:
            base, own = split_variant(name, PIPELINE_VARIANTS)
            return pipeline.step_function(base, {**(dhelix_options or {}), **own})

        times, done = _measure_variants(
            cluster, emulated, first_link, variants, make_step, device, repeats, warmup, time_limit_s
        )
        described = f"pipeline {kind}, PP={pp} x TP={tp}"
        return _summary(emulated, rank, cluster.link, model, described, device, None, microbatches, times, done)
    finally:
        cluster.close()


def _emulate(emulated: EmulatedLink, rank: int) -> tuple[Any, Link]:
    """The live emulation as rank ``rank``, and the link it starts on (ib400 for ``balanced``)."""
    import dhelix_compile
    from dhelix_compile.emulation import parse_link

    first_link = parse_link("ib400") if emulated.link == BALANCED else parse_link(emulated.link)
    return dhelix_compile.emulate(emulated.ranks, rank, link=first_link, traffic=emulated.traffic), first_link


def _measure_variants(
    cluster: Any,
    emulated: EmulatedLink,
    first_link: Link,
    variants: list[str],
    make_step: Callable[[str], Callable[[], None]],
    device: torch.device,
    repeats: int,
    warmup: int,
    time_limit_s: float,
) -> tuple[dict[str, VariantTimes], int]:
    """Each variant's step (``make_step(name)``) compiled and warmed, then timed on the link and
    with it free, interleaved with the others; returns the times and the repeats done."""
    from dhelix_compile.emulation.group import link_time_s

    times = {name: VariantTimes() for name in variants}
    steps: dict[str, Callable[[], None]] = {}

    def prepare(name: str) -> None:
        steps[name] = make_step(name)
        print(f"    compiling {name} ...", file=sys.stderr, flush=True)
        clock = compile_clock.totals()
        wall_s = _timed(steps[name], device)
        times[name].compile_phases_s = compile_clock.since(clock)
        times[name].compile_s = wall_s - times[name].compile_phases_s["dumps"]  # a user writes no dumps
        phases = compile_clock.format_phases(times[name].compile_phases_s)
        split = f" ({phases}: {compile_clock.SHOWN_HEADER})" if phases else ""
        print(f"    first step of {name}: {times[name].compile_s:.1f} s{split}", file=sys.stderr, flush=True)
        for _ in range(warmup):
            steps[name]()

    if emulated.link == BALANCED:  # the first variant sets the link's bandwidth
        first = variants[0]
        with cluster.link_free():
            prepare(first)
            cluster.ledger.clear()
            # the fastest: a busy moment only makes a step slower, and one slow sample would
            # halve the bandwidth for the whole run
            t_compute = min(_timed(steps[first], device) for _ in range(BALANCE_STEPS))
            per_step = cluster.ledger.transfers()[: len(cluster.ledger.transfers()) // BALANCE_STEPS]
        cluster.set_link(balanced_link(per_step, t_compute, first_link.latency_s))
        if compiled_by_dhelix(first):  # its plan priced the starting link: compiled again on this one
            print(f"    {first} planned on {first_link.name}: compiling it again", file=sys.stderr, flush=True)
            cold = times[first].compile_s, times[first].compile_phases_s
            del steps[first]
            prepare(first)
            times[first].compile_s, times[first].compile_phases_s = cold  # the first step is the cold one
    for name in variants:
        if name not in steps:
            prepare(name)
    started = time.perf_counter()
    done = 0
    for _ in range(repeats):
        for name in variants:
            row = times[name]
            cluster.ledger.clear()
            with recording_phases() as on_link:
                row.step_s.append(_timed(steps[name], device, row.host_s))
            timed = [_timed_transfer(t, times) for t, times in cluster.ledger.timed()]
            transfers = cluster.ledger.transfers()
            row.comm_s.append(link_time_s(transfers))
            row.wire_bytes.append(sum(t.wire_bytes for t in transfers))
            row.transfers = len(transfers)
            row.ops = dict(sorted(collections.Counter(t.op for t in transfers).items()))
            with cluster.link_free(), recording_phases() as link_free:
                row.compute_s.append(_timed(steps[name], device))
            if device.type == "cpu":  # CUDA: the host's spans are launch times, not the device's
                row.parts.append(exposure.Repeat(on_link, link_free, timed))
        done += 1
        if time.perf_counter() - started > time_limit_s:
            break
    return times, done


def _timed_transfer(transfer: Transfer, times: TransferTimes) -> exposure.TimedTransfer:
    """The exposure table's view of one emulated transfer (``emulation.group``'s ledger)."""
    return exposure.TimedTransfer(
        transfer.op,
        transfer.seconds,
        times.phase,
        times.waited_phase,
        times.blocked_s,
        times.queued_s,
        transfer.nbytes,
        times.issued_s,
        times.wait_called_s,
    )


def variant_row(row: VariantTimes) -> dict[str, Any]:
    """One variant's summary: medians of its repeats beside its own limit (module docstring)."""
    step, compute, comm = (statistics.median(v) for v in (row.step_s, row.compute_s, row.comm_s))
    limit = max(compute, comm)
    hideable = compute + comm - limit
    return {
        "step_s_median": step,
        "step_s_all": row.step_s,
        "t_compute_s": compute,
        "t_comm_s": comm,
        "limit_s": limit,
        "step_over_limit": step / limit,
        # None where nothing is hideable, or where the step beat its limit (its link-free
        # repeats ran slower than the step: noise, no share to read)
        "hidden_share": hidden_share(step, compute, comm) if hideable > 0 and step >= limit else None,
        "exposed_comm_s": max(0.0, step - compute),
        "host_s_median": statistics.median(row.host_s),
        "wire_bytes_per_step": statistics.median(row.wire_bytes),
        "transfers_per_step": row.transfers,
        "operations_per_step": row.ops,
        "compile_s": row.compile_s,
        "compile_phases_s": row.compile_phases_s,
        "parts": [part.as_dict() for part in exposure.part_rows(row.parts)],
    }


def _summary(
    emulated: EmulatedLink,
    rank: int,
    link: Link,
    model: str,
    parallel: str,
    device: torch.device,
    dtype: str | None,
    microbatches: int,
    times: dict[str, VariantTimes],
    repeats: int,
) -> dict[str, Any]:
    rows = {name: variant_row(row) for name, row in times.items()}
    return {
        "emulated": dataclasses.asdict(emulated),
        "rank": rank,
        "link": {"name": link.name, "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "alpha_s": link.latency_s},
        "model": model,
        "parallel": parallel,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "dtype": dtype or "float32",
        "microbatches": microbatches,
        "repeats": repeats,
        "torch": torch.__version__,
        "variants": rows,
    }


def markdown_emulated(summary: dict[str, Any]) -> str:
    """The table: each variant beside its own limit, with the bytes it sent."""
    link = summary["link"]
    head = (
        f"Emulated cluster: rank {summary.get('rank', 0)} of {summary['emulated']['ranks']}, link {link['name']} "
        f"({link['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s, alpha {link['alpha_s'] * 1e6:.3g} us"
        f"{', traffic copies' if summary['emulated']['traffic'] else ''}), {summary['model']} {summary['parallel']}, "
        f"{summary['device']} {summary['dtype']}, {summary['microbatches']} micro-batch(es), "
        f"median of {summary['repeats']}, torch {summary['torch']}"
    )
    lines = [
        head,
        "",
        "| variant | step ms | own compute ms | own comm ms | own limit ms | step / limit | hidden | MB sent/step "
        f"| host ms | first step s ({compile_clock.SHOWN_HEADER}) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in summary["variants"].items():
        hidden = "-" if row["hidden_share"] is None else f"{row['hidden_share']:.0%}"
        lines.append(
            f"| {name} | {format_ms(row['step_s_median'])} | {format_ms(row['t_compute_s'])} | "
            f"{format_ms(row['t_comm_s'])} | {format_ms(row['limit_s'])} | {row['step_over_limit']:.2f} | {hidden} | "
            f"{row['wire_bytes_per_step'] / 1e6:.1f} | {format_ms(row['host_s_median'])} | {_compile_cell(row)} |"
        )
    off = _balance_note(summary)
    if off:
        lines += ["", off]
    lines += [
        "",
        "first step: the variant's first call, which compiles every graph of the step, less writing the graph "
        "dumps the bench asks for (a user's step writes none); in brackets, of it, dhelix's "
        "compiles in AOTAutograd, measuring costs, running the graph passes, searching the strand plan and "
        "generating code (cost_model.compile_clock).",
    ]
    parts = [
        line
        for name, row in summary["variants"].items()
        for line in exposure.markdown_parts(name, row.get("parts", []))
    ]
    if parts:
        lines += ["", "Where each variant's communication is exposed, part by part of the step (bench.exposure):", ""]
        lines += [*exposure.PARTS_HEADER, *parts]
    return "\n".join(lines)


#: A balanced link whose first variant's own communication over its own compute falls outside
#: this range is reported off balance (:func:`_balance_note`).
BALANCE_RANGE = (0.8, 1.25)


def _balance_note(summary: dict[str, Any]) -> str | None:
    """A line when ``balanced`` set a link on which the first variant's communication is not
    about its compute (its compute measured while the machine was busy, or varying from step to
    step): the run's ratios stand, its regime is not T_comm = T_compute."""
    if summary["emulated"]["link"] != BALANCED or not summary["variants"]:
        return None
    name, row = next(iter(summary["variants"].items()))
    ratio = row["t_comm_s"] / row["t_compute_s"]
    if BALANCE_RANGE[0] <= ratio <= BALANCE_RANGE[1]:
        return None
    return (
        f"The link is off balance: {name}'s own communication is {ratio:.2f}x its own compute (the "
        f"bandwidth was set from its link-free steps; a busy machine then makes it too low)."
    )


def _compile_cell(row: dict[str, Any]) -> str:
    spent = compile_clock.format_phases(row.get("compile_phases_s"))
    first = f"{row.get('compile_s', 0.0):.1f}"
    return f"{first} ({spent})" if spent else first
