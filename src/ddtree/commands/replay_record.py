"""`ddtree replay record`: one greedy pass per prompt with the drafter's top-K at every
position, saved as a trace that `ddtree replay tau` replays for any budget."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ddtree.commands._args import (
    add_renamed,
    non_negative_int,
    output_file,
    positive_int,
    threads_label,
)
from ddtree.commands._decode import add_model_arguments, demo_prompts, load_models


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompts", type=Path, help="JSON list of prompt strings (default: demo's)")
    p.add_argument(
        "--n-prompts", type=non_negative_int, default=0, help="use the first n prompts (0: all)"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="default: %(default)s")
    p.add_argument(
        "--candidates",
        type=positive_int,
        default=1024,
        metavar="K",
        help="drafter candidates stored per depth (the trace's top-K), capped at the "
        "vocabulary; a budget N replays exactly when N <= K (default: %(default)s)",
    )
    add_renamed(p, "--top-k", "--candidates", "--top-k is sampling's top-k in every command")
    p.add_argument(
        "--out", type=output_file, help="trace file (default runs/trace-<time>.safetensors)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the --out file when it exists (without it an existing file is refused: "
        "a trace, or anything else, is not silently overwritten)",
    )
    p.add_argument(
        "--compare-ar",
        action="store_true",
        help="then time the engine's AR generation of the same prompts, side by side",
    )


def run(args: argparse.Namespace) -> int:
    """Interrupted (Ctrl-C, SIGTERM), the prompts recorded so far are saved as a trace of
    their own beside ``--out`` (``partial_path``), never under ``--out``."""
    from ddtree.commands._output import note, progress
    from ddtree.replay.trace import save_trace

    out = args.out or Path("runs") / f"trace-{time.strftime('%Y%m%d-%H%M%S')}.safetensors"
    check_out(out, args.force)  # now, not after the recording
    prompts = demo_prompts(args.prompts)
    if args.n_prompts:
        prompts = prompts[: args.n_prompts]
    with progress("loading models"):
        models = load_models(args, need_drafter=True)
    ids = [models.codec.encode(p) for p in prompts]
    start = time.perf_counter()
    trace = record_with_progress(models, ids, prompts, args.max_new_tokens, args.candidates, out)
    record_s = time.perf_counter() - start
    save_trace(trace, out)
    print(record_summary(trace, record_s, threads_label(args)))
    note(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {trace.fingerprint})")
    if args.compare_ar:
        compare_with_ar(models, ids, args.max_new_tokens, record_s)
    return 0


def check_out(out: Path, force: bool) -> None:
    """Refuse an ``--out`` (or its partial file) that is not a trace path, and an existing
    ``--out`` without ``--force``."""
    from ddtree.files import check_output_file
    from ddtree.replay.trace import TRACE_FILE

    for path in (out, partial_path(out)):
        check_output_file(path, TRACE_FILE)
    if out.exists() and not force:
        raise ValueError(
            f"--out {out}: the file exists; expected a new path (or --force to replace it)"
        )


def record_with_progress(models, ids, prompts, max_new_tokens: int, candidates: int, out: Path):
    """Record every prompt, a progress bar per prompt; the merged trace. Interrupted, the
    prompts recorded so far are kept at ``partial_path(out)`` and the interrupt re-raised."""
    from ddtree.commands._output import progress
    from ddtree.replay.record import record_prompts
    from ddtree.replay.trace import merge_traces, model_stamp, save_trace
    from ddtree.signals import keep

    traces = []
    try:
        with progress("recording", total=len(ids)) as bar:
            for i, trace in enumerate(
                record_prompts(
                    models.target,
                    models.drafter,
                    ids,
                    max_new_tokens,
                    candidates,
                    model_stamp(models.target.info, models.target_path),
                    model_stamp(models.drafter.info, models.drafter_path),
                    texts=prompts,
                )
            ):
                traces.append(trace)
                bar.advance(f"prompt {i + 1}: {trace.header.prompts[0].new_tokens} tokens")
    except KeyboardInterrupt:
        if traces:
            kept = save_trace(merge_traces(traces), partial_path(out))
            keep(kept, f"a trace of the first {len(traces)} of {len(ids)} prompts (not {out})")
        raise
    return merge_traces(traces)


def record_summary(trace, record_s: float, threads: str) -> str:
    """The line after a recording: prompts, tokens, roots, B, K and the measured times."""
    h = trace.header
    greedy_s = sum(p.greedy_s for p in h.prompts)
    draft_s = sum(p.draft_s for p in h.prompts)
    tokens = sum(p.new_tokens for p in h.prompts)
    return (
        f"recorded {len(h.prompts)} prompts, {tokens} tokens, {trace.topk_logprobs.shape[0]} "
        f"roots, B={h.block_size}, K={h.top_k}: {record_s:.2f} s (measured: greedy pass "
        f"{greedy_s:.2f} s, drafting + top-K {draft_s:.2f} s; {threads})"
    )


def partial_path(out: Path) -> Path:
    """Where an interrupted recording keeps its finished prompts: ``x.partial.safetensors``
    beside ``x.safetensors``."""
    return out.with_name(f"{out.stem}.partial{out.suffix}")


def compare_with_ar(models, ids, max_new_tokens: int, record_s: float) -> None:
    """Time the engine's AR generation of the same prompts and print the ratio."""
    from ddtree.engine import DecodeConfig, generate

    config = DecodeConfig(policy="ar", max_new_tokens=max_new_tokens)
    start = time.perf_counter()
    for prompt in ids:
        generate(models.target, None, prompt, config)
    ar_s = time.perf_counter() - start
    print(
        f"engine AR generation of the same tokens: {ar_s:.2f} s (measured); recording / AR = "
        f"{record_s / ar_s:.2f}x"
    )
