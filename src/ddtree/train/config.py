"""The training recipes' settings, apart from the recipes so that the command line can read
their defaults without importing torch (``ddtree --help`` stays light)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetTrainConfig:
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3
    vocab_size: int = 2048
    seed: int = 0
    max_files: int | None = None  # first files of the sorted corpus (tests use a slice)
    save_every: int = 200
    log_every: int = 20
    eval_windows: int = 32


@dataclass(frozen=True)
class DrafterTrainConfig:
    steps: int = 1200
    seqs_per_step: int = 32
    anchors_per_step: int = 8
    lr: float = 2e-3
    warmup_steps: int = 50
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    loss_gamma: float = 4.0  # position weight exp(-(j-1)/gamma)
    n_sequences: int = 1536
    prompt_len: int = 64
    new_tokens: int = 128
    gen_batch: int = 128
    seed: int = 0
    max_files: int | None = None
    save_every: int = 100
    log_every: int = 10
    eval_prompts: int = 8
    eval_budget: int = 32
    eval_new_tokens: int = 96
