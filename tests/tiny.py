"""Tiny transformers configs the model tests share (built in milliseconds, every code path of a
real model still run). The engine tests' own tiny pair, smaller and with room for long
decodes, is ``tests/engine/helpers.py``."""

from __future__ import annotations

TINY_VOCAB = 101
TINY_HF = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
"""The fields a tiny Qwen3, Llama and DeepSeek-V3 share."""

TINY_QWEN3 = dict(TINY_HF, num_key_value_heads=2, head_dim=16)
TINY_LLAMA = dict(TINY_HF, num_key_value_heads=2)
TINY_DEEPSEEK_V3 = dict(
    TINY_HF,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)
