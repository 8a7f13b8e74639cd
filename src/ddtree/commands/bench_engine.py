"""`ddtree bench engine`: sweep policies and budgets over a prompt set; write engine_run records."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ddtree.commands._args import (
    budget_list,
    int_list_upto,
    non_negative_int,
    records_file,
    threads_label,
)
from ddtree.commands._decode import (
    add_decode_arguments,
    add_model_arguments,
    decode_config,
    demo_prompts,
    engine_modes,
    load_models,
    policy_list,
    regime_lines,
    summary_tables,
)
from ddtree.vocab import get_policy, policies_help


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument(
        "--policies",
        type=policy_list(),
        default="ar,chain,ddtree",
        help=f"comma-separated, of {policies_help()}",
    )
    p.add_argument(
        "--budgets",
        type=budget_list,
        default=[8, 16, 32, 64, 128],
        help="DDTree budgets N; 'auto' chooses each step (--budget auto)",
    )
    p.add_argument("--prompts", type=Path, help="JSON list of prompt strings (default: demo's)")
    p.add_argument(
        "--n-prompts", type=non_negative_int, default=0, help="use the first n prompts (0: all)"
    )
    p.add_argument(
        "--records", type=records_file, help="engine_run records file (default runs/engine-*.jsonl)"
    )
    p.add_argument(
        "--concurrency",
        type=int_list_upto(256),
        help="comma-separated request counts C decoded together (ddtree.engine.batch: one "
        "target forward verifies every row's tree; the next prompt joins as one finishes); "
        "tokens/s is then all rows' (default: one request at a time, prompt-major)",
    )
    add_engine_modes_argument(p, default="eager")
    add_decode_arguments(p, max_new_tokens=64)


def add_engine_modes_argument(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--engine-modes",
        type=engine_modes,
        default=default,
        help="comma-separated engine modes to sweep: eager (PyTorch dispatch per kernel), "
        "compiled (torch.compile at static shapes; compile time reported apart) "
        f"(default: {default})",
    )


def configs_from_args(args: argparse.Namespace):
    policies = args.policies
    return [
        decode_config(args, policy, n, engine_mode=mode)
        for mode in args.engine_modes
        for policy in policies
        for n in (args.budgets if get_policy(policy).uses_budget else [args.budget])
    ]


def _label(config) -> str:
    return f"{config.engine_mode} {config.policy} B={config.block_size} N={config.budget_label}"


def run_sweep(args, configs, title: str, show_text: int = 0) -> int:
    """Decode the prompts under ``configs``; the tables go to stdout, progress to stderr.
    ``title`` may hold ``{threads}``: the thread count chosen and why.

    Interrupted (Ctrl-C, SIGTERM), it appends the records of the prompts every config
    finished (the last complete round of the sweep), marked ``interrupted``, and names them."""
    from ddtree.commands._output import console as make_console
    from ddtree.commands._output import note, progress
    from ddtree.engine.sweep import sweep_batched, sweep_rounds
    from ddtree.records import check_records_file, write_records
    from ddtree.signals import keep

    console = make_console()
    path = args.records or Path("runs") / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    check_records_file(path)  # now, not after the sweep
    prompts = demo_prompts(args.prompts)
    if args.n_prompts:
        prompts = prompts[: args.n_prompts]
    need_drafter = any(c.rules.needs_drafter for c in configs)
    with progress("loading models"):
        modes = tuple(sorted({c.engine_mode for c in configs}))
        models = load_models(args, need_drafter, engine_modes=modes, draft_vocab=args.draft_vocab)
    title = title.format(threads=threads_label(args))
    ids = [models.codec.encode(p) for p in prompts]
    points = []  # over the prompts every config has finished so far
    concurrency = getattr(args, "concurrency", None)  # ddtree demo sweeps one at a time
    levels = concurrency or [1]
    try:
        with progress("decoding", total=len(configs) * len(ids) * len(levels)) as bar:

            def warmup(config) -> None:
                if config.engine_mode != "eager":  # compiles the graphs it has not compiled yet
                    bar.announce(
                        f"warm-up of {_label(config)}: compiling its new widths (tens of "
                        "seconds each on a small CPU, cached on disk)"
                    )

            def advance(config, i, result):
                bar.advance(f"{_label(config)} prompt {i + 1}")

            if concurrency:  # each (C, config) over every prompt
                rounds = sweep_batched(
                    models.target, models.drafter, ids, configs, concurrency,
                    models.codec, advance, on_warmup=warmup,
                )  # fmt: skip
            else:  # prompt-major rounds
                rounds = sweep_rounds(
                    models.target, models.drafter, ids, configs, models.codec, advance,
                    on_warmup=warmup,
                )  # fmt: skip
            for finished in rounds:
                points = finished
    except KeyboardInterrupt:
        if points:
            done = len(points[0].results)
            records = _records(args, models, ids, points, f"after {done} of {len(ids)} prompts")
            write_records(path, records)
            keep(
                path,
                f"{len(records)} engine_run records over the first {done} of {len(ids)} prompts",
            )
        raise
    for i in range(min(show_text, len(prompts))):
        console.print(f"--- prompt {i + 1} ---")
        console.print(
            prompts[i], style="dim", end="", markup=False, highlight=False, soft_wrap=True
        )
        console.print(points[-1].results[i].text, markup=False, highlight=False, soft_wrap=True)
    for table in summary_tables(points, title):
        console.print(table)
    for line in regime_lines(points):
        console.print(line, markup=False, highlight=False)
    compiled = [p for p in points if p.config.engine_mode != "eager"]
    if compiled:
        each = [p.summary["compile_s"] for p in compiled]
        console.print(
            f"compile time (warm-up, not in any step): {sum(each):.1f} s over {len(each)} "
            f"compiled configs ({', '.join(f'{s:.1f}' for s in each)} s)"
        )
    records = _records(args, models, ids, points)
    write_records(path, records)
    note(f"wrote {len(records)} engine_run records to {path}")
    bad = [p.config.policy for p in points if p.identical_to_ar is False]
    if bad:
        console.print(f"[red]greedy output differs from AR for {bad}: losslessness broken[/red]")
        return 1
    return 0


def _records(args, models, ids, points, interrupted: str | None = None) -> list:
    """One engine_run record per point, over the prompts its results cover; ``interrupted``
    (``after 3 of 16 prompts``) goes into each config when the sweep did not finish."""
    from ddtree.engine import engine_run_record

    lens = [len(x) for x in ids[: len(points[0].results)]]
    mark = {} if interrupted is None else {"interrupted": interrupted}
    return [
        engine_run_record(
            p.results,
            p.config,
            models.target.info,
            models.target_path,
            models.drafter.info if p.config.rules.needs_drafter else None,
            models.drafter_path,
            device=args.device,
            prompt_lens=lens,
            extra={
                "identical_to_ar": p.identical_to_ar,
                "auto_budget": p.config.auto_budget,
                **mark,
            },
            compile_s=p.summary["compile_s"],
            concurrency=p.concurrency,
            summary=p.summary,
        )
        for p in points
    ]


def run(args: argparse.Namespace) -> int:
    title = f"ddtree bench engine ({args.device}, {args.dtype}, {{threads}})"
    return run_sweep(args, configs_from_args(args), title)
