"""Resharding microbenchmarks: a DTensor from one mesh to another, three ways, on 4 ranks.

    python -m dhelix_compile.bench.reshard --rate 1gbit --sizes-mb 1,4,16,64 --repeats 3

Every rank runs in a network namespace of its own, its link rate-limited each way (``tc tbf``;
loopback where namespaces cannot be made, and the output says so). For each layout pair and
tensor size (float32, 1024 columns), the variants run interleaved, ``--repeats`` times each:

    naive     the first source rank gathers the tensor (point-to-point from every tile's first
              replica), sends it whole to every destination rank, which slices its tile
    per_tile  every piece of the plan, from its source tile's first replica, sent point to point
              to every destination rank that needs it (no broadcasts, no load balancing)
    dhelix    ``dhelix_compile.reshard``: one broadcast per piece, senders balanced over replicas

Time: from a barrier to a barrier (the slowest rank), the median. Bytes: what the busiest rank's
link carries in its busier direction, a broadcast counted once per receiver (a root that sends
to each receiver; a ring broadcast such as NCCL's would send once). Every variant's result is
checked against the full tensor cut for the destination.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from dhelix_compile.resharding import reshard
from dhelix_compile.resharding.plan import Box, MeshLayout, ReshardPlan, plan_reshard

__all__ = ["LAYOUTS", "VARIANTS", "link_bytes", "main"]

VARIANTS = ("naive", "per_tile", "dhelix")
_COLUMNS = 1024

#: name -> ((source mesh, placements), (destination mesh, placements)).
LAYOUTS: dict[str, tuple[tuple[Any, tuple[Placement, ...]], tuple[Any, tuple[Placement, ...]]]] = {
    "[0,1] S(0) -> [2,3] S(1)": (([0, 1], (Shard(0),)), ([2, 3], (Shard(1),))),
    "2x2 (R,S(1)) -> 4 S(0)": (([[0, 1], [2, 3]], (Replicate(), Shard(1))), ([0, 1, 2, 3], (Shard(0),))),
    "[0,1,2] S(0) -> [1,2,3] R": (([0, 1, 2], (Shard(0),)), ([1, 2, 3], (Replicate(),))),
}


def link_bytes(plan: ReshardPlan, variant: str) -> int:
    """Bytes on the busiest rank's link, its busier direction, for ``variant`` of ``plan``'s move."""
    out: dict[int, int] = {}
    into: dict[int, int] = {}

    def send(src: int, dst: int, nbytes: int) -> None:
        if src != dst:
            out[src] = out.get(src, 0) + nbytes
            into[dst] = into.get(dst, 0) + nbytes

    if variant == "naive":
        root = plan.source.ranks[0]
        full = plan.itemsize * math.prod(plan.global_shape)
        for box, rank in _first_replicas(plan).items():
            send(rank, root, box.numel * plan.itemsize)
        for rank in plan.dest.ranks:
            send(root, rank, full)
    else:
        for piece in plan.pieces:
            for rank in piece.receivers:
                send(piece.sender, rank, piece.nbytes)
    return max([*out.values(), *into.values(), 0])


def _first_replicas(plan: ReshardPlan) -> dict[Box, int]:
    """Every source tile and the lowest rank holding it (the naive variants' sender)."""
    return {box: rank for rank, box in sorted(plan.source_tiles.items(), reverse=True)}


def _mesh(ranks: Any) -> DeviceMesh:
    return DeviceMesh("cpu", torch.tensor(ranks))


def _layout(ranks: Any, placements: tuple[Placement, ...]) -> MeshLayout:
    grid = torch.tensor(ranks)
    return MeshLayout(tuple(grid.shape), tuple(int(r) for r in grid.flatten().tolist()), placements)


def _naive(x: DTensor, plan: ReshardPlan, rank: int) -> torch.Tensor:
    root = plan.source.ranks[0]
    shape = plan.global_shape
    first_replica = _first_replicas(plan)
    full = torch.empty(shape) if rank == root or rank in plan.dest_tiles else None
    works = []
    for box, sender in first_replica.items():
        if box.numel == 0:
            continue
        if rank == sender and rank != root:
            works.append(dist.isend(x.to_local().contiguous(), root))
        if rank == root:
            assert full is not None
            if sender == root:
                full[box.within(_whole(shape))] = x.to_local()
            else:
                buf = torch.empty(box.shape)
                dist.recv(buf, sender)
                full[box.within(_whole(shape))] = buf
    for w in works:
        _wait(w)
    works = []
    for dest in plan.dest.ranks:
        if dest == root:
            continue
        if rank == root:
            assert full is not None
            works.append(dist.isend(full, dest))
        elif rank == dest:
            assert full is not None
            dist.recv(full, root)
    for w in works:
        _wait(w)
    tile = plan.dest_tiles.get(rank)
    if tile is None:
        return torch.empty(0)
    assert full is not None
    return full[tile.within(_whole(shape))].clone()


def _wait(work: dist.Work | None) -> None:
    if work is not None:
        work.wait()


def _whole(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), shape)


def _per_tile(x: DTensor, plan: ReshardPlan, rank: int) -> torch.Tensor:
    tile = plan.dest_tiles.get(rank)
    out = torch.empty(tile.shape) if tile is not None else torch.empty(0)
    works, received = [], []
    local = x.to_local()
    for piece in plan.pieces:
        src = piece.box.within(piece.source_tile)
        for dest in piece.receivers:
            if dest == piece.sender == rank:
                assert tile is not None
                out[piece.box.within(tile)] = local[src]
            elif rank == piece.sender:
                works.append(dist.isend(local[src].contiguous(), dest))
            elif rank == dest:
                buf = torch.empty(piece.box.shape)
                works.append(dist.irecv(buf, piece.sender))
                received.append((piece, buf))
    for w in works:
        _wait(w)
    for piece, buf in received:
        assert tile is not None
        out[piece.box.within(tile)] = buf
    return out


def _bench(rank: int, world_size: int, sizes_mb: list[int], repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, ((src_ranks, src), (dst_ranks, dst)) in LAYOUTS.items():
        mesh_a, mesh_b = _mesh(src_ranks), _mesh(dst_ranks)
        for size in sizes_mb:
            rows = size * 2**20 // (4 * _COLUMNS)
            full = torch.arange(rows * _COLUMNS, dtype=torch.float32).view(rows, _COLUMNS)
            x = distribute_tensor(full, mesh_a, src)
            naive_plan = plan_reshard(full.shape, _layout(src_ranks, src), _layout(dst_ranks, dst), 4, balanced=False)
            want = distribute_tensor(full, mesh_b, dst).to_local() if mesh_b.get_coordinate() is not None else None
            runs: dict[str, Any] = {
                "naive": lambda x=x, p=naive_plan: _naive(x, p, rank),
                "per_tile": lambda x=x, p=naive_plan: _per_tile(x, p, rank),
                "dhelix": lambda x=x, mesh_b=mesh_b, dst=dst: _as_local(reshard(x, mesh_b, dst)),
            }
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            correct = dict.fromkeys(VARIANTS, True)
            for i in range(repeats + 1):  # the first round warms up (groups, plans): not timed
                for variant in VARIANTS[i % 3 :] + VARIANTS[: i % 3]:
                    dist.barrier()
                    start = time.perf_counter()
                    got = runs[variant]()
                    dist.barrier()
                    if i > 0:
                        times[variant].append(time.perf_counter() - start)
                    if want is not None and not torch.equal(got, want):
                        correct[variant] = False
            results[f"{name} | {size}"] = {"s": {v: statistics.median(t) for v, t in times.items()}, "ok": correct}
    return results


def _as_local(y: Any) -> torch.Tensor:
    return y.to_local() if y.device_mesh.get_coordinate() is not None else torch.empty(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="every rank's link, each way (tc rate); 'none': loopback")
    parser.add_argument("--sizes-mb", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from dhelix_compile.bench import reshard as this  # the ranks import the function by module name
    from dhelix_compile.launch.link import LinkSpec, can_rate_limit
    from dhelix_compile.testing.multirank import run_on_ranks

    sizes = [int(s) for s in args.sizes_mb.split(",") if s]
    rate = None if args.rate == "none" else args.rate
    link = LinkSpec(rate=rate)
    where = f"4 ranks, every rank's link {rate} each way" if rate and can_rate_limit()[0] else "4 ranks on loopback"
    per_rank = run_on_ranks(this._bench, 4, sizes, args.repeats, timeout_s=args.timeout_s, link=link, forked=False)
    print(f"reshard microbenchmarks: {where}, float32, {_COLUMNS} columns, median of {args.repeats}")
    print("| layout | MB | naive ms | per_tile ms | dhelix ms | naive MB | per_tile MB | dhelix MB | correct |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for key in per_rank[0]:
        name, size = key.rsplit(" | ", 1)
        (src_ranks, src), (dst_ranks, dst) = LAYOUTS[name]
        seconds = {v: max(r[key]["s"][v] for r in per_rank) for v in VARIANTS}
        ok = all(all(r[key]["ok"].values()) for r in per_rank)
        nrows = int(size) * 2**20 // (4 * _COLUMNS)
        shape = (nrows, _COLUMNS)
        source, dest = _layout(src_ranks, src), _layout(dst_ranks, dst)
        plans = {
            "naive": plan_reshard(shape, source, dest, 4, balanced=False),
            "per_tile": plan_reshard(shape, source, dest, 4, balanced=False),
            "dhelix": plan_reshard(shape, source, dest, 4),
        }
        mb = {v: link_bytes(p, v) / 2**20 for v, p in plans.items()}
        print(
            f"| {name} | {size} | "
            + " | ".join(f"{seconds[v] * 1e3:.0f}" for v in VARIANTS)
            + " | "
            + " | ".join(f"{mb[v]:.1f}" for v in VARIANTS)
            + f" | {'yes' if ok else 'NO'} |"
        )
        rows.append({"layout": name, "mb": int(size), "seconds": seconds, "busiest_link_mb": mb, "correct": ok})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"where": where, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
