"""``ddtree train drafter``: train the bundled DFlash drafter on a frozen target."""

from __future__ import annotations

import argparse
from pathlib import Path

from ddtree.commands._args import (
    add_training_arguments,
    naming_the_checkpoint,
    output_folder,
    positive_float,
    positive_int,
    set_threads,
    threads_label,
    training_config,
)

DEFAULT_TARGET = "runs/demo-target"
DEFAULT_OUT = "runs/demo-drafter"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ddtree.train.config import DrafterTrainConfig

    d = DrafterTrainConfig()
    p.add_argument("--target", default=DEFAULT_TARGET, help="target directory (frozen)")
    p.add_argument(
        "--out",
        type=output_folder,
        default=DEFAULT_OUT,
        help="drafter directory (checkpoint/ inside)",
    )
    p.add_argument("--steps", type=positive_int, default=d.steps, help="total optimizer steps")
    p.add_argument(
        "--seqs-per-step", type=positive_int, default=d.seqs_per_step, help="sequences per step"
    )
    p.add_argument(
        "--anchors-per-step",
        type=positive_int,
        default=d.anchors_per_step,
        help="blocks drafted per sequence and step",
    )
    p.add_argument("--loss-gamma", type=positive_float, default=d.loss_gamma, help="position decay")
    p.add_argument(
        "--n-sequences", type=positive_int, default=d.n_sequences, help="regenerated seqs"
    )
    p.add_argument(
        "--new-tokens", type=positive_int, default=d.new_tokens, help="greedy tokens per seq"
    )
    p.add_argument(
        "--eval-prompts", type=positive_int, default=d.eval_prompts, help="held-out tau check"
    )
    add_training_arguments(p, d)


def run(args: argparse.Namespace) -> int:
    from ddtree.train.drafter import DrafterTrainConfig, train_drafter

    set_threads(args)
    cfg = training_config(DrafterTrainConfig, args)
    with naming_the_checkpoint(Path(args.out), cfg.steps):
        result = train_drafter(
            cfg,
            Path(args.target),
            Path(args.out),
            resume=args.resume,
            show_progress=not args.no_progress,
        )
    print(
        f"drafter: {result.n_params / 1e6:.2f}M params, {result.steps} steps in "
        f"{result.elapsed_s:.0f} s ({threads_label(args)}), loss {result.losses[0]:.3f} -> "
        f"{result.losses[-1]:.3f}, "
        f"mean tau {result.mean_tau:.2f} (greedy, budget {cfg.eval_budget}, "
        f"{cfg.eval_prompts} held-out prompts); saved to {result.out}"
    )
    return 0
