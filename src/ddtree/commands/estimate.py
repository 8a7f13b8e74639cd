"""`ddtree estimate`: project decode tokens/s for hardware and drafters you do not have.

With no scenario file it runs the bundled seed example (Kimi K2-Thinking shapes, TP 8, B300).
Imports only the estimator (numpy, rich, matplotlib for --report); never torch.
"""

from __future__ import annotations

import argparse
import sys

from ddtree.commands._args import int_list, positive_int, seed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", nargs="?", help="scenario TOML (default: the bundled seed example)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument(
        "--explain", action="store_true", help="print the chain of reasoning, every number labelled"
    )
    p.add_argument("--report", metavar="DIR", help="write report.md and PNG plots to DIR")
    p.add_argument(
        "--records",
        action="append",
        metavar="PATH",
        help="measurement records (JSONL file or folder) to use as anchors; repeatable",
    )
    p.add_argument(
        "--backtest",
        metavar="RECORDS",
        action="append",
        help="leave-one-out over the records' engine runs (calibrate without one, predict it)",
    )
    p.add_argument(
        "--train-budgets",
        type=int_list,
        help="with --backtest: calibrate on runs at these budgets, predict the others",
    )
    p.add_argument(
        "--validate",
        metavar="FOLDER",
        help="predict each published point of FOLDER (e.g. examples/validation) calibrated on "
        "the other sources' points; print the error per point and the MAPE",
    )
    p.add_argument(
        "--samples", type=positive_int, default=10_000, help="Monte Carlo samples (default 10000)"
    )
    p.add_argument("--seed", type=seed, default=0, help="Monte Carlo seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ddtree.perf import report
    from ddtree.perf.catalog import CatalogError
    from ddtree.perf.estimate import estimate, load, run_backtest
    from ddtree.perf.model import ModelError
    from ddtree.perf.scenario import ScenarioError
    from ddtree.perf.units import UnitError
    from ddtree.records import RecordError

    try:
        if args.validate:
            from ddtree.perf import validate

            v = validate.run(args.validate, min(args.samples, 2000), args.seed)
            if args.json:
                print(report.validation_json(v))
            else:
                report.validation_table(v, Console())
            return 0
        if args.backtest:
            sf = load(args.scenario, args.backtest)
            if args.scenario is None:  # hold out records only, not the bundled seed's anchors
                sf.anchors = [a for a in sf.anchors if a.from_records]
            bt = run_backtest(sf, args.train_budgets)
            if not bt.rows:
                print(
                    "ddtree estimate: --backtest found no engine_run records to hold out",
                    file=sys.stderr,
                )
                return 2
            if args.json:
                import json

                print(json.dumps(report.backtest_dict(bt), indent=2))
            else:
                print(report.backtest_text(bt))
            return 0
        sf = load(args.scenario, args.records)
        for note in sf.notes:
            print(f"note: {note}", file=sys.stderr)
        est = estimate(sf, args.samples, args.seed)
    except (ScenarioError, UnitError, CatalogError, ModelError, RecordError) as exc:
        print(f"ddtree estimate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(report.to_json(est))
    elif args.explain:
        print(report.explain(est))
    else:
        report.table(est, Console())
    if args.report:
        paths = report.write_report(est, args.report)
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0
