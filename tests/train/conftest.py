"""Shared tiny shapes for the training-recipe tests."""

from __future__ import annotations

import pytest
import torch

from ddtree.train.target import TargetShape, TargetTrainConfig, train_target

TINY_TARGET = TargetShape(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
)


@pytest.fixture
def tiny_shape() -> TargetShape:
    return TINY_TARGET


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A few steps of the target recipe on a corpus slice: a real exported target dir."""

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("target")
    cfg = TargetTrainConfig(
        steps=4, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1, vocab_size=300,
        max_files=30, log_every=2, eval_windows=1,
    )  # fmt: skip
    train_target(cfg, out, shape=TINY_TARGET, show_progress=False)
    return out
