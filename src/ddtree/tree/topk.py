"""Per-depth candidates from the drafter's block logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TopK:
    logprobs: torch.Tensor  # [..., L, K] float32, sorted descending
    tokens: torch.Tensor  # [..., L, K] int64


def topk_logprobs(logits: torch.Tensor, k: int) -> TopK:
    """log_softmax over the vocabulary, then the K best per depth. ``logits`` [..., L, V].

    DDTree takes K = min(budget, V): a budget-N tree can use rank N-1 at depth 1.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    k = min(k, logits.shape[-1])
    values, ids = torch.topk(torch.log_softmax(logits.to(torch.float32), dim=-1), k, dim=-1)
    return TopK(logprobs=values, tokens=ids)
