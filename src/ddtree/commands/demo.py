"""`ddtree demo`: the bundled pair on held-out prompts with AR, chain and DDTree, side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from ddtree.commands._args import non_negative_int, positive_int, records_file
from ddtree.commands._decode import add_decode_arguments, add_model_arguments
from ddtree.commands.bench_engine import add_engine_modes_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompts", type=Path, help="JSON list of prompt strings (default: demo's)")
    p.add_argument("--n-prompts", type=positive_int, default=4, help="how many prompts to decode")
    p.add_argument(
        "--records", type=records_file, help="engine_run records (default runs/engine-*.jsonl)"
    )
    p.add_argument(
        "--show", type=non_negative_int, default=2, help="print the DDTree text of this many"
    )
    add_engine_modes_argument(p, default="eager,compiled")
    add_decode_arguments(p, max_new_tokens=96)
    # Budget 7 = B - 1: DDTree verifies as many tokens as chain, so the tree's gain is all in
    # tau, and both share one compiled graph (one compile less on a fresh machine). On this
    # CPU the verify forward is compute-bound, so small budgets are the fast ones (demo
    # prompts, compiled: N=7 11.9 ms per step at tau 3.69, N=8 13.8 ms at tau 3.73).
    p.set_defaults(budget=7)


def run(args: argparse.Namespace) -> int:
    from ddtree.commands._decode import decode_config
    from ddtree.commands.bench_engine import run_sweep

    configs = [
        decode_config(args, policy, engine_mode=mode)
        for mode in args.engine_modes
        for policy in ("ar", "chain", "ddtree")
    ]
    title = (
        f"ddtree demo: bundled MLA+MoE target + DFlash drafter, {args.n_prompts} held-out prompts, "
        f"{args.max_new_tokens} new tokens ({args.device}, {{threads}})"
    )
    return run_sweep(args, configs, title, show_text=args.show)
