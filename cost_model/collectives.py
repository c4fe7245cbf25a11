"""Alpha-beta time models for collectives and point-to-point transfers.

Contract
--------
Pure functions of (op, bytes, group size, link, algorithm, backend). ``nbytes`` follows
the nccl-tests convention (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md),
i.e. it is the size of the *full* buffer ``S``:

=================  ==========================================
op                 S
=================  ==========================================
all_reduce         the tensor being reduced (input = output)
all_gather         the gathered output (``n`` x the input)
reduce_scatter     the full input (``n`` x the output)
all_to_all         the input of one rank (all its chunks)
broadcast          the tensor broadcast
send / recv        the message
=================  ==========================================

Every model has the form ``T = base + steps * alpha + wire_bytes / B`` with ``alpha`` the
link's per-hop latency, ``B`` its per-direction bandwidth and ``wire_bytes`` the bytes
that one rank pushes through its link (:func:`collective_bytes_on_wire`). For ``n``
ranks (``n == 1`` costs nothing):

NCCL (``backend="nccl"``), from the ring/tree cost model in NCCL ``src/graph/tuning.cc``
(``nsteps``, ``ratio`` and ``hwLat``) and the bus-bandwidth factors of nccl-tests
PERFORMANCE.md::

    all_reduce      ring   steps 2(n-1)           wire 2(n-1)/n * S
                    tree   steps 2*ceil(log2 n)   wire 2 * S       (tuning.cc: tree algBw = busBw/2)
    all_gather      ring   steps n-1              wire (n-1)/n * S
    reduce_scatter  ring   steps n-1              wire (n-1)/n * S
    all_to_all      pairwise steps n-1            wire (n-1)/n * S
    broadcast       ring (pipelined chain) steps n-1   wire S
    send / recv     steps 1                       wire S

plus a fixed ``NCCL_BASE_LATENCY_S`` per NCCL operation, P2P included (``baseLat`` Ring/Simple).

gloo (``backend="gloo"``), from the algorithms ProcessGroupGloo calls::

    all_reduce      ring (gloo/allreduce.cc, ring)             steps 2(n-1)   wire 2(n-1)/n * S
    all_gather      ring (gloo/allgather.cc)                   steps n-1      wire (n-1)/n * S
    reduce_scatter  sent as an all-to-all of the input, summed after the wait
                    (``graph_passes.gloo_collectives``: gloo's own clones and all-reduces the
                    whole input, twice the bytes, ProcessGroupGloo::reduce_scatter_tensor_coalesced,
                    pytorch#118911)                            steps n-1      wire (n-1)/n * S
    all_to_all      pairwise (gloo/alltoall.cc)                steps n-1      wire (n-1)/n * S
    broadcast       binomial tree (gloo/broadcast.cc)          steps ceil(log2 n)
                                                               wire ceil(log2 n) * S
    send / recv     steps 1                                    wire S

``algorithm="tree"`` only changes all-reduce on NCCL (the only collective NCCL runs on a
tree); ``"auto"`` takes the faster of ring and tree for it, like NCCL's tuner.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Literal, TypeAlias

import sympy
import torch

from cost_model.hardware import Link

aten = torch.ops.aten

CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv"]
Algorithm = Literal["ring", "tree", "auto"]
Backend = Literal["nccl", "gloo"]

COLLECTIVE_OP_NAMES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "send",
    "recv",
)

#: Fixed cost of one NCCL collective, NCCL ``src/graph/tuning.cc`` ``baseLat`` for
#: Ring/Simple (8.4 us). gloo has no kernel launch: its fixed costs are in the link latency.
NCCL_BASE_LATENCY_S: float = 8.4e-6
GLOO_BASE_LATENCY_S: float = 0.0

Bytes: TypeAlias = int | float | sympy.Expr


def _ceil_log2(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def alpha_beta_terms(
    op: str,
    group_size: int,
    algorithm: Algorithm = "ring",
    backend: Backend = "nccl",
) -> tuple[int, Fraction]:
    """``(steps, wire_factor)`` of a collective: ``T = base + steps*alpha + factor*S/B``.

    ``algorithm`` must be ``"ring"`` or ``"tree"`` here (``"auto"`` is resolved by
    :func:`collective_time_s`, which needs sizes).
    """
    if op not in COLLECTIVE_OP_NAMES:
        raise ValueError(f"unknown collective {op!r}; expected one of {COLLECTIVE_OP_NAMES}")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"unknown backend {backend!r}; expected 'nccl' or 'gloo'")
    if algorithm not in ("ring", "tree"):
        raise ValueError(f"algorithm must be 'ring' or 'tree' here, got {algorithm!r}")
    n = int(group_size)
    if n < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if op in ("send", "recv"):
        return 1, Fraction(1)
    if n == 1:
        return 0, Fraction(0)
    ring_share = Fraction(n - 1, n)
    if op == "all_reduce":
        if algorithm == "tree" and backend == "nccl":
            return 2 * _ceil_log2(n), Fraction(2)
        return 2 * (n - 1), 2 * ring_share
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return n - 1, ring_share
    # broadcast
    if backend == "gloo":
        depth = _ceil_log2(n)
        return depth, Fraction(depth)
    return n - 1, Fraction(1)


def base_latency_s(backend: Backend) -> float:
    """Fixed per-collective cost of the backend (see module docstring)."""
    return NCCL_BASE_LATENCY_S if backend == "nccl" else GLOO_BASE_LATENCY_S


def collective_bytes_on_wire(
    op: str,
    nbytes: Bytes,
    group_size: int,
    algorithm: Algorithm = "ring",
    backend: Backend = "nccl",
) -> Bytes:
    """Bytes one rank sends over its link: ``wire_factor * S`` (see module docstring).

    ``"auto"`` counts the ring algorithm's bytes. Returns an ``int``/``float`` for
    numeric ``nbytes``, a sympy expression for symbolic ``nbytes``.
    """
    algo = "ring" if algorithm == "auto" else algorithm
    _, factor = alpha_beta_terms(op, group_size, algo, backend)
    if isinstance(nbytes, sympy.Basic):
        return sympy.Rational(factor.numerator, factor.denominator) * nbytes
    value = factor * Fraction(nbytes)
    return int(value) if value.denominator == 1 else float(value)


def _candidate_algorithms(op: str, algorithm: Algorithm, backend: Backend) -> tuple[Literal["ring", "tree"], ...]:
    """The algorithms ``algorithm`` stands for: "auto" is ring and tree for NCCL all-reduce."""
    if algorithm != "auto":
        return (algorithm,)
    return ("ring", "tree") if (op == "all_reduce" and backend == "nccl") else ("ring",)


def collective_time_expr(
    op: str,
    nbytes: Bytes,
    group_size: int,
    link: Link,
    algorithm: Algorithm = "ring",
    backend: Backend = "nccl",
) -> sympy.Expr:
    """:func:`collective_time_s` as a sympy expression (``nbytes`` may be symbolic)."""
    if int(group_size) == 1 and op not in ("send", "recv"):
        return sympy.Integer(0)
    algos = _candidate_algorithms(op, algorithm, backend)
    size = nbytes if isinstance(nbytes, sympy.Basic) else sympy.Float(float(nbytes))
    times = []
    for algo in algos:
        steps, factor = alpha_beta_terms(op, group_size, algo, backend)
        times.append(
            sympy.Float(base_latency_s(backend) + steps * link.latency_s)
            + sympy.Rational(factor.numerator, factor.denominator) * size / sympy.Float(link.bandwidth_bytes_per_s)
        )
    return times[0] if len(times) == 1 else sympy.Min(*times)


def collective_time_s(
    op: str,
    nbytes: float,
    group_size: int,
    link: Link,
    algorithm: Algorithm = "ring",
    backend: Backend = "nccl",
) -> float:
    """Seconds for one collective: ``base + steps*alpha + wire_factor*S/B``.

    ``algorithm="auto"`` returns the faster of ring and tree for NCCL all-reduce (ring
    for everything else). A group of one rank costs nothing (no transfer is issued).
    """
    if int(group_size) == 1 and op not in ("send", "recv"):
        return 0.0
    best = math.inf
    for algo in _candidate_algorithms(op, algorithm, backend):
        steps, factor = alpha_beta_terms(op, group_size, algo, backend)
        t = (
            base_latency_s(backend)
            + steps * link.latency_s
            + float(factor) * float(nbytes) / link.bandwidth_bytes_per_s
        )
        best = min(best, t)
    return best
