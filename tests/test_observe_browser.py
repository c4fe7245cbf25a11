"""The dump pages as a person sees them: rendered by headless Chromium, measured in the page.

One helix step (two micro-batches, so a forward, a merged F ⊕ B graph and a backward) of a
sequence-parallel MLP under PyTorch's fake process group writes a dump, as ``dhelix demo`` does
on two ranks. For each graph folder, a copy of its ``index.html`` gets the folder's SVGs inline
and a script that measures every rendered text (``getBBox``, ``getComputedTextLength``) against
its SVG's ``viewBox`` and, for a bar's label, against the bar; ``chromium --headless --dump-dom``
prints the page after the script wrote what it found into it. The test reads that back and checks
titles, legends, the summary rows against the timeline's panels, and that no text is cut.

Needs Debian's ``chromium`` (``.ci/run`` installs it); skipped, saying so, where there is none.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

import dhelix_compile
from cost_model.testing import fake_world

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH to render the dump pages (apt-get install chromium)"
)

#: Runs in the page: measures every text of every inline SVG, and the page's title, heading and
#: rows, and writes the findings as JSON into <pre id="dhelix-check">.
CHECK_SCRIPT = """
<script>
(() => {
  const found = {title: document.title, h1: document.querySelector("h1").textContent, rows: {}, svgs: {}};
  for (const tr of document.querySelectorAll("table tr")) {
    const th = tr.querySelector("th"), td = tr.querySelector("td");
    if (th && td) found.rows[th.textContent] = td.textContent;
  }
  found.tableRight = Math.max(...[...document.querySelectorAll("table")].map(t => t.getBoundingClientRect().right));
  found.windowWidth = window.innerWidth;
  for (const holder of document.querySelectorAll("div[data-file]")) {
    const svg = holder.querySelector("svg");
    const box = svg.viewBox.baseVal;
    const texts = [], cut = [], tooWide = [];
    for (const t of svg.querySelectorAll("text")) {
      const b = t.getBBox(), content = t.textContent;
      texts.push(content);
      if (b.x < box.x - 0.5 || b.y < box.y - 0.5 || b.x + b.width > box.x + box.width + 0.5
          || b.y + b.height > box.y + box.height + 0.5) {
        cut.push([content, b.x, b.x + b.width, box.width]);
      }
      if (t.hasAttribute("data-bar-width")) {
        const right = t.x.baseVal[0].value + t.getComputedTextLength();
        const barRight = Number(t.dataset.barX) + Number(t.dataset.barWidth);
        if (right > barRight + 0.5) tooWide.push([content, right, barRight]);
      }
    }
    found.svgs[holder.dataset.file] = {texts, cut, tooWide,
      labels: svg.querySelectorAll("text[data-bar-width]").length};
  }
  const out = document.createElement("pre");
  out.id = "dhelix-check";
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
})();
</script>
"""


class _SequenceParallelMLP(nn.Module):
    """x (tokens / ranks, d) -> all-gather -> up, relu, down -> reduce-scatter -> a scalar loss."""

    def __init__(self, d: int = 128, hidden: int = 512) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = fc.all_gather_tensor_autograd(x, 0, dist.group.WORLD)
        y = self.down(torch.relu(self.up(full)))
        return fc.reduce_scatter_tensor_autograd(y, "sum", 0, dist.group.WORLD).pow(2).mean()


@pytest.fixture(scope="module")
def rank_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump_dir = tmp_path_factory.mktemp("helix_dump")
    torch._dynamo.reset()
    torch.manual_seed(0)
    with fake_world(4):  # a device and a link from the tables, not this machine's measurements
        model = _SequenceParallelMLP()
        step = dhelix_compile.helix(
            model, None, codegen="eager", fallback="error", dump_dir=str(dump_dir), device="a40", link="eth_25g"
        )
        step([torch.randn(32, 128) for _ in range(2)])
    return dump_dir / "rank0"


def _render(folder: Path) -> dict:
    """``folder``'s index.html with its SVGs inline and CHECK_SCRIPT, as Chromium renders it."""
    inline = "".join(
        f'<div data-file="{name}">{re.sub(r"(?s)^.*?(?=<svg)", "", (folder / name).read_text(), count=1)}</div>'
        for name in ("timeline.svg", "graph.svg")
    )
    page = (folder / "index.html").read_text().replace("</body>", inline + CHECK_SCRIPT + "</body>")
    checked = folder / "_browser_check.html"
    checked.write_text(page)
    assert CHROMIUM is not None
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--window-size=1280,900",
            "--dump-dom",
            checked.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    match = re.search(r'<pre id="dhelix-check">(.*?)</pre>', done.stdout, re.S)
    assert match, done.stderr[-2000:]
    return json.loads(html.unescape(match.group(1)))


@pytest.fixture(scope="module")
def rendered(rank_dir: Path) -> dict[str, dict]:
    return {kind: _render(rank_dir / f"0_0_{kind}") for kind in ("fwd", "merged", "bwd")}


def test_titles_say_what_each_graph_holds(rendered: dict[str, dict]) -> None:
    assert rendered["fwd"]["title"] == "dhelix: 0_0_fwd (forward)"
    assert rendered["bwd"]["title"] == "dhelix: 0_0_bwd (backward)"
    merged = rendered["merged"]
    assert (
        merged["title"]
        == merged["h1"]
        == (
            "dhelix: 0_0_merged (merged: forward of micro-batch i+1 (strand 0) ⊕ "
            "backward of micro-batch i (strand 1); helix steps B0+F1)"
        )
    )


def test_legends_name_each_strands_micro_batch(rendered: dict[str, dict]) -> None:
    texts = rendered["merged"]["svgs"]["timeline.svg"]["texts"]
    for entry in (
        "compute, forward of micro-batch i+1",
        "communication, forward of micro-batch i+1",
        "compute, backward of micro-batch i",
        "communication, backward of micro-batch i",
    ):
        assert entry in texts
    assert not any("strand 0" in t or "strand 1" in t for t in texts)
    assert "compute, forward" in rendered["fwd"]["svgs"]["timeline.svg"]["texts"]


def test_summary_rows_are_the_timeline_panels_numbers(rendered: dict[str, dict]) -> None:
    for kind, page in rendered.items():
        before = page["rows"]["exposed communication, original order (ms)"]
        after = page["rows"]["exposed communication, dhelix schedule (ms)"]
        headers = [t for t in page["svgs"]["timeline.svg"]["texts"] if ": makespan " in t]
        assert [h.split(":")[0] for h in headers] == ["original order", "dhelix schedule"], kind
        for header, order in zip(headers, ("original order", "dhelix schedule"), strict=True):
            compute, comm = page["rows"][f"compute / communication, {order} (ms, as its timeline panel)"].split(" / ")
            makespan = page["rows"][f"predicted makespan, {order} (ms)"]
            exposed = page["rows"][f"exposed communication, {order} (ms)"]
            assert f"makespan {makespan} ms; compute {compute} ms" in header, (kind, header)
            assert f"communication {comm} ms, exposed {exposed} ms" in header, (kind, header)
        share = page["rows"]["share hidden = (exposed before - exposed after) / hideable"]
        assert page["rows"]["hideable communication = exposed, original order (ms)"] == before
        assert share.endswith(f"= ({before} - {after}) / {before}"), (kind, share)


def test_no_text_is_cut(rendered: dict[str, dict]) -> None:
    labels = 0
    for kind, page in rendered.items():
        assert page["tableRight"] <= page["windowWidth"], kind  # the summary fits the window
        for name, found in page["svgs"].items():
            assert not found["cut"], (kind, name, found["cut"])
            assert not found["tooWide"], (kind, name, found["tooWide"])
            assert not any("…" in t for t in found["texts"]), (kind, name)
            labels += found["labels"]
    assert labels > 0  # some bars are wide enough to name their node
