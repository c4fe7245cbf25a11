"""The examples users copy from run as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multirank
@pytest.mark.timeout(400)
@pytest.mark.skipif(
    not os.environ.get("DHELIX_TEST_FULL"), reason="DHELIX_TEST_FULL=1: 80 s, over the default suite's time budget"
)
def test_train_llama_under_torchrun_matches_eager() -> None:
    """``torchrun --nproc-per-node 2 examples/train_llama.py``: helix's losses equal eager's (the
    script exits non-zero otherwise) and rank 0 prints the table."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(ROOT / "examples" / "train_llama.py"), "--steps", "2", "--microbatches", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=360, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "losses agree with eager" in done.stdout
    assert "| 2 | " in done.stdout and "helix vs Inductor:" in done.stdout
