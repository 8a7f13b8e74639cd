"""Greedy acceptance of a drafter on a target: mean tau of DDTree steps on held-out prompts.

Decodes through the engine (``ddtree.engine.generate``, policy ``ddtree``), so the figure is
the one the engine achieves: the same tree, the same stops (the target's EOS, max_new_tokens)
and taus that count only returned tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.engine import DecodeConfig, generate
from ddtree.models.base import Drafter, Target


@dataclass
class AcceptanceResult:
    budget: int
    block_size: int
    taus: list[list[int]]  # per prompt, tau of every step
    outputs: list[list[int]]  # per prompt, the generated token ids

    @property
    def mean_tau(self) -> float:
        flat = [t for per_prompt in self.taus for t in per_prompt]
        return sum(flat) / max(1, len(flat))


def greedy_acceptance(
    target: Target,
    drafter: Drafter,
    prompts: torch.Tensor,  # [P, T] int64
    budget: int,
    max_new_tokens: int,
) -> AcceptanceResult:
    config = DecodeConfig(
        "ddtree", block_size=drafter.block_size, budget=budget, max_new_tokens=max_new_tokens
    )
    results = [generate(target, drafter, prompt, config) for prompt in prompts]
    return AcceptanceResult(
        budget=budget,
        block_size=drafter.block_size,
        taus=[r.taus for r in results],
        outputs=[r.tokens for r in results],
    )
