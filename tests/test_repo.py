"""The repository keeps its promises: CI installs and tests exactly as the README says, in a fresh venv."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands(ending: str) -> list[str]:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    return [b.strip() for b in blocks if b.strip().endswith(ending)]


def test_ci_runs_exactly_the_readme_commands() -> None:
    """.ci/run picks the README's lines that start with ``pip install torch`` and end with the command."""
    readme_lines = (ROOT / "README.md").read_text().splitlines()
    ci = (ROOT / ".ci" / "run").read_text()
    for ending in ("dhelix demo", "python -m pytest -q"):
        (block,) = _readme_commands(ending)
        assert "\n" not in block, f"the README's {ending!r} command must stay one line (CI runs it)"
        picked = [line for line in readme_lines if re.fullmatch(rf"pip install torch.*{re.escape(ending)}", line)]
        assert picked[:1] == [block]
        assert f'readme_command "{ending}"' in ci
    assert 'eval "$test_cmd"' in ci


def test_ci_builds_a_fresh_virtual_environment() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^python3 -m venv \"\$venv\"$", ci, flags=re.M), "CI must create its own, empty venv"
    assert re.search(r"venv=\$\(mktemp -d", ci), "in a fresh temporary folder"
    assert '. "$venv/bin/activate"' in ci
    assert "python -m dhelix_compile.testing.smoke" in ci and "dhelix demo --help" in ci
