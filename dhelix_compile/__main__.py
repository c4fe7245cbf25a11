"""Command line: ``python -m dhelix_compile <command> ...`` (also installed as ``dhelix``).

Commands (one ``_add_<name>`` function each registers its sub-parser and handler):

    report DUMP_DIR [--html]   the predicted summary of every graph dumped under DUMP_DIR
                               (``rank*/`` folders included), as a table; ``--html`` also
                               writes DUMP_DIR/index.html linking every graph's page
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _run_report(args: argparse.Namespace) -> int:
    from dhelix_compile.report import collect_summaries, dump_index_html, format_table

    found = collect_summaries(args.dump_dir)
    if not found:
        print(f"no summary.json under {args.dump_dir}", file=sys.stderr)
        return 1
    sys.stdout.write(format_table(found))
    if args.html:
        page = Path(args.dump_dir) / "index.html"
        page.write_text(dump_index_html(args.dump_dir))
        print(f"wrote {page}")
    return 0


def _add_report(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "report", help="print the predicted summary of a dump directory as a table"
    )
    parser.add_argument("dump_dir", metavar="DUMP_DIR", help="a dhelix dump_dir (DHELIX_DUMP_DIR)")
    parser.add_argument("--html", action="store_true", help="also write DUMP_DIR/index.html")
    parser.set_defaults(handler=_run_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dhelix", description="dhelix: a torch.compile backend that hides communication")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_report(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
