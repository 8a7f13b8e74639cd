"""`ddtree tune`: the best budget per hardware and policy, from measured acceptance
(`ddtree replay tau` records) and the calibrated cost model. Imports no torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree.commands._args import (
    add_json_argument,
    int_list,
    int_list_upto,
    output_folder,
    positive_int,
    seed,
)
from ddtree.commands.estimate import add_oversubscribe_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="scenario TOML: model, drafter, deployment, anchors")
    p.add_argument(
        "--acceptance",
        action="append",
        required=True,
        metavar="RECORDS",
        help="acceptance records (`ddtree replay tau --records`); repeatable",
    )
    p.add_argument("--trace", help="use the acceptance records of this trace fingerprint")
    p.add_argument(
        "--hardware",
        default="b300,h200,this-machine",
        help="comma-separated hardware keys (default: %(default)s; this-machine needs --records "
        "with a bench_bandwidth record)",
    )
    p.add_argument(
        "--records",
        action="append",
        metavar="PATH",
        help="measurement records to calibrate on (JSONL file or folder); repeatable",
    )
    p.add_argument(
        "--train-budgets",
        type=int_list,
        help="calibrate only on engine runs at these budgets, and check the prediction at the "
        "other measured budgets on this-machine (held-out check)",
    )
    p.add_argument(
        "--concurrency",
        type=int_list_upto(4096),
        help="comma-separated request counts C: a curve per C and the table of the best "
        "budget N*(C) (the best tree shrinks as the verify turns compute-bound) (default: the "
        "scenario's C)",
    )
    p.add_argument(
        "--samples", type=positive_int, default=4000, help="Monte Carlo samples per point"
    )
    p.add_argument("--seed", type=seed, default=0, help="Monte Carlo seed")
    add_json_argument(p)
    p.add_argument(
        "--report",
        type=output_folder,
        metavar="DIR",
        help="write tune.md and tune_tokens_vs_budget.png",
    )
    add_oversubscribe_argument(p)


def run(args: argparse.Namespace) -> int:
    if args.report:
        from ddtree.extras import require_extra

        require_extra("report", "ddtree tune --report")
    from ddtree.perf.projection.tune import held_out

    hardware = [h for h in args.hardware.split(",") if h]
    if not hardware:
        raise ValueError("--hardware: expected at least one hardware key")
    sf, measured, curves = tune_curves(args, hardware)
    for note in sf.notes:  # the file's, and the physics warnings of the points swept
        print(f"note: {note}", file=sys.stderr)
    warnings = [w for w in (records_warning(sf, measured),) if w]
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    train = args.train_budgets or []
    check = None
    if train and "this-machine" in hardware:
        check = held_out(curves, sf.anchors, "this-machine", train)
    show_tune(args, curves, check, measured[0], sf.anchors, warnings)
    return 0


def show_tune(args: argparse.Namespace, curves, check, measured, anchors, warnings) -> None:
    """The ``--report`` files, then the JSON document or the tables."""
    if args.report:
        from ddtree.commands._output import note

        for path in write_report(curves, check, Path(args.report), anchors):
            note(f"wrote {path}")
    if args.json:
        print(json.dumps({**to_json(curves, check, measured.trace), "warnings": warnings}))
        return
    from ddtree.commands._output import console

    out = console()
    for part in tune_text(curves, check, measured):
        out.print(part, markup=False, highlight=False)


def tune_curves(args: argparse.Namespace, hardware: list[str]):
    """The scenario, the chosen trace's acceptance and the tuned curves: calibrated on the
    ``--train-budgets`` runs only when given."""
    from ddtree.perf.inputs.acceptance import choose_trace, read_acceptance
    from ddtree.perf.projection.calibrate import calibrate, training_anchors
    from ddtree.perf.projection.estimate import load
    from ddtree.perf.projection.tune import tune

    sf = load(args.scenario, args.records, args.allow_oversubscribe)
    measured = choose_trace(read_acceptance(args.acceptance), args.trace, "--acceptance")
    train = args.train_budgets or []
    anchors = training_anchors(sf.anchors, train) if train else sf.anchors
    cal = calibrate(anchors, sf.specs, sf.fixed)
    curves = tune(sf, cal, hardware, measured, args.samples, args.seed, args.concurrency or ())
    return sf, measured, curves


def records_warning(sf, measured) -> str | None:
    """One line when the engine runs, the bandwidth record and the trace's acceptance records
    tune combines differ in workload or setup."""
    from ddtree.perf.inputs.consistency import mismatch_warning
    from ddtree.records import BenchBandwidth, EngineRun

    used = [(r.kind, r) for r in sf.measurements if isinstance(r, (EngineRun, BenchBandwidth))]
    used += [("acceptance", m.record) for m in measured if m.record is not None]
    return mismatch_warning(
        "the records tune combines", used,
        "the calibration, this machine's bandwidth and the replayed tau describe different "
        "runs (and the held-out check compares them)",
    )  # fmt: skip


def _band(d: dict[int, float]) -> str:
    return f"{d[10]:.4g} / {d[50]:.4g} / {d[90]:.4g}"


def tune_text(curves, check, measured):
    from rich.table import Table

    out = [
        f"tau: {measured.label}",
        "tokens/s = C x tau / step [derived]; step from the calibrated cost model [derived]",
    ]
    swept = len({c.concurrency for c in curves}) > 1
    for c in curves:
        at = f", C={c.concurrency}" if swept else ""
        table = Table(title=f"{c.hardware}: {c.policy}, block {c.block_size}{at}")
        for col in ("N", "tau", "tok/s p10 / p50 / p90", "step ms p50", ""):
            table.add_column(col, justify="right")
        for p in c.points:
            mark = "best" if p is c.best else ("within 5%" if p.budget in c.flat else "")
            table.add_row(
                str(p.budget),
                f"{p.tau.mean:.2f}",
                _band(p.tokens_per_s),
                f"{p.step_s[50] * 1e3:.3g}",
                mark,
            )
        out.append(table)
        out.append(
            f"{c.hardware} {c.policy}{at}: best N = {c.best.budget} "
            f"({c.best.tokens_per_s[50]:.4g} tok/s p50); flat region (within 5%): "
            f"N in {c.flat}; why: {c.why}"
        )
    if swept:
        out.append(best_budget_table(curves))
    if check is not None:
        out.extend(held_out_text(check))
    return out


def best_budget_table(curves):
    """N*(C): the best budget of each hardware and policy at each request count."""
    from rich.table import Table

    levels = sorted({c.concurrency for c in curves})
    table = Table(
        title="best budget N*(C) (p50 tok/s); it shrinks as the verify turns compute-bound"
    )
    for col in ("hardware", "policy", *(f"C={c}" for c in levels)):
        table.add_column(col, justify="left" if col in ("hardware", "policy") else "right")
    rows: dict[tuple, dict[int, object]] = {}
    for c in curves:
        rows.setdefault((c.hardware, str(c.policy), c.block_size), {})[c.concurrency] = c
    for (hardware, policy, _), by_c in rows.items():
        cells = [
            f"{by_c[c].best.budget} ({by_c[c].best.tokens_per_s[50]:.4g})" if c in by_c else "-"
            for c in levels
        ]
        table.add_row(hardware, policy, *cells)
    return table


def held_out_text(check):
    from rich.table import Table

    table = Table(
        title=f"held-out check on {check.hardware}: calibrated on budgets "
        f"{check.train_budgets}, predicting the other measured runs"
    )
    for col in ("policy", "N", "measured tok/s", "predicted p50", "error", "tau engine / replay"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in check.rows:
        table.add_row(
            str(r.policy),
            str(r.budget),
            f"{r.measured_tokens_per_s:.1f}",
            f"{r.predicted_tokens_per_s:.1f}",
            f"{r.rel_error:+.1%}",
            f"{r.measured_tau:.3f} / {r.replayed_tau:.3f}",
        )
    verdict = "inside" if check.best_in_flat else "OUTSIDE"
    share = check.measured_share_of_best
    follow = (
        ""
        if share is None
        else f"; the predicted best N={check.predicted_best} measured {share:.1%} of the "
        "measured best's tokens/s"
    )
    return [
        table,
        f"MAPE {check.mape:.1%} over {len(check.rows)} held-out runs [measured vs derived]; the "
        f"measured best ddtree budget N={check.measured_best} is {verdict} the predicted flat "
        f"region {check.predicted_flat}{follow}",
    ]


def to_json(curves, check, trace: str) -> dict:
    def point(p) -> dict:
        return {
            "budget": p.budget,
            "tau": p.tau.mean,
            "tau_low": p.tau.low,
            "tau_high": p.tau.high,
            "tokens_per_s": {f"p{k}": v for k, v in p.tokens_per_s.items()},
            "step_s": {f"p{k}": v for k, v in p.step_s.items()},
            "components_s": p.components_s,
        }

    out = {
        "trace": trace,
        "curves": [
            {
                "hardware": c.hardware,
                "policy": str(c.policy),
                "block_size": c.block_size,
                "concurrency": c.concurrency,
                "best_budget": c.best.budget,
                "flat_budgets": c.flat,
                "why": c.why,
                "points": [point(p) for p in c.points],
            }
            for c in curves
        ],
    }
    if check is not None:
        out["held_out"] = {
            "hardware": check.hardware,
            "train_budgets": check.train_budgets,
            "mape": check.mape,
            "measured_best_budget": check.measured_best,
            "predicted_flat_budgets": check.predicted_flat,
            "best_in_flat": check.best_in_flat,
            "predicted_best_budget": check.predicted_best,
            "measured_share_of_best": check.measured_share_of_best,
            "rows": [
                {
                    "policy": str(r.policy),
                    "budget": r.budget,
                    "measured_tokens_per_s": r.measured_tokens_per_s,
                    "predicted_tokens_per_s": r.predicted_tokens_per_s,
                    "rel_error": r.rel_error,
                }
                for r in check.rows
            ],
        }
    return out


def write_report(curves, check, out: Path, anchors=()) -> list[Path]:
    """tune_tokens_vs_budget.png (``ddtree.perf.report.plots.tune_figure``: tokens/s per hardware
    and policy with the measured engine runs, tau below) and tune.md (the tables), each
    written whole or not at all."""
    from ddtree.files import replace_atomically
    from ddtree.perf.report import plots

    out.mkdir(parents=True, exist_ok=True)
    png = plots.save(plots.tune_figure(curves, anchors), out / "tune_tokens_vs_budget.png")
    md = ["# ddtree tune", "", "![tokens/s vs budget](tune_tokens_vs_budget.png)", ""]
    for c in curves:
        md += [f"## {c.hardware}: {c.policy}, block {c.block_size}", ""]
        md += ["| N | tau | tok/s p10 | p50 | p90 | step ms p50 |", "|---|---|---|---|---|---|"]
        for p in c.points:
            t = p.tokens_per_s
            md.append(
                f"| {p.budget} | {p.tau.mean:.2f} | {t[10]:.4g} | {t[50]:.4g} | {t[90]:.4g} | "
                f"{p.step_s[50] * 1e3:.3g} |"
            )
        md += ["", f"Best N = {c.best.budget}; within 5%: {c.flat}. {c.why}.", ""]
    if check is not None:
        md += [f"Held-out check on {check.hardware}: MAPE {check.mape:.1%}; measured best "
               f"N={check.measured_best}, predicted best N={check.predicted_best}, flat region "
               f"{check.predicted_flat}.", ""]  # fmt: skip
    report = out / "tune.md"
    with replace_atomically(report) as partial:
        partial.write_text("\n".join(md), encoding="utf-8")
    return [png, report]
