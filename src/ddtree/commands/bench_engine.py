"""`ddtree bench engine`: sweep policies and budgets over a prompt set; write engine_run records."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ddtree.commands._args import int_list, non_negative_int, output_file
from ddtree.commands._decode import (
    add_decode_arguments,
    add_model_arguments,
    check_engine_modes,
    decode_config,
    demo_prompts,
    engine_modes,
    load_models,
    set_threads,
    summary_tables,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, default_demo=True)
    p.add_argument("--policies", default="ar,chain,ddtree", help="comma-separated: ar,chain,ddtree")
    p.add_argument(
        "--budgets", type=int_list, default=[8, 16, 32, 64, 128], help="DDTree budgets N"
    )
    p.add_argument("--prompts", type=Path, help="JSON list of prompt strings (default: demo's)")
    p.add_argument(
        "--n-prompts", type=non_negative_int, default=0, help="use the first n prompts (0: all)"
    )
    p.add_argument(
        "--records", type=output_file, help="engine_run records file (default runs/engine-*.jsonl)"
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
    policies = [x for x in args.policies.split(",") if x]
    return [
        decode_config(args, policy, n, engine_mode=mode)
        for mode in args.engine_modes
        for policy in policies
        for n in (args.budgets if policy == "ddtree" else [args.budget])
    ]


def run_sweep(args, configs, title: str, show_text: int = 0) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from ddtree.engine import engine_run_record
    from ddtree.engine.sweep import sweep
    from ddtree.records import write_records

    console = Console()
    prompts = demo_prompts(args.prompts)
    if args.n_prompts:
        prompts = prompts[: args.n_prompts]
    need_drafter = any(c.policy != "ar" for c in configs)
    with console.status("loading models..."):
        models = load_models(args, need_drafter=need_drafter, default_demo=True)
    check_engine_modes(models, sorted({c.engine_mode for c in configs}))
    ids = [models.codec.encode(p) for p in prompts]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decoding", total=len(configs) * len(ids))

        def advance(config, i):
            label = (
                f"{config.engine_mode} {config.policy} B={config.block_size} "
                f"N={config.budget} prompt {i + 1}"
            )
            progress.update(task, advance=1, description=label)

        if "compiled" in {c.engine_mode for c in configs}:
            console.print(
                "compiled mode: the first request of each width bucket compiles its graphs "
                "(tens of seconds each on a small CPU; cached on disk for later runs)"
            )

        points = sweep(models.target, models.drafter, ids, configs, models.codec, advance)
    for i in range(min(show_text, len(prompts))):
        console.rule(f"prompt {i + 1}")
        console.print(
            prompts[i], style="dim", end="", markup=False, highlight=False, soft_wrap=True
        )
        console.print(points[-1].results[i].text, markup=False, highlight=False, soft_wrap=True)
    for table in summary_tables(points, title):
        console.print(table)
    compiled = [p for p in points if p.config.engine_mode != "eager"]
    if compiled:
        each = [p.summary["compile_s"] for p in compiled]
        console.print(
            f"compile time (warm-up, not in any step): {sum(each):.1f} s over {len(each)} "
            f"compiled configs ({', '.join(f'{s:.1f}' for s in each)} s)"
        )
    path = args.records or Path("runs") / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    records = [
        engine_run_record(
            p.results,
            p.config,
            models.target.info,
            models.target_path,
            None if models.drafter is None or p.config.policy == "ar" else models.drafter.info,
            models.drafter_path,
            device=args.device,
            prompt_lens=[len(x) for x in ids],
            extra={"identical_to_ar": p.identical_to_ar},
            compile_s=p.summary["compile_s"],
        )
        for p in points
    ]
    write_records(path, records)
    console.print(f"wrote {len(records)} engine_run records to {path}")
    bad = [p.config.policy for p in points if p.identical_to_ar is False]
    if bad:
        console.print(f"[red]greedy output differs from AR for {bad}: losslessness broken[/red]")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    title = f"ddtree bench engine ({args.device}, {args.dtype}, {set_threads(args)} threads)"
    return run_sweep(args, configs_from_args(args), title)
