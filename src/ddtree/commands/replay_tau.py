"""`ddtree replay tau TRACE`: exact greedy acceptance of chain and DDTree at any budget,
replayed from a trace without running a model; writes ``acceptance`` records."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from ddtree.commands._args import add_json_argument, int_list, records_file
from ddtree.commands._decode import policy_list

DEFAULT_BUDGETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="trace file from `ddtree replay record`")
    p.add_argument(
        "--budgets",
        type=int_list,
        default=DEFAULT_BUDGETS,
        help="DDTree budgets N (default: 1,2,4,...,1024)",
    )
    p.add_argument(
        "--policies",
        type=policy_list(replay=True),
        default="chain,ddtree",
        help="comma-separated: chain,ddtree",
    )
    add_json_argument(p)
    p.add_argument(
        "--records",
        type=records_file,
        help="acceptance records file to append to (default runs/acceptance-<time>.jsonl)",
    )
    p.add_argument("--target", type=Path, help="check the trace was recorded with this target")
    p.add_argument("--drafter", type=Path, help="check the trace was recorded with this drafter")


def run(args: argparse.Namespace) -> int:
    from ddtree.commands._output import note
    from ddtree.records import write_records
    from ddtree.replay.stats import acceptance_record
    from ddtree.replay.trace import check_folders, load_trace

    trace = load_trace(args.trace)
    check_folders(trace.header, str(args.trace), args.target, args.drafter)
    summaries, replay_s, replay_cpu_s = replay_with_progress(trace, args.policies, args.budgets)
    h = trace.header
    records = [acceptance_record(s, h, str(args.trace)) for s in summaries]
    path = args.records or Path("runs") / f"acceptance-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    write_records(path, records)
    if args.json:
        print(json.dumps(tau_json(summaries, h, args.trace, replay_s, replay_cpu_s, path)))
        return 0
    print_tau(summaries, h, replay_s, replay_cpu_s)
    note(f"wrote {len(records)} acceptance records to {path}")
    return 0


def replay_with_progress(trace, policies, budgets):
    """Replay every (policy, budget) point with a progress bar per policy and prompt; the
    summaries, the wall-clock and the CPU seconds it took."""
    from ddtree.commands._output import progress
    from ddtree.replay.simulate import replay_points
    from ddtree.replay.stats import replay_sweep

    points = replay_points(trace, policies, budgets)
    start, start_cpu = time.perf_counter(), time.process_time()
    n_policies = len({p for p, _ in points})
    with progress("replaying", total=n_policies * len(trace.header.prompts)) as bar:

        def advance(policy: str, i: int) -> None:
            bar.advance(f"{policy} prompt {i + 1}")

        summaries = replay_sweep(trace, policies, budgets, advance)
    return summaries, time.perf_counter() - start, time.process_time() - start_cpu


def tau_json(summaries, header, trace_path, replay_s, replay_cpu_s, records) -> dict:
    """The ``--json`` document: the trace, the timing, the tree backend and every point."""
    from ddtree.tree import backend

    return {
        "trace": header.fingerprint,
        "trace_path": str(trace_path),
        "block_size": header.block_size,
        "top_k": header.top_k,
        "replay_s": replay_s,
        "replay_cpu_s": replay_cpu_s,
        "tree_backend": backend(),
        "records": str(records),
        "points": [dataclasses.asdict(s) for s in summaries],
    }


def print_tau(summaries, header, replay_s, replay_cpu_s) -> None:
    """The tables, the timing line, and a warning for budgets past the trace's top-K."""
    from ddtree.commands._output import console, note
    from ddtree.tree import backend

    out = console()
    for table in tau_tables(summaries, header):
        out.print(table)
    out.print(
        f"replayed {len(summaries)} points x {len(header.prompts)} prompts in {replay_s:.2f} s "
        f"({replay_cpu_s:.2f} s CPU; tree backend {backend()}; measured)"
    )
    limited = [s for s in summaries if s.limited_steps]
    if limited:
        note(
            f"warning: budgets above the trace's top-K ({header.top_k}): {len(limited)} point(s) "
            "had trees that reached the last stored rank and may differ from the engine's "
            "(record with a larger `replay record --candidates`)"
        )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}"


def tau_tables(summaries, header):
    """Rich tables: tau with its interval and the surrogate; acceptance per depth; the tau
    histogram; acceptance per sibling rank."""
    from rich import box
    from rich.table import Table

    b = header.block_size
    pct = 100 * summaries[0].interval
    head = Table(
        title=f"replayed acceptance ({header.fingerprint}, B={b}, K={header.top_k}, "
        f"{len(header.prompts)} prompts; measured, exact for greedy decoding)"
    )
    for col in ("policy", "N", "mean tau", f"{pct:.0f}% interval", "surrogate E\\[tau]", "steps"):
        head.add_column(col, justify="left" if col == "policy" else "right")
    depth = Table(title="acceptance per depth, %", box=box.SIMPLE_HEAD)
    hist = Table(title="tau histogram, % of steps", box=box.SIMPLE_HEAD)
    rank = Table(
        title="acceptance per sibling rank, % (Sequoia's positional acceptance vector)",
        box=box.SIMPLE_HEAD,
    )
    for table, cols in (
        (depth, [f"d{d}" for d in range(1, b)]),
        (hist, [str(t) for t in range(1, b + 1)]),
        (rank, [f"r{r}" for r in range(1, len(summaries[0].rank_acceptance) + 1)]),
    ):
        table.add_column("policy")
        table.add_column("N", justify="right")
        for col in cols:
            table.add_column(col, justify="right")
    for s in summaries:
        n = str(s.budget)
        head.add_row(
            s.policy,
            n,
            f"{s.mean_tau:.3f}",
            f"{s.tau_low:.2f}-{s.tau_high:.2f}",
            f"{s.expected_tau:.2f}",
            str(s.steps),
        )
        depth.add_row(s.policy, n, *map(_pct, s.depth_acceptance))
        hist.add_row(s.policy, n, *(f"{100 * c / s.steps:.0f}" for c in s.histogram))
        rank.add_row(s.policy, n, *map(_pct, s.rank_acceptance))
    return head, depth, hist, rank
