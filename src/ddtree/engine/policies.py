"""Proposal policies: how a step turns the drafter's block logits into a draft tree.

One decode loop (``ddtree.engine.loop``) drives every policy; a policy only decides the tree:

- ``ar``: no drafter; the tree is the root alone (verify width M = 1).
- ``chain``: the drafter's top-1 at each of the B-1 positions, a path tree (DFlash's linear
  verification): a best-first tree with one candidate per depth and budget B-1.
- ``ddtree``: block B, budget N, best-first over the top-K candidates per depth with
  K = min(N, V) as the published DDTree code takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree.types import DraftTree


@dataclass(frozen=True)
class Policy:
    name: str
    needs_drafter: bool
    min_budget: int = 0  # the smallest DecodeConfig.budget it accepts (ddtree: 1 node)

    def candidates(self, budget: int, vocab_size: int) -> int:
        """K: candidates per depth taken from the drafter's logits."""
        if self.name == "chain":
            return 1
        return max(1, min(budget, vocab_size))

    def budget(self, block_size: int, budget: int) -> int:
        """Non-root nodes of the tree this policy builds."""
        if self.name == "ar":
            return 0
        if self.name == "chain":
            return block_size - 1
        return budget


POLICIES: dict[str, Policy] = {
    "ar": Policy("ar", needs_drafter=False),
    "chain": Policy("chain", needs_drafter=True),
    "ddtree": Policy("ddtree", needs_drafter=True, min_budget=1),
}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"policy {name!r}: expected one of {', '.join(POLICIES)}")
    return POLICIES[name]


def root_tree(root_token: int, device: torch.device | str = "cpu") -> DraftTree:
    """The tree of an ``ar`` step: the root alone (M = 1)."""
    return DraftTree(
        tokens=torch.tensor([root_token], dtype=torch.int64, device=device),
        parents=torch.tensor([-1], dtype=torch.int64, device=device),
        depth=torch.zeros(1, dtype=torch.int64, device=device),
        scores=torch.zeros(1, dtype=torch.float64, device=device),
        visibility=torch.ones(1, 1, dtype=torch.bool, device=device),
    )
