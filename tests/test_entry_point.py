"""The backend is found through the torch_dynamo_backends entry point, with no import of ours."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_fresh_interpreter_finds_and_uses_the_backend() -> None:
    script = textwrap.dedent(
        """
        import sys
        import torch
        assert "dhelix" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        assert "dhelix_compile" not in sys.modules
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        compiled = torch.compile(model, backend="dhelix", options={"codegen": "eager", "fallback": "error"})
        x = torch.randn(3, 4)
        out = compiled(x)
        out.sum().backward()
        torch.testing.assert_close(out, model(x))
        assert "dhelix_compile" in sys.modules
        print("OK")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("OK")


def test_public_names_stay_what_they_name_after_the_packages_behind_them_load() -> None:
    """``dhelix_compile.reshard`` and ``.data_parallel`` are functions; a subpackage of the same
    name would replace them once anything imported it (the backend imports the resharding one)."""
    script = textwrap.dedent(
        """
        import inspect
        import dhelix_compile
        import dhelix_compile.resharding.groups, dhelix_compile.data_parallelism.layout
        for name in dhelix_compile.__all__:
            value = getattr(dhelix_compile, name)
            assert not inspect.ismodule(value), name
        assert inspect.isfunction(dhelix_compile.reshard) and inspect.isfunction(dhelix_compile.data_parallel)
        print("OK")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
