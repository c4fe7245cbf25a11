"""The repository keeps its promises: CI installs and tests exactly as the README says, in a fresh venv."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The last step of each README command that CI runs: the demo, the quick suite, the full suite.
LAST_STEPS = ("dhelix demo", "python -m pytest -q", "DHELIX_TEST_FULL=1 python -m pytest -q")


def _readme_command_lines(last_step: str) -> list[str]:
    """The README's lines ``pip install torch ... && <last_step>``: what ``.ci/run`` looks for."""
    lines = (ROOT / "README.md").read_text().splitlines()
    return [line for line in lines if line.startswith("pip install torch") and line.endswith(f" && {last_step}")]


def _ci_readme_command() -> str:
    """``.ci/run``'s own ``readme_command`` function, as bash source."""
    ci = (ROOT / ".ci" / "run").read_text()
    found = re.search(r"^readme_command\(\) \{.*?^\}$", ci, flags=re.M | re.S)
    assert found, ".ci/run lost its readme_command function"
    return found.group(0)


def test_each_readme_command_is_one_fenced_line() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    for last_step in LAST_STEPS:
        (line,) = _readme_command_lines(last_step)
        assert f"{line}\n" in blocks, f"{last_step!r}: one fenced line (CI runs it)"
    (full,) = _readme_command_lines(LAST_STEPS[2])
    assert "'.[dev,hf]'" in full, "the full suite installs the hf extra: its Hugging Face tests run"


def test_ci_picks_each_readme_command_by_its_last_step() -> None:
    """``readme_command`` run by bash finds the same one line for each last step; the quick suite's
    command is not mistaken for the full one, whose line also ends in ``python -m pytest -q``."""
    function = _ci_readme_command()
    for last_step in LAST_STEPS:
        script = f"repo={shlex.quote(str(ROOT))}\n{function}\nreadme_command {shlex.quote(last_step)}"
        picked = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
        assert picked.splitlines() == _readme_command_lines(last_step)
    script = f"repo={shlex.quote(str(ROOT))}\n{function}\nreadme_command 'no such step'"
    missing = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert missing.returncode != 0 and "no such step" in missing.stderr


def test_ci_runs_the_readme_commands() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    for last_step in LAST_STEPS:
        assert f'readme_command "{last_step}"' in ci
    assert 'eval "$full_cmd"' in ci


def test_ci_builds_a_fresh_virtual_environment() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^python3 -m venv \"\$venv\"$", ci, flags=re.M), "CI must create its own, empty venv"
    assert re.search(r"venv=\$\(mktemp -d", ci), "in a fresh temporary folder"
    assert '. "$venv/bin/activate"' in ci
    assert "python -m dhelix_compile.testing.smoke" in ci and "dhelix demo --help" in ci
