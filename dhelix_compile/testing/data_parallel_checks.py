"""Rank-side checks of ``data_parallel`` against PyTorch's own DDP and FSDP2.

Contract
--------
``check_data_parallel(rank, world_size, mode, runner, tp=1, model="reference", ...)`` runs on every
rank of an initialised default process group (``run_on_ranks``) and

1. builds the mesh: ``(dp,)`` or ``(dp, tp)`` named ``("dp", "tp")``, ``dp = world_size // tp``,
   its ranks ascending or as ``mesh_ranks`` lists them (``[1, 0]``, ``[[3, 2], [1, 0]]``);
2. builds the model twice (same seeded weights), tensor-parallel over ``mesh["tp"]`` when
   ``tp > 1``, with this DP rank's micro-batches (the TP ranks of one DP rank share them);
3. baseline: PyTorch eager, ``DistributedDataParallel`` for ``mode="replicate"`` without TP or
   mixed precision, FSDP2 ``fully_shard`` (each block, then the root) otherwise, with the same
   ``MixedPrecisionPolicy`` when ``param_dtype`` is given; loop ``loss(mb).backward()``;
4. dhelix: ``data_parallel(model, mesh["dp"], mode, ...)`` run by ``runner``: ``"eager"`` (the same
   loop), ``"dhelix"`` (the loop over ``torch.compile(model, backend="dhelix")``) or ``"helix"``;
   both loops reduce replicated gradients once per step (DDP's ``no_sync`` /
   ``set_requires_gradient_sync`` on every micro-batch but the last), as ``helix`` does itself;
5. compares losses, full gradients (``full_tensor``) and, after one ``AdamW`` step on each, full
   parameters; checks that names and order are the unwrapped model's, that each parameter and
   its gradient are DTensors of one layout on the DP mesh (2-D with TP), and, before training,
   that each stored parameter is the one torch reads: its ``full_tensor()`` (torch's all-gathers,
   which put tile ``i`` on the group's ``i``-th rank) equals the unwrapped parameter, and its
   local shape is the DTensor's own (``compute_local_shape_and_global_offset``).

``check_uneven_tensor_parallel`` trains a small MLP whose TP shards are uneven (``[5, 4]`` over 2
TP ranks) and compares it with the unwrapped MLP run eagerly on every DP rank's batch.

It returns a picklable report and raises ``AssertionError`` naming every mismatch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from dhelix_compile.testing.helix_checks import full_grads, full_tensor

Runner = Literal["eager", "dhelix", "helix"]
ModelName = Literal["reference", "hf_llama"]

_DTYPES = {None: None, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _mesh(world_size: int, tp: int, listed: Any = None) -> DeviceMesh:
    """``(dp,)`` or ``(dp, tp)``, its ranks ascending, or as ``listed`` gives them (nested)."""
    if world_size % tp:
        raise ValueError(f"world_size {world_size} is not a multiple of tp={tp}")
    names = ("dp",) if tp == 1 else ("dp", "tp")
    if listed is not None:
        mesh = DeviceMesh("cpu", listed, mesh_dim_names=names)
        if tuple(mesh.shape) != ((world_size,) if tp == 1 else (world_size // tp, tp)):
            raise ValueError(f"mesh {listed} is not a ({world_size // tp}, {tp}) mesh of {world_size} ranks")
        return mesh
    if tp == 1:
        return init_device_mesh("cpu", (world_size,), mesh_dim_names=names)
    return init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=names)


def _build(model: ModelName, mesh: DeviceMesh, tp: int) -> tuple[nn.Module, list[nn.Module]]:
    """The model (tensor-parallel when ``tp > 1``) and its blocks (FSDP2's units)."""
    if model == "reference":
        from dhelix_compile.models.llama import ModelConfig, Transformer
        from dhelix_compile.models.tensor_parallel import parallelize_tp

        ref = Transformer(ModelConfig())
        if tp > 1:
            parallelize_tp(ref, mesh["tp"])
        return ref, list(ref.layers)
    from dhelix_compile.models.hf_llama import build_hf_llama, parallelize_hf_llama

    hf = build_hf_llama("tiny")
    if tp > 1:
        parallelize_hf_llama(hf, mesh["tp"], sequence_parallel=False)
    return hf, list(hf.model.layers)  # type: ignore[union-attr,arg-type]


def _microbatches(model: ModelName, dp_rank: int, n: int) -> tuple[list[Any], Callable[[nn.Module, Any], Any]]:
    generator = torch.Generator().manual_seed(1000 + dp_rank)
    if model == "reference":
        from dhelix_compile.models.llama import ModelConfig, lm_loss

        config = ModelConfig()
        shape = (2, config.max_seq_len)
        mbs = [
            (
                torch.randint(0, config.vocab_size, shape, generator=generator),
                torch.randint(0, config.vocab_size, shape, generator=generator),
            )
            for _ in range(n)
        ]
        return mbs, lambda m, mb: lm_loss(m(mb[0]), mb[1])
    from dhelix_compile.models.hf_llama import hf_llama_batches, hf_llama_loss

    return hf_llama_batches("tiny", n, generator), hf_llama_loss


def _train(model: nn.Module, run: Callable[[list[Any]], list[torch.Tensor]], mbs: list[Any]) -> dict[str, Any]:
    losses = [loss.detach().float() for loss in run(mbs)]
    grads = full_grads(model)
    # eps well above float noise: Adam's first step is lr * g / (|g| + eps), which would turn a
    # 1e-10 difference in a near-zero gradient (an unused embedding row) into a visible one
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    optimizer.step()
    params = {name: full_tensor(p) for name, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def sync_on_last(model: nn.Module | None) -> Callable[[bool], contextlib.AbstractContextManager[Any]]:
    """``sync(last)``, entered around each micro-batch's forward and backward, so that ``model``'s
    gradients are reduced by the last backward only, as users accumulate gradients: DDP's
    ``no_sync`` before it, ``set_requires_gradient_sync`` for ``data_parallel``; a no-op for any
    other model (FSDP2's reduce-scatter runs every micro-batch)."""

    def sync(last: bool) -> contextlib.AbstractContextManager[Any]:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext() if last else model.no_sync()
        info = vars(model).get("dhelix_data_parallel") if model is not None else None
        if info is not None:
            info.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    return sync


def _loop(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], sync_once: nn.Module | None = None
) -> Callable[[list[Any]], list[torch.Tensor]]:
    """``loss(mb).backward()`` for each micro-batch, gradients reduced by the last backward of
    ``sync_once`` (``sync_on_last``)."""
    sync = sync_on_last(sync_once)

    def run(mbs: list[Any]) -> list[torch.Tensor]:
        losses = []
        for k, mb in enumerate(mbs):
            with sync(k == len(mbs) - 1):
                loss = loss_fn(model, mb)
                loss.backward()
            losses.append(loss)
        return losses

    return run


def torch_data_parallel(
    model: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, mode: str, tp: int = 1, mp: Any = None
) -> nn.Module:
    """``model`` made data-parallel by PyTorch itself: DDP for ``replicate`` (without TP or mixed
    precision), else FSDP2 ``fully_shard`` on each of ``blocks``, then the root."""
    if mode == "replicate" and tp == 1 and mp is None:
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp or MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model


def check_data_parallel(
    rank: int,
    world_size: int,
    mode: Literal["shard", "replicate"],
    runner: Runner,
    *,
    tp: int = 1,
    model: ModelName = "reference",
    microbatches: int = 2,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    reshard_after_forward: bool = False,
    mesh_ranks: Any = None,
    **options: Any,
) -> dict[str, Any]:
    """See the module docstring; ``mesh_ranks``: the mesh's ranks as listed (nested for ``tp > 1``),
    ascending if not given; ``options`` go to ``helix`` or the backend (e.g. ``codegen="eager"``;
    ``fallback="error"`` unless given: a pass that fails must fail the check, not fall back)."""
    import dhelix_compile
    from dhelix_compile.data_parallelism import data_parallel

    torch._dynamo.reset()
    mesh = _mesh(world_size, tp, mesh_ranks)
    dp_mesh = mesh["dp"]
    mbs, loss_fn = _microbatches(model, dp_mesh.get_local_rank(), microbatches)
    mp = None
    if param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])

    base_model, blocks = _build(model, mesh, tp)
    wrapped = torch_data_parallel(base_model, blocks, dp_mesh, mode, tp, mp)
    ddp = wrapped if isinstance(wrapped, nn.parallel.DistributedDataParallel) else None  # FSDP2: every micro-batch
    want = _train(wrapped, _loop(wrapped, loss_fn, sync_once=ddp), mbs)
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        want["grads"] = {k.removeprefix("module."): v for k, v in want["grads"].items()}
        want["params"] = {k.removeprefix("module."): v for k, v in want["params"].items()}

    ours, _ = _build(model, mesh, tp)
    names = [name for name, _ in ours.named_parameters()]
    unwrapped = {name: full_tensor(p) for name, p in ours.named_parameters()}
    data_parallel(
        ours,
        dp_mesh,
        mode,
        param_dtype=_DTYPES[param_dtype],
        reduce_dtype=_DTYPES[reduce_dtype],
        reshard_after_forward=reshard_after_forward,
    )
    stored_problems = _stored_problems(ours, unwrapped)
    options.setdefault("fallback", "error")
    if runner == "helix":
        run: Callable[[list[Any]], list[torch.Tensor]] = dhelix_compile.helix(ours, loss_fn, **options)
    elif runner == "dhelix":
        compiled: Any = torch.compile(ours, backend=dhelix_compile.backend(**options), fullgraph=True)
        run = _loop(compiled, loss_fn, sync_once=ours)
    else:
        run = _loop(ours, loss_fn, sync_once=ours)
    got = _train(ours, run, mbs)

    problems = stored_problems + _layout_problems(ours, names, mesh.ndim)
    atol, rtol = (2e-2, 2e-2) if param_dtype == "bfloat16" else (1e-5, 1e-4)
    for k, (g, w) in enumerate(zip(got["losses"], want["losses"])):
        if not torch.allclose(g, w, atol=atol, rtol=rtol):
            problems.append(f"loss {k}: {g.item()} != {w.item()}")
    for what in ("grads", "params"):
        for name, w in want[what].items():
            g = got[what].get(name)
            if (g is None) != (w is None) or (g is not None and not torch.allclose(g, w, atol=atol, rtol=rtol)):
                diff = "missing" if g is None or w is None else f"max abs diff {(g - w).abs().max().item():.3g}"
                problems.append(f"{what[:-1]} {name}: {diff}")
    label = (
        f"rank {rank}/{world_size} {model} mode={mode} runner={runner} tp={tp} param_dtype={param_dtype} "
        f"reshard_after_forward={reshard_after_forward} mesh={mesh.mesh.tolist()}"
    )
    if problems:
        raise AssertionError(f"{label}: " + "; ".join(problems))
    placements = {name: str(tuple(p.placements)) for name, p in ours.named_parameters()}  # type: ignore[attr-defined]
    return {"losses": [loss.item() for loss in got["losses"]], "placements": placements}


def _stored_problems(model: nn.Module, unwrapped: dict[str, torch.Tensor]) -> list[str]:
    """Where a stored parameter is not the unwrapped one as torch reads it: its ``full_tensor()``
    (torch's all-gathers, in each group's rank order), and its local shape against the DTensor's
    own (from the rank's ``get_coordinate()``). Collectives: every rank calls it."""
    from dhelix_compile import _torch_compat as compat

    problems = []
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue  # _layout_problems names it
        coordinate = param.device_mesh.get_coordinate()
        assert coordinate is not None, "data_parallel's meshes hold every rank that runs the model"
        described = compat.local_shape_and_offset(
            tuple(param.shape), tuple(param.device_mesh.shape), coordinate, param.placements
        )[0]
        if tuple(param.to_local().shape) != described:
            problems.append(f"{name}: local shape {tuple(param.to_local().shape)} != the DTensor's {described}")
        if not torch.equal(full_tensor(param), unwrapped[name]):
            problems.append(f"{name}: full_tensor() is not the unwrapped parameter")
    return problems


def _layout_problems(model: nn.Module, names: list[str], mesh_ndim: int) -> list[str]:
    problems = []
    now = [name for name, _ in model.named_parameters()]
    if now != names:
        problems.append(f"named_parameters changed: {now} != {names}")
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor) or param.device_mesh.ndim != mesh_ndim:
            problems.append(f"{name} is not a DTensor on the {mesh_ndim}-D parameter mesh")
            continue
        grad = param.grad
        if grad is not None and (not isinstance(grad, DTensor) or grad.placements != param.placements):
            problems.append(f"{name}.grad is not a DTensor of the parameter's layout")
    return problems


def _mlp(hidden: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def _tensor_parallel_mlp(mesh: DeviceMesh, hidden: int = 5) -> nn.Module:
    """``_mlp`` with its first layer column-parallel over ``mesh`` (hidden 5 over 2 ranks: tiles
    of 3 and 2 rows), its output gathered (torch's ``RowwiseParallel`` infers an uneven input's
    global shape from the local one, so the second layer stays plain)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(_mlp(hidden), mesh, {"0": ColwiseParallel(output_layouts=Replicate())})


def check_uneven_tensor_parallel(
    rank: int, world_size: int, mode: Literal["shard", "replicate"] = "shard", mesh_ranks: Any = None
) -> dict[str, str]:
    """``data_parallel`` over a ``(dp, 2)`` mesh of a model whose TP shards are uneven; raises
    where the stored parameters are not the unwrapped ones (``_stored_problems``), where ranks
    store one parameter in different placements, or where the loss and full gradients differ from
    the unwrapped model's run eagerly on every DP rank's batch (gradients averaged, as DDP and
    FSDP2 do). Returns each parameter's placements."""
    import torch.distributed as dist

    from dhelix_compile.data_parallelism import data_parallel

    mesh = _mesh(world_size, 2, mesh_ranks)
    reference, ours = _mlp(), _tensor_parallel_mlp(mesh["tp"])
    unwrapped = {name: full_tensor(p) for name, p in ours.named_parameters()}
    data_parallel(ours, mesh["dp"], mode)
    problems = _stored_problems(ours, unwrapped)
    placements = {name: str(tuple(p.placements)) for name, p in ours.named_parameters()}  # type: ignore[attr-defined]
    every: list[dict[str, str] | None] = [None] * world_size
    dist.all_gather_object(every, placements)
    problems += [
        f"rank {r} stores {theirs} where rank {rank} stores {placements}"
        for r, theirs in enumerate(every)
        if theirs != placements
    ]

    dp = mesh["dp"].size()
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + i)) for i in range(dp)]
    loss = ours(batches[mesh["dp"].get_local_rank()]).pow(2).mean()
    loss.backward()
    losses = [reference(b).pow(2).mean() for b in batches]
    (torch.stack(losses).sum() / dp).backward()
    if not torch.allclose(loss.detach(), losses[mesh["dp"].get_local_rank()].detach(), atol=1e-6, rtol=1e-5):
        problems.append(f"loss {loss.item()} != {losses[mesh['dp'].get_local_rank()].item()}")
    want = {name: p.grad for name, p in reference.named_parameters()}
    for name, g in full_grads(ours).items():
        w = want[name]
        if g is None or w is None or not torch.allclose(g, w, atol=1e-6, rtol=1e-5):
            problems.append(f"grad {name}: {'missing' if g is None or w is None else (g - w).abs().max().item()}")
    if problems:
        raise AssertionError(f"rank {rank} mesh {mesh.mesh.tolist()} mode={mode}: " + "; ".join(problems))
    return placements


def permuted_mesh_errors(rank: int, world_size: int) -> dict[str, str]:
    """On 4 ranks, the message of each ``data_parallel`` call on a mesh listed out of order whose
    layout torch does not hold; raises if one passes, or if the mode whose layout torch holds
    there (``replicate``) is refused."""
    from dhelix_compile.data_parallelism import data_parallel

    across = _mesh(world_size, 2, [[2, 1], [3, 0]])  # tp groups {2, 1}, {3, 0}: DP positions 0 and 1 each
    data_parallel(_tensor_parallel_mlp(across["tp"], hidden=4), across["dp"], "replicate")
    reversed_tp = _mesh(world_size, 2, [[1, 0], [3, 2]])  # uneven TP shards on a dim listed 1, 0
    cases: dict[str, Callable[[], Any]] = {
        "groups across DP positions": lambda: data_parallel(
            _tensor_parallel_mlp(across["tp"], hidden=4), across["dp"], "shard"
        ),
        "uneven TP shards": lambda: data_parallel(_tensor_parallel_mlp(reversed_tp["tp"]), reversed_tp["dp"]),
    }
    return _error_messages(cases)


def data_parallel_errors(rank: int, world_size: int) -> dict[str, str]:
    """The message of each bad ``data_parallel`` call (on 2 ranks), by case; raises if one passes."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from dhelix_compile.data_parallelism import data_parallel

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    mesh_2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    only_rank_0 = DeviceMesh("cpu", [0])
    listed_down = _mesh(world_size, world_size, [list(range(world_size))[::-1]])  # (1, n): tp listed n-1, ..., 0

    def linear() -> nn.Module:
        return nn.Linear(4, 4)

    def tensor_parallel() -> nn.Module:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        return parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh_2d["tp"], {"0": ColwiseParallel()})

    def wrapped_twice() -> None:
        data_parallel(data_parallel(linear(), mesh), mesh)

    def compiled_in_place() -> None:
        model = linear()
        model.compile()
        data_parallel(model, mesh)

    cases: dict[str, Callable[[], Any]] = {
        "not a mesh": lambda: data_parallel(linear(), [0, 1]),  # type: ignore[arg-type]
        "2-D mesh": lambda: data_parallel(linear(), mesh_2d),
        "rank outside the mesh": lambda: data_parallel(linear(), only_rank_0) if rank else _raise("rank 1 checks"),
        "unknown mode": lambda: data_parallel(linear(), mesh, "zero3"),  # type: ignore[arg-type]
        "integer param_dtype": lambda: data_parallel(linear(), mesh, param_dtype=torch.int32),
        "zero group_timeout_s": lambda: data_parallel(linear(), mesh, group_timeout_s=0),
        "no parameters": lambda: data_parallel(nn.ReLU(), mesh),
        "parameters on another device": lambda: data_parallel(nn.Linear(4, 4, device="meta"), mesh),
        "FSDP2 inside": lambda: data_parallel(nn.Sequential(fully_shard(linear(), mesh=mesh)), mesh),  # type: ignore[call-overload]
        "DDP": lambda: data_parallel(nn.parallel.DistributedDataParallel(linear()), mesh),
        "wrapped twice": wrapped_twice,
        "compiled by torch.compile": lambda: data_parallel(torch.compile(linear()), mesh),  # type: ignore[arg-type]
        "compiled in place": compiled_in_place,
        "the TP mesh as DP mesh": lambda: data_parallel(tensor_parallel(), mesh_2d["tp"]),
        "uneven TP shards on a mesh listed out of order": lambda: data_parallel(
            _tensor_parallel_mlp(listed_down["tp"]), listed_down["dp"]
        ),
    }
    return _error_messages(cases)


def _error_messages(cases: dict[str, Callable[[], Any]]) -> dict[str, str]:
    """Each case's ``DataParallelError`` message, by case; raises if a case passes."""
    from dhelix_compile.data_parallelism import DataParallelError

    messages = {}
    for case, call in cases.items():
        try:
            call()
        except DataParallelError as exc:
            messages[case] = str(exc)
        else:
            raise AssertionError(f"data_parallel accepted: {case}")
    return messages


def _raise(message: str) -> None:
    from dhelix_compile.data_parallelism import DataParallelError

    raise DataParallelError(message)


def check_checkpoint(
    rank: int, world_size: int, directory: str, mode: Literal["shard", "replicate"], tp: int = 1
) -> int:
    """``torch.distributed.checkpoint`` round trips of a ``data_parallel`` model (after one step):
    into a fresh wrapped model, and into the unwrapped model; returns the tensors compared."""
    import torch.distributed.checkpoint as dcp

    from dhelix_compile.data_parallelism import data_parallel

    mesh = _mesh(world_size, tp)
    mbs, loss_fn = _microbatches("reference", mesh["dp"].get_local_rank(), 1)
    trained = data_parallel(_build("reference", mesh, tp)[0], mesh["dp"], mode)
    _train(trained, _loop(trained, loss_fn), mbs)
    dcp.save(trained.state_dict(), checkpoint_id=directory)
    want = {name: full_tensor(t) for name, t in trained.state_dict().items()}

    fresh = data_parallel(_build("reference", mesh, tp)[0], mesh["dp"], mode)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=directory)
    fresh.load_state_dict(state)
    from dhelix_compile.models.llama import ModelConfig, Transformer

    plain = Transformer(ModelConfig(seed=1))
    plain_state = plain.state_dict()
    dcp.load(plain_state, checkpoint_id=directory)
    plain.load_state_dict(plain_state)

    problems = []
    for label, model in (("wrapped", fresh), ("unwrapped", plain)):
        got = {name: full_tensor(t) for name, t in model.state_dict().items()}
        if got.keys() != want.keys():
            problems.append(f"{label}: keys {sorted(got.keys() ^ want.keys())} differ")
        problems += [
            f"{label}: {name} differs" for name in want if name in got and not torch.equal(got[name], want[name])
        ]
    if problems:
        raise AssertionError(f"rank {rank}: " + "; ".join(problems))
    return len(want)


def check_data_parallel_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``check_data_parallel(rank, world_size, **case)`` for each case, in one spawn of the ranks."""
    return [check_data_parallel(rank, world_size, **case) for case in cases]


def graph_collectives(
    rank: int, world_size: int, modes: list[Literal["shard", "replicate"]], reshard_after_forward: bool = False
) -> list[dict[str, dict[str, int]]]:
    """For each mode, the collectives (and ``dhelix::with_accumulated_grad``) in the partitions
    dhelix's capture (AOTAutograd with dhelix's joint pass, ``graph_passes.joint.regather``) makes of a
    ``data_parallel`` reference model over two micro-batches, gradient sync off for the first:
    ``"forward"``, ``"backward_accumulating"`` (the first micro-batch's backward) and
    ``"backward"`` (the last's), by op name."""
    return [_graph_collectives(rank, world_size, mode, reshard_after_forward) for mode in modes]


def _graph_collectives(
    rank: int, world_size: int, mode: Literal["shard", "replicate"], reshard_after_forward: bool
) -> dict[str, dict[str, int]]:
    from dhelix_compile import _torch_compat as compat
    from dhelix_compile.data_parallelism import data_parallel
    from graph_passes.joint.regather import mark_regathers

    torch._dynamo.reset()
    mesh = _mesh(world_size, 1)
    model = _build("reference", mesh, 1)[0]
    data_parallel(model, mesh["dp"], mode, reshard_after_forward=reshard_after_forward)
    graphs: dict[str, list[dict[str, int]]] = {"forward": [], "backward": []}

    def keep(gm: torch.fx.GraphModule, _: Any, *, is_backward: bool = False, **__: Any) -> Any:
        found: dict[str, int] = {}
        for node in gm.graph.nodes:
            name = str(node.target)
            if ("_c10d_functional" in name and "wait" not in name) or "with_accumulated_grad" in name:
                op = name.split(".")[1]
                found[op] = found.get(op, 0) + 1
        graphs["backward" if is_backward else "forward"].append(found)
        return compat.eager_partition(gm)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compat.compile_with_aot_autograd(gm, example_inputs, keep, joint_pass=mark_regathers)

    compiled: Any = torch.compile(model, backend=backend)
    mbs, loss_fn = _microbatches("reference", rank, 2)
    _loop(compiled, loss_fn, sync_once=model)(mbs)
    return {
        "forward": graphs["forward"][0],
        "backward_accumulating": graphs["backward"][0],
        "backward": graphs["backward"][-1],
    }


def mesh_wrappers(rank: int, world_size: int) -> dict[str, Any]:
    """What ``_torch_compat``'s mesh and placement wrappers give on a ``(1, world_size)`` mesh."""
    from dhelix_compile import _torch_compat as compat

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    joined = compat.concatenate_meshes([mesh["dp"], mesh["tp"]])
    strided = compat.strided_shard(0, split_factor=world_size)
    name = compat.group_name(mesh["tp"].get_group())
    return {
        "joined": (joined.mesh.tolist(), joined.mesh_dim_names),
        "strided_dim": strided.dim,
        "strided_split_factor": strided.split_factor,
        "group_resolves": compat.resolve_group(name) is mesh["tp"].get_group(),
    }
