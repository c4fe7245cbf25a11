"""The ``dhelix`` command line (also ``python -m dhelix_compile``).

Commands (one ``_add_<name>`` function each registers its sub-parser and handler; building the
parsers imports no torch, the commands import it when they run):

    report DUMP_DIR [--html]   the predicted summary of every graph dumped under DUMP_DIR
                               (``rank*/`` folders included), as a table, then each rank's
                               compile time; ``--html`` also writes DUMP_DIR/index.html
                               linking every graph's page
    demo [--model M] ...       train a TP+SP SwiGLU MLP block (or --model M) with helix on 2 ranks
                               over a rate-limited link: losses beside eager's, step times vs
                               Inductor and the ceiling
    simulate [--setting S]     cluster-scale predictions of the cost model for the DHelix
                               paper's settings: sequential vs dhelix step time and MFU;
                               an emulated setting's bench variants; ``--from-bench FILE``:
                               the predictions beside a recorded emulated bench run
    bench [--rate R] ...       every variant in one interleaved run beside T_compute, T_comm
                               and the limit max(T_compute, T_comm) (``dhelix_compile.bench.run``)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _run_report(args: argparse.Namespace) -> int:
    from dhelix_compile.observe.report import collect_summaries, dump_index_html, report

    if not collect_summaries(args.dump_dir):
        print(f"no summary.json under {args.dump_dir}", file=sys.stderr)
        return 1
    sys.stdout.write(report(args.dump_dir))
    if args.html:
        page = Path(args.dump_dir) / "index.html"
        page.write_text(dump_index_html(args.dump_dir))
        print(f"wrote {page}")
    return 0


def _add_report(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("report", help="print the predicted summary of a dump directory as a table")
    parser.add_argument("dump_dir", metavar="DUMP_DIR", help="a dhelix dump_dir (DHELIX_DUMP_DIR)")
    parser.add_argument("--html", action="store_true", help="also write DUMP_DIR/index.html")
    parser.set_defaults(handler=_run_report)


def _add_module_command(commands: argparse._SubParsersAction, name: str, help_text: str, module: Any) -> None:
    """A command whose module brings its own ``add_arguments(parser)``, ``run(args)`` and docstring."""
    parser = commands.add_parser(
        name, help=help_text, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)


def _add_demo(commands: argparse._SubParsersAction) -> None:
    from dhelix_compile.bench import demo

    _add_module_command(
        commands,
        "demo",
        "train a TP+SP SwiGLU MLP block with helix beside eager on 2 ranks, then time eager, Inductor and helix "
        "on a rate-limited link",
        demo,
    )


def _add_bench(commands: argparse._SubParsersAction) -> None:
    from dhelix_compile.bench import run as bench_run

    _add_module_command(
        commands, "bench", "every variant in one interleaved run beside T_compute, T_comm and the limit", bench_run
    )


def _run_simulate_bench(args: argparse.Namespace) -> int:
    """``simulate --from-bench FILE...``: each recorded emulated run beside its predictions."""
    from cost_model import cluster
    from dhelix_compile.bench.recorded import load_bench

    attention = cluster.MEASURED_ATTENTION_EFFICIENCY
    print(
        "Predictions of the cost model (cost_model/cluster/emulated.py) beside measurements of the emulated "
        "cluster (dhelix bench --link emulated:...). Measured: the bench's step, host time, own compute and "
        "communication, bytes and transfers. Assumed: elementwise ops at the datasheet's memory bandwidth, the "
        "programs each variant's passes make (cost_model.cluster.emulated.VARIANT_PROGRAMS; helix on any helix_schedule).\n"
    )
    for path in args.from_bench:
        try:
            setting, record = load_bench(path)
            comparison = cluster.compare_bench(
                setting, record, matmul_efficiency=_efficiency(args, cluster), attention_efficiency=attention
            )
        except (OSError, ValueError) as err:
            print(f"dhelix simulate: {path}: {err}", file=sys.stderr)
            return 2
        print(cluster.format_bench_comparison(comparison, source=str(path)))
    return 0


def _run_simulate_emulated(args: argparse.Namespace) -> int:
    """``simulate --setting <an emulated setting>``: its bench variants, predicted."""
    from cost_model import cluster

    setting = cluster.EMULATED_SETTINGS[args.setting]
    matmul, attention = _efficiency(args, cluster), cluster.MEASURED_ATTENTION_EFFICIENCY
    preds = [
        cluster.predict_variant(setting, v, matmul_efficiency=matmul, attention_efficiency=attention)
        for v in ("inductor", "dhelix", "helix")
    ]
    print(
        "Predictions from the cost model (cost_model/cluster/emulated.py), not measurements; "
        "`--from-bench FILE` sets them beside a recorded run.\n"
    )
    print(cluster.format_variant_predictions(setting, preds, matmul, attention))
    return 0


def _efficiency(args: argparse.Namespace, cluster: Any) -> float:
    return float(cluster.MEASURED_MATMUL_EFFICIENCY if args.matmul_efficiency is None else args.matmul_efficiency)


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    """``simulate``: cluster-scale step predictions of the cost model (``cost_model.cluster``)."""

    def run(args: argparse.Namespace) -> int:
        import json

        from cost_model import cluster

        if args.from_bench:
            return _run_simulate_bench(args)
        if args.setting in cluster.EMULATED_SETTINGS:
            return _run_simulate_emulated(args)
        names = None if args.setting == "all" else [args.setting]
        try:
            preds = cluster.simulate_settings(
                names, contention_factor=args.contention, matmul_efficiency=_efficiency(args, cluster)
            )
        except (cluster.UnknownSettingError, ValueError) as err:
            print(f"dhelix simulate: {err}", file=sys.stderr)
            return 2
        factors = ", ".join(sorted({f"{p.contention_factor:g}" for p in preds}))
        contention = f"{factors} (the devices' default)" if args.contention is None else f"{args.contention:g}"
        efficiency = (
            f"{cluster.MEASURED_MATMUL_EFFICIENCY:g} ({cluster.MATMUL_EFFICIENCY_SOURCE})"
            if args.matmul_efficiency is None
            else f"{args.matmul_efficiency:g} (given; 1 = roofline)"
        )
        print(
            "Predictions from the cost model (cost_model/cluster/), not measurements. "
            f"Contention factor: {contention} (assumed); matmul efficiency: {efficiency}; "
            "model shapes, links and batch sizes marked 'Assumed' below are assumptions, the paper's numbers "
            "are read from its figures. Sequential = Megatron-like, nothing overlapped; dhelix = the Strand "
            "Interleaving DP of graph_passes/interleave.py over one micro-batch's forward and another's "
            "backward.\n"
        )
        print(f"Paper: {cluster.PAPER_SUMMARY}.\n")
        if len(preds) > 1:
            print(cluster.format_summary(preds))
        for pred in preds:
            print(cluster.format_prediction(pred))
        if args.json:
            Path(args.json).write_text(json.dumps([p.to_dict() for p in preds], indent=2) + "\n")
            print(f"wrote {args.json}")
        return 0

    parser = commands.add_parser(
        "simulate",
        help="predicted step time and MFU of the DHelix paper's cluster settings (cost model, sequential vs dhelix)",
    )
    parser.add_argument(
        "--setting",
        default="all",
        metavar="NAME|all",
        help="one setting (e.g. a40-llama-8b, or an emulated one: h200-emulated-llama3_8b_gpu-tp8-ib400; an unknown "
        "name lists them) or 'all' (default: the paper's settings)",
    )
    parser.add_argument(
        "--contention",
        type=float,
        default=None,
        metavar="F",
        help="compute slowdown while the other strand's transfer is in flight (default: the device's)",
    )
    parser.add_argument(
        "--matmul-efficiency",
        type=float,
        default=None,
        metavar="E",
        help="achieved share of peak bf16 FLOP/s for matmuls and attention (default: 0.76, measured on an H200; "
        "1.0: roofline)",
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the predictions as JSON to OUT")
    parser.add_argument(
        "--from-bench",
        action="append",
        default=None,
        metavar="FILE",
        help="a recorded emulated bench result (dhelix bench --link emulated:... --out FILE; e.g. docs/results/"
        "2026-11-28-h200-emulated-tp8-ib400.json): its setting's predictions per variant beside the measured steps "
        "(repeatable)",
    )
    parser.set_defaults(handler=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dhelix", description="dhelix: a torch.compile backend that hides communication"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_report(commands)
    _add_demo(commands)
    _add_bench(commands)
    _add_simulate(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))
