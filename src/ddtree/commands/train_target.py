"""``ddtree train target``: train the bundled tiny MLA+MoE target on the stdlib corpus."""

from __future__ import annotations

import argparse
from pathlib import Path

from ddtree.commands._args import (
    add_training_arguments,
    naming_the_checkpoint,
    non_negative_int,
    output_folder,
    positive_int,
    set_threads,
    threads_label,
    training_config,
)

DEFAULT_OUT = "runs/demo-target"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ddtree.train.config import TargetTrainConfig

    d = TargetTrainConfig()
    p.add_argument(
        "--out",
        type=output_folder,
        default=DEFAULT_OUT,
        help="model directory (checkpoint/ inside)",
    )
    p.add_argument("--steps", type=positive_int, default=d.steps, help="total optimizer steps")
    p.add_argument(
        "--batch-size", type=positive_int, default=d.batch_size, help="sequences per step"
    )
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len, help="tokens per sequence")
    p.add_argument(
        "--warmup-steps", type=non_negative_int, default=d.warmup_steps, help="linear warm-up"
    )
    p.add_argument(
        "--vocab-size", type=positive_int, default=d.vocab_size, help="byte-level BPE vocabulary"
    )
    add_training_arguments(p, d)


def run(args: argparse.Namespace) -> int:
    from ddtree.train.target import TargetTrainConfig, train_target

    set_threads(args)
    cfg = training_config(TargetTrainConfig, args)
    with naming_the_checkpoint(Path(args.out), cfg.steps):
        result = train_target(
            cfg, Path(args.out), resume=args.resume, show_progress=not args.no_progress
        )
    print(
        f"target: {result.n_params / 1e6:.2f}M params, {result.steps} steps in "
        f"{result.elapsed_s:.0f} s ({threads_label(args)}), train loss {result.losses[0]:.3f} -> "
        f"{result.losses[-1]:.3f}, held-out loss {result.heldout_loss:.3f}; saved to {result.out}"
    )
    return 0
