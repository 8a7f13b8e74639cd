"""Hand-made draft trees for model tests, and the reference they are checked against."""

from __future__ import annotations

import torch

from ddtree.tree.types import DraftTree


def make_tree(tokens: list[int], parents: list[int]) -> DraftTree:
    """A DraftTree from tokens and parent indices (root first, parents before children)."""
    m = len(tokens)
    depth = [0] * m
    vis = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
        if i:
            depth[i] = depth[parents[i]] + 1
    return DraftTree(
        tokens=torch.tensor(tokens),
        parents=torch.tensor(parents),
        depth=torch.tensor(depth),
        scores=torch.zeros(m, dtype=torch.float64),
        visibility=vis,
    )


def path_of(parents: list[int], i: int) -> list[int]:
    """Node ``i``'s path from the root: the tokens a sequential decode of it would see."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """A transformers model's logits ``[T, V]`` over one sequence: the reference."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]
