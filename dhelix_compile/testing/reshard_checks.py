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
import math
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
    "INCONSISTENT_MESH",
    "LAYOUT_PAIRS",
    "PERMUTED_LAYOUT_PAIRS",
    "FuzzCase",
    "check_dtypes_and_errors",
    "check_every_layout_pair",
    "check_fuzzed_cases",
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

#: Meshes that list their ranks out of ascending order along a dim, where torch's collectives place
#: tiles by each dim group's sorted ranks, not by ``get_coordinate()`` (``dhelix_compile.mesh_positions``):
#: the same ranks reversed, 4 -> a 2x2 listed backwards, disjoint and overlapping permuted meshes.
#: Shapes that every mesh of the pair shards evenly: torch itself places uneven shards on such a
#: mesh inconsistently, and ``reshard`` refuses them (``check_reshard_errors``, the fuzz test).
PERMUTED_LAYOUT_PAIRS: dict[str, tuple[list[Any], list[Any]]] = {
    "reversed": ([0, 1, 2, 3], [3, 2, 1, 0]),
    "4_to_2x2_reversed": ([2, 0, 3, 1], [[3, 2], [1, 0]]),
    "disjoint_permuted": ([1, 0], [3, 2]),
    "overlapping_permuted": ([2, 0, 1], [3, 1]),
}
_PERMUTED_SHAPES: dict[str, tuple[int, ...]] = {
    "reversed": (4, 8),
    "4_to_2x2_reversed": (4, 8),
    "disjoint_permuted": (4, 6),
    "overlapping_permuted": (6, 12),
}

#: A mesh on which torch's collectives put two ranks at one tile position: refused.
INCONSISTENT_MESH: list[Any] = [[0, 3], [2, 1]]

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
    if tile is None:  # as many dims as the tensor: from_local reads Shard(-1) by the local tensor's
        return full.new_empty((0,) * full.dim())
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            k = mesh.size(mesh_dim)
            noise = _tile(_integers(full.shape, seed + 7, full.dtype), mesh, placements)
            assert noise is not None
            tile = tile - (k - 1) * noise if mesh.get_local_rank(mesh_dim) == 0 else noise
    return tile


def _integers(shape: Sequence[int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, tuple(shape), generator=gen).to(dtype)


def _mesh(ranks: list[Any]) -> DeviceMesh:
    return DeviceMesh("cpu", torch.tensor(ranks))


def check_layout_pair(rank: int, world_size: int, pair: str) -> dict[str, Any]:
    """Every placement pair of ``LAYOUT_PAIRS[pair]`` (or ``PERMUTED_LAYOUT_PAIRS[pair]``), forward
    and backward, then a second pass over them that must create no process group; returns the
    failures (empty when all equal)."""
    src_ranks, dst_ranks = {**LAYOUT_PAIRS, **PERMUTED_LAYOUT_PAIRS}[pair]
    shape = _PERMUTED_SHAPES.get(pair, (5, 7))
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
        "placement_not_list": lambda: reshard(x, mesh_b, Shard(0)),  # type: ignore[arg-type]
        "inconsistent_mesh": lambda: reshard(x, _mesh(INCONSISTENT_MESH), [Shard(0), Shard(1)]),
        "uneven_on_permuted_mesh": lambda: reshard(
            distribute_tensor(torch.zeros(5, 3), mesh_a, [Shard(0)]), _mesh([3, 2, 1, 0]), [Shard(0)]
        ),
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


def check_every_layout_pair(
    rank: int, world_size: int, pairs: Sequence[str] = tuple(LAYOUT_PAIRS)
) -> dict[str, dict[str, Any]]:
    """``check_layout_pair`` for every pair named (by default every entry of ``LAYOUT_PAIRS``), in
    one launch of the ranks."""
    return {pair: check_layout_pair(rank, world_size, pair) for pair in pairs}


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


#: One fuzzed case: (source mesh, destination mesh) as nested rank lists, source and destination
#: placements, the global shape, the dtype's name and a seed.
FuzzCase = tuple[list[Any], list[Any], tuple[Placement, ...], tuple[Placement, ...], tuple[int, ...], str, int]


def check_fuzzed_cases(rank: int, world_size: int, cases: Sequence[FuzzCase]) -> list[str]:
    """Each case against torch as the oracle, on every rank of the world; returns the failures.

    torch decides what is right: where its own ``distribute_tensor`` then ``full_tensor()`` returns
    the tensor on both layouts (agreed over the world), ``reshard`` must give every destination rank
    ``distribute_tensor``'s tile, ``full_tensor()`` the tensor, and (floating dtypes) every source
    rank the gradient ``distribute_tensor`` lays out on the source. Where torch loses the tensor on
    either layout (uneven shards on a mesh listing its ranks out of order, two ranks at one tile
    position), ``reshard`` must raise ``ReshardError`` on every rank of the two meshes.
    """
    from dhelix_compile.resharding import ReshardError

    meshes: dict[str, DeviceMesh] = {}

    def mesh_of(ranks: list[Any]) -> DeviceMesh:  # every rank makes every mesh, in one order
        return meshes.setdefault(str(ranks), _mesh(ranks))

    failures: list[str] = []
    for i, (src_ranks, dst_ranks, src, dst, shape, dtype_name, seed) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        mesh_a, mesh_b = mesh_of(src_ranks), mesh_of(dst_ranks)
        full = (_integers(shape, seed, torch.float32) / 8 + _integers(shape, seed + 3, torch.float32)).to(dtype)
        torch_holds_it = _torch_round_trips(shape, mesh_a, src) & _torch_round_trips(shape, mesh_b, dst)
        name = f"case {i}: {src_ranks} {list(src)} -> {dst_ranks} {list(dst)}, {list(shape)} {dtype_name}"
        union = {int(r) for r in (*mesh_a.mesh.flatten().tolist(), *mesh_b.mesh.flatten().tolist())}
        if rank not in union:
            continue
        try:
            failures += _fuzzed_case(rank, full, mesh_a, mesh_b, src, dst, seed, name, torch_holds_it)
        except ReshardError as e:
            if torch_holds_it:
                failures.append(f"rank {rank} {name}: refused a layout torch holds: {e}")
    dist.barrier()
    return failures


def _torch_round_trips(shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]) -> bool:
    """Whether torch holds a tensor of ``shape`` in ``placements`` on ``mesh`` as one tensor:
    ``distribute_tensor(full).full_tensor()`` is ``full`` on every rank of the mesh, and where a
    dim is ``Partial()``, parts that sum to ``full`` (``_source``) reduced by torch's own
    ``redistribute`` to ``Replicate()`` are ``full`` too. Agreed over the world (a collective: every
    rank calls it). ``full`` holds distinct non-zero values (torch pads shards with zeros), so
    that no misplaced tile goes unseen."""
    full = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(tuple(shape))
    ok = torch.ones(1, dtype=torch.int64)
    if mesh.get_coordinate() is not None:
        plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
        try:
            ok[0] = int(torch.equal(distribute_tensor(full, mesh, plain).full_tensor(), full))
            if any(isinstance(p, Partial) for p in placements):
                parts = DTensor.from_local(
                    _source(full, mesh, placements, 0),
                    mesh,
                    placements,
                    run_check=False,
                    shape=full.shape,
                    stride=full.stride(),
                )
                ok[0] &= int(torch.equal(parts.redistribute(mesh, plain).full_tensor(), full))
        except RuntimeError:  # torch's collectives refuse the layout (mismatched sizes): it does not hold it
            ok[0] = 0
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _fuzzed_case(
    rank: int,
    full: torch.Tensor,
    mesh_a: DeviceMesh,
    mesh_b: DeviceMesh,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    seed: int,
    name: str,
    torch_holds_it: bool,
) -> list[str]:
    differentiable = full.dtype.is_floating_point
    local = _source(full, mesh_a, src, seed)
    if differentiable:
        local.requires_grad_()
    x = DTensor.from_local(local, mesh_a, src, run_check=False, shape=full.shape, stride=full.stride())
    y = reshard(x, mesh_b, dst)
    assert isinstance(y, DTensor)
    if not torch_holds_it:
        return [f"rank {rank} {name}: returned a tensor where torch loses it (a ReshardError was due)"]
    failures = []
    want = _tile(full, mesh_b, dst)
    weight = torch.randn(full.shape, generator=torch.Generator().manual_seed(seed + 1)).to(full.dtype)
    if want is not None:
        got = y.to_local()
        if got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"rank {rank} {name}: tile differs from distribute_tensor's")
        if not torch.equal(y.full_tensor(), full):
            failures.append(f"rank {rank} {name}: full_tensor() differs")
    if not differentiable:
        return failures
    w = _tile(weight, mesh_b, dst)
    if w is None:
        y.backward(torch.zeros_like(y))
    else:
        (y.to_local() * w).sum().backward()
    want_grad = _tile(weight, mesh_a, src)
    if want_grad is not None and (local.grad is None or not torch.equal(local.grad, want_grad)):
        failures.append(f"rank {rank} {name}: gradient differs")
    return failures
