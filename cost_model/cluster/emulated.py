"""The emulated cluster's step, predicted per bench variant and set beside what the bench measured.

``dhelix bench --link emulated:<link>,ranks=N`` (``dhelix_compile.emulation``) runs rank 0 of an
N-rank tensor-parallel (or ZeRO-3) job in one process. Every collective takes this package's own link model
(``cost_model.collectives`` on a ``cost_model.links`` preset), on one queue per direction that
every group shares, asynchronously: on CUDA a delay kernel on a side stream, which the compute
stream waits for at the collective's wait while the host goes on issuing; on CPU a deadline that
the waiting thread sleeps to. This module predicts that step for each variant the bench runs,
from the segments ``dhelix simulate`` costs (:mod:`cost_model.cluster.strands`).

What a variant's passes make of the program (:data:`VARIANT_PROGRAMS`)::

    inductor           PyTorch's TP plan as written: one all-reduce per projection's input
    inductor_overlap   gradient, logits all-gathered for the loss; Inductor's order, each wait
                       at the first use (a projection's all-reduce runs under the next
                       projection's backward; the overlap scheduler's moves are not modeled)
    dhelix             combine_all_reduces: one all-reduce per layer input; reorder: each
                       backward segment's weight gradients run under its all-reduce
    helix              the same, plus vocab_parallel_loss (three all-reduces of one float32 per
                       token instead of the logits' gather); micro-batch i+1's forward merged
                       with micro-batch i's backward by the Strand Interleaving DP

Under ZeRO-3 (``ClusterSetting.dp_mode="shard"``, the bench's ``--data-parallel shard``) every
``data_parallel`` variant sends the same gathers and reduce-scatters (``strands``: one per
parameter); the programs differ in order alone (``VariantProgram.sharded_order``): Inductor's
waits each where it is issued, dhelix's and helix's issue a parameter group's gathers while the
group before it computes and leave the reduce-scatters to the step's end. FSDP2 + Inductor
(``torch_inductor``) sends FSDP2's: a gather and a reduce-scatter per unit, each layer gathered
again in the backward, each waited where issued. One MoE layer (``ModelShape.family="moe"``, the
bench's ``moe_*``) sends three all-to-alls a micro-batch in every variant; Inductor waits each at
its first use, dhelix runs the gates' gradient under the backward's.

A pipeline (``parallel.pp > 1``, the bench's ``--pipeline 1f1b``, PP x TP) is its last stage as
the bench's rank runs it: the stage's layers and the head, tensor-parallel over the stage's
ranks (``strands``), one strand (torch's 1F1B keeps no forward beside a backward on the last
stage), and per micro-batch a receive of the activation before the forward and a send of its
gradient after the backward, one micro-batch's hidden states each over the PP link. When they
are waited (``VariantProgram.stage_transfers``)::

    schedule_loop   pipeline_inductor: Schedule1F1B's own loop. The first receive waited before
                    F1; each send batched with the next forward's receive, both waited before
                    it; the last send waited at the end: R | F1 B1 | S1+R2 | F2 B2 | ... | Sm
    runtime         helix_pipeline: torch's action runtime, its 1F1B actions lowered by
                    ``_add_send_recv``. Each later receive posted before the backward ahead of
                    its forward and waited there (landed); the sends waited at the step's end:
                    R | F1 | R2 B1 S1 | F2 | R3 B2 S2 | ... | Bm Sm

The step, m micro-batches, at segment granularity (``strand_plan.advance``: one compute stream
and one link; a segment computes its lead, waits for its strand's latest transfer if it reads
it, computes the rest and issues its transfer, which starts when the link is free; compute
beside a transfer runs ``contention_factor`` times slower)::

    inductor, dhelix   F1 B1 F2 B2 ... Fm Bm
    helix              F1, M(F2, B1), ..., M(Fm, Bm-1), Bm: each M the path of least whole-step
                       time among plan_pairs (+ refine_path) and plan_timed, with the backward's
                       weight gradients in place or deferred one segment (the interleave pass's
                       candidates)
    helix[helix_schedule=same_phase]   M(F1, F2), M(B1, B2), ... (and paired_ends): the steps of
                       ``cost_model.helix_schedule``, each merged pair of calls planned so

Two predictions per variant:

    analytic         that schedule; compute from the roofline (matmuls and attention at
                     ``matmul_efficiency``), transfers from the link model. Nothing of the host.
    measured inputs  CUDA: max(host_s_median, analytic). The host issues the step's kernels and
                     collectives ahead of the GPU (a wait does not block it), so the step ends at
                     the later of the host's issue time (measured) and the GPU and link's
                     schedule. The link-free step (t_compute_s) is *not* the GPU's compute there:
                     where the host is the slower, it is the host's time, which runs ahead under
                     the waits -- taken as compute it would charge the host's time twice.
                     CPU: the compute is the host's own and a wait blocks it; the segments'
                     compute scaled so that one step's sums to the measured t_compute_s.

What no variant's program here holds: per-peer steps. dhelix's ``decompose="auto"`` may rewrite
an all-gather, reduce-scatter or all-reduce beside its matmul into sends and receives with each
peer where the compile measured that faster on the live link (``graph_passes.decompose``). A
record whose transfers hold sends and receives the program does not (``operations_per_step``)
gets :class:`PerPeerSteps`: the collectives replaced, and the link time with them sent as those
steps (same bytes, each send its own fixed cost), which accounts for the recorded one.

A prediction is *claimed* (``TOLERANCE``) where its inputs describe the run: measured inputs
always; the analytic one on CUDA when the run is not host-bound (host_s_median below
``HOST_BOUND_SHARE`` of the step), never on CPU (no roofline describes Python dispatch); neither
where the run holds per-peer steps.

Contract
--------
* :func:`predict_variant` ``(setting, variant, matmul_efficiency=..., compute_scale=1.0)`` ->
  :class:`VariantPrediction`; deterministic; ``ValueError`` names an unknown variant.
* :meth:`BenchRecord.from_json` reads ``dhelix bench --link emulated:... --out`` JSON; ``ValueError``
  names a missing field. :func:`compare_bench` -> :class:`BenchComparison`, one row per variant
  the record holds and :data:`VARIANT_PROGRAMS` knows (others are listed as not modeled), with
  :func:`per_peer_steps` where the run holds them.
* A pipeline's sends count in ``comm_s`` and ``wire_bytes`` (the emulator's outbound queue,
  the bench's own T_comm); its receives, as many and as large, in ``transfers`` and ``operations``.
* :data:`EMULATED_SETTINGS`: the recorded GPU runs' settings (the bench's ``llama3_8b_gpu`` at
  TP=8 on one H200, ib400 and nvlink4).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cost_model.cluster.setting import (
    ClusterSetting,
    DataParallelMode,
    Ends,
    Loss,
    ModelShape,
    PaperReport,
    Parallelism,
    ProjectionReduces,
    ShardedOrder,
)
from cost_model.cluster.step_model import MEASURED_ATTENTION_EFFICIENCY, MEASURED_MATMUL_EFFICIENCY
from cost_model.cluster.strands import ClusterSegment, stage_transfers, strands
from cost_model.collectives import alpha_beta_terms, base_latency_s
from cost_model.helix_schedule import SCHEDULE_KINDS, HelixScheduleKind, ScheduleStep, StrandCall, helix_schedule
from cost_model.links import BUILTIN_LINK_NAMES, Link, get_link, register_link
from cost_model.strand_plan import (
    Pair,
    PathState,
    Segment,
    advance,
    formula_cost,
    plan_pairs,
    plan_timed,
    refine_path,
)

#: A prediction is claimed to be within this share of the measured step.
TOLERANCE: float = 0.15
#: A run whose host time reaches this share of its step is host-bound: the analytic
#: prediction, which has no host, is not claimed for it.
HOST_BOUND_SHARE: float = 0.9
#: Compute slowdown beside an emulated transfer on CUDA, measured on an H200: a chain of
#: 4096x4096 bf16 matmuls took 5.452 ms beside a 128 MiB emulated all-reduce against 5.287 ms
#: alone (the delay kernel holds one SM; docs/results/2026-11-28-h200-emulated-timing-nvlink4.json).
EMULATED_CONTENTION_FACTOR: float = 1.03
#: Width of ``strand_plan.plan_timed`` for the helix candidates.
TIMED_WIDTH: int = 8

Order = Literal["inductor", "reordered", "two_strands"]


ProgramKind = Literal["tp", "zero3", "moe", "pipeline"]

#: How a pipeline variant moves the last stage's activations and gradients (module docstring).
StageTransfers = Literal["schedule_loop", "runtime"]


def program_kind(setting: ClusterSetting) -> ProgramKind:
    """What the setting's program is: a tensor-parallel transformer, ZeRO-3, one MoE layer, or
    the last stage of a pipeline (``parallel.pp > 1``), tensor-parallel within the stage."""
    if setting.model.family == "moe":
        return "moe"
    if setting.dp_mode == "shard":
        return "zero3"
    return "pipeline" if setting.parallel.pp > 1 else "tp"


@dataclass(frozen=True)
class VariantProgram:
    """What a bench variant's passes make of the program, and the order it runs in."""

    projection_reduces: ProjectionReduces
    loss: Loss
    order: Order
    descriptions: Mapping[ProgramKind, str]
    """The program on each kind of setting (:func:`program_kind`)."""
    schedule: HelixScheduleKind = "forward_backward"
    """``two_strands``: which strand calls run merged (``cost_model.helix_schedule``)."""
    sharded: ShardedOrder | None = None
    """Under ZeRO-3, the program's own collectives (FSDP2's); None: ``data_parallel``'s, in the
    variant's order."""
    stage_transfers: StageTransfers = "schedule_loop"
    """On a pipeline's last stage: when its receives are posted and its sends waited."""

    @property
    def sharded_order(self) -> ShardedOrder:
        if self.sharded is not None:
            return self.sharded
        return "as_traced" if self.order == "inductor" else "prefetched"

    def describe(self, setting: ClusterSetting) -> str:
        return self.descriptions[program_kind(setting)]


VARIANT_PROGRAMS: dict[str, VariantProgram] = {
    "inductor": VariantProgram(
        "per_projection",
        "gathered_logits",
        "inductor",
        {
            "tp": "TP plan as written, waits at first use",
            "zero3": "each gather and reduce-scatter waited where issued",
            "moe": "each all-to-all waited at first use",
        },
    ),
    "inductor_overlap": VariantProgram(
        "per_projection",
        "gathered_logits",
        "inductor",
        {
            "tp": "as inductor (its overlap scheduler's moves not modeled)",
            "zero3": "as inductor (its overlap passes' moves not modeled)",
            "moe": "as inductor (its overlap passes' moves not modeled)",
        },
    ),
    "torch_inductor": VariantProgram(
        "per_projection",
        "gathered_logits",
        "inductor",
        {"zero3": "FSDP2: a gather per layer and one of the root, again in the backward, each waited where issued"},
        sharded="fsdp2",
    ),
    "dhelix": VariantProgram(
        "fused",
        "gathered_logits",
        "reordered",
        {
            "tp": "all-reduces combined, weight gradients under them",
            "zero3": "gathers one group ahead, reduce-scatters waited at the end",
            "moe": "the gates' gradient under the backward's all-to-all",
        },
    ),
    "pipeline_inductor": VariantProgram(
        "per_projection",
        "gathered_logits",
        "inductor",
        {"pipeline": "Schedule1F1B, Inductor stages: TP plan as written, each send waited with the next receive"},
        stage_transfers="schedule_loop",
    ),
    "helix_pipeline": VariantProgram(
        "fused",
        "gathered_logits",
        "reordered",
        {"pipeline": "dhelix stages on torch's runtime: as dhelix, receives a backward ahead, sends waited at the end"},
        stage_transfers="runtime",
    ),
    "helix": VariantProgram(
        "fused",
        "vocab_parallel",
        "two_strands",
        {
            "tp": "as dhelix + vocab-parallel loss, two strands (SI DP)",
            "zero3": "as dhelix, two strands (SI DP)",
            "moe": "as dhelix, two strands (SI DP)",
        },
    ),
}


@dataclass(frozen=True)
class VariantPrediction:
    """One variant's predicted step, with its own compute, its transfers and their link time."""

    variant: str
    program: VariantProgram
    step_s: float
    compute_s: float
    """Its compute in one step, nothing overlapped (the link-free step on a GPU that issues itself)."""
    comm_s: float
    """Link time of its transfers in one step (the bench's own T_comm)."""
    wire_bytes: float
    """Bytes this rank sends in one step."""
    transfers: int
    operations: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Its transfers in one step by kind (``all_reduce``, ``all_gather``, ...)."""


def _plan_segments(side: Sequence[ClusterSegment], strand: int, *, defer: bool, scale: float) -> list[Segment]:
    """ClusterSegments as strand_plan segments; ``defer``: each segment's weight gradients move to
    the next segment's lead (they run under the segment's transfer, before the next wait)."""
    out: list[Segment] = []
    carried = 0.0
    for k, c in enumerate(side):
        own = c.weight_grad_s if defer and c.comm_s > 0 and k + 1 < len(side) else 0.0
        out.append(
            Segment(
                strand=strand,
                nodes=(),
                compute_s=(c.compute_s - own + carried) * scale,
                comm_s=c.comm_s,
                live_after_bytes=0,
                peak_bytes=0,
                lead_s=carried * scale,
                waits=c.waits,
            )
        )
        carried = own
    return out


def _run(path: Sequence[Pair], fwd: Sequence[Segment], bwd: Sequence[Segment], factor: float) -> float:
    state = PathState()
    for pair in path:
        state = advance(state, pair, fwd, bwd, factor)
    return state.end_s


def _one_strand_s(sequence: Sequence[Segment], factor: float) -> float:
    """``sequence`` run in order as one strand: every wait is on the strand's latest transfer."""
    segments = [dataclasses.replace(s, strand=0) for s in sequence]
    return _run([(i, None) for i in range(len(segments))], segments, [], factor)


def _single_strand_s(fwd: list[Segment], bwd: list[Segment], m: int, factor: float) -> float:
    """F1 B1 F2 B2 ... as one strand."""
    return _one_strand_s((fwd + bwd) * m, factor)


def _last_stage_s(
    fwd: list[Segment], bwd: list[Segment], m: int, factor: float, how: StageTransfers, transfer_s: float
) -> float:
    """The last stage of a 1F1B pipeline: F1 B1 F2 B2 ... as one strand (1F1B keeps no forward
    beside a backward there), with a receive of ``transfer_s`` before each forward and a send
    after each backward, timed as ``how`` (module docstring)."""

    def transfer(waits: bool) -> Segment:
        return Segment(
            strand=0, nodes=(), compute_s=0.0, comm_s=transfer_s, live_after_bytes=0, peak_bytes=0, waits=waits
        )

    # Neither the backward's first segment nor, on the runtime, a forward after the first waits
    # for the transfer just before it: the loss's gather landed within the forward, and the
    # forward's receive under the backward before it.
    loose_backward = [dataclasses.replace(bwd[0], waits=False), *bwd[1:]]
    sequence: list[Segment] = [transfer(True), dataclasses.replace(fwd[0], waits=True), *fwd[1:]]
    for i in range(m):
        if how == "runtime":
            if i + 1 < m:
                sequence.append(transfer(False))  # the next forward's receive, posted before this backward
            sequence += [*loose_backward, transfer(True)]  # the send, waited at the step's end
            if i + 1 < m:
                sequence += [dataclasses.replace(fwd[0], waits=False), *fwd[1:]]
        else:
            sequence += [*loose_backward, transfer(True)]  # the send, batched with the next receive
            if i + 1 < m:
                sequence += [dataclasses.replace(fwd[0], waits=True), *fwd[1:]]
    return _one_strand_s(sequence, factor)


def _two_strands_s(
    fwd: list[Segment], bwd: list[Segment], m: int, factor: float, schedule: HelixScheduleKind = "forward_backward"
) -> float:
    """The step as ``helix_schedule(m, schedule)`` runs it: a call alone, or two calls merged (the
    forward on the planner's forward side beside a backward; of two calls of one phase, the first).
    The least whole-step time over the interleave pass's planners (plan_pairs + refine_path,
    plan_timed), one planner for every merged step."""
    segments = {"fwd": fwd, "bwd": bwd}
    steps = helix_schedule(m, schedule)
    candidates: dict[tuple[str, ...], list[list[Pair]]] = {}
    for a_phase, b_phase in sorted({tuple(c.phase for c in _sides(step)) for step in steps if len(step) == 2}):
        a, b = segments[a_phase], segments[b_phase]
        dp_path, _ = plan_pairs(a, b, cost=formula_cost(a, b, factor))
        refined, _ = refine_path(dp_path, a, b, contention_factor=factor)
        timed, _ = plan_timed(a, b, contention_factor=factor, width=TIMED_WIDTH)
        candidates[(a_phase, b_phase)] = [dp_path, refined, timed]
    planners = len(next(iter(candidates.values()))) if candidates else 1
    best = math.inf
    for planner in range(planners):
        sides: tuple[list[Segment], list[Segment]] = ([], [])
        path: list[Pair] = []
        for step in steps:
            if len(step) == 1:
                side = 0 if step[0].phase == "fwd" else 1
                start = len(sides[side])
                sides[side].extend(segments[step[0].phase])
                path.extend(
                    (start + k, None) if side == 0 else (None, start + k) for k in range(len(segments[step[0].phase]))
                )
                continue
            first, second = _sides(step)
            starts = (len(sides[0]), len(sides[1]))
            sides[0].extend(segments[first.phase])
            sides[1].extend(segments[second.phase])
            merged = candidates[(first.phase, second.phase)][planner]
            path.extend((None if i is None else starts[0] + i, None if j is None else starts[1] + j) for i, j in merged)
        best = min(best, _run(path, sides[0], sides[1], factor))
    return best


def _sides(step: ScheduleStep) -> tuple[StrandCall, ...]:
    """A merged step's calls as the planner's two sides: a forward beside a backward on the
    forward side (0); two calls of one phase in the schedule's order."""
    return tuple(sorted(step, key=lambda c: c.phase != "fwd")) if step[0].phase != step[-1].phase else tuple(step)


def variant_setting(setting: ClusterSetting, variant: str) -> ClusterSetting:
    """``setting`` as ``variant``'s passes leave it (``VARIANT_PROGRAMS``)."""
    program = _program(variant)
    return dataclasses.replace(
        setting, projection_reduces=program.projection_reduces, loss=program.loss, sharded_order=program.sharded_order
    )


#: A bench variant ``helix[helix_schedule=<kind>]``: helix's program on another schedule.
_SCHEDULED_HELIX = re.compile(r"^helix\[helix_schedule=(?P<kind>[a-z_]+)\]$")


def modeled(variant: str, setting: ClusterSetting | None = None) -> bool:
    """Whether :func:`predict_variant` has a program for the bench variant ``variant`` (on
    ``setting``'s kind of program, :func:`program_kind`, where given)."""
    try:
        program = _program(variant)
    except ValueError:
        return False
    return setting is None or program_kind(setting) in program.descriptions


def _program(variant: str) -> VariantProgram:
    if variant in VARIANT_PROGRAMS:
        return VARIANT_PROGRAMS[variant]
    match = _SCHEDULED_HELIX.match(variant)
    if match is not None and match["kind"] in SCHEDULE_KINDS:
        kind = typing.cast(HelixScheduleKind, match["kind"])
        helix = VARIANT_PROGRAMS["helix"]
        described = {k: f"{text}, schedule {kind}" for k, text in helix.descriptions.items()}
        return dataclasses.replace(helix, schedule=kind, descriptions=described)
    raise ValueError(
        f"no program model for bench variant {variant!r}; modeled: {', '.join(VARIANT_PROGRAMS)}, "
        f"and helix[helix_schedule=<{'|'.join(SCHEDULE_KINDS)}>]"
    )


def predict_variant(
    setting: ClusterSetting,
    variant: str,
    *,
    matmul_efficiency: float = MEASURED_MATMUL_EFFICIENCY,
    attention_efficiency: float = MEASURED_ATTENTION_EFFICIENCY,
    compute_scale: float = 1.0,
) -> VariantPrediction:
    """``variant``'s step on ``setting`` (module docstring); ``compute_scale`` multiplies every
    segment's compute (1.0: the roofline's)."""
    program = _program(variant)
    if program_kind(setting) not in program.descriptions:
        raise ValueError(f"bench variant {variant!r} is modeled on {', '.join(program.descriptions)} settings only")
    fwd_c, bwd_c = strands(variant_setting(setting, variant), matmul_efficiency, attention_efficiency)
    factor = 1.0 if setting.contention_factor is None else setting.contention_factor
    m = setting.micro_batches
    defer = program.order != "inductor"
    fwd = _plan_segments(fwd_c, 0, defer=False, scale=compute_scale)
    bwd = _plan_segments(bwd_c, 1, defer=defer, scale=compute_scale)
    stage = stage_transfers(setting) if program_kind(setting) == "pipeline" else ()
    if stage:
        step = _last_stage_s(fwd, bwd, m, factor, program.stage_transfers, stage[-1].comm_s)
    elif program.order == "two_strands":
        # the pass keeps whichever candidate its simulation prefers: weight gradients in place or deferred
        in_place = _plan_segments(bwd_c, 1, defer=False, scale=compute_scale)
        step = min(
            _two_strands_s(fwd, bwd, m, factor, program.schedule),
            _two_strands_s(fwd, in_place, m, factor, program.schedule),
        )
    else:
        step = _single_strand_s(fwd, bwd, m, factor)
    both = fwd_c + bwd_c + list(stage)
    return VariantPrediction(
        variant=variant,
        program=program,
        step_s=step,
        compute_s=m * math.fsum(c.compute_s for c in both) * compute_scale,
        comm_s=m * math.fsum(c.comm_s for c in both),
        wire_bytes=m * math.fsum(c.wire_bytes for c in both),
        transfers=m * sum(1 for c in both if c.collective is not None),
        operations={op: m * n for op, n in sorted(_operations(both).items())},
    )


def _operations(segments: Sequence[ClusterSegment]) -> collections.Counter[str]:
    """The segments' transfers by kind: a collective's label is ``"<kind> (<what>)"``."""
    return collections.Counter(c.collective.split(" ", 1)[0] for c in segments if c.collective is not None)


# --------------------------------------------------------------------------- recorded runs


@dataclass(frozen=True)
class MeasuredVariant:
    """One variant's row of a bench result (seconds, bytes)."""

    step_s: float
    t_compute_s: float
    t_comm_s: float
    host_s: float
    wire_bytes: float
    transfers: int
    operations: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Its transfers in one step by kind (``operations_per_step``; empty where not recorded)."""


@dataclass(frozen=True)
class BenchRecord:
    """What ``dhelix bench --link emulated:... --out`` recorded (``bench.emulated._summary``)."""

    model: str
    parallel: str
    device: str
    dtype: str
    microbatches: int
    ranks: int
    link: Link
    variants: Mapping[str, MeasuredVariant]

    @property
    def on_cuda(self) -> bool:
        return self.device.lower() != "cpu"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchRecord:
        try:
            link = data["link"]
            variants = {
                name: MeasuredVariant(
                    step_s=float(row["step_s_median"]),
                    t_compute_s=float(row["t_compute_s"]),
                    t_comm_s=float(row["t_comm_s"]),
                    host_s=float(row["host_s_median"]),
                    wire_bytes=float(row["wire_bytes_per_step"]),
                    transfers=int(row["transfers_per_step"]),
                    operations={str(k): int(v) for k, v in row.get("operations_per_step", {}).items()},
                )
                for name, row in data["variants"].items()
            }
            return cls(
                model=str(data["model"]),
                parallel=str(data["parallel"]),
                device=str(data["device"]),
                dtype=str(data["dtype"]),
                microbatches=int(data["microbatches"]),
                ranks=int(data["emulated"]["ranks"]),
                link=Link(
                    str(link["name"]),
                    float(link["bandwidth_bytes_per_s"]),
                    float(link["alpha_s"]),
                    "the bench result's link",
                ),
                variants=variants,
            )
        except KeyError as err:
            raise ValueError(f"not an emulated bench result: no field {err}") from None


def recorded_link(record: BenchRecord) -> str:
    """The cost model's name of the record's link: the registered entry of that name, or the
    record's own numbers registered (a ``balanced`` or ``alpha=...,bandwidth=...`` link); where
    another record registered that name with other numbers (a balanced link's label rounds its
    rate), the record's numbers under the name and those numbers. ``ValueError`` where one of
    the cost model's own links (``cost_model.links.BUILTIN_LINK_NAMES``) has that name and other
    numbers."""
    link = record.link
    try:
        known = get_link(link.name)
    except KeyError:
        return register_link(link).name
    if (known.bandwidth_bytes_per_s, known.latency_s) == (link.bandwidth_bytes_per_s, link.latency_s):
        return known.name
    if known.name not in BUILTIN_LINK_NAMES:
        own = dataclasses.replace(
            link, name=f"{link.name}@{link.bandwidth_bytes_per_s:.0f}_bytes_per_s_{link.latency_s * 1e6:g}us"
        )
        return register_link(own).name
    raise ValueError(
        f"the bench result's link {link.name!r} ({link.bandwidth_bytes_per_s / 1e9:g} GB/s, alpha "
        f"{link.latency_s * 1e6:g} us) differs from the cost model's entry of that name "
        f"({known.bandwidth_bytes_per_s / 1e9:g} GB/s, alpha {known.latency_s * 1e6:g} us)"
    )


_DEVICE_NAMES: tuple[tuple[str, str], ...] = (("h200", "h200"), ("h100", "h100_sxm"), ("a100", "a100_80gb"))


def device_entry(device: str) -> str:
    """The ``cost_model.hardware`` entry of a bench result's device ("NVIDIA H200" -> "h200")."""
    if device.lower() == "cpu":
        return "cpu"
    for needle, entry in _DEVICE_NAMES:
        if needle in device.lower():
            return entry
    raise ValueError(f"no cost_model.hardware entry for device {device!r}")


def emulated_setting_name(device: str, model: str, parallel: str, ranks: int, link: str) -> str:
    """``h200-emulated-llama3_8b_gpu-tp8-ib400``: device entry, bench model, parallelism, ranks, link preset."""
    return f"{device}-emulated-{model}-{parallel}{ranks}-{link}"


def emulated_setting(
    name: str,
    model: ModelShape,
    *,
    link: str,
    ranks: int,
    seq_len: int,
    micro_batch_size: int,
    micro_batches: int,
    device: str,
    dtype: Literal["bfloat16", "float32"] = "bfloat16",
    sequence_parallel: bool = False,
    ends: Ends = "vocab_parallel",
    dp_mode: DataParallelMode = "replicate",
    pp: int = 1,
) -> ClusterSetting:
    """A tensor-parallel job of ``ranks`` on one emulated link, as the bench writes it (PyTorch's
    TP plan: per-projection all-reduces, logits gathered for the loss; ``ends="replicated"``:
    the plan on the decoder layers only, ``ClusterSetting.ends``); with ``pp`` > 1 a pipeline of
    ``pp`` stages, each tensor-parallel over ``ranks // pp``; with ``dp_mode="shard"`` a ZeRO-3
    job of ``ranks`` instead (``data_parallel(model, mode="shard")``, no TP), and an MoE layer
    (``model.family == "moe"``) with its experts split over the ``ranks``."""
    over_dp = dp_mode == "shard" or model.family == "moe"
    if ranks % pp or (pp > 1 and over_dp):
        raise ValueError(f"an emulated pipeline of {pp} stages needs a tensor-parallel job of a multiple of {pp} ranks")
    return ClusterSetting(
        name=name,
        model=model,
        parallel=Parallelism(
            dp=ranks if over_dp else 1,
            tp=1 if over_dp else ranks // pp,
            pp=pp,
            sequence_parallel=sequence_parallel,
        ),
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        micro_batches=micro_batches,
        device=device,
        gpus_per_node=ranks,
        intra_node_link=link,
        inter_node_link=link,
        paper=PaperReport(None, None, None, "none: an emulated cluster (dhelix bench --link emulated:...)"),
        dtype=dtype,
        projection_reduces="per_projection",
        loss="gathered_logits",
        contention_factor=EMULATED_CONTENTION_FACTOR if device != "cpu" else 1.0,
        ends=ends,
        dp_mode=dp_mode,
    )


#: The bench's ``llama3_8b_gpu`` (``dhelix_compile.bench.choices.MODEL_SIZES``).
LLAMA3_8B_2_LAYERS = ModelShape(
    "llama3_8b_gpu",
    "llama",
    2,
    4096,
    32,
    14336,
    8192,
    "the bench's llama3_8b_gpu (dhelix_compile.bench.choices.MODEL_SIZES)",
    kv_heads=8,
)

#: The recorded GPU runs (BENCHMARKS.md, "Emulated cluster"): TP=8, 4096 tokens, 2 micro-batches, bf16.
EMULATED_SETTINGS: dict[str, ClusterSetting] = {
    s.name: s
    for s in (
        emulated_setting(
            emulated_setting_name("h200", "llama3_8b_gpu", "tp", 8, preset),
            LLAMA3_8B_2_LAYERS,
            link=entry,
            ranks=8,
            seq_len=4096,
            micro_batch_size=1,
            micro_batches=2,
            device="h200",
        )
        for preset, entry in (("ib400", "ib_ndr"), ("nvlink4", "nvlink4"))
    )
}


#: The transfers of a per-peer step (``dhelix::exchange``: a send and a receive), as the emulator records them.
PER_PEER_OPERATIONS: tuple[str, str] = ("send", "recv")


@dataclass(frozen=True)
class PerPeerSteps:
    """Collectives of the modeled program that a run issued as per-peer steps instead.

    ``graph_passes.decompose`` (``decompose="auto"``, dhelix's default) rewrites an all-gather ->
    matmul, matmul -> reduce-scatter or matmul -> all-reduce site into exchanges with each peer,
    in 1, 2 or 4 pieces, where the compile measured it faster on the live link: a choice the
    model does not make, and an overlap of each piece with the site's matmul it does not model.
    The rewrite sends the same bytes; each send is a transfer with its own fixed cost."""

    replaced: Mapping[str, int]
    """Collectives a step of the modeled program issues and the run did not, by kind."""
    sends: int
    """The run's sends beyond the modeled program's own (a pipeline stage's); ``recvs`` likewise."""
    recvs: int
    comm_s: float
    """The modeled program's link time with ``replaced`` sent as the ``sends`` (the emulator's
    accounting: collectives and sends on the outbound queue; the receives, as many and as large,
    on the inbound one)."""


def per_peer_steps(
    setting: ClusterSetting, predicted: VariantPrediction, measured: MeasuredVariant
) -> PerPeerSteps | None:
    """What the run issued as per-peer steps instead of ``predicted``'s collectives (None: nothing,
    or no record of its transfers by kind). Each transfer costs ``base + steps * alpha + wire / B``
    and the steps keep the bytes, so the link time differs by the fixed costs alone."""
    # beyond the program's own sends and receives (a pipeline stage's)
    sends, recvs = (measured.operations.get(op, 0) - predicted.operations.get(op, 0) for op in PER_PEER_OPERATIONS)
    if sends <= 0 and recvs <= 0:
        return None
    replaced = {
        op: n - measured.operations.get(op, 0)
        for op, n in predicted.operations.items()
        if op not in PER_PEER_OPERATIONS and n > measured.operations.get(op, 0)
    }
    over_dp = program_kind(setting) in ("zero3", "moe")  # their collectives run over the DP group
    link = setting.dp_link if over_dp else setting.tp_link
    group = setting.parallel.dp if over_dp else setting.parallel.tp

    def fixed_s(op: str) -> float:
        return base_latency_s("nccl") + alpha_beta_terms(op, group)[0] * link.latency_s

    comm_s = predicted.comm_s + sends * fixed_s("send") - math.fsum(k * fixed_s(op) for op, k in replaced.items())
    return PerPeerSteps(replaced, sends, recvs, comm_s)


@dataclass(frozen=True)
class VariantComparison:
    """A variant's predictions beside its measurement."""

    variant: str
    measured: MeasuredVariant
    analytic: VariantPrediction
    measured_inputs_s: float
    measured_inputs: str
    """What the measured-inputs prediction took from the run."""
    host_bound: bool
    analytic_claimed: bool
    per_peer: PerPeerSteps | None = None
    """Where the run's program holds per-peer steps the modeled one does not: neither prediction
    is claimed."""
    notes: tuple[str, ...] = ()
    """Where the variant's program on this setting differs from its description."""

    @property
    def measured_inputs_claimed(self) -> bool:
        return self.per_peer is None

    @property
    def analytic_ratio(self) -> float:
        return self.analytic.step_s / self.measured.step_s

    @property
    def measured_inputs_ratio(self) -> float:
        return self.measured_inputs_s / self.measured.step_s


@dataclass(frozen=True)
class BenchComparison:
    """Every modeled variant of one recorded run."""

    setting: ClusterSetting
    record: BenchRecord
    matmul_efficiency: float
    attention_efficiency: float
    rows: tuple[VariantComparison, ...]
    not_modeled: tuple[str, ...]


def _program_notes(setting: ClusterSetting, variant: str) -> tuple[str, ...]:
    if setting.ends == "replicated" and _program(variant).loss == "vocab_parallel":
        return (
            "no column-wise LM head (the embedding and head are replicated): vocab_parallel_loss has no "
            "logits gather to rewrite, the loss is the replicated head's, as the other variants'",
        )
    return ()


def compare_bench(
    setting: ClusterSetting,
    record: BenchRecord,
    *,
    matmul_efficiency: float = MEASURED_MATMUL_EFFICIENCY,
    attention_efficiency: float = MEASURED_ATTENTION_EFFICIENCY,
) -> BenchComparison:
    """Each variant of ``record`` that :data:`VARIANT_PROGRAMS` models, predicted on ``setting``."""
    rows = []
    efficiencies = {"matmul_efficiency": matmul_efficiency, "attention_efficiency": attention_efficiency}
    for variant, measured in record.variants.items():
        if not modeled(variant, setting):
            continue
        analytic = predict_variant(setting, variant, **efficiencies)
        host_bound = measured.host_s >= HOST_BOUND_SHARE * measured.step_s
        if record.on_cuda:
            inputs_s = max(measured.host_s, analytic.step_s)
            inputs = "host_s_median"
        else:
            scale = measured.t_compute_s / analytic.compute_s
            inputs_s = predict_variant(setting, variant, compute_scale=scale, **efficiencies).step_s
            inputs = "t_compute_s"
        per_peer = per_peer_steps(setting, analytic, measured)
        rows.append(
            VariantComparison(
                variant=variant,
                measured=measured,
                analytic=analytic,
                measured_inputs_s=inputs_s,
                measured_inputs=inputs,
                host_bound=host_bound,
                analytic_claimed=record.on_cuda and not host_bound and per_peer is None,
                per_peer=per_peer,
                notes=_program_notes(setting, variant),
            )
        )
    not_modeled = tuple(v for v in record.variants if not modeled(v, setting))
    return BenchComparison(setting, record, matmul_efficiency, attention_efficiency, tuple(rows), not_modeled)


__all__ = [
    "EMULATED_CONTENTION_FACTOR",
    "EMULATED_SETTINGS",
    "HOST_BOUND_SHARE",
    "LLAMA3_8B_2_LAYERS",
    "PER_PEER_OPERATIONS",
    "TOLERANCE",
    "VARIANT_PROGRAMS",
    "BenchComparison",
    "BenchRecord",
    "MeasuredVariant",
    "PerPeerSteps",
    "ProgramKind",
    "VariantComparison",
    "VariantPrediction",
    "VariantProgram",
    "compare_bench",
    "device_entry",
    "emulated_setting",
    "emulated_setting_name",
    "modeled",
    "per_peer_steps",
    "predict_variant",
    "program_kind",
    "recorded_link",
    "variant_setting",
]
