"""``ddtree train target``: train the bundled tiny MLA+MoE target on the stdlib corpus."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from ddtree.commands._args import non_negative_int, positive_float, positive_int, seed, threads

DEFAULT_OUT = "runs/demo-target"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ddtree.train.config import TargetTrainConfig

    d = TargetTrainConfig()
    p.add_argument("--out", default=DEFAULT_OUT, help="model directory (checkpoint/ inside)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="total optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size)
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len)
    p.add_argument("--lr", type=positive_float, default=d.lr)
    p.add_argument("--warmup-steps", type=non_negative_int, default=d.warmup_steps)
    p.add_argument("--vocab-size", type=positive_int, default=d.vocab_size)
    p.add_argument("--seed", type=seed, default=d.seed)
    p.add_argument("--max-files", type=positive_int, default=None, help="first N corpus files only")
    p.add_argument(
        "--save-every", type=positive_int, default=d.save_every, help="checkpoint interval"
    )
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument(
        "--threads", type=threads, default=2, help="torch CPU threads (0: torch's default)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import torch

    from ddtree.train.target import TargetTrainConfig, train_target

    if args.threads:
        torch.set_num_threads(args.threads)
    names = {f.name for f in fields(TargetTrainConfig)}
    cfg = TargetTrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    result = train_target(
        cfg, Path(args.out), resume=args.resume, show_progress=not args.no_progress
    )
    print(
        f"target: {result.n_params / 1e6:.2f}M params, {result.steps} steps in "
        f"{result.elapsed_s:.0f} s, train loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
        f"held-out loss {result.heldout_loss:.3f}; saved to {result.out}"
    )
    return 0
