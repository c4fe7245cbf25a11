"""What only a GPU shows: ``python -m dhelix_compile.bench.gpu [--out DIR]``.

Three checks, each reported on its own (one failing does not hide the others), in this order:

``contention``  the slowdown of bf16 matmuls (8192^3, and a Llama MLP shard's 4096x4096x7168) and
                of an fp32 add (memory-bound) while bytes move on a side stream: host-to-device
                and device-to-host copies (the copy engines) and a device-to-device copy (a kernel
                on the SMs, as NCCL's are). Each op is timed alone and beside the copies in
                alternation. One GPU has no peer to send to; this is the closest stand-in for
                NCCL's contention, which the cost model prices as ``Device.contention_factor``.
``ops``         one Llama decoder layer, as a rank of 2-way tensor parallelism holds it
                (``--hidden`` 4096, ``--heads`` 16 of 128, ``--kv-heads`` 4, ``--ffn`` 7168:
                Llama-3-8B's shard), forward and backward captured through AOTAutograd; every
                compute node's analytic estimate on the device's table entry against its
                measured time (CUDA events, the op alone on random inputs), and the layer
                compiled by Inductor against the sum of the estimates.
``codegen``     ``helix`` with its defaults (or ``--options``) on a bench workload (``--workloads``): Inductor's code
                for the merged graph (compiled, run, the Triton kernels counted) and its losses
                and gradients against the eager loop's; beside it, Inductor and
                ``torch.compile(backend="dhelix")`` loops, first step (compile) and step times.
                ``--group gloo`` (the default): 2 gloo ranks sharing the one device, real
                collectives, so the numerics mean something. ``--group fake``: the fake
                process group in this process, compute only; torch 2.11's fake collectives
                leave their outputs unwritten on CUDA, so its numerics are noise there.

Prints a table per check and writes ``gpu.json`` under ``--out``. Runs on the CPU too
(``--device cpu``, small sizes: how the tests keep it working), where ``contention`` is skipped.

Modules: ``timing`` (CUDA events, or the clock on the CPU), ``contention``, ``layer_ops``,
``codegen``, and ``__main__`` (the command line).
"""
