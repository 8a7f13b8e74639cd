"""Proposers: what one decode step puts in front of the target, one per drafting kind.

A proposer is chosen once per request from the policy's ``drafting`` (``PROPOSERS``, a
registry that imports its implementations) and asked three things by the loop: which target
layers it reads (``capture_layers``), the hidden states of the tokens just committed
(``observe``), and the next step's tree (``propose``, which stamps the stages it runs).

- ``RootProposer`` (no drafter: ``ar``): the tree is the root alone (M = 1).
- ``BlockTreeProposer`` (``Drafting.BLOCK``: ``chain``, ``ddtree``): one drafter forward over
  the block ``[root, MASK x (B-1)]``, the top-K of its logits per depth (K =
  ``policy.candidates``), and the best-first tree of ``policy.budget(B, N)`` nodes. A drafter
  with a draft vocabulary (``Drafter.draft_tokens``) returns logits over its K tokens only: the
  top-K is taken over those columns (log-probabilities renormalised over the K) and its
  columns mapped back to vocabulary ids before the tree is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ddtree import tree as tree_core
from ddtree.engine.timing import StageClock
from ddtree.models.base import Drafter
from ddtree.models.static import EnginePlan
from ddtree.tree.types import DraftTree
from ddtree.vocab import Drafting, Policy


class Proposer(Protocol):
    capture_layers: list[int]  # target hidden states it reads (HF indexing)

    def set_engine_mode(self, plan: EnginePlan) -> float:
        """As ``Target.set_engine_mode``: seconds spent compiling."""

    def observe(self, hidden: torch.Tensor | None, rows: torch.Tensor | None = None) -> None:
        """``hidden`` [T, F]: the target's captured hidden states of its last forward; ``rows``
        [tau] int64: the ones committed (None: all of them, the prefill)."""

    def propose(self, root: int, clock: StageClock) -> DraftTree:
        """The tree of the step rooted at the last committed token ``root``."""


@dataclass
class RootProposer:
    """No drafter: every step verifies the root alone and commits one token."""

    device: torch.device
    capture_layers: list[int] = field(default_factory=list)

    def set_engine_mode(self, plan: EnginePlan) -> float:
        return 0.0

    def observe(self, hidden: torch.Tensor | None, rows: torch.Tensor | None = None) -> None:
        pass

    def propose(self, root: int, clock: StageClock) -> DraftTree:
        return DraftTree(
            tokens=torch.tensor([root], dtype=torch.int64, device=self.device),
            parents=torch.tensor([-1], dtype=torch.int64, device=self.device),
            depth=torch.zeros(1, dtype=torch.int64, device=self.device),
            scores=torch.zeros(1, dtype=torch.float64, device=self.device),
            visibility=torch.ones(1, 1, dtype=torch.bool, device=self.device),
        )


@dataclass
class BlockTreeProposer:
    """A block drafter's one forward, top-K per depth, then the best-first tree."""

    drafter: Drafter
    policy: Policy
    budget: int  # non-root nodes of every tree: policy.budget(B, N)
    capture_layers: list[int] = field(default_factory=list)
    draft_tokens: torch.Tensor | None = None  # [K] int64: column -> id; None: column = id
    _context: torch.Tensor | None = None  # [T, F] committed, not yet seen by the drafter

    def set_engine_mode(self, plan: EnginePlan) -> float:
        return self.drafter.set_engine_mode(plan)

    def observe(self, hidden: torch.Tensor | None, rows: torch.Tensor | None = None) -> None:
        self._context = hidden if rows is None else hidden.index_select(0, rows.to(hidden.device))

    def propose(self, root: int, clock: StageClock) -> DraftTree:
        logits = self.drafter.propose(self._context, root)  # [B-1, V] (or [B-1, K_vocab])
        clock.mark("draft")
        return self.tree(root, logits, clock)

    def pending_context(self) -> torch.Tensor:
        """[T, F] what the next propose hands the drafter (a batch drafts many at once:
        ``ddtree.engine.batch``)."""
        return self._context

    def tree(self, root: int, logits: torch.Tensor, clock: StageClock) -> DraftTree:
        """The step's tree from the drafter's logits [B-1, V or K_vocab]: top-K per depth
        (stamped ``topk``), then best-first (``build``)."""
        k = self.policy.candidates(self.budget, int(logits.shape[-1]))
        top = tree_core.topk_logprobs(logits, k)  # logprobs, columns: [B-1, k] each
        tokens = top.tokens  # [B-1, k] int64 vocabulary ids
        if self.draft_tokens is not None:
            tokens = self.draft_tokens[tokens.to(self.draft_tokens.device)].to(tokens.device)
        clock.mark("topk")
        tree = tree_core.build_tree(root, top.logprobs, tokens, self.budget)
        clock.mark("build")
        return tree


def _root(policy: Policy, drafter, block_size: int, budget: int, device) -> RootProposer:
    return RootProposer(device)


def _block_tree(policy: Policy, drafter, block_size: int, budget: int, device):
    if drafter is None:
        raise ValueError(f"policy {policy.name!r} needs a drafter")
    if drafter.block_size != block_size:
        raise ValueError(
            f"block_size {block_size} != the drafter's block_size {drafter.block_size}"
        )
    nodes = policy.budget(block_size, budget)
    draft_tokens = getattr(drafter, "draft_tokens", None)  # absent: an older full-V drafter
    return BlockTreeProposer(drafter, policy, nodes, list(drafter.target_layer_ids), draft_tokens)


PROPOSERS: dict[Drafting | None, Callable[..., Proposer]] = {
    None: _root,
    Drafting.BLOCK: _block_tree,
}
"""A policy's ``drafting`` -> its proposer's factory (policy, drafter, B, N, device)."""


def check_runnable(policy: Policy) -> None:
    """Refuse a policy the engine has no proposer for (one the estimator prices only)."""
    if policy.drafting not in PROPOSERS:
        raise ValueError(
            f"policy {policy.name!r}: the engine has no proposer for its drafting "
            f"{policy.drafting!r}; the estimator prices it, the engine cannot decode it"
        )


def proposer_for(
    policy: Policy, drafter: Drafter | None, block_size: int, budget: int, device: torch.device
) -> Proposer:
    """The proposer of one request; ValueError if the policy needs a drafter it was not given
    or one of another block size."""
    check_runnable(policy)
    return PROPOSERS[policy.drafting](policy, drafter, block_size, budget, device)
