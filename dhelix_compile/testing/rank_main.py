"""One rank of ``run_on_ranks``: ``python -m dhelix_compile.testing.rank_main WORKDIR``.

Reads ``WORKDIR/job.pkl`` (``fn, args, kwargs, pg_timeout_s, num_threads``), joins the gloo
group through ``env://`` (the launcher set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``),
calls ``fn(rank, world_size, *args, **kwargs)`` and writes ``("ok", pickled result, time)`` or
``("exception", traceback, time)`` to ``WORKDIR/rank<r>.result``. SIGUSR1 dumps every thread's
stack to ``WORKDIR/rank<r>.stacks`` (the launcher sends it to a rank it is about to kill); a
fatal signal (a segfault, glibc's abort on heap corruption) prints them to stderr, which the
launcher reports with the crash.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path


def main(workdir: Path) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stack_file = open(workdir / f"rank{rank}.stacks", "w")  # noqa: SIM115 (lives with the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a crash (SIGSEGV, SIGABRT) shows where
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    result_path = workdir / f"rank{rank}.result"
    import torch
    import torch.distributed as dist

    outcome: tuple[str, object, float]  # (status, pickled result or traceback, time)
    try:
        fn, args, kwargs, pg_timeout_s, num_threads = pickle.loads((workdir / "job.pkl").read_bytes())
        torch.set_num_threads(num_threads)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout_s))
        outcome = ("ok", pickle.dumps(fn(rank, world_size, *args, **kwargs)), time.time())
    except BaseException:  # noqa: BLE001 (reported to the parent, which raises)
        # Report before tearing down: peers notice the teardown and fail right after.
        outcome = ("exception", traceback.format_exc(), time.time())
    _write(result_path, outcome)
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a failed rank's teardown must not mask its error
            dist.destroy_process_group()
    return 0 if outcome[0] == "ok" else 1


def _write(path: Path, outcome: tuple[str, object, float]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(outcome))
    tmp.replace(path)  # whole or not at all: a rank killed mid-write leaves no half result


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
