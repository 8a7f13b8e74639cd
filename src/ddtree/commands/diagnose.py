"""`ddtree diagnose A.jsonl B.jsonl`: attribute the tokens/s ratio of two engine runs to tau
and to each stage's time (and to context length where the runs' contexts differ)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree.commands._args import add_json_argument, non_negative_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, help="engine_run records of the reference run (A)")
    p.add_argument("b", type=Path, help="engine_run records of the run to explain (B)")
    p.add_argument("--policy", help="compare only records of this policy")
    p.add_argument("--budget", type=non_negative_int, help="compare only records at this budget")
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    from ddtree.perf.validation.diagnose import diagnose, pair_runs, pair_warning, select, to_json
    from ddtree.records import read_records

    runs = [
        select(read_records(path, kind="engine_run"), args.policy, args.budget)
        for path in (args.a, args.b)
    ]
    pairs = pair_runs(runs[0], runs[1], str(args.a), str(args.b))
    results = [diagnose(a, b, str(args.a), str(args.b)) for a, b in pairs]
    warnings = list(dict.fromkeys(w for a, b in pairs if (w := pair_warning(a, b))))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps({"diagnoses": [to_json(d) for d in results], "warnings": warnings}))
        return 0
    from ddtree.commands._output import console

    out = console()
    for d in results:
        for part in diagnosis_text(d):
            out.print(part)
    return 0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:+.3f}" if x else "0"


def diagnosis_text(d):
    """A headline (the tokens/s ratio as tau ratio x step-time ratio) and a stage table."""
    from rich.table import Table

    a, b = d.a, d.b

    def name(v) -> str:
        ctx = "" if v.mean_context is None else f", mean context {v.mean_context:.0f} tok"
        return f"{v.label} ({v.policy} B={v.block_size} N={v.budget}{ctx}; {v.source})"

    head = (
        f"{name(a)}\n -> {name(b)}\n"
        f"tokens/s {a.tokens_per_s:.1f} -> {b.tokens_per_s:.1f}: ratio {d.tokens_per_s_ratio:.3f}"
        f" = tau ratio {d.tau_ratio:.3f} ({a.mean_tau:.2f} -> {b.mean_tau:.2f})"
        f" x step-time ratio {d.step_ratio:.3f} ({a.step_s * 1e3:.2f} -> {b.step_s * 1e3:.2f} ms)"
        " [measured; ratios derived]"
    )
    table = Table(
        title=f"step B / step A = {1 / d.step_ratio:.3f} = 1 + the stages' shares "
        "(ms per step; share = change / step A)"
    )
    for col in ("stage", "A ms", "B ms", "change ms", "share", "from context", "at equal context"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in d.stages:
        table.add_row(
            str(s.stage),
            f"{s.a_s * 1e3:.3f}",
            f"{s.b_s * 1e3:.3f}",
            _ms(s.b_s - s.a_s),
            f"{s.share:+.3f}",
            _ms(s.context_s),
            _ms(s.other_s),
        )
    out = [head, table]
    if d.context_note:
        out.append(f"({d.context_note})")
    else:
        worst = max(d.stages, key=lambda s: abs(s.b_s - s.a_s))
        slope = worst.context_slope_s or 0.0
        out.append(
            f"largest change: {worst.stage} ({_ms(worst.b_s - worst.a_s)} ms per step), of which "
            f"context length {_ms(worst.context_s)} ms ({slope * 1e9:.1f} ns per context token, "
            "fitted over both runs' steps)"
        )
    return out
