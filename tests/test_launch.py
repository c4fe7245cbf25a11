"""Tests of the one launcher, ``dhelix_compile.launch.ranks.launch_ranks``: loopback, rate-limited namespaces, cleanup.

The namespace tests need root, ``ip`` and ``tc`` (``can_rate_limit()``) and are skipped without
them. After every test no namespace made by this process (``dhx<pid>-...``) may remain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dhelix_compile.launch.link as link_module
from dhelix_compile.launch.link import LinkSpec, can_rate_limit
from dhelix_compile.launch.ranks import LaunchResult, launch_ranks

pytestmark = pytest.mark.multirank

CAN_RATE_LIMIT, WHY_NOT = can_rate_limit()
needs_netns = pytest.mark.skipif(not CAN_RATE_LIMIT, reason=f"cannot make rate-limited namespaces here: {WHY_NOT}")
LOOPBACK = LinkSpec(rate=None)
RATE = "100mbit"
GATHER_FLOATS = 1 << 20  # 4 MiB of float32 sent by each rank

# Inits gloo from the environment, all-reduces, then times one all_gather of 4 MiB per rank.
GLOO_PROGRAM = textwrap.dedent(
    f"""
    import os, time
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    x = torch.full(({GATHER_FLOATS},), float(rank))
    out = [torch.empty_like(x) for _ in range(world)]
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_gather(out, x)
    elapsed = time.perf_counter() - t0
    assert all(bool((o == r).all()) for r, o in enumerate(out))
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "DHX_T")
    env = " ".join(f"{{k}}={{os.environ.get(k)}}" for k in keys)
    print(f"sum={{total.item()}} elapsed={{elapsed:.4f}} {{env}}", flush=True)
    dist.destroy_process_group()
    """
)

# Starts a grandchild, records both pids, then sleeps far past any test's timeout.
SLEEPER_PROGRAM = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    path = os.path.join(os.environ["DHX_PID_DIR"], "pids" + os.environ["RANK"])
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(path + ".tmp", path)
    print("rank", os.environ["RANK"], "is sleeping", file=sys.stderr, flush=True)
    time.sleep(120)
    """
)


def _my_namespaces(pid: int | None = None) -> list[str]:
    prefix = f"dhx{os.getpid() if pid is None else pid}-"
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix)]


@pytest.fixture(autouse=True)
def _no_namespace_left() -> Iterator[None]:
    yield
    if CAN_RATE_LIMIT:
        assert _my_namespaces() == []


def _parse(result: LaunchResult) -> list[dict[str, str]]:
    assert result.returncodes == [0] * len(result.returncodes), result.stderr
    rows = []
    for out in result.stdout:
        line = out.strip().splitlines()[-1]
        rows.append(dict(item.split("=", 1) for item in line.split()))
    return rows


def _is_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie is dead, just unreaped


def _wait_gone(pids: list[int], within_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if not _is_gone(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if not _is_gone(pid)]


def _read_pids(pid_dir: Path, world_size: int) -> list[int]:
    return [int(p) for r in range(world_size) for p in (pid_dir / f"pids{r}").read_text().split()]


# ---- launching ------------------------------------------------------------------------------


def test_loopback_all_reduce() -> None:
    result = launch_ranks([sys.executable, "-c", GLOO_PROGRAM], 2, LOOPBACK, timeout_s=60, env={"DHX_T": "seen"})
    assert result.link.startswith("loopback (no rate requested")
    assert not result.rate_limited
    rows = _parse(result)
    for rank, row in enumerate(rows):
        assert row["sum"] == "3.0"
        assert (row["RANK"], row["LOCAL_RANK"], row["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert row["MASTER_ADDR"] == "127.0.0.1"
        assert row["DHX_T"] == "seen"


@needs_netns
def test_namespaces_all_reduce_and_rate() -> None:
    result = launch_ranks([sys.executable, "-c", GLOO_PROGRAM], 2, LinkSpec(rate=RATE), timeout_s=60)
    assert result.rate_limited
    assert result.link.startswith(f"veth {RATE} tbf (namespaces dhx{os.getpid()}-")
    rows = _parse(result)
    assert [row["sum"] for row in rows] == ["3.0", "3.0"]
    assert rows[0]["MASTER_ADDR"].startswith("10.")
    ifnames = [row["GLOO_SOCKET_IFNAME"] for row in rows]
    assert len(set(ifnames)) == 2 and all(0 < len(name) <= 15 for name in ifnames)
    # Each rank sends its 4 MiB over its own direction of the link.
    theory_s = GATHER_FLOATS * 4 * 8 / 100e6
    elapsed = max(float(row["elapsed"]) for row in rows)
    print(f"all_gather of 4 MiB/rank at {RATE}: {elapsed:.3f} s (rate alone: {theory_s:.3f} s)")
    assert 0.5 * theory_s <= elapsed <= 30 * theory_s


@needs_netns
def test_bad_rate_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="fast"):
        launch_ranks([sys.executable, "-c", "pass"], 2, LinkSpec(rate="fast"), timeout_s=20)


@needs_netns
def test_four_ranks_get_a_rate_limited_link_each_through_a_bridge() -> None:
    """More than two ranks: a star (every rank's namespace joined to a bridge in a hub namespace)."""
    result = launch_ranks([sys.executable, "-c", GLOO_PROGRAM], 4, LinkSpec(rate=RATE), timeout_s=90)
    assert result.rate_limited and result.link.startswith(f"4 veth links of {RATE} tbf each way")
    rows = _parse(result)
    assert [row["sum"] for row in rows] == ["10.0"] * 4
    ifnames = [row["GLOO_SOCKET_IFNAME"] for row in rows]
    assert len(set(ifnames)) == 4 and all(0 < len(name) <= 15 for name in ifnames)


def test_loopback_allows_three_ranks_and_sets_rank_env() -> None:
    program = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'])"
    result = launch_ranks([sys.executable, "-c", program], 3, LOOPBACK, timeout_s=20)
    assert result.returncodes == [0, 0, 0]
    assert [out.split() for out in result.stdout] == [["0", "3"], ["1", "3"], ["2", "3"]]


def test_peers_of_a_failed_rank_are_killed_after_grace() -> None:
    program = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '0' else time.sleep(60)"
    start = time.monotonic()
    result = launch_ranks([sys.executable, "-c", program], 2, LOOPBACK, timeout_s=30, failure_grace_s=0.5)
    assert result.returncodes == [3, -signal.SIGKILL]
    assert time.monotonic() - start < 10


def test_loopback_rendezvous_is_a_store_this_process_hosts() -> None:
    """No free-port race: the launcher binds port 0 and every rank joins as a client (torchrun's way)."""
    program = "import os; print(os.environ['MASTER_PORT'], os.environ['TORCHELASTIC_USE_AGENT_STORE'])"
    first = launch_ranks([sys.executable, "-c", program], 2, LOOPBACK, timeout_s=20)
    second = launch_ranks([sys.executable, "-c", program], 2, LOOPBACK, timeout_s=20)
    for result in (first, second):
        assert result.returncodes == [0, 0]
        ports = {out.split()[0] for out in result.stdout}
        assert len(ports) == 1 and all(out.split()[1] == "True" for out in result.stdout)


# ---- timeouts and signals -------------------------------------------------------------------


@pytest.mark.parametrize(
    "link",
    [
        pytest.param(LOOPBACK, id="loopback"),
        pytest.param(LinkSpec(rate="1gbit"), id="netns", marks=needs_netns),
    ],
)
def test_timeout_kills_every_process(link: LinkSpec, tmp_path: Path) -> None:
    with pytest.raises(TimeoutError) as info:
        launch_ranks(
            [sys.executable, "-c", SLEEPER_PROGRAM],
            2,
            link,
            timeout_s=4,
            env={"DHX_PID_DIR": str(tmp_path)},
        )
    message = str(info.value)
    assert "ranks [0, 1] did not finish" in message
    assert "rank 0 is sleeping" in message and "rank 1 is sleeping" in message
    pids = _read_pids(tmp_path, 2)
    assert _wait_gone(pids) == []


@pytest.mark.parametrize(
    "rate",
    [pytest.param(None, id="loopback"), pytest.param("1gbit", id="netns", marks=needs_netns)],
)
def test_sigterm_cleans_up(rate: str | None, tmp_path: Path) -> None:
    launcher = textwrap.dedent(
        f"""
        import sys
        from dhelix_compile.launch.ranks import LinkSpec, launch_ranks
        launch_ranks([sys.executable, "-c", {SLEEPER_PROGRAM!r}], 2,
                     LinkSpec(rate={rate!r}), timeout_s=60,
                     env={{"DHX_PID_DIR": {str(tmp_path)!r}}})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60  # the launcher imports torch first
        while not all((tmp_path / f"pids{r}").exists() for r in range(2)):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.05)
        if rate is not None:
            assert len(_my_namespaces(proc.pid)) == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert _wait_gone(_read_pids(tmp_path, 2)) == []
    if CAN_RATE_LIMIT:
        assert _my_namespaces(proc.pid) == []


def test_falls_back_to_loopback_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link_module, "can_rate_limit", lambda: (False, "not root"))
    program = "import os; print(os.environ['MASTER_ADDR'])"
    result = launch_ranks([sys.executable, "-c", program], 2, LinkSpec(rate="1gbit"), timeout_s=20)
    assert result.link == "loopback (not root)" and not result.rate_limited
    assert result.returncodes == [0, 0] and result.stdout == ["127.0.0.1\n"] * 2
