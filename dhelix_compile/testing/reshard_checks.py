"""Rank functions that check ``reshard`` against the full tensor, for ``run_on_ranks`` (4 ranks).

Every case builds the source DTensor from a seeded full tensor ``F`` (the same on every rank),
reshards it, and compares each rank's local tile with ``F`` cut the way DTensor cuts it for the
destination layout. The backward sends ``W`` (another seeded full tensor, laid out like the
destination) back: the source's local gradient must be ``W`` cut for the source layout (a
``Partial()`` source dim receives the whole gradient, as torch's ``Partial -> Replicate``).
A ``Partial()`` source holds integer-valued parts: with ``F`` in eighths, they sum to it exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dhelix_compile.resharding import ReshardWork, reshard
from dhelix_compile.resharding.groups import created_group_count

__all__ = [
    "LAYOUT_PAIRS",
    "check_dtypes_and_errors",
    "check_every_layout_pair",
    "check_layout_pair",
    "check_reshard_errors",
    "placement_pairs",
]

#: (source mesh, destination mesh), as nested rank lists: disjoint, 2x2 -> 4, overlapping.
LAYOUT_PAIRS: dict[str, tuple[list[Any], list[Any]]] = {
    "disjoint": ([0, 1], [2, 3]),
    "2x2_to_4": ([[0, 1], [2, 3]], [0, 1, 2, 3]),
    "overlapping": ([0, 1, 2], [1, 2, 3]),
}

_SOURCE_1D: list[Placement] = [Shard(0), Shard(1), Replicate(), Partial()]
_DEST_1D: list[Placement] = [Shard(0), Shard(1), Replicate()]


def placement_pairs(source_ndim: int, dest_ndim: int) -> list[tuple[tuple[Placement, ...], tuple[Placement, ...]]]:
    """Every source placement tuple (at most one ``Partial()``) with every destination one."""
    sources = [
        p for p in itertools.product(_SOURCE_1D, repeat=source_ndim) if sum(isinstance(x, Partial) for x in p) <= 1
    ]
    dests = list(itertools.product(_DEST_1D, repeat=dest_ndim))
    return [(s, d) for s in sources for d in dests]


def _tile(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor | None:
    """This rank's tile of ``full`` (``Partial`` read as ``Replicate``), ``None`` outside the mesh."""
    if mesh.get_coordinate() is None:
        return None
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    return distribute_tensor(full, mesh, plain).to_local()


def _source(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], seed: int) -> torch.Tensor:
    """This rank's local part of ``full`` in ``placements``: integer-valued parts for ``Partial()``."""
    tile = _tile(full, mesh, placements)
    if tile is None:
        return torch.empty(0, dtype=full.dtype)
    coord = mesh.get_coordinate()
    assert coord is not None
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            k = mesh.size(mesh_dim)
            noise = _tile(_integers(full.shape, seed + 7, full.dtype), mesh, placements)
            assert noise is not None
            tile = tile - (k - 1) * noise if coord[mesh_dim] == 0 else noise
    return tile


def _integers(shape: Sequence[int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, tuple(shape), generator=gen).to(dtype)


def _mesh(ranks: list[Any]) -> DeviceMesh:
    return DeviceMesh("cpu", torch.tensor(ranks))


def check_layout_pair(rank: int, world_size: int, pair: str, shape: tuple[int, ...] = (5, 7)) -> dict[str, Any]:
    """Every placement pair of ``LAYOUT_PAIRS[pair]``, forward and backward, then a second pass
    over them that must create no process group; returns the failures (empty when all equal)."""
    src_ranks, dst_ranks = LAYOUT_PAIRS[pair]
    mesh_a, mesh_b = _mesh(src_ranks), _mesh(dst_ranks)
    failures: list[str] = []
    pairs = placement_pairs(mesh_a.ndim, mesh_b.ndim)
    for i, (src, dst) in enumerate(pairs):
        failures += _check_one(rank, mesh_a, mesh_b, src, dst, shape, seed=i, async_op=i % 2 == 1)
    groups = created_group_count()
    for i, (src, dst) in enumerate(pairs[:8]):
        failures += _check_one(rank, mesh_a, mesh_b, src, dst, shape, seed=i, async_op=False)
    return {"failures": failures, "cases": len(pairs), "new_groups_on_repeat": created_group_count() - groups}


def _check_one(
    rank: int,
    mesh_a: DeviceMesh,
    mesh_b: DeviceMesh,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    shape: tuple[int, ...],
    seed: int,
    async_op: bool,
) -> list[str]:
    full = _integers(shape, seed, torch.float32) / 8 + _integers(shape, seed + 3, torch.float32)  # sums exact
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))
    local = _source(full, mesh_a, src, seed).requires_grad_()
    x = DTensor.from_local(local, mesh_a, src, run_check=False, shape=full.shape, stride=full.stride())
    result = reshard(x, mesh_b, dst, async_op=async_op)
    y = result.wait() if isinstance(result, ReshardWork) else result
    name = f"{src} -> {dst}"
    failures = []
    want = _tile(full, mesh_b, dst)
    if want is None:
        y.backward(torch.zeros_like(y))  # outside mesh_b: still sends this rank's share back
    else:
        got = y.to_local()
        if got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"rank {rank} {name}: forward differs")
        w = _tile(weight, mesh_b, dst)
        assert w is not None
        (got * w).sum().backward()
    want_grad = _tile(weight, mesh_a, src)
    if want_grad is not None and (local.grad is None or not torch.equal(local.grad, want_grad)):
        failures.append(f"rank {rank} {name}: gradient differs")
    return failures


def check_dtypes(rank: int, world_size: int) -> list[str]:
    """Forward only, [0, 1] Shard(0) -> [2, 3] Shard(1) and 2x2 -> 4, for several dtypes."""
    failures = []
    for dtype in (torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool):
        full = _integers((6, 5), 3, torch.float32).to(dtype)
        for src_ranks, dst_ranks in (([0, 1], [2, 3]), ([[0, 1], [2, 3]], [0, 1, 2, 3])):
            mesh_a, mesh_b = _mesh(src_ranks), _mesh(dst_ranks)
            src = (Shard(0),) * mesh_a.ndim
            x = distribute_tensor(full, mesh_a, src)  # a placeholder on ranks outside mesh_a
            y = reshard(x, mesh_b, [Shard(1)])
            assert isinstance(y, DTensor)
            want = _tile(full, mesh_b, [Shard(1)])
            if want is not None and not torch.equal(y.to_local(), want):
                failures.append(f"rank {rank} {dtype}: differs")
    return failures


def check_reshard_errors(rank: int, world_size: int) -> dict[str, str]:
    """Bad calls and their messages: none may reach a collective (a rank outside both meshes raises
    before anything is sent)."""
    from dhelix_compile.resharding import ReshardError

    mesh_a, mesh_b = _mesh([0, 1]), _mesh([2, 3])
    full = torch.arange(8.0).view(2, 4)
    x = distribute_tensor(full, mesh_a, [Shard(0)])
    messages = {}
    cases: dict[str, Any] = {
        "not_dtensor": lambda: reshard(full, mesh_b, [Shard(0)]),  # type: ignore[arg-type]
        "placement_count": lambda: reshard(x, mesh_b, [Shard(0), Shard(1)]),
        "shard_dim": lambda: reshard(x, mesh_b, [Shard(2)]),
        "partial_dest": lambda: reshard(x, mesh_b, [Partial()]),
        "disagree": lambda: reshard(x, mesh_b, [Shard(1)] if rank == 3 else [Shard(0)]),
    }
    mesh_c = _mesh([1])  # every rank builds every mesh (DeviceMesh makes its groups with all ranks)
    if rank == 0:  # in neither [1] nor [2, 3]
        placeholder = distribute_tensor(full, mesh_c, [Replicate()])
        cases["neither_mesh"] = lambda: reshard(placeholder, mesh_b, [Shard(0)])
    try:
        other_device = DeviceMesh("cuda", [2, 3], _init_backend=False)
        cases["device_type"] = lambda: reshard(x, other_device, [Shard(0)])
    except Exception:  # noqa: BLE001  # a torch that cannot describe a CUDA mesh here: that case is left out
        pass
    for name, call in cases.items():
        try:
            call()
            messages[name] = "no error"
        except ReshardError as e:
            messages[name] = str(e)
    dist.barrier()
    return messages


def check_every_layout_pair(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """``check_layout_pair`` for every entry of ``LAYOUT_PAIRS``, in one launch of the ranks."""
    return {pair: check_layout_pair(rank, world_size, pair) for pair in LAYOUT_PAIRS}


def check_dtypes_and_errors(rank: int, world_size: int) -> tuple[list[str], dict[str, str]]:
    return check_dtypes(rank, world_size), check_reshard_errors(rank, world_size)


def check_compiled(rank: int, world_size: int, codegen: str = "inductor") -> dict[str, Any]:
    """``reshard`` inside a function compiled by dhelix (``fullgraph=True``): one graph whose
    broadcasts are functional collectives, values and gradients equal to eager, on the three mesh
    pairs' first layouts ([0, 1] Shard(0) -> [2, 3] Shard(1), 2x2 (Replicate, Shard(1)) -> 4
    Shard(0), [0, 1, 2] Partial -> [1, 2, 3] Replicate)."""
    import dhelix_compile

    cases: list[tuple[str, tuple[Placement, ...], tuple[Placement, ...]]] = [
        ("disjoint", (Shard(0),), (Shard(1),)),
        ("2x2_to_4", (Replicate(), Shard(1)), (Shard(0),)),
        ("overlapping", (Partial(),), (Replicate(),)),
    ]
    from torch._dynamo.backends.common import aot_autograd

    aot_graphs: list[str] = []

    def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
        aot_graphs.append(gm.code)
        return gm.forward

    backends = {
        "dhelix": dhelix_compile.backend(codegen=codegen),
        "aot": aot_autograd(fw_compiler=keep, bw_compiler=keep),
    }
    failures = []
    for i, (pair, src, dst) in enumerate(cases):
        src_ranks, dst_ranks = LAYOUT_PAIRS[pair]
        mesh_a, mesh_b = _mesh(src_ranks), _mesh(dst_ranks)
        shape = (6, 4)
        full = _integers(shape, i, torch.float32) / 8
        weight = torch.randn(shape, generator=torch.Generator().manual_seed(i + 1))

        def step(x: DTensor, mesh_b: DeviceMesh = mesh_b, dst: tuple[Placement, ...] = dst) -> DTensor:
            y = reshard(x, mesh_b, dst)  # alone: torch's DTensor ops fail under Dynamo on ranks outside a mesh
            assert isinstance(y, DTensor)
            return y

        outputs = []
        compiled = [torch.compile(step, backend=b, fullgraph=True) for b in backends.values()]
        for fn in (step, *compiled):
            local = _source(full, mesh_a, src, i).requires_grad_()
            if mesh_a.get_coordinate() is None:  # a leaf placeholder: Dynamo refuses from_local's non-leaf one
                x = DTensor.from_local(local.detach(), mesh_a, src, run_check=False, shape=full.shape, stride=(4, 1))
                x.requires_grad_()
            else:
                x = DTensor.from_local(local, mesh_a, src, run_check=False, shape=full.shape, stride=full.stride())
            y = fn(x)
            w = _tile(weight, mesh_b, dst)
            if w is None:
                y.backward(torch.zeros_like(y))
            else:
                (y.to_local() * w).sum().backward()
            outputs.append((y.to_local().detach(), local.grad))
        (eager_y, eager_grad), *others = outputs
        for name, (compiled_y, compiled_grad) in zip(backends, others, strict=True):
            if not torch.equal(eager_y, compiled_y):
                failures.append(f"{pair} {name}: values differ")
            same_grad = (eager_grad is None and compiled_grad is None) or (
                eager_grad is not None and compiled_grad is not None and torch.equal(eager_grad, compiled_grad)
            )
            if not same_grad:
                failures.append(f"{pair} {name}: gradients differ")
    broadcasts = sum(code.count("_c10d_functional.broadcast.default") for code in aot_graphs)
    return {"failures": failures, "aot_graphs": len(aot_graphs), "broadcasts": broadcasts}
