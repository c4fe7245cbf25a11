"""The ``dhelix`` command line: its parsers build without torch (``--help`` answers at once), its help
says what the commands do, and launched ranks' progress reaches the parent's bar."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dhelix_compile.bench import progress_file
from dhelix_compile.bench.choices import MODEL_NAMES
from dhelix_compile.cli import main

ROOT = Path(__file__).resolve().parents[1]
HELP_COMMANDS = ([], ["report"], ["demo"], ["bench"], ["simulate"])


def test_building_the_parsers_imports_no_torch() -> None:
    code = (
        "import sys; from dhelix_compile.cli import build_parser; build_parser();"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sympy', 'numpy')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.parametrize("command", HELP_COMMANDS, ids=lambda c: " ".join(c) or "dhelix")
def test_help_imports_no_torch(command: list[str]) -> None:
    """``python -X importtime -m dhelix_compile ... --help``: every module it imported, none of them torch."""
    argv = [sys.executable, "-X", "importtime", "-m", "dhelix_compile", *command, "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: {' '.join(['dhelix', *command])} ")
    imported = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "dhelix_compile.cli" in imported  # the guard reads what it should
    assert not [m for m in imported if m.split(".")[0] == "torch"], "--help imported torch"


def _help(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's line breaks undone


def test_bench_help_shows_the_command_and_lists_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "bench")
    assert "dhelix bench --model small" in text
    assert "python -m dhelix_compile.bench.run" not in text
    assert not re.search(r"--mode\b", text)  # the workers' option, not the command's
    assert ", ".join(MODEL_NAMES) in text
    assert "ib400 50.0 GB/s per direction" in text  # the link presets, from cost_model.links


def test_demo_help_names_what_it_trains(capsys: pytest.CaptureFixture[str]) -> None:
    assert "train a TP+SP SwiGLU MLP block with helix" in _help(capsys)
    assert "default mlp_medium, a SwiGLU MLP block" in _help(capsys, "demo")


def test_progress_file_feeds_the_parents_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_file, "POLL_S", 0.01)
    path = tmp_path / "run.progress"
    err = ""
    with progress_file.progress_from_file(path, "  train steps"):
        ranks = [progress_file.ProgressFile(path, total=4), progress_file.ProgressFile(None, total=4)]
        for rank in ranks:  # rank 0 writes, the others do not
            rank.step("eager")
            rank.step("helix")
        deadline = time.monotonic() + 30
        while "train steps" not in err and time.monotonic() < deadline:  # the bar is drawn
            time.sleep(0.01)
            err += capsys.readouterr().err
    err += capsys.readouterr().err  # the bar closed: its last state
    assert path.read_text() == "2 4 helix\n"
    assert "  train steps [" in err and "2/4" in err and "helix" in err, err
