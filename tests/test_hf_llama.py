"""A Hugging Face Llama under PyTorch's TP and TP+SP plans: helix and the backend equal eager on 2 gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")

from dhelix_compile.testing.multirank import run_on_ranks


def _check(rank: int, world_size: int, sequence_parallel: bool) -> list[float]:
    import dhelix_compile
    from dhelix_compile.models.hf_llama import build_hf_llama, hf_llama_batches, hf_llama_loss, parallelize_hf_llama

    mesh = torch.distributed.device_mesh.DeviceMesh("cpu", list(range(world_size)))
    models = [parallelize_hf_llama(build_hf_llama("tiny"), mesh, sequence_parallel=sequence_parallel) for _ in "abc"]
    eager, helixed, backend = models
    mbs = hf_llama_batches("tiny", 3, torch.Generator().manual_seed(0))  # TP ranks share their batch
    expected = []
    for mb in mbs:  # the eager gradient-accumulation loop
        loss = hf_llama_loss(eager, mb)
        loss.backward()
        expected.append(loss.detach())
    options = {"codegen": "eager", "fallback": "error"}
    losses = dhelix_compile.helix(helixed, hf_llama_loss, **options)(copy.deepcopy(mbs))
    compiled = torch.compile(backend, backend="dhelix", options=options)
    for mb in mbs:
        hf_llama_loss(compiled, mb).backward()
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-5)
    for name, p in eager.named_parameters():
        for other in (helixed, backend):
            got = other.get_parameter(name).grad
            want, got = (getattr(g, "_local_tensor", g) for g in (p.grad, got))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return [float(x) for x in losses]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "sequence_parallel",
    [
        pytest.param(False, marks=pytest.mark.full),
        True,
    ],
    ids=["tp", "tp_sp"],
)
def test_hf_llama_helix_and_backend_equal_eager(sequence_parallel: bool) -> None:
    losses = run_on_ranks(_check, 2, sequence_parallel, timeout_s=240)
    assert all(len(r) == 3 for r in losses)
