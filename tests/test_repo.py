"""The repository keeps its promises: CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    test_commands = [b.strip() for b in blocks if "python -m pytest" in b]
    assert len(test_commands) == 1, test_commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_commands[0] in ci.splitlines()
