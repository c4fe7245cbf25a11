"""The project's prose states what is true, not how it came to be.

A measurement carries its date, commit, command and machine; the period of work that made it
("the ninth session", "this afternoon", "until 2026-11-27 ...", "no longer ...") is history, which
git keeps. This test reads the Markdown pages (README.md, BENCHMARKS.md, docs/**/*.md) and the
Python files of the packages, tests and examples (their comments, docstrings and option docs, read
line by line) and names every ``file:line`` where such a phrase appears.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PY_DIRS = ("dhelix_compile", "graph_passes", "cost_model", "tests", "examples")
MARKDOWN = ("README.md", "BENCHMARKS.md")

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\\d+(?:st|nd|rd|th)"
)
_DATE = r"20\d\d-\d\d-\d\d"
# the words a passive "is used to <verb>" puts before "used to"; any other "used to" tells history
_PASSIVE = ("is", "are", "was", "were", "be", "been", "being", "get", "gets", "got")

#: Each pattern names one way of telling the period of work; matched case-insensitively.
HISTORY_PATTERNS: dict[str, re.Pattern[str]] = {
    "a session of work": re.compile(
        rf"\b(?:{_ORDINALS}|this|that|last|next|previous|earlier|later|same)\s+(?:work\s+)?sessions?\b", re.I
    ),
    "a time of day": re.compile(r"\b(?:afternoon|morning|evening|tonight|yesterday|late night)s?\b", re.I),
    "a faster or slower day": re.compile(r"\b(?:fast|faster|slow|slower)\s+day\b", re.I),
    "a change dated": re.compile(rf"\b(?:until|till|since|before)\s+(?:the\s+)?{_DATE}", re.I),
    "before, as a sentence": re.compile(r"\bBefore,\s"),
    "no longer": re.compile(r"\bno longer\b(?!\s+than)", re.I),
    "used to": re.compile("".join(rf"(?<!\b{w} )" for w in _PASSIVE) + r"\bused to\b", re.I),
    "a period of work": re.compile(r"\bperiods? of work\b", re.I),
    "an earlier run or version": re.compile(r"\bearlier\s+(?:runs?|versions?|code|tables?)\b", re.I),
    "first found": re.compile(r"\bfirst found (?:in|on|by|during)\b", re.I),
    "until now": re.compile(r"\buntil now\b", re.I),
}


def history_phrases(text: str) -> list[tuple[str, str, int]]:
    """Every (pattern name, matched text, offset) in ``text``."""
    found = [(name, m.group(0), m.start()) for name, pat in HISTORY_PATTERNS.items() for m in pat.finditer(text)]
    return sorted(found, key=lambda hit: hit[2])


def _joined(text: str) -> str:
    """``text`` with each line's indentation and comment marker dropped, so that a phrase broken over two
    comment lines reads as one; the line breaks stay, so offsets keep their line numbers."""
    return re.sub(r"\n[ \t]*(?:#+[ \t]*)?", "\n", text)


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in MARKDOWN if (ROOT / name).is_file()]
    files += sorted((ROOT / "docs").rglob("*.md")) if (ROOT / "docs").is_dir() else []
    for d in PY_DIRS:
        files += sorted((ROOT / d).rglob("*.py"))
    return [f for f in files if f.resolve() != Path(__file__).resolve()]


HISTORY_SAMPLES = [
    "measured in the ninth session",
    "as the fourteenth session found",
    "this session's runs",
    "the 12th session",
    "in the previous session",
    "on a faster afternoon",
    "a slow afternoon",
    "Same machine, a slower day",
    "ran this morning",
    "2026-11-25, late night",
    "this module's policy until 2026-11-27",
    "Since 2026-11-26 each repeat's ceiling step is corrected",
    "the parameters no longer count",
    "one such time used to stay in the cache",
    "it used to be slower",
    "what this period of work changed",
    "An earlier run that timed the ops alone",
    "first found in the MoE runs",
    "until now every graph fell back",
    "runs before 2026-11-27 did not record it",
    "Before, every order counted the parameters",
    "policy until\n    # 2026-11-27",
]

PRODUCT_SAMPLES = [
    "the value is used to pick the candidate",
    "the bytes are used to size the bucket",
    "a bound no longer than the timeout",
    "its own process group, like start_new_session",
    "a torch.profiler session is on",
    "run in a fresh session (its own process group)",
    "measured 2026-11-27 at cb1672a on a 2-core Intel Xeon",
    "the first call of a step runs on the partner thread",
    "the earlier of the two waits",
    "variants compared with, first found first",
    "the evenly spaced samples",
    "the step before, as the schedule has it",
]


@pytest.mark.parametrize("text", HISTORY_SAMPLES)
def test_pattern_flags_history(text: str) -> None:
    assert history_phrases(_joined(text)), f"not flagged: {text!r}"


@pytest.mark.parametrize("text", PRODUCT_SAMPLES)
def test_pattern_leaves_product_text(text: str) -> None:
    assert not history_phrases(_joined(text)), f"flagged: {text!r}: {history_phrases(_joined(text))}"


def test_no_development_history() -> None:
    hits = []
    for path in scanned_files():
        text = _joined(path.read_text(encoding="utf-8"))
        for name, phrase, offset in history_phrases(text):
            line = text.count("\n", 0, offset) + 1
            hits.append(f"{path.relative_to(ROOT)}:{line}: {name}: {' '.join(phrase.split())!r}")
    assert not hits, (
        "development history (state what is true, with date, commit, command and machine; git keeps the "
        "history):\n" + "\n".join(hits)
    )
