"""The private-torch-API wrappers still behave as dhelix assumes (the first test to break on upgrade)."""

from __future__ import annotations

import pytest
import torch

from dhelix_compile import _torch_compat as compat


def test_compile_with_aot_autograd_hands_us_forward_and_backward_partitions() -> None:
    seen: list[dict] = []

    def inner(gm, example_inputs, **kwargs):
        seen.append({"is_backward": bool(kwargs.get("is_backward")), "is_inference": bool(kwargs.get("is_inference"))})
        assert isinstance(gm, torch.fx.GraphModule)
        return compat.eager_partition(gm)

    def backend(gm, example_inputs):
        return compat.compile_with_aot_autograd(gm, example_inputs, inner)

    torch._dynamo.reset()
    model = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    compiled = torch.compile(model, backend=backend)
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x))
    with torch.no_grad():
        compiled(x)
    assert seen == [
        {"is_backward": False, "is_inference": False},
        {"is_backward": True, "is_inference": False},
        {"is_backward": False, "is_inference": True},
    ]


def test_aot_autograd_cache_never_bypasses_our_inner_compile() -> None:
    """Compiling the same model twice must call our inner compiler twice (no cache hit)."""
    calls = []

    def inner(gm, example_inputs, **kwargs):
        calls.append(kwargs.get("is_backward"))
        return compat.eager_partition(gm)

    for _ in range(2):
        torch._dynamo.reset()
        torch.compile(torch.nn.Linear(4, 3), backend=lambda gm, ex: compat.compile_with_aot_autograd(gm, ex, inner))(
            torch.randn(2, 4)
        )
    assert len(calls) == 2


def test_joint_pass_sees_annotated_nodes_and_its_recompute_marks_reach_the_partitioner() -> None:
    """``annotated`` tags survive Dynamo and AOTAutograd into the joint graph that ``joint_pass``
    sees, and a ``MUST_RECOMPUTE`` it sets there makes the partitioner recompute the node in the
    backward (what ``graph_passes.joint.regather`` relies on)."""
    from torch.utils.checkpoint import CheckpointPolicy

    tagged: list[str] = []
    backward_ops: list[str] = []

    def joint(graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if (node.meta.get("custom") or {}).get("test") == "cos":
                tagged.append(str(node.target))  # the cos, and its backward (traced in the same region)
                if node.target is torch.ops.aten.cos.default:
                    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    node.meta["ac_graph_id"] = 1

    def inner(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            backward_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compat.eager_partition(gm)

    def f(x):
        with compat.annotated({"test": "cos"}):
            c = x.cos()
        return (c * x).sum()

    torch._dynamo.reset()
    compiled = torch.compile(
        f, backend=lambda gm, ex: compat.compile_with_aot_autograd(gm, ex, inner, joint_pass=joint)
    )
    x = torch.randn(5, requires_grad=True)
    compiled(x).backward()
    assert tagged[0] == "aten.cos.default" and "aten.sin.default" in tagged
    assert "aten.cos.default" in backward_ops  # recomputed, not saved
    torch.testing.assert_close(x.grad, x.cos() - x * x.sin())


def test_a_tangent_holding_an_opaque_object_equal_to_a_primals_is_tied_to_the_primal() -> None:
    """The joint graph ``tie_opaque_tangents`` mends: a forward output reading a tangent's opaque
    object (``return [tanh, tangents_2, ...]``) reads the primal's equal one; a tangent whose
    object no primal holds stays."""
    from torch._library.fake_class_registry import FakeScriptObject

    graph = torch.fx.Graph()
    mesh, x, tangent, other = (graph.placeholder(n) for n in ("primals_1", "primals_2", "tangents_1", "tangents_2"))
    for node, value in ((mesh, ("tp", 2)), (tangent, ("tp", 2)), (other, ("dp", 4))):
        node.meta["val"] = FakeScriptObject(None, "DeviceMesh", value)
    graph.output((graph.call_function(torch.tanh, (x,)), tangent, other))
    assert compat.tie_opaque_tangents(graph) == 1
    (outputs,) = graph.output_node().args
    assert list(outputs)[1:] == [mesh, other] and not tangent.users


def test_eager_partition_is_boxed() -> None:
    gm = torch.fx.symbolic_trace(lambda a, b: a + b)
    fn = compat.eager_partition(gm)
    assert getattr(fn, "_boxed_call", False)
    torch.testing.assert_close(fn([torch.ones(2), torch.ones(2)]), torch.full((2,), 2.0))


def test_eager_partition_draws_inductors_random_prims_from_their_seeds() -> None:
    """torch's eager ``prims.inductor_random`` ignores its seed; run by ``eager_partition`` a call
    with one seed gives one tensor (a backward recomputing a dropout mask gets its forward's)."""
    import torch._inductor.inductor_prims

    prims = torch.ops.prims

    def draws(seeds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first = prims.inductor_lookup_seed.default(seeds, 0)
        second = prims.inductor_lookup_seed.default(seeds, 1)
        return (
            prims.inductor_random.default([64], first, "rand"),
            prims.inductor_random.default([64], first, "randn"),
            prims.inductor_random.default([64], second, "rand"),
            prims.inductor_randint.default(0, 1000, [64], first),
            prims.inductor_random.default([64], first, "rand"),
        )

    gm = torch.fx.symbolic_trace(draws)
    seeds = torch.tensor([123, 456])
    rand, randn, other, randint, again = compat.eager_partition(gm)([seeds])
    assert torch.equal(rand, again) and not torch.equal(rand, other)
    assert randn.min() < 0 and rand.min() >= 0 and rand.max() < 1 and rand.dtype == torch.float32
    assert randint.dtype == torch.int64 and randint.min() >= 0 and randint.max() < 1000
    assert torch.equal(compat.eager_partition(gm)([seeds])[0], rand)  # a function of the seed alone
    assert any(n.target is prims.inductor_random.default for n in gm.graph.nodes), "gm itself is not rewritten"


def test_mode_options() -> None:
    assert compat.inductor_mode_options(None) == {}
    assert compat.inductor_mode_options("default") == {}
    assert compat.inductor_mode_options("max-autotune").get("max_autotune") is True


def test_inductor_config_patch() -> None:
    before = torch._inductor.config.reorder_for_locality
    with compat.inductor_config_patch({"reorder_for_locality": not before}):
        assert torch._inductor.config.reorder_for_locality is (not before)
    assert torch._inductor.config.reorder_for_locality is before
    with compat.inductor_config_patch({}):
        pass


def test_compile_id_outside_dynamo_is_none() -> None:
    assert compat.current_compile_id() is None


def test_entry_point_backend_is_listed() -> None:
    assert "dhelix" in compat.list_dynamo_backends()


def test_logging_calls_do_not_break_a_fullgraph_capture() -> None:
    import logging

    import torch

    from dhelix_compile import _torch_compat as compat

    logger = logging.getLogger("dhelix.test.model")

    def fn(x: torch.Tensor) -> torch.Tensor:
        logger.warning("a model's log line")
        return x * 2

    torch._dynamo.reset()
    with compat.logging_calls_ignored_by_dynamo():
        out = torch.compile(fn, fullgraph=True, backend="eager")(torch.ones(2))
    assert out.tolist() == [2.0, 2.0]
    assert logging.Logger.warning not in torch._dynamo.config.ignore_logging_functions  # restored after


def test_into_one_fake_mode_puts_every_value_of_a_graph_in_one_fake_mode() -> None:
    """A graph whose inputs come from two fake modes (two Dynamo compiles) gets one mode."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(torch.ops.aten.mm.default, (a, b)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with FakeTensorMode():
        x = torch.empty(2, 3)
    with FakeTensorMode():
        y = torch.empty(3, 4)
    inputs = compat.into_one_fake_mode(gm, [x, y])
    mode = detect_fake_mode(tuple(inputs))
    assert mode is not None
    vals = [n.meta["val"] for n in gm.graph.nodes if "val" in n.meta]
    assert len(vals) == 4 and all(v.fake_mode is mode for v in vals)  # 2 inputs, mm, output
    assert vals[-1].shape == (2, 4)


def test_pipeline_actions_round_trip_through_torchs_action_type() -> None:
    forward = compat.pipeline_action("F", 0, 3)
    backward = compat.pipeline_action("B", 1, 2)
    assert compat.pipeline_action_fields(forward) == ("F", 0, 3, None)
    assert str(backward) == "1B2"
    kind, stage, mb, subs = compat.pipeline_action_fields(compat.pipeline_overlap_action(forward, backward))
    assert (kind, stage, mb, subs) == ("OVERLAP_F_B", None, None, (forward, backward))


def test_compiled_module_sees_both_ways_of_compiling() -> None:
    plain, method, wrapped = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    method.compile()
    assert not compat.compiled_module(plain)
    assert compat.compiled_module(method) and compat.compiled_module(torch.compile(wrapped))


def test_local_shape_and_offset_matches_torch_chunking() -> None:
    """7 columns over a 2x2 mesh (Shard(0), Shard(1)) with 3 rows: torch.chunk sizes, empty last row shard."""
    from torch.distributed.tensor.placement_types import Shard

    placements = [Shard(0), Shard(1)]
    assert compat.local_shape_and_offset((3, 7), (2, 2), (0, 1), placements) == ((2, 3), (0, 4))
    assert compat.local_shape_and_offset((3, 7), (2, 2), (1, 0), placements) == ((1, 4), (2, 0))
    assert compat.local_shape_and_offset((1, 7), (2, 2), (1, 0), placements)[0] == (0, 4)


def test_mesh_concatenation_strided_shards_and_group_names() -> None:
    from dhelix_compile.testing.data_parallel_checks import mesh_wrappers
    from dhelix_compile.testing.multirank import run_on_ranks

    for facts in run_on_ranks(mesh_wrappers, 2, timeout_s=60):
        assert facts["joined"] == ([[0, 1]], ("dp", "tp"))
        assert facts["strided_dim"] == 0 and facts["strided_split_factor"] == 2
        assert facts["group_resolves"]


def test_waiting_for_inductors_compile_workers_is_a_no_op_without_a_pool() -> None:
    """The profiled cost model waits for Inductor's compile pool before measuring (its workers
    import torch on the cores the measurements use); with one compile thread there is no pool."""
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    assert callable(AsyncCompile.wait_pool_ready)
    with inductor_config.patch(compile_threads=1):
        compat.wait_for_compile_workers(timeout_s=5.0)


def test_starting_inductors_compile_workers_is_a_no_op_without_a_pool() -> None:
    """dhelix starts Inductor's compile pool when a model is handed to it; with one compile
    thread Inductor compiles in-process and nothing starts."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(compile_threads=1):
        assert compat.start_compile_workers() is False


def test_a_placeholder_marked_donated_lends_its_buffer_to_the_graphs_output() -> None:
    """``mark_donated`` + ``donated_placeholders`` (codegen.generate): Inductor writes the output
    over the handed-over input, as it does over a backward's saved activations; unmarked, not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dhelix_compile.codegen import generate

    def f(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        return ((x.sin() * 2 + y).relu(),)

    x, y = torch.randn(64, 64), torch.randn(64, 64)
    for donate in (False, True):
        gm = make_fx(f, tracing_mode="fake")(x, y)
        if donate:
            compat.mark_donated(gm, [0])
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        assert placeholders[0].endswith(compat.DONATED_SUFFIX) is donate
        assert not placeholders[1].endswith(compat.DONATED_SUFFIX)
        compiled = generate(gm, [x, y], "inductor", {})
        args = [x.clone(), y.clone()]
        donated_at = args[0].data_ptr()
        (out,) = compiled(args)  # clears args: the call owns the inputs
        assert (out.data_ptr() == donated_at) is donate
        torch.testing.assert_close(out, f(x, y)[0])


def test_a_backward_partition_sees_the_inputs_aot_autograd_donates() -> None:
    """``donated_input_indices`` reads AOTAutograd's donated saved activations while the backward
    compiles (helix hands them to its merged graphs): saved activations, not the tangent."""
    seen: dict[bool, tuple[int, ...]] = {}
    inputs: dict[bool, list[str]] = {}

    def inner(gm, example_inputs, **kwargs):
        backward = bool(kwargs.get("is_backward"))
        seen[backward] = compat.donated_input_indices()
        inputs[backward] = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        return compat.eager_partition(gm)

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    compiled = torch.compile(model, backend=lambda gm, inputs: compat.compile_with_aot_autograd(gm, inputs, inner))
    compiled(torch.randn(2, 4)).sum().backward()
    names = [inputs[True][i] for i in seen[True]]
    assert names and not any(name.startswith(("tangents", "primals")) for name in names)
    assert compat.donated_input_indices() == ()  # outside a compile


def _calls_on_a_rank(rank: int, world_size: int) -> list:
    import threading

    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    peer = 1 - rank

    def step() -> None:
        def on_a_thread() -> None:  # as helix's second strand issues its collectives
            c10d.wait_tensor(c10d.all_reduce(torch.ones(8), "sum", "0"))

        thread = threading.Thread(target=on_a_thread)
        thread.start()
        thread.join()
        splits_out, splits_in = ([3, 2], [3, 1]) if rank == 0 else ([1, 1], [2, 1])
        dist.all_to_all_single(torch.empty(sum(splits_out), 2), torch.ones(sum(splits_in), 2), splits_out, splits_in)
        dist.barrier()
        sending = dist.isend(torch.ones(5, dtype=torch.int64), peer)
        dist.irecv(torch.empty(5, dtype=torch.int64), peer).wait()
        sending.wait()

    return [(call.op, call.args) for call in compat.process_group_calls(step)]


@pytest.mark.multirank
def test_process_group_calls_lists_every_threads_c10d_ops_with_shapes_and_integer_arguments() -> None:
    from dhelix_compile.testing.multirank import run_on_ranks

    rank0, rank1 = run_on_ranks(_calls_on_a_rank, 2, timeout_s=120)
    ops = [op for op, _ in rank0]
    assert ops == ["allreduce_", "alltoall_base_", "barrier", "send", "recv_"], ops
    assert rank0[0][1][0] == [((8,), "float32")]  # a tensor list, from the other thread
    assert rank0[1][1][:2] == (((5, 2), "float32"), ((4, 2), "float32"))  # output, input
    assert rank0[1][1][3:5] == ([3, 2], [3, 1]) and rank1[1][1][3:5] == ([1, 1], [2, 1])  # the splits
    assert rank0[3][1][0] == [((5,), "int64")] and rank0[3][1][2] == 1  # to the peer


def test_tracing_for_graph_cache_gives_inductor_a_shape_env_outside_a_compile() -> None:
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake = FakeTensorMode(shape_env=ShapeEnv())
    inputs = [fake.from_tensor(torch.ones(2, 3))]
    assert TracingContext.try_get() is None
    with compat.tracing_for_graph_cache(inputs):
        context = TracingContext.try_get()
        assert context is not None and context.fake_mode is fake and fake.shape_env is not None
    assert TracingContext.try_get() is None
    with compat.tracing_for_graph_cache([torch.ones(2)]):  # real tensors: nothing to key by
        assert TracingContext.try_get() is None


def test_stable_mesh_cache_keys_patches_the_pickler_only_within_the_block() -> None:
    from torch._inductor.codecache import FxGraphCachePickler

    original = FxGraphCachePickler._reduce_fake_script_object
    with compat.stable_mesh_cache_keys():
        assert FxGraphCachePickler._reduce_fake_script_object is not original
    assert FxGraphCachePickler._reduce_fake_script_object is original


def test_a_merged_graph_compiles_to_its_strands_own_kernels() -> None:
    """codegen.generate on a graph of two strands (helix's M): no fused kernel joins them, so M's
    kernels are those F and B compile alone; a graph of one strand fuses as Inductor does."""
    from torch._inductor import metrics
    from torch.fx.experimental.proxy_tensor import make_fx

    from dhelix_compile.codegen import generate, holds_strands
    from graph_passes.annotate import META_KEY

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.sin() * 2, x.cos() + 1  # two pointwise loops reading x: Inductor fuses them

    x = torch.randn(64, 64)
    kernels = {}
    for merged, strand_kernels in ((False, True), (True, True), (True, False)):
        gm = make_fx(f, tracing_mode="fake")(x)
        for node in gm.graph.nodes:  # the first output's ops one strand, the second's the other
            if node.op == "call_function":
                strand = int(merged and node.target in (torch.ops.aten.cos.default, torch.ops.aten.add.Tensor))
                node.meta[META_KEY] = {"strand": strand}
        assert holds_strands(gm) is merged
        metrics.reset()
        with compat.inductor_config_patch({"fx_graph_cache": False}):
            compiled = generate(gm, [x], "inductor", {}, strand_kernels=strand_kernels)
        kernels[merged, strand_kernels] = metrics.generated_kernel_count
        for got, want in zip(compiled([x]), f(x), strict=True):
            torch.testing.assert_close(got, want)
    # helix_strand_kernels=False: Inductor fuses across the strands again
    assert kernels == {(False, True): 1, (True, True): 2, (True, False): 1}


def test_the_cpu_vector_check_runs_once_on_its_own_thread_and_only_for_cpu_tensors(monkeypatch) -> None:
    """``start_vec_isa_check`` runs Inductor's ``pick_vec_isa`` on a thread of its own, once a
    process, where a tensor lives on the CPU; ``wait_for_vec_isa_check`` waits for it."""
    import threading

    from torch._inductor import cpu_vec_isa

    calls: list[str] = []
    monkeypatch.setattr(compat, "_vec_isa_check", None)
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: calls.append(threading.current_thread().name))
    compat.start_vec_isa_check([torch.empty(1, device="meta"), "not a tensor"])
    compat.wait_for_vec_isa_check()
    assert calls == []
    compat.start_vec_isa_check(iter([torch.empty(1, device="meta"), torch.empty(1)]))
    compat.start_vec_isa_check([torch.empty(1)])
    compat.wait_for_vec_isa_check()
    assert calls == ["dhelix-vec-isa"]
