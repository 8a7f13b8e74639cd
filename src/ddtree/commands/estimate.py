"""`ddtree estimate`: project decode tokens/s for hardware and drafters you do not have.

With no scenario file it runs the bundled seed example (Kimi K2-Thinking shapes, TP 8, B300).
Imports only the estimator (numpy, rich; matplotlib for --report, the [report] extra); never
torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddtree.commands._args import (
    add_json_argument,
    available_cpus,
    int_list,
    output_folder,
    positive_int,
    seed,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", nargs="?", help="scenario TOML (default: the bundled seed example)")
    add_json_argument(p)
    p.add_argument(
        "--explain",
        action="store_true",
        help="after the summary: every parameter, each case's step breakdown and the chain of "
        "reasoning, every number labelled",
    )
    p.add_argument(
        "--report", type=output_folder, metavar="DIR", help="write report.md and PNG plots to DIR"
    )
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
    train = p.add_mutually_exclusive_group()
    train.add_argument(
        "--train-budgets",
        type=int_list,
        help="with --backtest: calibrate on runs at these budgets, predict the others",
    )
    train.add_argument(
        "--train-concurrency",
        type=int_list,
        help="with --backtest: calibrate on runs at these request counts C (bench engine "
        "--concurrency), predict the others: the model's C-scaling against measured runs",
    )
    p.add_argument(
        "--validate",
        metavar="FOLDER",
        nargs="?",
        const="",
        help="score the estimator on published measurements: FOLDER (default: the bundled "
        "corpus, examples/validation) split by source into train (each source predicted from "
        "the other train sources) and test (predicted from all train sources, never fitted); "
        "prints every point, the scores of each split, the test scores last",
    )
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=available_cpus(),
        help="with --validate: worker processes for its fits, one per held-out source (default: "
        "the CPUs this process may use, %(default)s; the scores are the same whatever it is)",
    )
    add_oversubscribe_argument(p)
    p.add_argument(
        "--samples",
        type=positive_int,
        default=10_000,
        help="Monte Carlo samples (default: %(default)s)",
    )
    p.add_argument("--seed", type=seed, default=0, help="Monte Carlo seed (default: %(default)s)")


def add_oversubscribe_argument(p: argparse.ArgumentParser) -> None:
    """--allow-oversubscribe, shared by estimate and tune (the physics checks' memory fit)."""
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="price a configuration whose weights + KV + activations exceed a GPU's memory "
        "(a warning instead of an error)",
    )


def run(args: argparse.Namespace) -> int:
    if args.report:
        from ddtree.extras import require_extra

        require_extra("report", "ddtree estimate --report")
    from ddtree.perf.hardware.catalog import CatalogError
    from ddtree.perf.hardware.units import UnitError
    from ddtree.perf.inputs.scenario import ScenarioError
    from ddtree.perf.shapes.model import ModelError
    from ddtree.records import RecordError

    try:
        if args.validate is not None:
            return validate(args)
        if args.backtest:
            return backtest(args)
        est = estimate_scenario(args)
    except (ScenarioError, UnitError, CatalogError, ModelError, RecordError) as exc:
        # one line, whatever the file's own keys and strings hold (a newline, a \x1c)
        print(f"ddtree estimate: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    show_estimate(args, est)
    return 0


def validate(args: argparse.Namespace) -> int:
    """``--validate``: score the estimator on the published measurements, table or JSON."""
    from ddtree.commands._output import console, progress
    from ddtree.perf.report import render as report
    from ddtree.perf.validation import corpus

    folder = corpus.BUNDLED if not args.validate else Path(args.validate)
    points = corpus.load_points(folder)
    with progress(f"validate ({args.jobs} jobs), fits", total=corpus.fit_count(points)) as bar:
        v = corpus.run(folder, min(args.samples, 2000), args.seed, args.jobs, bar.advance, points)
    if args.json:
        print(report.validation_json(v))
    else:
        report.validation_table(v, console())
    return 0


def backtest(args: argparse.Namespace) -> int:
    """``--backtest``: leave-one-out over the records' engine runs, text or JSON; 2 when there
    is no engine run to hold out."""
    from ddtree.perf.projection.estimate import load, records_warning, run_backtest
    from ddtree.perf.report import render as report

    sf = load(args.scenario, args.backtest, args.allow_oversubscribe)
    if args.scenario is None:  # hold out records only, not the bundled seed's anchors
        sf.anchors = [a for a in sf.anchors if a.from_records]
    mixed = records_warning(sf)
    if mixed:
        print(f"warning: {mixed}", file=sys.stderr)
    bt = run_backtest(sf, args.train_budgets, args.train_concurrency)
    if not bt.rows:
        print(
            "ddtree estimate: --backtest found no engine_run records to hold out", file=sys.stderr
        )
        return 2
    if args.json:
        import json

        print(json.dumps(report.backtest_dict(bt), indent=2))
    else:
        print(report.backtest_text(bt))
    return 0


def estimate_scenario(args: argparse.Namespace):
    """Load the scenario (and ``--records``), print its notes, and estimate it."""
    from ddtree.perf.projection.estimate import estimate, load

    sf = load(args.scenario, args.records, args.allow_oversubscribe)
    for note in sf.notes:
        print(f"note: {note}", file=sys.stderr)
    return estimate(sf, args.samples, args.seed)


def show_estimate(args: argparse.Namespace, est) -> None:
    """The calibration warnings, then JSON, the summary (and ``--explain``), and the
    ``--report`` files."""
    from ddtree.commands._output import console
    from ddtree.perf.report import render as report

    for warning in report.calibration_warnings(est):
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print(report.to_json(est))
    elif args.explain:  # the answer first, then how it was reached
        report.summary(est, console(), details=False)
        print(report.explain(est))
    else:
        report.summary(est, console())
    if args.report:
        paths = report.write_report(est, args.report, on_written=_keeping_report(args.report))
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)


def _keeping_report(folder):
    """``on_written`` for ``write_report``: what an interrupt keeps of the report so far."""
    from ddtree.signals import keep

    done = []

    def written(path) -> None:
        done.append(path.name)
        if path.name != "report.md":
            keep(folder, f"{', '.join(done)} (report.md not written yet)")

    return written
