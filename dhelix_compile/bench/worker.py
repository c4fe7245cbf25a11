"""One rank of a benchmark run: ``python -m dhelix_compile.bench.worker --out F.json ...``.

Launched (by ``dhelix_compile.launch.ranks.launch_ranks``) with RANK / WORLD_SIZE / MASTER_ADDR
/ MASTER_PORT in the environment. Three modes:

    --mode link      gloo over the real (possibly rate-limited) link: every variant's step time,
                     interleaved, each step started together on all ranks (barrier); then each
                     variant's own collectives (one more step, recorded at the process group:
                     ``measure.record_sent_collectives``; a pipeline's sends and receives too,
                     paired up across the ranks: ``measure.pair_transfers``) replayed back to
                     back with no compute, its own T_comm, and its own ceiling
                     (``measure.ceiling_steps``): those transfers each hidden under a share of
                     its own T_compute (--own-t-compute-s) of synthetic compute.
    --mode compute   the "fake" process group (collectives return at once, nothing is sent):
                     the same variants' step times are T_compute, the step without communication.
    --mode comm      gloo over the link, T_comm only (``--rate auto`` times it at the rates it
                     tries, ``bench.link_rate``).

A step is one forward and backward per micro-batch (``--microbatches``; gradients accumulate,
helix merges consecutive micro-batches) of a workload (``bench.workloads``: the reference
transformer, an MLP block, an MoE layer, a Hugging Face Llama). A step's time is the slowest
rank's. Per variant the first step is timed apart (it compiles every graph: the compile time)
with where dhelix's compiles in it spent their time (``compile_phases_s``: ``cost_model.compile_clock``).
Rank 0 writes the JSON; every rank exits 0 on success.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cost_model import compile_clock
from cost_model.rank_agreement import agree_max, all_agree, gather_floats
from dhelix_compile.bench.choices import (
    DATA_PARALLEL_MODES,
    MODEL_NAMES,
    PIPELINE_VARIANTS,
    SCHEDULE_KINDS,
    compiled_by_dhelix,
)
from dhelix_compile.bench.data_parallel import data_parallel_collectives_step, data_parallel_step
from dhelix_compile.bench.measure import (
    Replay,
    SentCollective,
    SentReplay,
    ceiling_steps,
    gather_sent,
    pair_transfers,
    record_collectives,
    record_sent_collectives,
    replay_collectives,
    time_interleaved,
    times_alone,
)
from dhelix_compile.bench.pipeline_parallel import P2PReplay, build_pipeline
from dhelix_compile.bench.progress_file import ProgressFile
from dhelix_compile.bench.steps import parse_variants, split_variant, step_function
from dhelix_compile.bench.variants import overlap_scheduler_on_cpu
from dhelix_compile.bench.workloads import build_workload
from dhelix_compile.comm_threads import local_ranks, prioritize_gloo_threads
from dhelix_compile.helix_runtime.schedule import HelixScheduleKind, graph_calls, helix_schedule, read_schedule_kind


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--mode", choices=["link", "compute", "comm"], default="link")
    parser.add_argument("--model", choices=sorted(MODEL_NAMES), default="small")
    parser.add_argument("--parallel", choices=["tp", "tp_sp"], default="tp_sp")
    parser.add_argument("--variants", default="eager,inductor,inductor_overlap,dhelix")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches per step (gradients accumulate)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dhelix-options", default="{}", help="JSON dict of dhelix options")
    parser.add_argument(
        "--gloo-priority",
        choices=["realtime", "normal"],
        default="realtime",
        help="gloo's threads for every variant (dhelix_compile.comm_threads); dhelix variants get it as their option",
    )
    parser.add_argument("--time-limit-s", type=float, default=300.0, help="stop repeating after this")
    parser.add_argument(
        "--t-compute-s",
        type=float,
        default=0.0,
        help="link mode: the T_compute of a variant --own-t-compute-s does not name (0: no ceiling for it)",
    )
    parser.add_argument(
        "--own-t-compute-s",
        default="{}",
        help="link mode: JSON {variant: seconds}, each variant's T_compute, under which its own collectives' "
        "ceiling is timed (a variant not named: --t-compute-s, else no ceiling)",
    )
    parser.add_argument("--progress-file", default=None, help="rank 0 writes 'done total variant' here")
    parser.add_argument(
        "--pipeline",
        choices=SCHEDULE_KINDS,
        default=None,
        help="the model as a pipeline under this torch schedule (bench.pipeline_parallel), its variants",
    )
    parser.add_argument(
        "--data-parallel",
        choices=DATA_PARALLEL_MODES,
        default=None,
        help="the model as written, data-parallel over every rank in this mode (bench.data_parallel), its variants",
    )
    return parser.parse_args(argv)


def init_process_group(mode: str) -> tuple[int, int]:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "compute":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    else:
        # a variant that fails on one rank leaves its peer in a receive: the group's timeout ends it
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
    return rank, world_size


def _graph_summaries(dump_dir: Path, rank: int) -> dict[str, dict[str, Any]]:
    """This rank's graph summaries by kind (``fwd``, ``bwd``, and the merged kinds of
    ``helix_runtime.schedule.MERGED_GRAPH_KINDS``: the folder name's suffix)."""
    return {
        path.parent.name.rsplit("_", 1)[-1]: json.loads(path.read_text())
        for path in sorted((dump_dir / f"rank{rank}").glob("*/summary.json"))
    }


def _per_step(
    per_graph: dict[str, float], microbatches: int, schedule: HelixScheduleKind | None = None
) -> float | None:
    """A step's total of a per-call number of each graph.

    Single strand (``schedule`` None): n x (forward + backward). Helix: each graph kind times
    its calls in ``schedule`` (``helix_runtime.schedule``).
    """
    if schedule is None:
        calls = {"fwd": microbatches, "bwd": microbatches}
    else:
        calls = graph_calls(helix_schedule(microbatches, schedule))
    if any(kind not in per_graph for kind in calls):
        return None
    return sum(count * per_graph[kind] for kind, count in calls.items())


def _predicted_step_s(dump_dir: Path, rank: int, microbatches: int) -> float | None:
    """Predicted step time from this rank's graph dumps: each planned graph's predicted makespan,
    added up per step. A graph is planned where the interleave pass (a merged graph) or the
    reorder pass recorded its prediction; the makespan is its final graph's (the dumps' timeline:
    what ran after the passes, helix's in-graph gradient adds included), else the pass's."""
    return _planned_per_step(dump_dir, rank, microbatches, "makespan_after_s", "predicted_makespan_s")


def _predicted_contention_s(dump_dir: Path, rank: int, microbatches: int) -> float | None:
    """The compute time the planned graphs' schedules add per step by running beside transfers
    (``timeline.contention_after_s``, the simulator's contention factors); None where a planned
    graph's dump does not say."""
    return _planned_per_step(dump_dir, rank, microbatches, "contention_after_s")


def _planned_per_step(
    dump_dir: Path, rank: int, microbatches: int, timeline_key: str, record_key: str | None = None
) -> float | None:
    """A per-call number of each planned graph (``_predicted_step_s`` says which) added up per
    step: its dumps' ``timeline[timeline_key]``, else its pass's ``record_key`` record."""
    per_graph: dict[str, float] = {}
    for kind, summary in _graph_summaries(dump_dir, rank).items():
        records = summary.get("records", {})
        for pass_name in ("interleave", "reorder"):
            if "predicted_makespan_s" in records.get(pass_name, {}):
                value = summary.get("timeline", {}).get(timeline_key)
                if value is None and record_key is not None:
                    value = records[pass_name][record_key]
                if value is not None:
                    per_graph[kind] = value
                break
    return _per_step(per_graph, microbatches, read_schedule_kind(dump_dir / f"rank{rank}"))


#: The parts of a measured call's account (``observe.measured.CallAccount``) the bench adds up.
ACCOUNT_PARTS = (
    "compute_predicted_s",
    "compute_measured_s",
    "blocked_predicted_s",
    "blocked_measured_s",
    "variation_s",
)


def _step_account(dump_dir: Path, rank: int, microbatches: int) -> dict[str, float] | None:
    """Each of ``ACCOUNT_PARTS`` per step, from the graphs' measured accounts (``profile_steps``);
    None unless every graph the step calls has one (a graph its schedule never calls has none)."""
    found = {kind: (s.get("measured") or {}).get("account") for kind, s in _graph_summaries(dump_dir, rank).items()}
    accounts: dict[str, dict[str, float]] = {kind: a for kind, a in found.items() if a is not None}
    if not accounts:
        return None
    schedule = read_schedule_kind(dump_dir / f"rank{rank}")
    totals: dict[str, float] = {}
    for part in ACCOUNT_PARTS:
        total = _per_step({kind: a[part] for kind, a in accounts.items()}, microbatches, schedule)
        if total is None:
            return None
        totals[part] = total
    return totals


def _folder(variant: str) -> str:
    """The variant's dump folder name: ``helix[decompose=off]`` -> ``helix-decompose=off``."""
    return re.sub(r"[^A-Za-z0-9_=.-]+", "-", variant).strip("-")


def _gloo_threads(args: argparse.Namespace) -> str:
    """Every variant runs with gloo's threads as ``--gloo-priority`` says, the baselines too: the
    bench compares schedules, not thread priorities (``dhelix_compile.comm_threads``). What they
    run at, in words."""
    if args.gloo_priority == "normal":
        return "normal priority (--gloo-priority normal)"
    result = prioritize_gloo_threads(local_ranks(), args.threads)
    if result.reason is not None:
        print(f"dhelix bench: gloo's threads stay at normal priority: {result.reason}", file=sys.stderr)
        return f"normal priority ({result.reason})"
    budget = f", {result.share * 100:g}% of each ms" if result.share else ""
    if result.refused_share:  # other processes hold deadline bandwidth: the kernel admitted less
        budget += f", {result.refused_share * 100:g}% refused"
    return f"real-time priority (SCHED_DEADLINE{budget}; --gloo-priority realtime)"


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dhelix_bench_") as dump_root:
        return _run(args, Path(dump_root))


def _run(args: argparse.Namespace, dump_root: Path) -> dict[str, Any]:
    rank, world_size = init_process_group(args.mode)
    torch.set_num_threads(args.threads)
    mesh = torch.distributed.device_mesh.DeviceMesh("cpu", list(range(world_size)))
    gen = torch.Generator().manual_seed(1234)
    user_options = json.loads(args.dhelix_options)
    if user_options.get("dump_dir"):  # keep the dumps: one folder per variant under the user's
        dump_root = Path(user_options.pop("dump_dir"))
    barrier = None if args.mode == "compute" else dist.barrier
    user_options.setdefault("gloo_thread_priority", args.gloo_priority)
    setup = _setup(args, rank, world_size, mesh, gen, user_options, dump_root)
    _gloo_threads(args)  # before the first steps: their compiles profile the link at this priority
    if args.mode == "comm":
        return _t_comm_only(setup, args.repeats, rank)

    steps: dict[str, Any] = {}
    errors: dict[str, str] = {}
    first_step_s: dict[str, float] = {}
    compile_phases_s: dict[str, dict[str, float]] = {}
    for name in parse_variants(args.variants):
        ok = True
        try:
            step = setup.step(name)
            with overlap_scheduler_on_cpu(name):
                for warm_up in range(max(args.warmup, 1)):
                    if barrier:
                        barrier()
                    clock = compile_clock.totals()
                    start = time.perf_counter()
                    step()
                    if warm_up == 0:  # compiles every graph the step needs, then runs it once
                        compile_phases_s[name] = compile_clock.since(clock)
                        # less the graph dumps the bench writes for its predictions: a user's
                        # step without dump_dir writes none
                        first_step_s[name] = time.perf_counter() - start - compile_phases_s[name]["dumps"]
        except Exception:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
            errors[name] = traceback.format_exc(limit=3)
            ok = False
        if all_agree(ok, dist.group.WORLD):
            steps[name] = step
        else:
            errors.setdefault(name, "failed on another rank")

    gloo_threads = _gloo_threads(args)  # groups the variants made too
    repeats = _repeats_within(args.time_limit_s, steps, args.repeats, barrier)
    progress = ProgressFile(args.progress_file if rank == 0 else None, total=repeats * len(steps))
    times = time_interleaved(steps, repeats, barrier, on_step=progress.step)
    result: dict[str, Any] = {
        "mode": args.mode,
        "model": args.model,
        "parallel": args.parallel,
        "pipeline": args.pipeline,
        "data_parallel": args.data_parallel,
        "model_config": setup.config,
        "batch": setup.batch,
        "seq_len": setup.seq_len,
        "world_size": world_size,
        "microbatches": args.microbatches,
        "threads": args.threads,
        "gloo_threads": gloo_threads if args.mode == "link" else None,
        "repeats": repeats,
        "step_s": {name: agree_max(samples, dist.group.WORLD) for name, samples in times.wall_s.items()},
        "cpu_s": {name: agree_max(samples, dist.group.WORLD) for name, samples in times.cpu_s.items()},
        "gloo_cpu_s": {name: agree_max(samples, dist.group.WORLD) for name, samples in times.gloo_cpu_s.items()},
        "first_step_s": {name: agree_max([first_step_s[name]], dist.group.WORLD)[0] for name in steps},
        "compile_phases_s": {
            name: dict(zip(compile_clock.PHASES, agree_max(list(compile_phases_s[name].values()), dist.group.WORLD)))
            for name in steps
        },
        "errors": errors,
    }
    if args.mode == "link":
        own_compute = {name: float(t) for name, t in json.loads(args.own_t_compute_s).items()}
        own, failed = _own_bounds(steps, own_compute, args.t_compute_s, args.time_limit_s, repeats, rank)
        result["own"] = own
        errors.update(failed)
        predicted = {
            name: _predicted_step_s(dump_root / _folder(name), rank, args.microbatches)
            for name in steps
            if compiled_by_dhelix(name) and not args.pipeline
        }
        names = sorted(predicted)
        contention = [_predicted_contention_s(dump_root / _folder(name), rank, args.microbatches) for name in names]
        per_rank = gather_floats([*(predicted[name] for name in names), *contention], dist.group.WORLD)
        result["predicted_step_s"] = {name: [row[i] for row in per_rank] for i, name in enumerate(names)}
        result["predicted_contention_s"] = {
            name: [row[len(names) + i] for row in per_rank] for i, name in enumerate(names)
        }
        if rank == 0:  # profiled calls (profile_steps): rank 0's account of each step
            accounts = {name: _step_account(dump_root / _folder(name), rank, args.microbatches) for name in names}
            result["measured_account"] = {name: parts for name, parts in accounts.items() if parts}
    dist.barrier() if args.mode == "link" else None
    return result if rank == 0 else {}


def _timed_bound(
    replays: dict[str, Replay], ceilings: dict[str, tuple[Replay, float]], repeats: int, barrier: Any
) -> dict[str, Any]:
    """Each of ``replays`` back to back (``T_comm``) and each of ``ceilings`` (a replay under that
    many seconds of synthetic compute, ``measure.ceiling_steps``), interleaved over ``repeats``
    (the slowest rank's seconds): ``{key: {"t_comm_s", "t_comm_cpu_s", "t_comm_gloo_cpu_s"}}``
    and ``{key: ceiling samples}`` (``compute_s``, ``in_flight``: per depth ``step_s``,
    ``cpu_s``, ``gloo_cpu_s``), as ``bench.run.ceiling_row`` reads them."""
    world = dist.group.WORLD
    timed: dict[str, Callable[[], Any]] = {f"comm {key}": replay for key, replay in replays.items()}
    depths: dict[str, list[int]] = {}
    alone: dict[int, list[float]] = {}
    for key, (replay, compute_s) in ceilings.items():
        if id(replay) not in alone:
            alone[id(replay)] = times_alone(replay, 5)
        compute, overlapped = ceiling_steps(
            replay, compute_s, lambda counts: [int(c) for c in agree_max(counts, world)], alone_s=alone[id(replay)]
        )
        timed[f"compute {key}"] = compute
        timed.update({f"ceiling_{depth} {key}": step for depth, step in overlapped.items()})
        depths[key] = sorted(overlapped)
    for warm_up in timed.values():
        warm_up()
    times = time_interleaved(timed, repeats, barrier)

    def slowest(samples: dict[str, list[float]], name: str) -> list[float]:
        return agree_max(samples[name], world)

    comm = {
        key: {
            "t_comm_s": slowest(times.wall_s, f"comm {key}"),
            "t_comm_cpu_s": slowest(times.cpu_s, f"comm {key}"),
            "t_comm_gloo_cpu_s": slowest(times.gloo_cpu_s, f"comm {key}"),
        }
        for key in replays
    }
    ceiling = {
        key: {
            "compute_s": slowest(times.wall_s, f"compute {key}"),
            "in_flight": {
                depth: {
                    "step_s": slowest(times.wall_s, f"ceiling_{depth} {key}"),
                    "cpu_s": slowest(times.cpu_s, f"ceiling_{depth} {key}"),
                    "gloo_cpu_s": slowest(times.gloo_cpu_s, f"ceiling_{depth} {key}"),
                }
                for depth in depths[key]
            },
        }
        for key in ceilings
    }
    return {"comm": comm, "ceiling": ceiling}


def sent_summary(sent: list[SentCollective]) -> dict[str, Any]:
    """What a variant's recorded collectives come to per step: ``wire_bytes_per_step`` (this
    rank's), ``transfers_per_step`` and ``collectives`` (calls per op, sorted by op)."""
    counts: dict[str, int] = {}
    for collective in sent:
        counts[collective.op] = counts.get(collective.op, 0) + 1
    return {
        "wire_bytes_per_step": sum(c.wire_bytes for c in sent),
        "transfers_per_step": len(sent),
        "collectives": dict(sorted(counts.items())),
    }


def _own_bounds(
    steps: dict[str, Callable[[], None]],
    own_compute_s: dict[str, float],
    t_compute_s: float,
    time_limit_s: float,
    repeats: int,
    rank: int,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Each variant's own bound on the link: one more step of it, its calls on the process group
    recorded (``measure.record_sent_collectives``) on every rank and paired up across the ranks
    (``measure.pair_transfers``: a pipeline's sends meet their receives); those transfers
    replayed alone (its own ``T_comm``; variants whose ranks all sent the same calls share one
    replay) and under synthetic compute of its own ``T_compute`` (its own ceiling). Per variant
    (the slowest rank's times; the calls and bytes of the rank that put most bytes on the wire):
    ``sent_summary``'s keys, ``t_comm_s``, ``t_comm_cpu_s``, ``t_comm_gloo_cpu_s`` and
    ``ceiling``; and the variants whose recording failed or whose ranks' calls do not pair up,
    with why."""
    world = dist.group.WORLD
    size = dist.get_world_size()
    every_rank: dict[str, list[list[SentCollective]]] = {}
    plans: dict[str, list[list[list[int]]]] = {}
    errors: dict[str, str] = {}
    for name, step in steps.items():
        sent: list[SentCollective] = []
        ok = True
        try:
            dist.barrier()
            sent = record_sent_collectives(step, rank, size)
        except Exception:  # noqa: BLE001 - reported per variant, not fatal
            errors[name] = "recording its collectives: " + traceback.format_exc(limit=3)
            ok = False
        if not all_agree(ok, world):
            errors.setdefault(name, "recording its collectives failed on another rank")
            continue
        every_rank[name] = gather_sent(sent, world)
        try:  # the same lists on every rank: the same transfers, or the same error, everywhere
            plans[name] = pair_transfers(every_rank[name])
        except ValueError as exc:
            errors[name] = f"its ranks' recorded calls do not pair up: {exc}"
            every_rank.pop(name)
    replays: dict[str, SentReplay] = {}
    key_of: dict[str, str] = {}
    for name, calls in every_rank.items():  # every rank compares every rank's calls: the same keys everywhere
        same = next((key for key in replays if every_rank[key] == calls), name)
        if same == name:
            replays[name] = SentReplay(calls[rank], size, [transfer[rank] for transfer in plans[name]])
        key_of[name] = same
    ceilings: dict[str, tuple[Replay, float]] = {}
    for name in every_rank:
        compute_s = own_compute_s.get(name, t_compute_s)
        if compute_s > 0 and len(replays[key_of[name]]) > 0:
            ceilings[name] = (replays[key_of[name]], compute_s)
    start = time.perf_counter()  # one round: each replay, and each ceiling's compute at least 3 times
    for replay in replays.values():
        replay()
    round_s = time.perf_counter() - start + 3 * sum(compute_s for _, compute_s in ceilings.values())
    fit = int(time_limit_s / max(agree_max([round_s], world)[0], 1e-6))
    timed = _timed_bound(dict(replays), ceilings, max(3, min(repeats, fit)), dist.barrier)
    own: dict[str, dict[str, Any]] = {}
    for name, calls in every_rank.items():
        wire = [sum(c.wire_bytes for c in rank_calls) for rank_calls in calls]
        busiest = wire.index(max(wire))  # the first rank that put most bytes on the wire
        own[name] = {
            **sent_summary(calls[busiest]),
            **timed["comm"][key_of[name]],
            "ceiling": timed["ceiling"].get(name),
        }
    return own, errors


def _t_comm_only(setup: _Setup, repeats: int, rank: int) -> dict[str, Any]:
    """``--mode comm``: the step's collectives replayed back to back, ``repeats`` times after one
    untimed replay (the slowest rank's seconds, on rank 0)."""
    replay = setup.replay()
    replay()
    times = time_interleaved({"comm": replay}, repeats, dist.barrier)
    t_comm = agree_max(times.wall_s["comm"], dist.group.WORLD)
    dist.barrier()
    return {"mode": "comm", "t_comm_s": t_comm} if rank == 0 else {}


@dataclasses.dataclass
class _Setup:
    """What a run measures: ``step(variant)`` a fresh model's step (compiled at its first call),
    ``replay()`` the step's communication alone, and the workload's description."""

    step: Callable[[str], Callable[[], None]]
    replay: Callable[[], Any]
    config: dict[str, str]
    batch: int
    seq_len: int


def _setup(
    args: argparse.Namespace,
    rank: int,
    world_size: int,
    mesh: Any,
    gen: torch.Generator,
    user_options: dict[str, Any],
    dump_root: Path,
) -> _Setup:
    def options(name: str) -> dict[str, Any]:
        return {**user_options, "dump_dir": str(dump_root / _folder(name))}

    if args.pipeline:
        pipeline = build_pipeline(args.pipeline, args.model, rank, world_size, args.microbatches, gen)

        def pipeline_step(name: str) -> Callable[[], None]:
            base, own = split_variant(name, PIPELINE_VARIANTS)
            return pipeline.step_function(base, {**options(name), **own})

        return _Setup(
            pipeline_step,
            lambda: P2PReplay(pipeline.transfers, rank),
            pipeline.config,
            pipeline.batch,
            pipeline.seq_len,
        )
    if args.data_parallel:
        mode = args.data_parallel
        workload = build_workload(args.model, "none", mesh, world_size, args.microbatches, gen)

        def replay_data_parallel() -> Any:
            return replay_collectives(record_collectives(*data_parallel_collectives_step(workload, mode, mesh)))

        return _Setup(
            lambda name: data_parallel_step(name, workload, mode, mesh, options(name)),
            replay_data_parallel,
            workload.config,
            workload.batch,
            workload.seq_len,
        )
    workload = build_workload(args.model, args.parallel, mesh, world_size, args.microbatches, gen)

    def step(name: str) -> Callable[[], None]:
        module = workload.make()
        run_step = step_function(name, module, workload.loss_fn, options(name))

        def run() -> None:
            module.zero_grad(set_to_none=True)
            run_step(workload.microbatches)

        return run

    def replay() -> Any:  # every micro-batch's collectives, back to back
        nodes = record_collectives(
            workload.make(), lambda model: step_function("eager", model, workload.loss_fn)(workload.microbatches)
        )
        return replay_collectives(nodes)

    return _Setup(step, replay, workload.config, workload.batch, workload.seq_len)


def _repeats_within(limit_s: float, steps: dict[str, Any], wanted: int, barrier: Any) -> int:
    """As many repeats as fit the time limit (judged by one probe round), at least 3."""
    start = time.perf_counter()
    time_interleaved(steps, 1, barrier)
    round_s = max(time.perf_counter() - start, 1e-6)
    fit = int(limit_s / round_s)
    fit = -int(agree_max([-fit], dist.group.WORLD)[0])  # the fewest that fit on any rank
    return max(3, min(wanted, fit))


def main(argv: list[str] | None = None) -> int:
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a crash (SIGSEGV, SIGABRT) shows the Python stacks
    args = parse_args(argv)
    result = run(args)
    if result:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
