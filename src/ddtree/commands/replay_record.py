"""`ddtree replay record`: one greedy pass per prompt with the drafter's top-K at every
position, saved as a trace that `ddtree replay tau` replays for any budget."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ddtree.commands._args import non_negative_int, output_file, positive_int
from ddtree.commands._decode import add_model_arguments, demo_prompts, load_models


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, default_demo=True)
    p.add_argument("--prompts", type=Path, help="JSON list of prompt strings (default: demo's)")
    p.add_argument(
        "--n-prompts", type=non_negative_int, default=0, help="use the first n prompts (0: all)"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="default: %(default)s")
    p.add_argument(
        "--top-k",
        type=positive_int,
        default=1024,
        help="drafter candidates stored per depth, capped at the vocabulary; a budget N replays "
        "exactly when N <= K (default: %(default)s)",
    )
    p.add_argument(
        "--out", type=output_file, help="trace file (default runs/trace-<time>.safetensors)"
    )
    p.add_argument(
        "--compare-ar",
        action="store_true",
        help="then time the engine's AR generation of the same prompts, side by side",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from ddtree.replay.record import record_trace
    from ddtree.replay.trace import model_stamp, save_trace

    if args.max_new_tokens < 1 or args.top_k < 1:
        raise ValueError("--max-new-tokens and --top-k must be >= 1")
    console = Console(stderr=True)
    prompts = demo_prompts(args.prompts)
    if args.n_prompts:
        prompts = prompts[: args.n_prompts]
    with console.status("loading models..."):
        models = load_models(args, need_drafter=True, default_demo=True)
    ids = [models.codec.encode(p) for p in prompts]
    out = args.out or Path("runs") / f"trace-{time.strftime('%Y%m%d-%H%M%S')}.safetensors"
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("recording", total=len(ids))

        def advance(i: int, new_tokens: int) -> None:
            progress.update(task, advance=1, description=f"prompt {i + 1}: {new_tokens} tokens")

        start = time.perf_counter()
        trace = record_trace(
            models.target,
            models.drafter,
            ids,
            args.max_new_tokens,
            args.top_k,
            model_stamp(models.target.info, models.target_path),
            model_stamp(models.drafter.info, models.drafter_path),
            texts=prompts,
            on_prompt=advance,
        )
        record_s = time.perf_counter() - start
    save_trace(trace, out)
    h = trace.header
    greedy_s = sum(p.greedy_s for p in h.prompts)
    draft_s = sum(p.draft_s for p in h.prompts)
    tokens = sum(p.new_tokens for p in h.prompts)
    size_mb = out.stat().st_size / 1e6
    console.print(
        f"recorded {len(ids)} prompts, {tokens} tokens, {trace.topk_logprobs.shape[0]} roots, "
        f"B={h.block_size}, K={h.top_k}: {record_s:.2f} s (measured: greedy pass "
        f"{greedy_s:.2f} s, drafting + top-K {draft_s:.2f} s)"
    )
    console.print(f"wrote {out} ({size_mb:.1f} MB, {trace.fingerprint})")
    if args.compare_ar:
        compare_with_ar(console, models, ids, args.max_new_tokens, record_s)
    return 0


def compare_with_ar(console, models, ids, max_new_tokens: int, record_s: float) -> None:
    """Time the engine's AR generation of the same prompts and print the ratio."""
    from ddtree.engine import DecodeConfig, generate

    config = DecodeConfig(policy="ar", max_new_tokens=max_new_tokens)
    start = time.perf_counter()
    for prompt in ids:
        generate(models.target, None, prompt, config)
    ar_s = time.perf_counter() - start
    console.print(
        f"engine AR generation of the same tokens: {ar_s:.2f} s (measured); recording / AR = "
        f"{record_s / ar_s:.2f}x"
    )
