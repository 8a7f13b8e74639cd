"""`ddtree replay check TRACE`: decode the trace's prompts with the engine and compare every
step's tau with the replayed one (the mismatch rate of replay; expected 0)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ddtree.commands._args import int_list, non_negative_int, threads_label
from ddtree.commands._decode import add_model_arguments, load_models, policy_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="trace file from `ddtree replay record`")
    add_model_arguments(p)
    p.add_argument("--budgets", type=int_list, default=[1, 4, 16, 64], help="DDTree budgets N")
    p.add_argument(
        "--policies",
        type=policy_list(replay=True),
        default="chain,ddtree",
        help="comma-separated: chain,ddtree",
    )
    p.add_argument(
        "--n-prompts", type=non_negative_int, default=0, help="check the first n prompts (0: all)"
    )


def run(args: argparse.Namespace) -> int:
    from ddtree.commands._output import console as make_console
    from ddtree.commands._output import progress
    from ddtree.replay.simulate import replay_points
    from ddtree.replay.trace import check_folders, load_trace

    console = make_console()
    trace = load_trace(args.trace)
    with progress("loading models"):
        models = load_models(args, need_drafter=True)
    check_folders(trace.header, str(args.trace), models.target_path, models.drafter_path)
    points = replay_points(trace, args.policies, args.budgets)
    count = len(trace.header.prompts)
    prompts = list(range(min(args.n_prompts, count) if args.n_prompts else count))
    report = check_with_progress(trace, models, args.policies, args.budgets, points, prompts)
    console.print(check_table(report, points, f"{trace.fingerprint}; {threads_label(args)}"))
    console.print(
        f"mismatch rate {report.mismatch_rate:.2%} ({report.mismatched_steps} of "
        f"{report.steps} engine steps; measured)"
    )
    if not report.lossless:
        console.print("[red]the engine's tokens differ from the trace's greedy continuation[/red]")
    if not report.walks_equal:
        console.print("[red]the sweep's shared-tree walk differs from per-budget builds[/red]")
    ok = report.lossless and report.walks_equal and report.mismatched_steps == 0
    return 0 if ok else 1


def check_with_progress(trace, models, policies, budgets, points, prompts):
    """Decode each point's prompts with the engine, a progress bar per run; the report."""
    from ddtree.commands._output import progress
    from ddtree.replay.check import check_against_engine

    with progress("decoding", total=len(points) * len(prompts)) as bar:

        def advance(run) -> None:
            bar.advance(f"{run.policy} N={run.budget} prompt {run.prompt + 1}")

        return check_against_engine(
            trace, models.target, models.drafter, policies, budgets, prompts, advance
        )


def check_table(report, points, label: str):
    """One row per (policy, budget): runs, steps, mismatched steps, lossless."""
    from rich.table import Table

    table = Table(title=f"replay vs engine, step by step ({label})")
    for col in ("policy", "N", "runs", "steps", "mismatched steps", "lossless"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for policy, budget in points:
        runs = [r for r in report.runs if (r.policy, r.budget) == (policy, budget)]
        table.add_row(
            policy,
            str(budget),
            str(len(runs)),
            str(sum(r.steps for r in runs)),
            str(sum(len(r.mismatched) for r in runs)),
            "yes" if all(r.lossless for r in runs) else "NO",
        )
    return table
