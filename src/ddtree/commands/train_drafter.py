"""``ddtree train drafter``: train the bundled DFlash drafter on a frozen target."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from ddtree.commands._args import positive_float, positive_int, seed, threads

DEFAULT_TARGET = "runs/demo-target"
DEFAULT_OUT = "runs/demo-drafter"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ddtree.train.config import DrafterTrainConfig

    d = DrafterTrainConfig()
    p.add_argument("--target", default=DEFAULT_TARGET, help="target directory (frozen)")
    p.add_argument("--out", default=DEFAULT_OUT, help="drafter directory (checkpoint/ inside)")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="total optimizer steps")
    p.add_argument("--seqs-per-step", type=positive_int, default=d.seqs_per_step)
    p.add_argument("--anchors-per-step", type=positive_int, default=d.anchors_per_step)
    p.add_argument("--lr", type=positive_float, default=d.lr)
    p.add_argument("--loss-gamma", type=positive_float, default=d.loss_gamma, help="position decay")
    p.add_argument(
        "--n-sequences", type=positive_int, default=d.n_sequences, help="regenerated seqs"
    )
    p.add_argument(
        "--new-tokens", type=positive_int, default=d.new_tokens, help="greedy tokens per seq"
    )
    p.add_argument("--seed", type=seed, default=d.seed)
    p.add_argument("--max-files", type=positive_int, default=None, help="first N corpus files only")
    p.add_argument(
        "--save-every", type=positive_int, default=d.save_every, help="checkpoint interval"
    )
    p.add_argument("--eval-prompts", type=positive_int, default=d.eval_prompts)
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument(
        "--threads", type=threads, default=2, help="torch CPU threads (0: torch's default)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import torch

    from ddtree.train.drafter import DrafterTrainConfig, train_drafter

    if args.threads:
        torch.set_num_threads(args.threads)
    names = {f.name for f in fields(DrafterTrainConfig)}
    cfg = DrafterTrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    result = train_drafter(
        cfg,
        Path(args.target),
        Path(args.out),
        resume=args.resume,
        show_progress=not args.no_progress,
    )
    print(
        f"drafter: {result.n_params / 1e6:.2f}M params, {result.steps} steps in "
        f"{result.elapsed_s:.0f} s, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
        f"mean tau {result.mean_tau:.2f} (greedy, budget {cfg.eval_budget}, "
        f"{cfg.eval_prompts} held-out prompts); saved to {result.out}"
    )
    return 0
