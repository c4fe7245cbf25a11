"""Timing primitives for the benchmark: interleaved step timing and collective replay.

Contract
    - ``time_interleaved(steps, repeats, barrier)``: for each repeat, runs every variant's step
      once, in the given order, each after ``barrier()`` (so all ranks start a step together);
      returns :class:`Timings`: per-variant lists of wall seconds on this rank, and of the CPU
      seconds this process spent in each step (all its threads: compute, gloo's transport,
      the kernel's socket work done on their behalf). Interleaving puts every variant under
      the same conditions (link, machine load) instead of measuring one after another.
    - ``record_collectives(module, step_of)``: compiles ``module`` through AOTAutograd (eager
      codegen), runs ``step_of(compiled)`` (a whole step) and returns the collective issue
      nodes of the graphs it ran, in execution order; ``replay_collectives(nodes)`` issues exactly those
      collectives (same ops, shapes, dtypes, groups) back to back on the live process group and
      waits for each. Its time is ``T_comm``: the step's communication with no compute around.
    - ``ceiling_steps(replay, compute_s, agree)``: the same collectives, each hidden under a
      share of ``compute_s`` of synthetic matmuls, with one or two of them in flight at a time
      -- the best overlap this machine allows for the step's communication and compute (see its
      docstring). The bench reports the faster of the two depths.
    - On a gloo group an all-gather and a sum reduce-scatter are replayed as all-to-alls, as the
      ``gloo_collectives`` pass sends them (torch 2.13's gloo all-gather in flight beside compute
      corrupts the heap; its reduce-scatter all-reduces the whole input, twice the bytes; the
      pass's docstring says how that was found). ``T_comm`` and the ceiling are the step's
      collectives as dhelix sends them, not as Inductor does.
    - ``record_sent_collectives(step, rank, group_size)``: the calls one run of ``step`` made on
      the process group (``_torch_compat.process_group_calls``: every thread, whoever issued
      them), each a :class:`SentCollective` with the bytes this rank put on the wire for it --
      a variant's *own* collectives, as its final code sends them. ``SentReplay`` issues them
      again on the live group: its time back to back is the variant's own ``T_comm``, and
      ``ceiling_steps`` takes it as it takes ``CollectiveReplay`` (the variant's own ceiling).
    - ``pair_transfers(every_rank)``: every rank's recorded calls (``gather_sent``) as one list of
      transfers that every rank replays in the same order, each rank issuing its part of a
      transfer together and waiting for it before the next; ValueError where the ranks' calls do
      not pair up (a send without its receive, collectives that differ). A pipeline's ranks send
      different sequences (one sends what the other receives), and a schedule keeps several in
      flight (1F1B: rank 0 sends F1 while rank 1 sends B0); each transfer is the fewest calls that
      every rank can issue in its recorded order and wait for without waiting on a later transfer:

          rank 0:  send F0 | send F1  recv B0 | send F2  recv B1 | recv B2
          rank 1:  recv F0 | recv F1  send B0 | recv F2  send B1 | send B2

      Every rank has finished every earlier transfer when it issues one, so each transfer finds
      all its peers posted: the replay cannot deadlock, at any number of transfers in flight.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.fx

from cost_model.collectives import collective_bytes_on_wire
from cost_model.op_kinds import is_comm, kind_of
from cost_model.profile.running import run_node, transfer_tensors
from cost_model.rank_agreement import gather_texts
from cost_model.timing import back_to_back_s, median_run_s
from dhelix_compile import _torch_compat as compat
from dhelix_compile.comm_threads import gloo_threads_cpu_s

c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class Timings:
    """Seconds per step, per variant, on this rank: ``wall_s`` (``time.perf_counter``) and
    ``cpu_s`` (``time.process_time``: every thread of this process). ``wall - cpu`` is a lower
    bound on the time the rank sat idle, waiting for a transfer or a peer; a CPU time close to
    the wall time means the rank was busy throughout (on a machine whose cores the ranks fill,
    the CPU a transfer takes cannot be hidden behind compute). ``gloo_cpu_s``: the part of
    ``cpu_s`` that gloo's threads ran (``comm_threads.gloo_threads_cpu_s``; the kernel's socket
    work in their system calls included, softirq work done elsewhere not)."""

    wall_s: dict[str, list[float]]
    cpu_s: dict[str, list[float]]
    gloo_cpu_s: dict[str, list[float]]


def time_interleaved(
    steps: Mapping[str, Callable[[], Any]],
    repeats: int,
    barrier: Callable[[], Any] | None = None,
    on_step: Callable[[str], Any] | None = None,
) -> Timings:
    """Wall and CPU seconds per step, per variant, measured round-robin (see the module docstring).

    ``on_step(variant)`` is called after each timed step (progress reporting).
    """
    timings = Timings({name: [] for name in steps}, {name: [] for name in steps}, {name: [] for name in steps})
    for _ in range(repeats):
        for name, step in steps.items():
            start_gloo = gloo_threads_cpu_s()  # read outside the timed window: it lists /proc (~0.2 ms)
            if barrier is not None:
                barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            timings.cpu_s[name].append(time.process_time() - start_cpu)
            timings.wall_s[name].append(time.perf_counter() - start)
            timings.gloo_cpu_s[name].append(gloo_threads_cpu_s() - start_gloo)
            if on_step is not None:
                on_step(name)
    return timings


def record_collectives(module: torch.nn.Module, step_of: Callable[[torch.nn.Module], Any]) -> list[torch.fx.Node]:
    """Collective issue nodes of the graphs ``step_of(compiled_module)`` runs (its forwards and
    backwards, every micro-batch), in execution order: a graph run twice gives its nodes twice."""
    recorded: list[torch.fx.Node] = []

    def inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable[..., Any]:
        comms = [n for n in gm.graph.nodes if is_comm(kind_of(n))]

        def recording(*args: Any) -> Any:
            recorded.extend(comms)
            return gm.forward(*args)

        return compat.eager_partition(recording)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return compat.compile_with_aot_autograd(gm, example_inputs, inner)

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend)
    assert isinstance(compiled, torch.nn.Module), "torch.compile of a module is a module"
    step_of(compiled)
    torch._dynamo.reset()
    return recorded


def _materialize(value: Any) -> Any:
    """A real tensor for each fake tensor (``meta["val"]``) in a node argument."""
    if isinstance(value, torch.fx.Node):
        val = value.meta["val"]
        return torch.empty(val.shape, dtype=val.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v) for v in value)
    return value


class CollectiveReplay:
    """``nodes``' collectives on the live process group, with real tensors of their shapes.

    Calling it issues each collective and waits for it before the next (``T_comm``);
    ``issue(i)`` and ``wait(handles)`` split one collective for schedules that put work between.
    An all-gather or a sum reduce-scatter on a gloo group is issued as one all-to-all (see the
    module docstring), the way dhelix's compiled graphs send them.
    """

    def __init__(self, nodes: Sequence[torch.fx.Node]) -> None:
        self.calls = [(n, _materialize(n.args), _materialize(n.kwargs)) for n in nodes]

    def __len__(self) -> int:
        return len(self.calls)

    def issue(self, i: int) -> list[torch.Tensor]:
        node, args, kwargs = self.calls[i]
        return transfer_tensors(
            run_node(node, args, kwargs)
        )  # the profiler's runner: gloo gathers and reduce-scatters as all-to-alls

    @staticmethod
    def wait(handles: Sequence[torch.Tensor]) -> None:
        for tensor in handles:
            c10d.wait_tensor(tensor)

    def __call__(self) -> None:
        for i in range(len(self)):
            self.wait(self.issue(i))


def replay_collectives(nodes: Sequence[torch.fx.Node]) -> CollectiveReplay:
    """A function that issues ``nodes``' collectives one after another, waiting for each."""
    return CollectiveReplay(nodes)


class Replay(Protocol):
    """Collectives that can be issued one by one and waited for (``ceiling_steps`` takes any)."""

    def __len__(self) -> int: ...

    def issue(self, i: int) -> list[Any]: ...

    def wait(self, handles: Sequence[Any]) -> None: ...

    def __call__(self) -> None: ...


#: ``c10d::`` ops -> the collective they send (``SentCollective.op``); ops not named here raise.
_SENT_OPS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "broadcast_": "broadcast",
    "send": "send",
    "recv_": "recv",
}
#: ``c10d::`` ops that send nothing a step's time depends on.
_NOT_SENT = frozenset({"barrier", "monitored_barrier_"})


@dataclasses.dataclass(frozen=True)
class SentCollective:
    """One collective a step sent on the process group, as its ``c10d`` op received it.

    ``op``: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``,
    ``send`` or ``recv``; ``shape`` and ``dtype``: its input (a gather's shard, a scatter's
    whole input); ``splits``: an all-to-all's input rows per rank and ``out_splits`` its output
    rows per rank (empty: even); ``peer``: a send's destination, a receive's source, a
    broadcast's root. ``wire_bytes``: what this rank pushed through its link for it, as gloo
    sends it (``cost_model.collectives``, ``backend="gloo"``; ProcessGroupGloo reduce-scatters by
    all-reducing the whole input; an all-to-all's rows to itself stay local).
    """

    op: str
    shape: tuple[int, ...]
    dtype: str
    wire_bytes: int
    splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()
    peer: int | None = None


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _wire_bytes(op: str, shape: Sequence[int], dtype: str, splits: Sequence[int], rank: int, group_size: int) -> int:
    nbytes = _nbytes(shape, dtype)
    if op == "recv":
        return 0
    if op == "all_to_all" and splits:
        return nbytes - nbytes * int(splits[rank]) // max(sum(splits), 1)
    if op == "all_gather":  # the full buffer S is the output: the shard from every rank
        return int(collective_bytes_on_wire(op, nbytes * group_size, group_size, backend="gloo"))
    sent_as = "all_reduce" if op == "reduce_scatter" else op
    return int(collective_bytes_on_wire(sent_as, nbytes, group_size, backend="gloo"))


def sent_collectives(calls: Sequence[compat.ProcessGroupCall], rank: int, group_size: int) -> list[SentCollective]:
    """``calls`` (``_torch_compat.process_group_calls``) as :class:`SentCollective` s, one per
    tensor of a coalesced call; ValueError naming a ``c10d`` op this module cannot replay."""
    sent: list[SentCollective] = []
    for call in calls:
        if call.op in _NOT_SENT:
            continue
        op = _SENT_OPS.get(call.op)
        if op is None:
            raise ValueError(f"the step called c10d::{call.op}, which the bench cannot replay")
        args = call.args
        splits: tuple[int, ...] = ()
        out_splits: tuple[int, ...] = ()
        peer: int | None = None
        if op == "all_to_all":  # (output, input, group, output splits, input splits, ...)
            inputs = [args[1]]
            out_splits, splits = tuple(args[3] or ()), tuple(args[4] or ())
        elif op in ("all_gather", "reduce_scatter") and call.op.startswith("_"):  # (output, input, ...)
            inputs = [args[1]]
        elif op in ("all_gather", "reduce_scatter"):  # (outputs, inputs, ...)
            inputs = list(args[1])
        else:  # (tensors, group, peer or root or reduce op, ...)
            inputs = list(args[0])
            peer = int(args[2]) if op in ("send", "recv", "broadcast") else None
        for shape, dtype in inputs:
            wire = _wire_bytes(op, shape, dtype, splits, rank, group_size)
            sent.append(SentCollective(op, tuple(shape), dtype, wire, splits, out_splits, peer))
    return sent


def record_sent_collectives(step: Callable[[], Any], rank: int, group_size: int) -> list[SentCollective]:
    """The collectives one call of ``step`` sent on the process group (see the module docstring);
    every rank must call it together (the step's collectives run)."""
    return sent_collectives(compat.process_group_calls(step), rank, group_size)


def gather_sent(sent: Sequence[SentCollective], group: Any) -> list[list[SentCollective]]:
    """Every rank's ``sent``, in rank order (every rank of ``group`` calls it together)."""
    texts = gather_texts(json.dumps([dataclasses.asdict(c) for c in sent]), group)
    return [[_sent_from(fields) for fields in json.loads(text)] for text in texts]


def _sent_from(fields: dict[str, Any]) -> SentCollective:
    return SentCollective(
        op=fields["op"],
        shape=tuple(fields["shape"]),
        dtype=fields["dtype"],
        wire_bytes=fields["wire_bytes"],
        splits=tuple(fields["splits"]),
        out_splits=tuple(fields["out_splits"]),
        peer=fields["peer"],
    )


_P2P = ("send", "recv")


def _describe(c: SentCollective) -> str:
    return f"{c.op} of {'x'.join(map(str, c.shape)) or 'a scalar'} {c.dtype}"


def pair_transfers(every_rank: Sequence[Sequence[SentCollective]]) -> list[list[list[int]]]:
    """``every_rank[r]`` (rank r's recorded calls, in its order) as transfers that every rank
    replays in the same order (see the module docstring): per transfer, per rank, the indices of
    that rank's calls in it, consecutive and in its recorded order (none where the rank takes no
    part). The k-th send from rank s to rank d meets the k-th receive on d from s (same shape and
    dtype); the k-th collective of every rank is one call (the same op on every rank).

    The transfers, built alike on every rank from the same lists: the first call left of the
    lowest rank with calls left, and every call that must go with it -- each rank's calls before
    one in the transfer, and each call's peers -- until nothing more must. ValueError names the
    first call that pairs with nothing.
    """
    size = len(every_rank)
    message_of = [[-1] * len(calls) for calls in every_rank]
    members: list[list[tuple[int, int]]] = []
    sends: dict[tuple[int, int], list[int]] = {}
    receives: dict[tuple[int, int], list[int]] = {}
    collectives: list[list[int]] = [[] for _ in range(size)]
    for rank, calls in enumerate(every_rank):
        for i, c in enumerate(calls):
            if c.op not in _P2P:
                collectives[rank].append(i)
                continue
            if c.peer is None or not 0 <= c.peer < size or c.peer == rank:
                raise ValueError(f"rank {rank}'s call {i} ({_describe(c)}) names peer {c.peer} of {size} ranks")
            channel = (rank, c.peer) if c.op == "send" else (c.peer, rank)
            (sends if c.op == "send" else receives).setdefault(channel, []).append(i)
    for src, dst in sorted({*sends, *receives}):
        sent, received = sends.get((src, dst), []), receives.get((src, dst), [])
        for k in range(max(len(sent), len(received))):
            if k >= len(sent) or k >= len(received):
                rank, i = (src, sent[k]) if k < len(sent) else (dst, received[k])
                raise ValueError(
                    f"rank {rank}'s call {i} ({_describe(every_rank[rank][i])}) has no peer: rank {src} sent "
                    f"{len(sent)} tensors to rank {dst}, which received {len(received)} from it"
                )
            a, b = every_rank[src][sent[k]], every_rank[dst][received[k]]
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                raise ValueError(
                    f"rank {src}'s call {sent[k]} ({_describe(a)} to rank {dst}) meets rank {dst}'s call "
                    f"{received[k]} ({_describe(b)})"
                )
            members.append([(src, sent[k]), (dst, received[k])])
    counts = {len(indices) for indices in collectives}
    if len(counts) > 1:
        raise ValueError(f"the ranks called different numbers of collectives: {[len(c) for c in collectives]}")
    for k in range(counts.pop() if counts else 0):
        ops = [every_rank[rank][collectives[rank][k]].op for rank in range(size)]
        if len(set(ops)) > 1:
            raise ValueError(f"the ranks' collective {k} is not one call: {ops} (rank order)")
        members.append([(rank, collectives[rank][k]) for rank in range(size)])
    for message, ends in enumerate(members):
        for rank, i in ends:
            message_of[rank][i] = message

    transfers: list[list[list[int]]] = []
    start = [0] * size
    while True:
        seed = next((rank for rank in range(size) if start[rank] < len(every_rank[rank])), None)
        if seed is None:
            return transfers
        end = list(start)  # per rank, one past its last call in the transfer
        taken = {message_of[seed][start[seed]]}
        pending = list(taken)
        while pending:
            for rank, i in members[pending.pop()]:
                while end[rank] <= i:  # the rank's calls before this one go with it
                    message = message_of[rank][end[rank]]
                    end[rank] += 1
                    if message not in taken:
                        taken.add(message)
                        pending.append(message)
        transfers.append([list(range(a, b)) for a, b in zip(start, end, strict=True)])
        start = end


def _consecutive_p2p(sent: Sequence[SentCollective]) -> list[list[int]]:
    """One transfer per collective, and one per run of consecutive sends and receives."""
    transfers: list[list[int]] = []
    for i, collective in enumerate(sent):
        if collective.op in _P2P and transfers and sent[transfers[-1][-1]].op in _P2P:
            transfers[-1].append(i)
        else:
            transfers.append([i])
    return transfers


class SentReplay:
    """``sent``'s collectives again on the live default group, with tensors of their shapes.

    One *transfer* is a group of calls issued together, then waited for. ``transfers``: this
    rank's part of each of ``pair_transfers``' transfers (empty where it takes no part), the same
    number on every rank. Without it, one transfer per collective and one per run of consecutive
    sends and receives (as ``batch_isend_irecv`` issues them: a rank waiting for its send before
    it posts the receive its peer sends first would deadlock). All-reduces, all-to-alls, broadcasts, sends and
    receives go as they were sent; a reduce-scatter as the all-reduce of its whole input
    that ProcessGroupGloo runs for it; an all-gather as one all-to-all of its shard repeated
    once per rank (``gather_as_all_to_all``: the same bytes on the link; torch 2.13's gloo
    all-gather in flight beside compute corrupts the heap, which the ceiling's schedule would
    provoke).
    """

    def __init__(
        self, sent: Sequence[SentCollective], group_size: int, transfers: Sequence[Sequence[int]] | None = None
    ) -> None:
        self.sent = list(sent)
        self.group_size = group_size
        self.transfers = [list(t) for t in transfers] if transfers is not None else _consecutive_p2p(self.sent)
        if [i for t in self.transfers for i in t] != list(range(len(self.sent))):
            raise ValueError(f"transfers {self.transfers} are not the {len(self.sent)} calls in order")
        self._tensors = [self._buffers(c) for c in self.sent]

    def _buffers(self, c: SentCollective) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = getattr(torch, c.dtype)
        source = torch.ones(c.shape, dtype=dtype)
        if c.op == "all_gather":
            source = source.repeat(self.group_size, *([1] * (source.dim() - 1)))
            return source, torch.empty_like(source)
        if c.op == "all_to_all":
            rows = sum(c.out_splits) if c.out_splits else c.shape[0] if c.shape else 0
            return source, torch.empty((rows, *c.shape[1:]), dtype=dtype)
        return source, source

    def __len__(self) -> int:
        return len(self.transfers)

    def _issue_one(self, i: int) -> Any:
        c = self.sent[i]
        source, target = self._tensors[i]
        if c.op in ("all_reduce", "reduce_scatter"):
            return dist.all_reduce(source, async_op=True)
        if c.op in ("all_gather", "all_to_all"):
            out_splits = list(c.out_splits) or None
            in_splits = list(c.splits) or None
            return dist.all_to_all_single(target, source, out_splits, in_splits, async_op=True)
        if c.op == "broadcast":
            return dist.broadcast(source, src=int(c.peer or 0), async_op=True)
        if c.op == "send":
            return dist.isend(source, dst=int(c.peer or 0))
        return dist.irecv(source, src=c.peer)

    def issue(self, i: int) -> list[Any]:
        return [self._issue_one(j) for j in self.transfers[i]]

    @staticmethod
    def wait(handles: Sequence[Any]) -> None:
        for work in handles:
            work.wait()

    def __call__(self) -> None:
        for i in range(len(self)):
            self.wait(self.issue(i))


class _Matmuls:
    """Square fp32 matmuls into a preallocated output: stand-in compute of a known cost."""

    SIZE = 256

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = (torch.randn(self.SIZE, self.SIZE, generator=gen) for _ in range(2))
        self.out = torch.empty(self.SIZE, self.SIZE)

    def run(self, count: int) -> None:
        for _ in range(count):
            torch.mm(self.a, self.b, out=self.out)

    def seconds_each(self, count: int = 50) -> float:
        self.run(5)
        return back_to_back_s(lambda: self.run(1), count)


def ceiling_steps(
    replay: Replay,
    compute_s: float,
    agree: Callable[[list[int]], list[int]],
    samples: int = 5,
    alone_s: Sequence[float] | None = None,
    in_flight: Sequence[int] = (1, 2),
) -> tuple[Callable[[], None], dict[int, Callable[[], None]]]:
    """``(compute_alone, overlapped)``: about ``compute_s`` of synthetic matmuls alone, and for
    each depth ``d`` in ``in_flight`` the same matmuls with ``replay``'s collectives issued among
    them: each collective is followed by a share of the matmuls in proportion to its time alone
    (median of ``samples``), and waited for once ``d`` collectives are in flight (``d = 1``: right
    after its own share; ``d = 2``: after the next one's, as dhelix's schedules keep
    ``max_in_flight=2``), the rest at the end.

    Each ``overlapped[d]`` is a schedule with every transfer in flight under compute that does not
    depend on it, nothing else between; the faster depth is the best this step's communication
    and this much compute can have, and its time on the real link is what this machine allows --
    the *ceiling* a rewrite of the step can reach (the CPU the transfers take and the cores they
    share show up here as they do in the step). One collective at a time pays each one's fixed
    cost in series, which a step of many small collectives (a data-parallel step's per-parameter
    gathers) does not have to; two at a time share the link between them. ``agree(counts)``: the
    element-wise maximum over ranks, so every rank runs the same matmul counts (called once
    for the count from one matmul's time, then once per calibration loop: ``_calibrated_count``);
    every rank must call this together. ``alone_s``: the collectives' times alone, if already known (then only the
    matmuls are timed). The matmuls are small enough to stay in cache, so if anything the
    ceiling is optimistic.
    """
    if not in_flight or min(in_flight) < 1:
        raise ValueError(f"in_flight must list depths >= 1, got {list(in_flight)}")
    alone = list(alone_s) if alone_s is not None else times_alone(replay, samples)
    matmuls = _Matmuls()
    total = _calibrated_count(matmuls, compute_s, agree)
    counts = _shares(total, alone)

    def compute_alone() -> None:
        matmuls.run(sum(counts))

    def overlapped(depth: int) -> None:
        pending: deque[list[Any]] = deque()
        for i, count in enumerate(counts):
            pending.append(replay.issue(i))
            matmuls.run(count)
            while len(pending) >= depth:
                replay.wait(pending.popleft())
        while pending:
            replay.wait(pending.popleft())

    return compute_alone, {depth: functools.partial(overlapped, depth) for depth in in_flight}


#: ``_calibrated_count``: the loop is timed again until the count moves by at most this share ...
CALIBRATION_TOLERANCE = 0.02
#: ... or this many times
CALIBRATION_ROUNDS = 4


def _calibrated_count(matmuls: _Matmuls, compute_s: float, agree: Callable[[list[int]], list[int]]) -> int:
    """How many of ``matmuls`` take ``compute_s``, the same count on every rank (``agree``).

    A first count from one matmul's time, then corrected by the loop's own time, again until the
    count settles (``CALIBRATION_TOLERANCE``, at most ``CALIBRATION_ROUNDS`` loops): a lone matmul
    timed while the other ranks do something else runs at another speed than a long loop of them,
    and one loop timed while the machine was still busy with something else (a rank writing its
    profiles, a transfer's tail) counted 12% too few matmuls (the MoE layer's ceiling on
    2026-11-26: 221 ms of matmuls for a 251 ms ``T_compute``).
    """
    total = agree([max(round(compute_s / matmuls.seconds_each()), 1)])[0]
    for _ in range(CALIBRATION_ROUNDS):
        start = time.perf_counter()
        matmuls.run(total)
        corrected = agree([max(round(total * compute_s / (time.perf_counter() - start)), 1)])[0]
        settled = abs(corrected - total) <= CALIBRATION_TOLERANCE * total
        total = corrected
        if settled:
            break
    return total


def _shares(count: int, weights: Sequence[float]) -> list[int]:
    """``count`` split in proportion to ``weights`` (rounded cumulatively, so the parts sum to it)."""
    total = sum(weights)
    if total <= 0:
        return [count if i == 0 else 0 for i in range(len(weights))]
    bounds, cumulative = [0], 0.0
    for w in weights:
        cumulative += w
        bounds.append(round(count * cumulative / total))
    return [b - a for a, b in itertools.pairwise(bounds)]


def times_alone(replay: Replay, samples: int) -> list[float]:
    """Each collective's time issued and waited alone: the median of ``samples`` after a warm-up."""
    cpu = torch.device("cpu")

    def alone(i: int) -> None:
        replay.wait(replay.issue(i))

    return [median_run_s(functools.partial(alone, i), 1, samples, cpu) for i in range(len(replay))]
