"""Types of the tree core: its results and the interface of a backend. Shapes are written on
every field.

Vocabulary: block size ``B``, depth ``L = B - 1``, budget ``N`` (non-root nodes),
verify width ``M = N + 1``. Node 0 is the root (the last committed token, depth 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A draft tree of ``M = n_nodes`` nodes (root first), ordered by non-increasing score.

    Parents always come before their children, so ``parents[i] < i`` for ``i > 0``.
    """

    tokens: torch.Tensor  # [M] int64, token id of each node; tokens[0] is the root token
    parents: torch.Tensor  # [M] int64, parent node index; parents[0] == -1
    depth: torch.Tensor  # [M] int64, depth of each node; depth[0] == 0
    scores: torch.Tensor  # [M] float64, path log-prob from the root; scores[0] == 0
    visibility: torch.Tensor  # [M, M] bool, visibility[i, j]: j is an ancestor of i or i itself

    # Acceptance finds "the child of i whose token is t" without a child table: siblings carry
    # distinct tokens (one ranked list per depth), so node j is on the accepted path exactly when
    # every non-root ancestor-or-self a of j has tokens[a] == target_token[parents[a]].

    @property
    def n_nodes(self) -> int:
        """Verify width M (root included)."""
        return int(self.tokens.shape[0])


@dataclass
class AcceptResult:
    """Outcome of verifying one tree."""

    accepted: torch.Tensor  # [tau] int64 node indices, root first, each the parent of the next
    bonus_token: int  # the target's token after the last accepted node
    tau: int  # tokens committed this step = accepted draft nodes + 1 = len(accepted)


@dataclass(frozen=True)
class TreeBackend:
    """One implementation of the host tree core (the registry: ``ddtree.tree.backends``)."""

    name: str
    # (root_token, topk_logprobs [L, K], topk_tokens [L, K], budget) -> DraftTree on the CPU
    build_tree: Callable[[int, torch.Tensor, torch.Tensor, int], DraftTree]
    # (visibility [M, M] bool, depth [M] int64, start, mask [rows, cols] float,
    #  positions [rows] int64) -> None; fills mask and positions in place (layout.py)
    fill_layout: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], None]
    # (tree, target_tokens [M] int64) -> AcceptResult
    accept_greedy: Callable[[DraftTree, torch.Tensor], AcceptResult]


class BackendUnavailable(ImportError):
    """The requested backend cannot be loaded here (the message says why)."""
