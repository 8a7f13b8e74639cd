"""Samplers: how the target's logits become tokens, chosen once per request (``sampler_for``).

``first`` picks the token after the prefill; ``accept`` walks a verified tree by match with
the target's token at every node (``ddtree.tree.accept_greedy`` / ``accept_sampled``): greedy
takes the argmax, sampling draws from the processed distribution, which keeps the output
distributed as the target's (lossless).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree import tree as tree_core
from ddtree.tree.types import AcceptResult, DraftTree


class GreedySampler:
    def first(self, logits: torch.Tensor) -> int:
        """``logits`` [V]: the target's next-token logits after the last committed token."""
        return int(logits.argmax())

    def accept(self, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
        """``logits`` [M, V]: the target's next-token logits at every tree node."""
        return tree_core.accept_greedy(tree, logits.argmax(dim=-1).to(tree.tokens.device))


@dataclass
class TemperatureSampler:
    temperature: float  # > 0
    top_k: int  # 0: off
    top_p: float  # 1: off
    generator: torch.Generator

    def first(self, logits: torch.Tensor) -> int:
        """``logits`` [V]."""
        return int(
            tree_core.sample_token(logits, self.temperature, self.top_k, self.top_p, self.generator)
        )

    def accept(self, tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
        """``logits`` [M, V]."""
        return tree_core.accept_sampled(
            tree, logits, self.temperature, self.top_k, self.top_p, self.generator
        )


def sampler_for(
    temperature: float, top_k: int, top_p: float, seed: int, device: torch.device
) -> GreedySampler | TemperatureSampler:
    """Greedy at temperature 0, else a sampler with its own generator seeded with ``seed``."""
    if temperature == 0:
        return GreedySampler()
    generator = torch.Generator(device=device).manual_seed(seed)
    return TemperatureSampler(temperature, top_k, top_p, generator)
