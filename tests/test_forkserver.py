"""The fork server: a forked child is the ``python -m`` process it stands for, or it is not forked."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dhelix_compile.launch.forkserver import ForkServer, fixed_env
from dhelix_compile.testing.multirank import run_on_ranks

_CHILD = textwrap.dedent(
    """
    import os, sys
    print("args", sys.argv[1:], "cwd", os.getcwd(), "pgid", os.getpgid(0) == os.getpid())
    print("env", os.environ.get("DHELIX_FORKED_VALUE"), "absent", "DHELIX_ONLY_IN_SERVER" in os.environ)
    print("stdin", sys.stdin.read() == "", flush=True)
    print("on stderr", file=sys.stderr)
    if sys.argv[1] == "sleep":
        import time
        time.sleep(60)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture
def server(tmp_path: Path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "forked_child.py").write_text(_CHILD)
    env = {**os.environ, "DHELIX_ONLY_IN_SERVER": "1"}
    started = ForkServer(["json", "a_module_that_is_not_installed"], env=env)  # the missing one is skipped
    yield started
    started.close()


def _spawn(server: ForkServer, tmp_path: Path, *args: str, **extra_env: str):
    env = {k: v for k, v in os.environ.items() if k != "DHELIX_ONLY_IN_SERVER"}
    env.update(PYTHONPATH=str(tmp_path / "lib"), **extra_env)
    out, err = tmp_path / "out", tmp_path / "err"
    out.write_bytes(b"")
    err.write_bytes(b"")
    argv = [sys.executable, "-m", "forked_child", *args]
    assert server.can_run(argv, env)
    return server.spawn(argv, env, str(tmp_path), str(out), str(err)), out, err


def test_a_forked_child_runs_the_module_with_its_arguments_environment_folder_and_files(server, tmp_path) -> None:
    child, out, err = _spawn(server, tmp_path, "3", "x", DHELIX_FORKED_VALUE="42")
    assert child.wait(timeout=30) == 3 and child.poll() == 3
    lines = out.read_text().splitlines()
    assert lines[0] == f"args ['3', 'x'] cwd {tmp_path} pgid True"  # its own process group
    assert lines[1] == "env 42 absent False"  # the request's environment, not the server's
    assert lines[2] == "stdin True"
    assert err.read_text() == "on stderr\n"
    assert not os.path.exists(f"/proc/{child.pid}"), "reaped by the server"


def test_a_killed_child_reports_the_signal_as_popen_does(server, tmp_path) -> None:
    child, out, _ = _spawn(server, tmp_path, "sleep")
    deadline = time.monotonic() + 30
    while "stdin" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert child.poll() is None
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_requests_it_cannot_honour_are_left_to_a_cold_start(server, tmp_path) -> None:
    env = dict(os.environ)
    assert not server.can_run([sys.executable, "script.py"], env)  # only `python -m`
    assert not server.can_run(["/usr/bin/env", "-m", "x"], env)
    # read when the server started or imported torch: a forked child would keep the server's value
    assert not server.can_run([sys.executable, "-m", "x"], {**env, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    assert not server.can_run([sys.executable, "-m", "x"], {**env, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert server.why_not([sys.executable, "-m", "x"], {**env, "MALLOC_MMAP_THRESHOLD_": "1"}) == (
        "environment variables differ from the server's: MALLOC_MMAP_THRESHOLD_"
    )
    assert not server.can_run([sys.executable, "-m", "x"], {k: v for k, v in env.items() if k != "HOME"})
    # read after a rank starts: free to differ
    runtime = {"RANK": "3", "DHELIX_CODEGEN": "eager", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "1"}
    assert server.can_run([sys.executable, "-m", "x"], {**env, **runtime})
    assert fixed_env({"RANK": "0", "MASTER_PORT": "1", "DHELIX_DUMP_DIR": "d"}) == fixed_env({})
    server.close()
    assert not server.can_run([sys.executable, "-m", "x"], env)


def test_a_server_with_threads_refuses_to_fork(tmp_path) -> None:
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    refusing = ForkServer(["threaded"], env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:
        assert refusing.refused is not None and "2 threads" in refusing.refused
        assert not refusing.can_run([sys.executable, "-m", "x"], dict(os.environ))
    finally:
        refusing.close()


def _pid_and_parent(rank: int, world_size: int) -> tuple[int, int]:
    return os.getpid(), os.getppid()


@pytest.mark.multirank
def test_ranks_start_cold_when_asked_or_when_the_fork_server_is_off(monkeypatch) -> None:
    forked = run_on_ranks(_pid_and_parent, 2)
    asked_cold = run_on_ranks(_pid_and_parent, 2, forked=False)  # as the benchmarks' measurements run
    monkeypatch.setenv("DHELIX_FORKSERVER", "0")
    cold = run_on_ranks(_pid_and_parent, 2)
    assert {parent for _, parent in forked} != {os.getpid()}  # children of the server
    assert {parent for _, parent in asked_cold} == {parent for _, parent in cold} == {os.getpid()}
