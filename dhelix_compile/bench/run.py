"""The side-by-side benchmark: every variant in one run, each beside its own physical limit.

    dhelix bench --model small --rate 1gbit --out bench.json
    dhelix bench --microbatches 4 --variants eager,inductor,dhelix,helix

1. Ranks on the fake process group (``bench.worker`` in mode ``compute``): each variant's step
   with no communication -> ``T_compute`` (per variant; the top-level number is Inductor's, the
   codegen dhelix uses). With ``--rate auto`` (the default), ranks then time the step's
   collectives alone on the link at a probe rate, and again at the rate scaled by
   ``T_comm / T_compute`` (interpolated once two rates bracket it), until ``T_comm`` is within 8%
   of ``T_compute`` (``bench.link_rate``; at most 4 rates, else the closest timed): the regime
   dhelix is for, on whatever machine runs the bench.
2. Ranks on gloo over a rate-limited veth link between two network namespaces
   (``dhelix_compile.launch``; loopback when that is impossible, and the output says so):
   every variant interleaved; then one more step of each, its calls on the process group
   recorded (``measure.record_sent_collectives``: the collectives its final code sends, with
   the bytes on the wire; a pipeline's sends and receives, paired up across the ranks by
   ``measure.pair_transfers``), and those transfers alone on the link -> its own ``T_comm``.
3. Summary per variant, against its own numbers: median and spread of the step time, and the
   share of hideable communication it hid::

       T_seq  = own T_compute + own T_comm         (nothing overlapped)
       limit  = max(own T_compute, own T_comm)     (perfect overlap)
       hidden = (T_seq - T_step) / (T_seq - limit)

   beside the bytes it sent per step and its transfers: a variant that sends less (dhelix
   combining all-reduces) has a lower limit, and that gain shows as such, apart from hiding.

   And where a step's time went on the link: its CPU time (the busiest rank's, every thread of
   the process; gloo's threads' part beside it) and ``idle = step - CPU``, a lower bound on the
   time the rank waited for a transfer or a peer -- the communication left exposed. A variant with little idle time is
   busy throughout: what keeps it above the limit is work, not waiting (on a CPU machine, the
   CPU the transfers themselves take; ``T_comm``'s CPU time is shown beside it).
4. Its own *ceiling* (``measure.ceiling_steps``): its own collectives, each issued and then
   hidden under a share of its own ``T_compute`` of synthetic matmuls, with one and with two in
   flight at a time, the faster of the two -- a perfect schedule of this much communication and
   compute. Its hidden share is the most this machine can hide of them; the variant's share is
   to be read against it, not against 100%. A pipeline variant's ceiling is its own sends and
   receives under its own ``T_compute``, as any other's.

Writes JSON (per variant ``step_s_median``, ``step_s_all``, ``t_compute_s``, ``t_comm_s``,
``limit_s``, ``step_over_limit``, ``hidden_share``, ``wire_bytes_per_step``,
``transfers_per_step``, ``collectives``, ``ceiling``, ``step_over_ceiling``, ``cpu_s_median``,
``gloo_cpu_s_median``, ``idle_s``; top level ``t_compute_s`` and ``t_comm_s`` of the
reference variant, Inductor where it ran (``t_comm_variant`` names it), ``t_comm_cpu_s``,
``t_comm_gloo_cpu_s``, ``limit_s``, ``ceiling`` (one for every variant, where the link run's
JSON holds one; the workers time each variant's own), ``link``, ``rate``,
``rate_probes``) and prints a markdown table.

With ``--link emulated:<link>`` one process instead runs as one rank of an emulated cluster whose
collectives take the link model's time (``bench.emulated``; the presets under ``--link``); with
``--pipeline``, one rank of a PP x TP job (``--tp``). On CPU it also prints, part by part of each
variant's step (F0, B0+F1, ...), where its communication stays exposed and why (``bench.exposure``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cost_model import compile_clock
from cost_model.links import describe_presets
from cost_model.units import format_ms
from dhelix_compile.bench import link_rate
from dhelix_compile.bench.bounds import hidden_share
from dhelix_compile.bench.choices import (
    DATA_PARALLEL_MODES,
    DATA_PARALLEL_VARIANTS,
    MODEL_NAMES,
    MODEL_SIZES,
    NOT_BY_DEFAULT,
    PIPELINE_VARIANTS,
    SCHEDULE_KINDS,
    STEP_VARIANTS,
    UNPARALLELIZED_MODELS,
)
from dhelix_compile.bench.progress_file import progress_from_file
from dhelix_compile.launch.link import can_rate_limit
from dhelix_compile.launch.ranks import LaunchResult, LinkSpec, launch_ranks


def _worker_argv(out: Path, mode: str, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dhelix_compile.bench.worker",
        "--out",
        str(out),
        "--mode",
        mode,
        "--model",
        args.model,
        "--parallel",
        args.parallel,
        "--variants",
        args.variants,
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--dhelix-options",
        args.dhelix_options,
        "--time-limit-s",
        str(args.time_limit_s),
        "--microbatches",
        str(args.microbatches),
        "--gloo-priority",
        args.gloo_priority,
        *(["--pipeline", args.pipeline] if args.pipeline else []),
        *(["--data-parallel", args.data_parallel] if args.data_parallel else []),
    ]


def _tail(stderr: str, chars: int = 3000) -> str:
    """The end of a worker's stderr, or from its fatal error on (a crash's Python stacks, which
    ``faulthandler`` prints before the long list of loaded extension modules)."""
    fatal = stderr.find("Fatal Python error")
    return stderr[fatal : fatal + 2 * chars] if fatal >= 0 else stderr[-chars:]


def _launch(
    out: Path,
    mode: str,
    link: LinkSpec,
    args: argparse.Namespace,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], LaunchResult]:
    progress = out.with_suffix(".progress")
    argv = [*_worker_argv(out, mode, args), "--progress-file", str(progress), *extra]
    with progress_from_file(progress, label=f"{mode:>7} steps"):
        result = launch_ranks(argv, args.ranks, link, timeout_s=args.timeout_s, env=env)
    if any(result.returncodes) or not out.exists():
        tails = "\n".join(f"--- rank {r} ---\n{_tail(err)}" for r, err in enumerate(result.stderr))
        raise RuntimeError(f"benchmark workers ({mode}) failed: return codes {result.returncodes}\n{tails}")
    return json.loads(out.read_text()), result


#: The variants the others are compared with (speedups, the top-level T_compute), first found first.
BASELINES = ("torch_inductor", "inductor", "pipeline_inductor")


def _baseline(variants: dict[str, Any]) -> Any:
    """The value of the first baseline variant (``BASELINES``) in ``variants``, or None."""
    return next((variants[name] for name in BASELINES if name in variants), None)


def _t_compute(compute_run: dict[str, Any]) -> float:
    """The top-level ``T_compute``: Inductor's step on the fake group, else the fastest variant's."""
    compute = {name: statistics.median(samples) for name, samples in compute_run["step_s"].items()}
    baseline = _baseline(compute)
    return baseline if baseline is not None else min(compute.values())


def _cpu_and_idle(
    step_s: float, cpu_samples: list[float] | None, gloo_samples: list[float] | None = None
) -> dict[str, float | None]:
    """The median CPU time per step, ``idle = step - CPU`` and the median CPU time of gloo's
    threads per step (None without samples, as for a result file that holds none of gloo's)."""
    gloo = statistics.median(gloo_samples) if gloo_samples else None
    if not cpu_samples:
        return {"cpu_s_median": None, "idle_s": None, "gloo_cpu_s_median": gloo}
    cpu = statistics.median(cpu_samples)
    return {"cpu_s_median": cpu, "idle_s": max(step_s - cpu, 0.0), "gloo_cpu_s_median": gloo}


def _cpu_cell(row: dict[str, Any]) -> str:
    """CPU per step, gloo's threads' part in brackets where recorded."""
    gloo = row.get("gloo_cpu_s_median")
    return format_ms(row.get("cpu_s_median")) + ("" if gloo is None else f" ({format_ms(gloo)})")


def _slowest_rank(per_rank: list[float | None] | None) -> float | None:
    """The largest of the ranks' numbers; None unless every rank has one."""
    return max(v for v in per_rank if v is not None) if per_rank and None not in per_rank else None


def _compute_cpu_cell(row: dict[str, Any]) -> str:
    """The variant's CPU per step beside gloo's threads, alone -> on the link ("-" where unknown)."""
    cpu, gloo = row.get("cpu_s_median"), row.get("gloo_cpu_s_median")
    on_link = None if cpu is None or gloo is None else cpu - gloo
    return f"{format_ms(row.get('cpu_s_alone_median'))} -> {format_ms(on_link)}"


def _compile_times(link_run: dict[str, Any], name: str) -> dict[str, Any]:
    """The variant's first step on the link (compile + one step), and where dhelix's compiles in it
    spent their time (``cost_model.compile_clock``'s phases, the slowest rank's each; None for runs
    that did not record them)."""
    return {
        "first_step_s": (link_run.get("first_step_s") or {}).get(name),
        "compile_phases_s": (link_run.get("compile_phases_s") or {}).get(name),
    }


def ceiling_row(
    measured: dict[str, Any] | None, t_comm: float, t_compute: float | None = None
) -> dict[str, Any] | None:
    """The ceiling row: of the replays with one and with two collectives in flight, the faster
    median (``in_flight`` says which; ``step_s_by_in_flight`` keeps both).

    With ``t_compute`` (the top-level ``T_compute``), each repeat's step is corrected by how far
    its matmuls alone (``compute_s``, timed in the same repeat) were from it: the matmuls are
    calibrated to ``T_compute``, but their speed drifts within a run (``small``, 2026-11-26:
    378.7 ms of matmuls for a 327.4 ms ``T_compute``), and a ceiling with more compute than the
    step's would flatter every variant. The corrected median is never below the physical limit
    ``max(t_compute, t_comm)``. ``step_s_measured`` keeps the uncorrected median; the hidden share
    is then against ``t_compute``."""
    if not measured:
        return None
    by_depth = {int(depth): times for depth, times in measured["in_flight"].items()}
    compute = measured["compute_s"]

    def corrected(steps: list[float]) -> list[float]:
        if t_compute is None:
            return steps
        return [step - (own - t_compute) for step, own in zip(steps, compute, strict=True)]

    # corrected, never below the physical limit: the correction is per repeat, and noisy
    floor = 0.0 if t_compute is None else max(t_compute, t_comm)
    medians = {depth: max(statistics.median(corrected(times["step_s"])), floor) for depth, times in by_depth.items()}
    depth = min(medians, key=lambda d: (medians[d], d))
    own = statistics.median(compute)
    return {
        "step_s_median": medians[depth],
        "step_s_measured": statistics.median(by_depth[depth]["step_s"]),
        "in_flight": depth,
        "step_s_by_in_flight": medians,
        "t_compute_s": own,
        **_cpu_and_idle(medians[depth], by_depth[depth]["cpu_s"], by_depth[depth].get("gloo_cpu_s")),
        "hidden_share": hidden_share(medians[depth], own if t_compute is None else t_compute, t_comm),
    }


def _own_comm(own: dict[str, Any] | None, link_run: dict[str, Any]) -> dict[str, float | None]:
    """A variant's ``T_comm`` and its CPU times (medians): its own collectives' replay, else
    the run's shared one (a link run's JSON with one ``t_comm_s`` for every variant)."""
    source = own if own is not None else link_run

    def median(key: str) -> float | None:
        samples = source.get(key)
        return statistics.median(samples) if samples else None

    return {key: median(key) for key in ("t_comm_s", "t_comm_cpu_s", "t_comm_gloo_cpu_s")}


def own_bound(step_s: float, t_compute_s: float, t_comm_s: float) -> dict[str, float]:
    """A variant's own limit ``max(T_compute, T_comm)``, its step over it, and the share it hid."""
    limit = max(t_compute_s, t_comm_s)
    return {
        "limit_s": limit,
        "step_over_limit": step_s / limit if limit > 0 else math.inf,
        "hidden_share": hidden_share(step_s, t_compute_s, t_comm_s),
    }


def summarize(link_run: dict[str, Any], compute_run: dict[str, Any], link: str) -> dict[str, Any]:
    """The JSON summary of one benchmark (see the module docstring)."""
    compute = {name: statistics.median(samples) for name, samples in compute_run["step_s"].items()}
    t_compute = _t_compute(compute_run)
    owns: dict[str, Any] = link_run.get("own") or {}
    variants: dict[str, Any] = {}
    for name, samples in link_run["step_s"].items():
        own_compute = compute.get(name, t_compute)
        own = owns.get(name)
        comm = _own_comm(own, link_run)
        median = statistics.median(samples)
        predicted = (link_run.get("predicted_step_s") or {}).get(name)
        contention = (link_run.get("predicted_contention_s") or {}).get(name)
        alone_cpu = (compute_run.get("cpu_s") or {}).get(name)
        ceiling = ceiling_row((own or {}).get("ceiling"), comm["t_comm_s"] or 0.0, own_compute)
        variants[name] = {
            "predicted_step_s": _slowest_rank(predicted),
            "predicted_contention_s": _slowest_rank(contention),
            "cpu_s_alone_median": statistics.median(alone_cpu) if alone_cpu else None,
            "measured_account": (link_run.get("measured_account") or {}).get(name),
            "step_s_median": median,
            "step_s_all": samples,
            "step_s_min": min(samples),
            "step_s_max": max(samples),
            "t_compute_s": own_compute,
            **comm,
            # without a T_comm: its collectives were not recorded (the run's errors say why)
            **(
                own_bound(median, own_compute, comm["t_comm_s"])
                if comm["t_comm_s"] is not None
                else dict.fromkeys(("limit_s", "step_over_limit", "hidden_share"))
            ),
            "wire_bytes_per_step": (own or {}).get("wire_bytes_per_step"),
            "transfers_per_step": (own or {}).get("transfers_per_step"),
            "collectives": (own or {}).get("collectives"),
            "ceiling": ceiling,
            "step_over_ceiling": median / ceiling["step_s_median"] if ceiling else None,
            **_cpu_and_idle(
                median, (link_run.get("cpu_s") or {}).get(name), (link_run.get("gloo_cpu_s") or {}).get(name)
            ),
            **_compile_times(link_run, name),
        }
    reference = next((name for name in (*BASELINES, *variants) if name in variants), None)
    top = variants[reference] if reference else _own_comm(None, link_run)
    t_comm = top["t_comm_s"] or 0.0
    return {
        "link": link,
        "model": link_run["model"],
        "parallel": link_run["parallel"],
        "pipeline": link_run.get("pipeline"),
        "data_parallel": link_run.get("data_parallel"),
        "world_size": link_run["world_size"],
        "microbatches": link_run.get("microbatches", 1),
        "gloo_threads": link_run.get("gloo_threads"),
        "repeats": link_run["repeats"],
        "t_compute_s": t_compute,
        "t_comm_s": t_comm,
        "t_comm_variant": reference if owns else None,
        "t_comm_cpu_s": top["t_comm_cpu_s"],
        "t_comm_gloo_cpu_s": top["t_comm_gloo_cpu_s"],
        "limit_s": max(t_compute, t_comm),
        "ceiling": ceiling_row(link_run.get("ceiling"), t_comm, t_compute),
        "variants": variants,
        "errors": {**compute_run.get("errors", {}), **link_run.get("errors", {})},
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _plan_cell(variant: dict[str, Any]) -> str:
    """``compile_clock.SHOWN_HEADER`` seconds of the variant's first step (``-`` without dhelix graphs)."""
    return compile_clock.format_phases(variant.get("compile_phases_s")) or "-"


def rate_probes_line(summary: dict[str, Any]) -> list[str]:
    """With ``--rate auto``: the rates timed on the way to the run's, in one line."""
    probes = summary.get("rate_probes")
    if not probes:
        return []
    timed = ", ".join(f"{format_ms(p['t_comm_s'])} ms at {p['rate']}" for p in probes)
    return [f"rate auto: {summary['rate']}, where T_comm takes about T_compute (the collectives alone: {timed})"]


def _megabytes(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a markdown table, ratios beside seconds, each variant beside its own limit."""
    base = (_baseline(summary["variants"]) or {}).get("step_s_median")
    parallel = summary["parallel"]
    if summary.get("pipeline"):
        parallel = f"pipeline {summary['pipeline']}"
    if summary.get("data_parallel"):
        parallel = f"data parallel, {summary['data_parallel']}"
    comm_of = f" ({summary['t_comm_variant']}'s own collectives)" if summary.get("t_comm_variant") else ""
    lines = [
        f"link: {summary['link']}; model {summary['model']} ({parallel}), "
        f"{summary['world_size']} ranks, {summary.get('microbatches', 1)} micro-batches per step, "
        f"{summary['repeats']} interleaved repeats"
        + (f"; gloo's threads at {summary['gloo_threads']}" if summary.get("gloo_threads") else ""),
        *rate_probes_line(summary),
        "",
        f"T_compute = {format_ms(summary['t_compute_s'])} ms, T_comm = {format_ms(summary['t_comm_s'])} ms{comm_of}"
        + (
            f"; T_comm takes {format_ms(summary['t_comm_cpu_s'])} ms of CPU per rank"
            + (
                f", {format_ms(summary['t_comm_gloo_cpu_s'])} ms of it on gloo's threads"
                if summary.get("t_comm_gloo_cpu_s") is not None
                else ""
            )
            if summary.get("t_comm_cpu_s") is not None
            else ""
        ),
        "",
        "| variant | step median (ms) | min-max (ms) | speedup vs Inductor | own T_compute (ms) | own T_comm (ms) "
        "| own limit (ms) | step / own limit | hidden share | step / own ceiling | MB sent / step | transfers / step "
        f"| CPU (gloo's threads) (ms) | idle (ms) | first step (s) | {compile_clock.SHOWN_HEADER} (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    shared = summary.get("ceiling")
    for name, v in summary["variants"].items():
        speedup = f"{base / v['step_s_median']:.2f}x" if base else "-"
        vs_ceiling = v.get("step_over_ceiling")
        if vs_ceiling is None and shared:
            vs_ceiling = v["step_s_median"] / shared["step_s_median"]
        transfers = v.get("transfers_per_step")
        lines.append(
            f"| {name} | {format_ms(v['step_s_median'])} | {format_ms(v['step_s_min'])}-{format_ms(v['step_s_max'])} "
            f"| {speedup} | {format_ms(v['t_compute_s'])} | {format_ms(v['t_comm_s'])} | {format_ms(v['limit_s'])} "
            f"| {_ratio(v['step_over_limit'])} | {_share(v['hidden_share'])} | {_ratio(vs_ceiling)} "
            f"| {_megabytes(v.get('wire_bytes_per_step'))} | {'-' if transfers is None else transfers} "
            f"| {_cpu_cell(v)} | {format_ms(v.get('idle_s'))} "
            f"| {_seconds(v.get('first_step_s'))} | {_plan_cell(v)} |"
        )
    if shared:
        speedup = f"{base / shared['step_s_median']:.2f}x" if base else ""
        limit = summary["limit_s"]
        lines.append(
            f"| *ceiling* | {format_ms(shared['step_s_median'])} | | {speedup} | {format_ms(shared['t_compute_s'])} "
            f"| {format_ms(summary['t_comm_s'])} | {format_ms(limit)} | {shared['step_s_median'] / limit:.2f} "
            f"| {shared['hidden_share']:.0%} | 1.00 | | | {_cpu_cell(shared)} | {format_ms(shared['idle_s'])} | | |"
        )
    lines += [
        "",
        "own T_compute: the variant's step on the fake process group; own T_comm: the collectives its step sent "
        "(recorded at the process group; a pipeline's sends and receives, those in flight together replayed "
        "together), replayed back to back alone on the link; own limit = max of the two; "
        "hidden share = (own T_compute + own T_comm - step) / (own T_compute + own T_comm - own limit). "
        "MB sent / step: the bytes the rank that sent most put on the wire, as gloo sends them.",
        "CPU: the busiest rank's CPU time per step (all its threads; in brackets, gloo's threads'); "
        "idle = step - CPU, the time it waited at least.",
        "first step: the variant's first call on the link, which compiles every graph of the step, less writing "
        "the graph dumps the bench asks for its predictions (a user's step writes none), with the caches the "
        "bench started with (the run "
        "on the fake group compiles into its own); a variant compiled after another in the same processes "
        f"reuses its kernels. {compile_clock.SHOWN_HEADER}: of it, dhelix's compiles in AOTAutograd "
        "(the joint graph and its partitions), measuring ops, collectives and segment pairs on the live group "
        "(cost_model='profile', the default there), running the graph passes, searching the strand plan of "
        "helix's merged graphs and generating code with Inductor (cost_model.compile_clock; waiting for the "
        "other ranks and writing the graph dumps are left out); the rest is Dynamo's trace and the step itself.",
    ]
    ceilings = {n: v["ceiling"] for n, v in summary["variants"].items() if v.get("ceiling")}
    if ceilings:
        lines += [
            "",
            "| variant | own ceiling (ms) | 1 in flight (ms) | 2 in flight (ms) | uncorrected (ms) | matmuls alone (ms) "
            "| ceiling's hidden share | CPU (gloo's threads) (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, c in ceilings.items():
            depth = c["step_s_by_in_flight"]
            lines.append(
                f"| {name} | {format_ms(c['step_s_median'])} | {format_ms(depth.get(1))} | {format_ms(depth.get(2))} "
                f"| {format_ms(c['step_s_measured'])} | {format_ms(c['t_compute_s'])} | {c['hidden_share']:.0%} "
                f"| {_cpu_cell(c)} |"
            )
        lines += [
            "",
            "own ceiling: the variant's own collectives, each in flight under its share of the variant's own "
            "T_compute of synthetic matmuls, one or two in flight at a time, whichever was faster -- the most this "
            "machine hides of that communication beside that compute. Each repeat is corrected by its matmuls' time "
            "alone minus the own T_compute, measured in the same repeat (uncorrected: the median before that).",
        ]
    if shared:
        lines.append(
            "*ceiling*: the step's transfers, each in flight under its share of T_compute of synthetic matmuls "
            "(its own T_compute: those matmuls alone), one or two in flight at a time, whichever was faster "
            f"(here {shared['in_flight']}: "
            + ", ".join(f"{d} in flight {format_ms(t)} ms" for d, t in sorted(shared["step_s_by_in_flight"].items()))
            + ") -- the most this machine hides of this communication. Each repeat's ceiling step is corrected "
            "by its matmuls' time alone minus T_compute, measured in the same repeat "
            f"(uncorrected: {format_ms(shared['step_s_measured'])} ms)."
        )
    predicted = {n: v for n, v in summary["variants"].items() if v.get("predicted_step_s")}
    if predicted:
        lines += [
            "",
            "| variant | predicted step (ms) | measured median (ms) | predicted / measured "
            "| CPU beside gloo's threads, alone -> on the link (ms) | predicted contention (ms) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, v in predicted.items():
            lines.append(
                f"| {name} | {format_ms(v['predicted_step_s'])} | {format_ms(v['step_s_median'])} "
                f"| {v['predicted_step_s'] / v['step_s_median']:.2f} | {_compute_cpu_cell(v)} "
                f"| {format_ms(v.get('predicted_contention_s'))} |"
            )
        lines += [
            "",
            "CPU beside gloo's threads: the busiest rank's CPU per step less its gloo threads', alone (the step "
            "on the fake process group, where dhelix plans with the analytic model: a plan the profiled costs "
            "change, a decomposition, differs) and on the link; what it grew by is compute slowed beside the "
            "transfers, the transfers' own work on the calling thread, and what the plan on the link adds. "
            "Predicted contention: the compute time the cost model adds for running beside transfers.",
        ]
    accounted = {n: v["measured_account"] for n, v in summary["variants"].items() if v.get("measured_account")}
    if accounted:
        lines += [
            "",
            "Where measured and predicted differ, per step, from the profiled calls (profile_steps; rank 0; "
            "observe.measured.CallAccount): segments ending at an issue (compute), segments ending at a wait "
            "(compute, then blocked on a transfer), and the per-call variation (the median call minus its "
            "segments' medians added up: time lost in different segments in different calls).",
            "",
            "| variant | compute segments, predicted -> measured (ms) | blocked segments, predicted -> measured (ms) "
            "| per-call variation (ms) |",
            "|---|---:|---:|---:|",
        ]
        for name, a in accounted.items():
            lines.append(
                f"| {name} | {format_ms(a['compute_predicted_s'])} -> {format_ms(a['compute_measured_s'])} "
                f"| {format_ms(a['blocked_predicted_s'])} -> {format_ms(a['blocked_measured_s'])} "
                f"| {format_ms(a['variation_s'])} |"
            )
    if summary.get("errors"):
        lines += ["", "variants that failed: " + ", ".join(sorted(summary["errors"]))]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``dhelix bench`` and ``python -m dhelix_compile.bench.run``)."""
    parser.add_argument(
        "--model",
        default="small",
        metavar="NAME",
        help=f"the workload (bench.workloads; default small): {', '.join(MODEL_NAMES)}. "
        "mlp_*: a SwiGLU MLP block; moe_*: an expert-parallel MoE layer; hf_llama*: Hugging Face's Llama "
        "(the hf extra); the others: the Llama-style reference transformer",
    )
    parser.add_argument("--parallel", choices=["tp", "tp_sp"], default="tp_sp")
    parser.add_argument(
        "--pipeline",
        choices=SCHEDULE_KINDS,
        default=None,
        help="run the model as a pipeline under this torch.distributed.pipelining schedule, one stage group "
        f"over the ranks (variants {', '.join(PIPELINE_VARIANTS)}; bench.pipeline_parallel); with --link "
        "emulated:...,ranks=N one rank of a PP x TP job, each stage tensor-parallel over its TP group (--tp)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="with --pipeline on an emulated link: the TP ranks inside each stage, the rest pipeline ranks "
        "(default: 2 pipeline ranks, TP over the rest; 4 ranks: PP=2 x TP=2)",
    )
    parser.add_argument(
        "--data-parallel",
        choices=DATA_PARALLEL_MODES,
        default=None,
        help="run the model as written, data-parallel over the ranks in this mode: PyTorch's DDP/FSDP2 beside "
        f"data_parallel (variants {', '.join(DATA_PARALLEL_VARIANTS)}; bench.data_parallel)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated, from {', '.join(STEP_VARIANTS)} (with --pipeline: {', '.join(PIPELINE_VARIANTS)}; "
        f"with --data-parallel: {', '.join(DATA_PARALLEL_VARIANTS)}); "
        "each may carry dhelix options of its own in brackets: helix[cost_model=analytic,decompose=off]. "
        f"Default: {', '.join(v for v in STEP_VARIANTS if v not in NOT_BY_DEFAULT)}, or every pipeline variant",
    )
    parser.add_argument(
        "--rate",
        default="auto",
        help="tc tbf rate of the link ('400mbit'); 'auto': the rate at which the step's collectives alone take "
        "T_compute (bench.link_rate); 'none' for plain loopback",
    )
    parser.add_argument(
        "--link",
        default=None,
        help="'emulated:<link>[,ranks=N][,rank=R][,traffic]': one process as rank R of N (default 8; R default 0, "
        "with --pipeline the rank holding the last stage), every collective "
        "timed by the link model, no CPU spent on transfers (bench.emulated). <link>: a preset below, "
        "'alpha=5us,bandwidth=40GB/s', or 'balanced' (the bandwidth at which the first variant's collectives "
        "take its compute time). Without --link: gloo ranks over a tc-limited veth link (--rate). Presets: "
        + "; ".join(_preset_lines()),
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="with --link emulated:...")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="with --link emulated:...: the model's dtype"
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks (a rate-limited link joins exactly 2)")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches per step (helix merges them)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--gloo-priority",
        choices=["realtime", "normal"],
        default="realtime",
        help="gloo's threads in every variant, T_comm and the ceilings: at real-time priority (dhelix's default "
        "gloo_thread_priority, dhelix_compile.comm_threads) or left at normal priority",
    )
    parser.add_argument(
        "--dhelix-options",
        default="{}",
        help="dhelix options for every dhelix variant, as key=value pairs (decompose=off,profile_steps=2) or a "
        "JSON object; a variant's own options in brackets win over them",
    )
    parser.add_argument(
        "--time-limit-s", type=float, default=240.0, help="per launch of the ranks, for the timed repeats"
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per launch, then the ranks are killed")
    parser.add_argument("--out", default=None, help="write the JSON summary here")


def _preset_lines() -> list[str]:
    return describe_presets().splitlines()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.variants = default_variants(args)
    return args


def default_variants(args: argparse.Namespace) -> str:
    """``--variants`` as given, else the defaults for the run (every pipeline or data-parallel
    variant with ``--pipeline`` or ``--data-parallel``)."""
    known = _known_variants(args)
    if args.variants:
        return str(args.variants)
    if args.pipeline or args.data_parallel:
        return ",".join(known)
    return ",".join(v for v in STEP_VARIANTS if v not in NOT_BY_DEFAULT)


def _known_variants(args: argparse.Namespace) -> tuple[str, ...]:
    """The variants this kind of run knows (step, pipeline or data-parallel)."""
    if args.pipeline:
        return PIPELINE_VARIANTS
    return DATA_PARALLEL_VARIANTS if args.data_parallel else STEP_VARIANTS


def _check(args: argparse.Namespace) -> str | None:
    """A message naming the bad option, or None."""
    from dhelix_compile.bench.steps import parse_variants, split_variant

    if args.model not in MODEL_NAMES:
        return f"unknown model size {args.model!r}; choose from {', '.join(MODEL_NAMES)}"
    if args.pipeline and args.model not in MODEL_SIZES:
        return f"--pipeline cuts the reference transformer into stages: choose --model from {', '.join(MODEL_SIZES)}"
    if args.data_parallel and args.model not in UNPARALLELIZED_MODELS:
        return f"--data-parallel runs a model as written: choose --model from {', '.join(UNPARALLELIZED_MODELS)}"
    if args.data_parallel and args.pipeline:
        return "--data-parallel and --pipeline are separate benchmarks; choose one"
    if args.tp is not None and not (args.pipeline and args.link):
        return "--tp sets the TP ranks inside the stages of --pipeline on an emulated link (--link emulated:...)"
    if args.pipeline and args.link and (args.device != "cpu" or args.dtype not in (None, "float32")):
        return "--pipeline on an emulated link runs float32 on CPU"
    try:
        for variant in parse_variants(args.variants):
            split_variant(variant, _known_variants(args))
    except ValueError as exc:
        return str(exc)
    if args.ranks < 1 or args.microbatches < 1 or args.repeats < 1:
        return "--ranks, --microbatches and --repeats must be >= 1"
    if args.rate.lower() not in ("none", "auto"):
        try:
            link_rate.parse_rate(args.rate)
        except ValueError as exc:
            return f"--rate: {exc}"
    if args.rate.lower() != "none" and args.ranks != 2:
        return "a rate-limited link joins exactly 2 ranks; use --ranks 2 or --rate none"
    try:  # the workers and the runs below read it as JSON
        args.dhelix_options = json.dumps(dhelix_options(args.dhelix_options))
    except ValueError as exc:
        return f"--dhelix-options: {exc}"
    return None


def dhelix_options(text: str) -> dict[str, Any]:
    """``--dhelix-options``: a JSON object, or ``key=value`` pairs as a variant's brackets take
    them (``dump_dir=/tmp/d,profile_steps=2``). ValueError says what is wrong."""
    from dhelix_compile.bench.steps import parse_options

    if not text.strip().startswith(("{", "[")):
        return parse_options(text, "--dhelix-options")
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a JSON object: {exc}") from exc
    if not isinstance(options, dict):
        raise ValueError(f"not a JSON object: {text!r}")
    return options


def measure(args: argparse.Namespace, total_stages: int = 2) -> dict[str, Any]:
    """Both launches and their summary (``args`` as ``parse_args`` gives them, already checked).

    Raises ValueError for a link rate ``tc`` rejects, RuntimeError when the workers fail.
    ``total_stages``: the stages the caller's progress lines count; these two are the last.
    """
    rate = None if args.rate.lower() == "none" else args.rate
    first, stages = total_stages - 1, total_stages
    with tempfile.TemporaryDirectory(prefix="dhelix_bench_") as tmp:
        print(
            f"[{first}/{stages}] T_compute: {args.variants} on the fake process group ...", file=sys.stderr, flush=True
        )
        # Inductor's caches of its own: the link run's first step then compiles what the user's
        # caches do not hold, as a first step does, not what this run just compiled
        own_caches = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "compute_inductor_cache")}
        compute_run, _ = _launch(Path(tmp) / "compute.json", "compute", LinkSpec(rate=None), args, env=own_caches)
        t_compute = _t_compute(compute_run)
        probes: list[dict[str, Any]] = []
        if rate is not None and rate.lower() == "auto":
            rate, probes = _calibrate_rate(args, t_compute, Path(tmp))
        print(
            f"[{first + 1}/{stages}] on the link (rate {rate or 'none'}): every variant interleaved, then each "
            "one's own collectives alone and under its own T_compute ...",
            file=sys.stderr,
            flush=True,
        )
        own_compute = {name: statistics.median(samples) for name, samples in compute_run["step_s"].items()}
        extra = ["--t-compute-s", repr(t_compute), "--own-t-compute-s", json.dumps(own_compute)]
        link_run, launched = _launch(Path(tmp) / "link.json", "link", LinkSpec(rate=rate), args, extra)
    return {**summarize(link_run, compute_run, launched.link), "rate": rate, "rate_probes": probes}


def _calibrate_rate(args: argparse.Namespace, t_compute_s: float, tmp: Path) -> tuple[str | None, list[dict[str, Any]]]:
    """``--rate auto``: the rate at which the step's collectives alone take ``T_compute``
    (``bench.link_rate``; the closest timed one when none was within the tolerance), and the
    rates timed on the way (``rate``, ``t_comm_s``). None (loopback) where no link can be
    rate-limited here."""
    ok, reason = can_rate_limit()
    if not ok:
        print(f"    --rate auto: no rate-limited link here ({reason}); loopback", file=sys.stderr, flush=True)
        return None, []
    probe_args = argparse.Namespace(**{**vars(args), "repeats": 3})
    rate, probes = link_rate.PROBE_RATE, []
    for i in range(link_rate.MAX_PROBES):
        run, _ = _launch(tmp / f"comm{i}.json", "comm", LinkSpec(rate=rate), probe_args)
        t_comm = statistics.median(run["t_comm_s"])
        probes.append({"rate": rate, "t_comm_s": t_comm})
        timed = [(link_rate.parse_rate(p["rate"]), p["t_comm_s"]) for p in probes]
        done = link_rate.calibrated(t_comm, t_compute_s)
        last = i == link_rate.MAX_PROBES - 1
        if done:
            following = rate
        elif last:
            following = link_rate.format_rate(link_rate.best_rate(timed, t_compute_s))
        else:
            following = link_rate.format_rate(link_rate.next_rate(timed, t_compute_s))
        print(
            f"    --rate auto: T_comm {format_ms(t_comm)} ms at {rate} for T_compute {format_ms(t_compute_s)} ms"
            + ("" if done else f" -> {following}" + (" (the closest timed)" if last else "")),
            file=sys.stderr,
            flush=True,
        )
        rate = following
        if done:
            break
    return rate, probes


def _run_emulated(args: argparse.Namespace) -> int:
    """``--link emulated:...``: every variant on the emulated cluster (``bench.emulated``)."""
    from dhelix_compile.bench import emulated
    from dhelix_compile.bench.steps import parse_variants

    try:
        spec = emulated.parse_emulated_link(args.link)
    except ValueError as exc:
        print(f"dhelix bench: {exc}", file=sys.stderr)
        return 2
    if spec is None:
        print(f"dhelix bench: --link {args.link!r}: expected emulated:<link>[,ranks=N][,traffic]", file=sys.stderr)
        return 2
    print(
        f"[1/1] emulated cluster ({args.link}): every variant interleaved, on the link and with it free ...",
        file=sys.stderr,
        flush=True,
    )
    if args.pipeline:
        try:
            emulated.pipeline_tp(spec.ranks, args.tp)
        except ValueError as exc:
            print(f"dhelix bench: {exc}", file=sys.stderr)
            return 2
        summary = emulated.measure_emulated_pipeline(
            spec,
            args.pipeline,
            args.model,
            parse_variants(args.variants),
            tp=args.tp,
            microbatches=args.microbatches,
            repeats=args.repeats,
            warmup=args.warmup,
            dhelix_options=json.loads(args.dhelix_options),
            time_limit_s=args.time_limit_s,
        )
    else:
        summary = emulated.measure_emulated(
            spec,
            args.model,
            args.parallel,
            parse_variants(args.variants),
            microbatches=args.microbatches,
            repeats=args.repeats,
            warmup=args.warmup,
            device=args.device,
            dtype=args.dtype,
            dhelix_options=json.loads(args.dhelix_options),
            time_limit_s=args.time_limit_s,
            data_parallel=args.data_parallel,
        )
    print(emulated.markdown_emulated(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    """Both modes, the summary, the table; returns the exit code."""
    args.variants = default_variants(args)
    if args.link is not None:
        args.rate, args.ranks = "none", 1  # the gloo link's options do not apply
        problem = _check(args)
        if problem:
            print(f"dhelix bench: {problem}", file=sys.stderr)
            return 2
        return _run_emulated(args)
    problem = _check(args)
    if problem:
        print(f"dhelix bench: {problem}", file=sys.stderr)
        return 2
    try:
        summary = measure(args)
    except ValueError as exc:  # a rate tc rejects
        print(f"dhelix bench: {exc}", file=sys.stderr)
        return 2
    print(markdown(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
