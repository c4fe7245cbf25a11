"""A fork server: one Python process that has imported torch forks each rank instead of a cold start.

Contract
--------
``ForkServer(preload)`` starts ``python -m dhelix_compile.launch.forkserver <modules>``: it
imports ``preload`` once (those installed: a module that is missing is skipped, one that fails
to import stops the server, which then refuses), then forks one child per
``spawn(argv, env, cwd, stdout, stderr)``.
Each child runs ``argv`` (``[sys.executable, "-m", module, *args]``, the only form served) as
``python -m`` would, in a fresh session (its own process group, like ``start_new_session``),
with ``env`` as its environment (plus what the server's imports set there and ``env`` lacks:
Inductor's cache folder), ``cwd`` as its directory, ``PYTHONPATH``'s entries on ``sys.path``,
stdin from ``/dev/null`` and stdout / stderr appended to the given files.
``spawn`` returns a :class:`ForkedProcess`: the part of ``subprocess.Popen`` that
``launch.ranks`` uses (``pid``, ``returncode``, ``poll``, ``wait``), return codes as Popen's
(``-N`` for signal N). The server reaps every child; kill them with ``os.killpg`` as before.

Why: a rank's cold start imports torch, Dynamo and Inductor (3-4 s of CPU per rank on a
small machine); a fork shares the imported modules copy-on-write and starts in milliseconds.
The default test suite starts about a hundred groups of ranks.

When it does not serve (``can_run`` is False; the caller starts a subprocess as before):

* the server refused to fork: it had more than one thread after its imports (forking a
  threaded process can deadlock the child);
* ``argv`` is not ``[sys.executable, "-m", module, ...]``;
* ``env`` differs from the server's outside ``RUNTIME_VARIABLES`` and ``RUNTIME_PREFIXES``
  (``DHELIX_*``, which ``dhelix_compile.config`` reads when a model compiles, and Inductor's
  per-process ``_TORCHINDUCTOR_*`` values): the server's were read when it
  started and imported torch (``MALLOC_*`` by the C library, ``TORCHINDUCTOR_*`` by
  Inductor's config, ``OMP_*`` by the thread pools), so a child could not honour other values.
  What the server's imports set themselves (Inductor's cache folder) may be absent or equal;
* the server has exited.

Lifetime: the server exits when its stdin closes (the process that started it is gone or
called ``close``), killing the process groups of the children still running.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any

__all__ = ["RUNTIME_PREFIXES", "RUNTIME_VARIABLES", "ForkServer", "ForkedProcess", "fixed_env"]

#: Read only after a rank starts (by ``init_process_group`` or the harness), so they may differ
#: between the server and a request; every other variable must be the server's.
RUNTIME_VARIABLES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
        "GLOO_SOCKET_IFNAME",
        "PYTHONPATH",
        "PYTEST_CURRENT_TEST",
    }
)
#: The same, by prefix: dhelix's own (``dhelix_compile.config`` reads them when a model compiles)
#: and the values Inductor keeps in ``os.environ`` for its own process once it has compiled
#: (``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``: an address in that process, set again in each).
RUNTIME_PREFIXES = ("DHELIX_", "_TORCHINDUCTOR_")
#: Set in the server before its imports, unless the environment sets them: what a rank process
#: sets before importing torch (``testing.rank_main``), and a single-threaded OpenBLAS, whose
#: thread pool would otherwise start with torch and leave the server unable to fork safely
#: (ranks run with ``torch.set_num_threads(1)`` anyway).
_RANK_DEFAULTS = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
_POLL_S = 0.02
_START_TIMEOUT_S = 120.0
_SPAWN_TIMEOUT_S = 30.0


def fixed_env(env: Mapping[str, str], imports_set: Mapping[str, str] | None = None) -> dict[str, str]:
    """What of ``env`` a forked child would keep from the server: every variable but the
    runtime ones (module docstring), with the rank defaults where ``env`` lacks them, and
    without those equal to what the server's imports set (``imports_set``)."""
    merged = {**_RANK_DEFAULTS, **env}
    imports_set = imports_set or {}
    return {
        k: v
        for k, v in sorted(merged.items())
        if k not in RUNTIME_VARIABLES and not k.startswith(RUNTIME_PREFIXES) and imports_set.get(k) != v
    }


class ForkedProcess:
    """A child of the fork server, as much of ``subprocess.Popen`` as the launcher uses."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.pid = pid
        self._server = server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._exit_code(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server._exit_code(self.pid, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0.0)
        return self.returncode


class ForkServer:
    """The client side: starts the server process and asks it for children (module docstring)."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self._proc = subprocess.Popen(  # the server sets _RANK_DEFAULTS itself, before its imports
            [sys.executable, "-m", __name__, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ if env is None else env),
            start_new_session=True,
        )
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._closed = False
        self.refused: str | None = None
        assert self._proc.stdout is not None
        first = _readline(self._proc.stdout, _START_TIMEOUT_S)
        word, _, rest = first.partition(" ")
        if word == "ready":
            reply = json.loads(rest)
            self._fixed: dict[str, str] = reply["fixed"]
            self._imports_set: dict[str, str] = reply["imports_set"]
        else:
            self._fixed, self._imports_set = {}, {}
            self.refused = rest.strip() or first.strip() or "the server exited while importing"
        self._reader = threading.Thread(target=self._read_replies, name="forkserver-replies", daemon=True)
        self._reader.start()

    def can_run(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``spawn`` serves this request (module docstring)."""
        return self.why_not(argv, env) is None

    def why_not(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        """Why ``spawn`` would not serve this request, or None when it would."""
        if self.refused is not None:
            return f"the server refused to fork: {self.refused}"
        if self._closed or self._proc.poll() is not None:
            return "the server has stopped"
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
            return "not a `python -m` command of this interpreter"
        fixed = fixed_env(env, self._imports_set)
        differ = sorted(k for k in set(fixed) | set(self._fixed) if fixed.get(k) != self._fixed.get(k))
        if differ:
            return f"environment variables differ from the server's: {', '.join(differ)}"
        return None

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, stdout: str, stderr: str
    ) -> ForkedProcess:
        """Fork a child running ``argv`` (``can_run`` must hold); its output goes to the two paths."""
        why = self.why_not(argv, env)
        if why is not None:
            raise RuntimeError(f"the fork server cannot run {list(argv)[:3]}: {why}")
        with self._cond:
            request_id = self._next_id
            self._next_id += 1
        request = {
            "id": request_id,
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd or os.getcwd(),
            "stdout": stdout,
            "stderr": stderr,
        }
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(request) + "\n").encode())
        self._proc.stdin.flush()
        with self._cond:
            if not self._cond.wait_for(
                lambda: request_id in self._pids or self._proc.poll() is not None, _SPAWN_TIMEOUT_S
            ):
                raise RuntimeError("the fork server did not answer a spawn request")
            if request_id not in self._pids:
                raise RuntimeError(f"the fork server exited (code {self._proc.returncode})")
            return ForkedProcess(self, self._pids.pop(request_id))

    def close(self) -> None:
        """Stop the server (it kills the process groups of its children still running)."""
        if self._closed:
            return
        self._closed = True
        with suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._proc.poll() is not None, timeout)
            if pid in self._exits:
                return self._exits[pid]
            if self._proc.poll() is not None:  # the server is gone, and with it the reaping
                return -signal.SIGKILL if not os.path.exists(f"/proc/{pid}") else None
            return None

    def _read_replies(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            word, *fields = raw.decode().split()
            with self._cond:
                if word == "pid":
                    self._pids[int(fields[0])] = int(fields[1])
                elif word == "exit":
                    self._exits[int(fields[0])] = int(fields[1])
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()


def _readline(stream: Any, timeout_s: float) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline().decode() if ready else ""


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared(preload: Sequence[str]) -> ForkServer | None:
    """This process's fork server (started on first use, stopped at exit); None where it refused."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._proc.poll() is not None:
            _shared = ForkServer(preload)
            atexit.register(_shared.close)
        return _shared if _shared.refused is None else None


# ---------------------------------------------------------------------------------- server side


#: The server's answers go to this descriptor (its stdout when it started); its fd 1 becomes its
#: stderr, so that nothing an import prints can garble them. Children close it.
_replies_fd = 1


def _send(line: str) -> None:
    os.write(_replies_fd, (line + "\n").encode())


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc: trust threading's view
        return threading.active_count()


def _run_child(request: dict[str, Any], added: Mapping[str, str]) -> None:
    """In the forked child: become the requested ``python -m module args`` process; never returns.
    ``added``: the variables the server's imports set, which the requested environment lacks."""
    code = 1
    try:
        os.setsid()
        os.close(_replies_fd)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.dup2(out, fd)
            os.close(out)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**added, **request["env"]})
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:] = [os.getcwd(), *extra, *sys.path[1:]]
        module, args = request["argv"][2], request["argv"][3:]
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        with suppress(Exception):
            atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the child must exit here whatever happened
        traceback.print_exc()
    finally:
        with suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _serve(preload: Sequence[str]) -> int:
    global _replies_fd
    _replies_fd = os.dup(1)
    os.dup2(2, 1)
    for key, value in _RANK_DEFAULTS.items():
        os.environ.setdefault(key, value)
    before = dict(os.environ)
    for module in preload:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as missing:  # an optional one (pytest without the dev extra)
            if missing.name != module:
                raise
    threads = _thread_count()
    if threads != 1:
        _send(f"refuse {threads} threads after importing {' '.join(preload)}")
        return 0
    # what the imports set (Inductor's cache folder), as a cold process would have it too
    added = {k: v for k, v in os.environ.items() if k not in before}
    _send("ready " + json.dumps({"fixed": fixed_env(before), "imports_set": added}))
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], _POLL_S)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:  # the client is gone
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _run_child(request, added)
                children.add(pid)
                _send(f"pid {request['id']} {pid}")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
    for pid in children:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    for pid in children:
        with suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
