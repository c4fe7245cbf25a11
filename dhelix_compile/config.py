"""dhelix configuration: one frozen dataclass, and the only place environment variables are read.

Precedence, lowest to highest::

    field defaults  <  DHELIX_* environment variables  <  explicit options

``torch.compile(m, backend="dhelix", options={...})`` and ``dhelix_compile.backend(**options)``
both go through :meth:`DHelixConfig.from_options`, so an option typo or a bad value fails the
same way everywhere: a :class:`ConfigError` that names the option and lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from collections.abc import Mapping
from typing import Any, Literal

from cost_model.helix_schedule import HelixScheduleKind

Codegen = Literal["inductor", "eager"]
Fallback = Literal["inductor", "error"]
CostModelKind = Literal["auto", "analytic", "profile"]
DecomposeMode = Literal["off", "auto", "per_peer", "chunked"]
HelixSchedule = HelixScheduleKind
GlooThreadPriority = Literal["realtime", "normal"]


class ConfigError(ValueError):
    """An unknown option or an invalid option value."""


def _option(default: Any, doc: str, env: str | None = None, *, experimental: bool = False) -> Any:
    """A dataclass field carrying its documentation and, optionally, its environment variable.

    ``experimental``: the option turns on a variant that measured slower than the default or level
    with it (its doc says where); it stays so that the measurement can be repeated.
    :meth:`DHelixConfig.describe` lists these last, marked ``(experimental)``."""
    return dataclasses.field(default=default, metadata={"doc": doc, "env": env, "experimental": experimental})


#: The merged graph's memory budget where ``interleave_memory_budget_ratio`` is None and its
#: backward does not recompute.
INTERLEAVE_MEMORY_BUDGET_RATIO: float = 1.25


@dataclasses.dataclass(frozen=True)
class DHelixConfig:
    """Every knob of the dhelix backend. Build it with :meth:`from_options`; see :meth:`describe`."""

    codegen: Codegen = _option(
        "inductor",
        "How the scheduled graphs become code: 'inductor' or 'eager'. 'inductor' (the default) "
        "compiles them with compile_fx_inner; 'eager' runs the FX graph as is, for debugging and fast tests.",
        env="DHELIX_CODEGEN",
    )
    fallback: Fallback = _option(
        "inductor",
        "What happens when a dhelix pass raises: 'inductor' falls back to plain Inductor, 'error' re-raises. "
        "'inductor' logs a warning naming the pass and compiles the untouched graph; the tests use 'error'.",
        env="DHELIX_FALLBACK",
    )
    dump_dir: str | None = _option(
        None,
        "Folder for graph dumps; None disables them. Each compiled graph gets a folder with the graph "
        "before and after every pass, op-count diffs, pictures and timelines (docs/observability.md).",
        env="DHELIX_DUMP_DIR",
    )
    disable_passes: tuple[str, ...] = _option(
        (),
        "Names of graph passes to skip (a list, or a comma-separated string).",
        env="DHELIX_DISABLE_PASSES",
    )
    cost_model: CostModelKind = _option(
        "auto",
        "Where op and collective costs come from: 'profile' (measured), 'analytic' (tables) or 'auto'. "
        "'profile' measures on the live device and process group, agreed across ranks, compute ops "
        "cached on disk; the first compile of a graph pays for it (docs/backend.md). 'analytic' "
        "(roofline + alpha-beta tables) measures nothing but is blind to the link actually in use. "
        "'auto' profiles when a real process group of several ranks is live, the only case with a "
        "link to measure, and is analytic otherwise.",
        env="DHELIX_COST_MODEL",
    )
    device: str = _option(
        "auto",
        "Device of the cost model: a name from cost_model.DEVICES, or 'auto'. The names: h100_sxm, "
        "h200, a100_80gb, a800, a40, cpu; 'auto' is the CUDA device's entry, else this CPU, measured once.",
        env="DHELIX_DEVICE",
    )
    link: str = _option(
        "auto",
        "Link collectives use, for the cost model: a name from cost_model.LINKS, or 'auto'. The names "
        "include nvlink4, ib_ndr, eth_100g, loopback; 'auto' is the emulated cluster's link under "
        "dhelix_compile.emulate, else nvlink4 on CUDA, loopback on CPU.",
        env="DHELIX_LINK",
    )
    cache_dir: str = _option(
        "~/.cache/dhelix",
        "Where profiled costs are cached (cost_model='profile').",
        env="DHELIX_CACHE_DIR",
    )
    memory_budget_ratio: float = _option(
        1.0,
        "Reordering may raise a graph's predicted peak memory to at most this multiple of the "
        "original order's (>= 1). The peak counted is the live bytes above the graph's parameters and "
        "other inputs it never frees (a backward frees its saved activations). Where the reordered graph does not fit, compute it ran "
        "early is run later until it does, else the original order stays. 1.0 (the default): no "
        "higher. The prediction counts Inductor's fused and in-place kernels but not a kernel "
        "that writes several outputs at once: at 1.25 the MLP block's backward was predicted "
        "1.10x its original order's peak and the step peaked at 1.27x the eager accumulation "
        "loop's (BENCHMARKS.md).",
    )
    max_in_flight: int = _option(2, "At most this many collectives issued and not yet waited on (>= 1).")
    bucket_mb: float = _option(
        0.0,
        "Largest bucket, in MB, of data_parallel's parameter all-gathers and gradient reductions; 0 "
        "keeps one collective per parameter. A bucket holds one group's and dtype's collectives, as "
        "DDP's buckets: one collective's fixed cost instead of one per parameter, issued when its last "
        "input exists. 0 is the default: measured faster with gloo on 2 CPU cores (BENCHMARKS.md).",
        experimental=True,
    )
    max_issue_distance: int = _option(
        512, "At most this many graph nodes between a collective's issue and its wait (>= 1)."
    )
    vocab_parallel_loss: bool = _option(
        True,
        "Compute a loss over all-gathered logits from each rank's vocabulary shard. Where a "
        "column-wise LM head with replicated output feeds the cross-entropy, the softmax's max and sum "
        "and the target's logit become three all-reduces of one number per token instead of the "
        "gather, and the backward computes only this rank's part of the logits' gradient "
        "(Megatron's vocab-parallel cross-entropy; graph_passes.joint.vocab_parallel_loss). Sums of "
        "exponentials are added in another order than eager's.",
    )
    decompose: DecomposeMode = _option(
        "auto",
        "Collective decomposition into per-peer steps or chunks: 'auto', 'per_peer', 'chunked' or 'off'. "
        "The sites (all-gather->matmul, matmul->reduce-scatter, matmul->all-reduce, all-to-all<->bmm) "
        "become per-peer P2P steps or k chunks over partitioned matmuls: 'auto' (the default) rewrites a site only where it is faster that way (with cost_model='profile': the "
        "site and its rewrites run on the live group; else predicted), "
        "'per_peer' / 'chunked' force that family wherever it applies, 'off' leaves every site alone.",
        env="DHELIX_DECOMPOSE",
    )
    decompose_max_chunks: int = _option(4, "Largest number of chunks the chunked decomposition tries (>= 1).")
    decompose_auto_chunked: bool = _option(
        False,
        "decompose='auto' also tries k chunked collectives per site. Off by default: each chunk is a "
        "whole collective call whose CPU and latency the per-site prediction misses; on the TP+SP "
        "reference model auto picked chunks for a few percent predicted and ran about 12% slower "
        "than per-peer steps (BENCHMARKS.md).",
        experimental=True,
    )
    decompose_pieces: int = _option(
        0,
        "How many pieces each per-peer transfer is split into: 1..16 forces it, 0 picks 1, 2 or 4 per site. "
        "The compute on one piece runs while the next is in flight. 0 (the default) chooses with cost_model='profile' by running each candidate on the live group (pieces "
        "measured faster on a dim-512 MLP block, slower on a dim-256 model, where the per-op "
        "model cannot tell them apart; see BENCHMARKS.md), else by prediction.",
    )
    decompose_chains: bool = _option(
        False,
        "Rewrite an all-gather -> row-wise compute -> reduce-scatter as one per-peer pipeline. "
        "On sequence parallelism's MLP block, forward and backward, each peer's rows go through the "
        "whole block as they land and go straight back as its partial, where the cost model "
        "predicts the whole graph faster that way than with the two collectives decomposed on their own. "
        "Off by default: measured slower than those on the MLP block, and the model does not "
        "tell them apart reliably (BENCHMARKS.md).",
        experimental=True,
    )
    decompose_all_to_all_chains: bool = _option(
        True,
        "Rewrite an MoE layer's dispatch all-to-all -> experts -> combine all-to-all as one per-peer "
        "pipeline. Each peer's tokens go through the experts as they land and go straight back, "
        "where that saves more than the two all-to-alls decomposed on their own (measured where the "
        "candidates run, else predicted). A helix merged graph is also planned from strands without "
        "it, and the faster is compiled.",
    )
    decompose_min_gain_ratio: float = _option(
        0.02,
        "decompose='auto' rewrites a site only if its time drops by at least this fraction ([0, 1)). "
        "The time is measured where the candidates run, else predicted; of the variants within this fraction "
        "of the fastest, the one with the fewest pieces is chosen.",
    )
    helix_schedule: HelixSchedule = _option(
        "forward_backward",
        "helix: which strand calls of a step run as one merged graph. 'forward_backward' (the "
        "default, DHelix's pairing): F0, B0+F1, ..., B(n-1), the first forward and the last "
        "backward alone; 'paired_ends': F0+F1, B0+F2, ..., B(n-2)+B(n-1), one micro-batch's "
        "activations more held; 'same_phase': F0+F1, B0+B1, F2+F3, ... On 2 gloo ranks level with "
        "the default on the bench's TP+SP and MoE workloads (a strand alone already hides much of its "
        "communication behind its own per-peer steps); on the emulated link (CPU, balanced) "
        "'same_phase', with no strand call left alone, stepped 5% faster on HF Llama TP and 10% on the "
        "MoE layer, 4% slower on TP+SP, whose two forwards' transfers outlast their compute; "
        "'paired_ends' 6% faster on TP+SP and 9% on the MoE layer (helix_runtime.schedule; BENCHMARKS.md).",
    )
    helix_strand_rewrites: bool = _option(
        False,
        "helix, several micro-batches: strands keep the rewrites chosen for a graph alone "
        "(decompose='auto', bucketing); merged graphs of them compete with plain ones. "
        "The strands run alone once a step (the first forward, the last backward). Off by default: the merged graph kept the plain strands on every "
        "workload measured (HF Llama TP+SP: 0.2123 s against 0.2135 measured, and a first step of "
        "59.7 s against 40.5 s with no rewrite at all, 2 gloo ranks; docs/backend.md). On the emulated "
        "link (HF Llama TP+SP, balanced, 4 micro-batches; 2026-11-29, 3825e74) the merged graphs took the rewritten strands "
        "and ran slower: a step of 1290.7 ms against 1128.8 (the lone first forward 146.4 against 179.6, "
        "each merged part 313-331 against 246-260), a first step of 72.7 s against 31.3. A forced "
        "decompose mode applies either way.",
        experimental=True,
    )
    helix_strand_kernels: bool = _option(
        True,
        "helix: no fused kernel joins a merged graph's two strands, so its kernels are theirs, "
        "cached from compiling F and B. (codegen.generate) "
        "The DDP bench step (small --data-parallel replicate): 39 kernels in all instead of 50, M "
        "compiled in 3.4 s instead of 8.8; steps 796.8 ms against 839.8 without, HF Llama TP+SP "
        "771.2 against 786.1 (2 gloo ranks, one run each; docs/backend.md).",
        experimental=True,
    )
    helix_grads_in_graph: bool = _option(
        True,
        "helix: each backward graph adds each parameter's gradient into its .grad where it is computed. "
        "The graph (dhelix::grad_total) returns the sum for autograd to store, instead of "
        "returning the micro-batch's gradient for autograd to add after the graph, which a merged "
        "graph holds while micro-batch i+1's forward runs. The interleave pass's memory budget "
        "then counts the gradients as freed. On the MoE layer: step 210.6 ms instead of 233.1, "
        "peak 1.01x the eager accumulation loop's instead of 1.42x; HF Llama TP+SP 1.02x instead "
        "of 1.29x (BENCHMARKS.md). The same sums "
        "in the same order as eager's; a parameter with a tensor hook (register_hook), or nothing "
        "accumulated yet, gets its gradient as usual; off in helix_pipeline (one graph serves "
        "several stage modules).",
    )
    interleave_memory_budget_ratio: float | None = _option(
        None,
        "helix: a merged graph may raise its predicted peak memory to at most this multiple "
        "of its backward-then-forward order's (>= 1; None: 1.25, 1.0 if B recomputes). The peak counted is the live bytes above the "
        "graph's parameters and other inputs it never frees: what the step adds to the memory it "
        "already holds. A merged graph whose backward recomputes gets 1.0 by default "
        "(activation checkpointing asks for memory: the reference transformer with checkpointed blocks "
        "peaked at 1.12-1.15x the eager checkpointed loop's instead of 1.19-1.26x; docs/helix.md); a "
        "value applies to every merged graph. On the MoE layer 1.25 leaves out an order that sends the "
        "forward's all-to-all first: 6-10% faster, but it holds both micro-batches' expert activations, "
        "1.31-1.45x the eager accumulation loop's peak (2.0 lets it in; docs/options.md).",
    )
    interleave_defer_weight_grads: tuple[int, ...] = _option(
        (1,),
        "helix: for each distance d, the strand plan also tries a backward whose weight gradients run "
        "d segments later. Weight gradients are work no later transfer depends on (a list of ints >= 1, or "
        "'1,2'; () turns it off).",
    )
    interleave_refine_evals: int = _option(
        4000,
        "helix: evaluations of the local search that refines the strand plan's DP path (0 turns it off; >= 0).",
    )
    interleave_slice_ratio: float = _option(
        0.5,
        "helix: the strand plan also cuts long stretches of compute into slices of at most this times "
        "the median transfer (0 turns it off). A strand whose transfer lands in the middle of the "
        "other strand's stretch then goes on there (planned by the timed DP; the simulator judges it "
        "beside the other orders; >= 0).",
    )
    interleave_measure_pairs: bool = _option(
        False,
        "helix, cost_model='profile': the strand plan's DP prices each pair of segments by running them "
        "together on the live group, not by the formula. The chosen order "
        "is judged by the simulator either way. Off by default: on HF Llama TP+SP (dhelix bench, 4 "
        "micro-batches, 2 gloo ranks) 380 pair measurements took 65 s of a 125 s first step, and the "
        "order kept was the sliced plan, which the formula prices, with them and without; HF Llama TP's "
        "step measured level (729 ms against 726).",
        experimental=True,
    )
    interleave_timed_width: int = _option(
        0,
        "helix: partial paths each cell of the strand plan's timed DP keeps; 0 (the default) turns it off. "
        "The timed DP runs over simulated clocks, which lets a long transfer run under several "
        "segments (try 4); on the 2-core CPU machine its plans were predicted faster and measured "
        "level (>= 0).",
        experimental=True,
    )
    gloo_thread_priority: GlooThreadPriority = _option(
        "realtime",
        "On gloo, run the communication threads ahead of the compute ('realtime') or leave them alone ('normal'). "
        "The process's communication threads (torch's pt_gloo_runloop, gloo's "
        "gloo_tcp_loop) run under SCHED_DEADLINE, each for at most 30% of "
        "every millisecond, from the first compile of a graph with communication: at normal "
        "priority a transfer in flight waits for the scheduler each time it needs its threads while "
        "every core computes (a 512 KiB all-to-all: 0.6 ms alone, 3-4 ms under matmuls), and under "
        "a fixed real-time priority gloo's spin-waits could stall a step for seconds "
        "(dhelix_compile.comm_threads, BENCHMARKS.md). Needs CAP_SYS_NICE (root has it) and "
        "deadline bandwidth the kernel admits (where other processes hold it, halved shares are "
        "tried, none below 5%); without them one warning says so and the threads stay at normal "
        "priority, as when the machine's ranks times their torch threads exceed its cores. "
        "'normal' leaves the threads alone. NCCL has no such threads: nothing changes there.",
        env="DHELIX_GLOO_THREAD_PRIORITY",
    )
    consistency_timeout_s: float = _option(
        300.0,
        "How long a rank waits at compile time for the others before failing with an error that names "
        "the missing rank (> 0). It waits for their collective sequences and for the CPU device the "
        "first rank to ask measures for all; the timeout of the graph's process groups (group_timeout_s, else "
        "the default group's) ends the wait where shorter. The c10d store sees no death: a rank "
        "that dies while the others compile fails them here.",
    )
    group_timeout_s: float | None = _option(
        None,
        "How long a transfer dhelix runs waits for a peer that does not answer before it fails, in seconds (> 0). "
        "The transfers are its compiled graphs' collectives and helix_pipeline's sends and receives; each "
        "process group they run on gets it, as torch keeps one timeout per group (its other "
        "transfers get it too). It bounds a step only where a peer's death is not seen: its machine "
        "lost, a network partition, a process stopped or hung. A rank that dies on a machine that "
        "stays up fails its peers' transfers at once (docs/failures.md). None (the "
        "default): the default process group's timeout (init_process_group(timeout=...); torch's "
        "default is 30 minutes on gloo), for every such group whose own is longer: torch 2.13 makes "
        "a DeviceMesh's subgroups and new_group's groups with its default whatever that timeout "
        "(dhelix_compile.group_timeouts).",
    )
    profile_steps: int = _option(
        0,
        "With dump_dir: profile N calls of every compiled graph and write measured against predicted times. "
        "After one warm-up call, N calls run under torch.profiler, which writes the measured timeline (measured.trace.json, measured.svg) and predicted vs "
        "measured time per communication segment (predicted_vs_measured.json, summary.json, "
        "index.html) into the graph's dump folder; later calls run unprofiled. 0 disables it; "
        "a positive value without dump_dir is an error (>= 0).",
        env="DHELIX_PROFILE_STEPS",
    )

    # ------------------------------------------------------------------ construction

    @property
    def interleave_budget_ratio(self) -> float:
        """``interleave_memory_budget_ratio`` as the interleave pass applies it: the value set, else
        :data:`INTERLEAVE_MEMORY_BUDGET_RATIO` (``helix_runtime.merged_candidates`` sets a merged
        graph's own where its backward recomputes)."""
        if self.interleave_memory_budget_ratio is None:
            return INTERLEAVE_MEMORY_BUDGET_RATIO
        return self.interleave_memory_budget_ratio

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None
    ) -> DHelixConfig:
        """Defaults, overridden by ``DHELIX_*`` env vars, overridden by ``options``; validated."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            env_name = f.metadata.get("env")
            if env_name and environ.get(env_name, "") != "":
                values[f.name] = environ[env_name]
        options = dict(options or {})
        _check_known(options)
        values.update(options)
        return cls(**{name: _coerce(name, value) for name, value in values.items()}).validate()

    def patch(self, **changes: Any) -> DHelixConfig:
        """A copy with ``changes`` applied and validated (handy in tests)."""
        _check_known(changes)
        coerced = {name: _coerce(name, value) for name, value in changes.items()}
        return dataclasses.replace(self, **coerced).validate()

    def validate(self) -> DHelixConfig:
        """Raise :class:`ConfigError` for a value outside a field's ``Literal`` choices; return self."""
        for f in dataclasses.fields(self):
            choices = _literal_choices(f.name)
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(
                    f"dhelix option {f.name}={value!r} is not valid; choose one of "
                    f"{', '.join(repr(c) for c in choices)}"
                )
        if not all(isinstance(p, str) and p for p in self.disable_passes):
            raise ConfigError(f"dhelix option disable_passes={self.disable_passes!r}: expected pass names")
        _check_number("memory_budget_ratio", self.memory_budget_ratio, float, minimum=1.0)
        _check_number("max_in_flight", self.max_in_flight, int, minimum=1)
        _check_number("bucket_mb", self.bucket_mb, float, minimum=0)
        _check_number("max_issue_distance", self.max_issue_distance, int, minimum=1)
        _check_number("consistency_timeout_s", self.consistency_timeout_s, float, minimum=1e-3)
        if self.group_timeout_s is not None:
            _check_number("group_timeout_s", self.group_timeout_s, float, minimum=1e-3)
        _check_number("decompose_max_chunks", self.decompose_max_chunks, int, minimum=1)
        _check_number("decompose_pieces", self.decompose_pieces, int, minimum=0)
        if self.decompose_pieces > 16:
            raise ConfigError(f"dhelix option decompose_pieces={self.decompose_pieces!r}: must be <= 16")
        for name in (
            "vocab_parallel_loss",
            "decompose_auto_chunked",
            "decompose_chains",
            "decompose_all_to_all_chains",
            "helix_grads_in_graph",
        ):
            _check_bool(name, getattr(self, name))
        _check_number("decompose_min_gain_ratio", self.decompose_min_gain_ratio, float, minimum=0.0)
        if self.decompose_min_gain_ratio >= 1.0:
            raise ConfigError(f"dhelix option decompose_min_gain_ratio={self.decompose_min_gain_ratio!r}: must be < 1")
        if self.interleave_memory_budget_ratio is not None:
            _check_number("interleave_memory_budget_ratio", self.interleave_memory_budget_ratio, float, minimum=1.0)
        for distance in self.interleave_defer_weight_grads:
            _check_number("interleave_defer_weight_grads", distance, int, minimum=1)
        _check_number("interleave_refine_evals", self.interleave_refine_evals, int, minimum=0)
        _check_number("interleave_timed_width", self.interleave_timed_width, int, minimum=0)
        _check_number("interleave_slice_ratio", self.interleave_slice_ratio, float, minimum=0.0)
        _check_number("profile_steps", self.profile_steps, int, minimum=0)
        if self.profile_steps > 0 and self.dump_dir is None:
            raise ConfigError(
                f"dhelix option profile_steps={self.profile_steps} needs dump_dir "
                "(the measured timeline is written into each graph's dump folder)"
            )
        return self

    # ------------------------------------------------------------------ documentation

    @classmethod
    def describe(cls, *, brief: bool = False) -> str:
        """The options table (markdown): name, default, environment variable, meaning.

        ``brief=True`` gives each option's summary (the first sentence of its doc; the README's
        table), else its whole doc and its choices (``docs/options.md``). The experimental options
        come last, each marked ``(experimental)``.
        """
        rows = ["| option | default | env var | meaning |", "|---|---|---|---|"]
        for f in sorted(dataclasses.fields(cls), key=lambda f: bool(f.metadata["experimental"])):
            doc = f.metadata["doc"]
            choices = _literal_choices(f.name)
            if brief:
                doc = option_summary(doc)
            elif choices:
                doc += " Choices: " + ", ".join(f"`{c}`" for c in choices) + "."
            env = f"`{f.metadata['env']}`" if f.metadata.get("env") else ""
            marker = "(experimental) " if f.metadata["experimental"] else ""
            rows.append(f"| `{f.name}` | `{f.default!r}` | {env} | {marker}{doc} |")
        return "\n".join(rows)


def option_summary(doc: str) -> str:
    """An option's summary: its doc up to the first full stop followed by a space (or the end)."""
    end = doc.find(". ")
    return doc if end < 0 else doc[: end + 1]


def ranks_from_fork_server() -> bool:
    """``DHELIX_FORKSERVER``: whether ``testing.run_on_ranks`` forks its ranks from a process that
    has imported torch once (the default) or, with ``0``, starts every rank cold. Not an option
    of the backend: it only changes how the test harness starts processes."""
    return os.environ.get("DHELIX_FORKSERVER", "1") != "0"


def experimental_option_names() -> tuple[str, ...]:
    """Names of the options marked experimental (``_option(experimental=True)``), in declaration order."""
    return tuple(f.name for f in dataclasses.fields(DHelixConfig) if f.metadata["experimental"])


def option_names() -> tuple[str, ...]:
    """Names of every valid option, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(DHelixConfig))


def _check_known(options: Mapping[str, Any]) -> None:
    valid = option_names()
    for name in options:
        if name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown dhelix option {name!r}{hint}; valid options: {', '.join(valid)}")


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(DHelixConfig)


def _literal_choices(name: str) -> tuple[Any, ...]:
    hint = _field_types()[name]
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"dhelix option {name}={value!r}: expected True or False")


def _check_number(name: str, value: Any, kind: type, *, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ConfigError(f"dhelix option {name}={value!r}: expected {'an integer' if kind is int else 'a number'}")
    if value < minimum:
        raise ConfigError(f"dhelix option {name}={value!r}: must be >= {minimum}")


def _comma_tuple(name: str, value: Any, item: type, expected: str) -> tuple[Any, ...]:
    """A list or tuple as is, or ``"a, b"`` split on commas, each part converted by ``item``."""
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, str):
        try:
            return tuple(item(part.strip()) for part in value.split(",") if part.strip())
        except ValueError:
            pass
    raise ConfigError(f"dhelix option {name}={value!r}: expected {expected}, or a list")


def _coerce(name: str, value: Any) -> Any:
    """Turn strings from env vars (or loose user input) into the field's type."""
    if name == "disable_passes":
        return _comma_tuple(name, value, str, "pass names like 'a,b'")
    if name == "interleave_defer_weight_grads":
        return _comma_tuple(name, value, int, "integers like '1,2'")
    if name == "dump_dir" and value is not None:
        return os.fspath(value)
    if name == "profile_steps" and isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ConfigError(f"dhelix option profile_steps={value!r}: expected an integer") from None
    return value
