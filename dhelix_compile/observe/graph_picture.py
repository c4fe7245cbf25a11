"""A picture of a graph: Graphviz DOT, rendered to SVG by ``dot`` when it is installed.

Contract
--------
* :func:`graph_dot` -- DOT text of ``gm``: one box per node, filled by kind (compute,
  collective, wait, p2p, view, other; read from ``node.meta["dhelix"]["kind"]``, else
  :func:`cost_model.op_kinds.kind_of`), outlined in the colour of its strand
  (``meta["dhelix"]["strand"]``, default 0), edges from producers to users. Node order is
  the graph's, so ``dot`` lays out the schedule top to bottom.
* :func:`write_graph_picture` -- writes ``<stem>.dot`` and ``<stem>.svg``: Graphviz's
  rendering when ``shutil.which("dot")`` finds it (timeout :data:`DOT_TIMEOUT_S`), otherwise
  :func:`node_list_svg`, a readable fallback listing the nodes in schedule order with the
  same colours and each node's inputs, as wide as its longest row. Returns how the SVG was made.

Deterministic: the DOT text and the fallback depend only on the graph.
"""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
from pathlib import Path

import torch.fx

from cost_model.op_kinds import kind_of, op_name
from dhelix_compile.observe import svg
from dhelix_compile.observe.timeline import strand_colour

log = logging.getLogger("dhelix")

#: Fill colour per node kind (ColorBrewer-like, readable with black text).
KIND_COLOURS: dict[str, str] = {
    "compute": "#a6c8ec",
    "collective": "#ffb55a",
    "wait": "#ff8a80",
    "p2p": "#d3a6f0",
    "view": "#e6e6e6",
    "other": "#ffffff",
}

#: Seconds ``dot`` may take before the fallback is used instead.
DOT_TIMEOUT_S = 60.0


def node_kind(node: torch.fx.Node) -> str:
    meta = node.meta.get("dhelix")
    if isinstance(meta, dict) and "kind" in meta:
        return str(meta["kind"])
    return kind_of(node)


def node_strand(node: torch.fx.Node) -> int:
    meta = node.meta.get("dhelix")
    return int(meta.get("strand", 0)) if isinstance(meta, dict) else 0


def _target_name(node: torch.fx.Node) -> str:
    return op_name(node) if node.op == "call_function" else node.op


def _dot_id(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def graph_dot(gm: torch.fx.GraphModule, title: str = "") -> str:
    """DOT text of ``gm`` (see the module docstring)."""
    lines = [
        "digraph G {",
        "  rankdir=TB;",
        f"  label={_dot_id(title)}; labelloc=t; fontname=Helvetica;",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10, penwidth=2];',
        '  edge [color="#777777", arrowsize=0.6];',
    ]
    for index, node in enumerate(gm.graph.nodes):
        kind = node_kind(node)
        strand = node_strand(node)
        label = (
            _dot_id(f"{index}: {node.name}")[:-1]
            + "\\n"
            + _dot_id(f"{_target_name(node)} [{kind}, strand {strand}]")[1:]
        )
        lines.append(
            f'  {_dot_id(node.name)} [label={label}, fillcolor="{KIND_COLOURS.get(kind, "#ffffff")}", '
            f'color="{strand_colour(strand)}"];'
        )
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            lines.append(f"  {_dot_id(inp.name)} -> {_dot_id(node.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_dot(dot_text: str, svg_path: Path) -> bool:
    """Render DOT to SVG with Graphviz; False when ``dot`` is missing or fails."""
    dot = shutil.which("dot")
    if dot is None:
        return False
    try:
        subprocess.run(
            [dot, "-Tsvg", "-o", str(svg_path)],
            input=dot_text.encode(),
            check=True,
            capture_output=True,
            timeout=DOT_TIMEOUT_S,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("graphviz failed (%s); writing the node-list picture instead", exc)
        return False
    return True


_ROW_H_PX = 20
_MIN_WIDTH_PX = 1000
_ROW_TEXT_X_PX = 20
_MARGIN_PX = 12


def node_list_svg(gm: torch.fx.GraphModule, title: str = "") -> str:
    """The fallback picture: one coloured row per node in schedule order, with its inputs.

    Rows are never cut: the SVG is as wide as its longest line (``svg.text_width_px``)."""
    nodes = list(gm.graph.nodes)
    height_px = 60 + _ROW_H_PX * (len(nodes) + 2)
    heading = title or "graph"
    note = "Graphviz 'dot' not installed: nodes in schedule order (fill = kind, left bar = strand)"
    lines = []
    for index, node in enumerate(nodes):
        inputs = ", ".join(i.name for i in node.all_input_nodes)
        kind, strand = node_kind(node), node_strand(node)
        lines.append((node, f"{index:4d}  {node.name} = {_target_name(node)}({inputs})   [{kind}, strand {strand}]"))
    width_px = math.ceil(
        max(
            _MIN_WIDTH_PX,
            8 + svg.text_width_px(heading, 14, weight="bold") + _MARGIN_PX,
            8 + svg.text_width_px(note, 11) + _MARGIN_PX,
            *(_ROW_TEXT_X_PX + svg.text_width_px(text, 11, mono=True) + _MARGIN_PX for _, text in lines),
        )
    )
    rows = [svg.text(8, 20, heading, size=14, weight="bold"), svg.text(8, 38, note, size=11)]
    y = 50
    for node, text in lines:
        rows.append(
            f'<rect x="8" y="{y}" width="6" height="{_ROW_H_PX - 3}" fill="{strand_colour(node_strand(node))}"/>'
            f'<rect x="16" y="{y}" width="{width_px - 24}" height="{_ROW_H_PX - 3}" '
            f'fill="{KIND_COLOURS.get(node_kind(node), "#ffffff")}" stroke="#bbb"/>'
        )
        rows.append(svg.text(_ROW_TEXT_X_PX, y + 13, text, size=11, mono=True))
        y += _ROW_H_PX
    legend_x = 8.0
    for kind, colour in KIND_COLOURS.items():
        rows.append(f'<rect x="{legend_x:.1f}" y="{y + 6}" width="14" height="12" fill="{colour}" stroke="#999"/>')
        rows.append(svg.text(legend_x + 18, y + 16, kind, size=11))
        legend_x += 30 + svg.text_width_px(kind, 11)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width_px}" height="{height_px}" '
        f'viewBox="0 0 {width_px} {height_px}" font-family="Helvetica, Arial, sans-serif">\n'
        f'<rect width="{width_px}" height="{height_px}" fill="white"/>\n' + "\n".join(rows) + "\n</svg>\n"
    )


def write_graph_picture(gm: torch.fx.GraphModule, folder: Path, stem: str = "graph", title: str = "") -> str:
    """Write ``<stem>.dot`` and ``<stem>.svg``; returns ``"graphviz"`` or ``"node list"``."""
    dot_text = graph_dot(gm, title)
    (folder / f"{stem}.dot").write_text(dot_text)
    svg_path = folder / f"{stem}.svg"
    if render_dot(dot_text, svg_path):
        return "graphviz"
    svg_path.write_text(node_list_svg(gm, title))
    return "node list"
