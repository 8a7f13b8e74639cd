"""The batched, vectorised tree builder: R requests' trees in one call with no host
synchronisation (shapes depend only on R, L, K and the budget), the same trees as
``ddtree.tree.build.build_tree``.

Experimental: no decode path uses it. The batch engine (``ddtree.engine.batch``) builds each
row's tree on the host with the compiled tree core, which is faster on a CPU. This builder is for
a device proposer that keeps the trees on the GPU between the drafter's top-K and the verify
(it runs inside a captured graph: ``check_values=False``). ``ddtree bench tree`` measures it
against the host builder, and ``tests/tree/test_build.py`` holds it to the host builder's trees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree.build import check_topk
from ddtree.tree.types import DraftTree


@dataclass
class DraftTreeBatch:
    """R trees padded to ``budget + 1`` nodes. Rows past ``n_nodes[r]`` are padding
    (token 0, parent -1, score -inf, visibility only on the diagonal)."""

    tokens: torch.Tensor  # [R, N+1] int64
    parents: torch.Tensor  # [R, N+1] int64
    depth: torch.Tensor  # [R, N+1] int64
    scores: torch.Tensor  # [R, N+1] float64
    visibility: torch.Tensor  # [R, N+1, N+1] bool
    n_nodes: torch.Tensor  # [R] int64, real nodes per tree (root included)

    def tree(self, r: int) -> DraftTree:
        """Tree r as a DraftTree (one host synchronisation for its size)."""
        m = int(self.n_nodes[r])
        return DraftTree(
            tokens=self.tokens[r, :m],
            parents=self.parents[r, :m],
            depth=self.depth[r, :m],
            scores=self.scores[r, :m],
            visibility=self.visibility[r, :m, :m],
        )


def _pair_count(p: int, k: int, n: int) -> int:
    """sum(min(k, n // q) for q in 1..p), over the O(sqrt(n)) runs of equal n // q."""
    total, q = 0, 1
    while q <= p and n // q > 0:
        v = n // q
        last = min(p, n // v)  # the last q with n // q == v
        total += min(k, v) * (last - q + 1)
        q = last + 1
    return total


def _candidate_pairs(p: int, k: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Static (parent score rank i, child rank j) pairs with (i + 1) * (j + 1) <= n, i < p,
    j < k, in (i, j) order: [C] int64 each. Made on ``device`` from shapes alone (no host
    copy, no data-dependent shape), so a captured graph can hold them.

    Example p = 3, k = 4, n = 4: counts min(k, n // (i + 1)) = [4, 2, 1], C = 7,
    i = [0, 0, 0, 0, 1, 1, 2], j = [0, 1, 2, 3, 0, 1, 0].
    """
    counts = torch.clamp(n // torch.arange(1, p + 1, device=device), max=k)  # [p]
    ends = counts.cumsum(0)
    flat = torch.arange(_pair_count(p, k, n), device=device)
    i = torch.searchsorted(ends, flat, right=True)
    return i, flat - (ends - counts)[i]


def build_trees(
    root_tokens: torch.Tensor,  # [R] int64
    topk_logprobs: torch.Tensor,  # [R, L, K] float, sorted descending per depth
    topk_tokens: torch.Tensor,  # [R, L, K] int64
    budget: int,
    check_values: bool = True,
) -> DraftTreeBatch:
    """Batched, vectorised builder: same trees (nodes and order) as ``build_tree``, with no host
    synchronisation (shapes depend only on R, L, K and the budget). ``check_values=False``
    skips the NaN / sortedness checks, which read the inputs on the host: pass it inside a
    captured graph (``torch.compile(fullgraph=True)``, CUDA graphs).

    Level by level: keep the ``budget`` best nodes of each depth among the children of the kept
    nodes of the depth above (a node of the global top-N has its parent in the global top-N,
    and is among the N best of its depth). Kept nodes of a depth are held in lexicographic
    rank order, so the flattened (parent, rank) grid of the next depth is lexicographic too.
    The final order sorts all kept nodes by (score desc, rank tuple asc) with stable sorts.
    """
    check_topk(topk_logprobs, topk_tokens, budget, values=check_values)
    assert topk_logprobs.dim() == 3, "build_trees takes [R, L, K]"
    device = topk_logprobs.device
    r_count, n_depth, k = topk_logprobs.shape
    k = min(k, budget)
    n = budget
    lp = topk_logprobs[:, :, :k].to(torch.float64)
    tok = topk_tokens[:, :, :k].to(torch.int64)
    batch = torch.arange(r_count, device=device)[:, None]

    level_scores, level_ranks, level_parent, level_depth = [], [], [], []
    # depth 0: the root, score 0, no ranks; its "global id" is -1 (root)
    parent_scores = torch.zeros(r_count, 1, dtype=torch.float64, device=device)
    parent_ranks = torch.full((r_count, 1, n_depth), -1, dtype=torch.int64, device=device)
    parent_ids = torch.full((r_count, 1), -1, dtype=torch.int64, device=device)
    offset = 0
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for d in range(n_depth if n > 0 and k > 0 else 0):
        p = parent_scores.shape[1]
        keep = min(n, p * k)
        # Candidates: the parent ranked i-th by score (0-based) can only place its j-th child in
        # the level's top N if (i + 1) * (j + 1) <= N; otherwise N children of better-or-equal
        # parents with better-or-equal ranks outrank it (ties included). Example N = 4, K = 4:
        # pairs (0,0..3), (1,0..1), (2,0), (3,0): 8 candidates instead of P * K = 16.
        if p not in pairs:  # p is the same at most depths: make each set once per call
            pairs[p] = _candidate_pairs(p, k, n, device)
        pi, pj = pairs[p]  # [C] each
        by_score = torch.sort(parent_scores, dim=1, descending=True, stable=True).indices
        cand_parent = by_score[:, pi]  # [R, C] parent's index in lexicographic order
        cand_lex = cand_parent * k + pj  # [R, C] position in the lexicographic (parent, rank) grid
        cand_score = parent_scores.gather(1, cand_parent) + lp[:, d, pj]  # [R, C]
        # lexicographic order first, so the stable score sort breaks ties by rank tuple
        lex_order = torch.sort(cand_lex, dim=1).indices
        cand_lex, cand_score = cand_lex.gather(1, lex_order), cand_score.gather(1, lex_order)
        best = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :keep]
        best = torch.sort(best, dim=1).values  # back to lexicographic order
        order = cand_lex.gather(1, best)  # [R, keep] flat (parent, rank) ids
        scores = cand_score.gather(1, best)  # [R, keep]
        par = order // k
        rank = order % k
        ranks = parent_ranks.gather(1, par[:, :, None].expand(-1, -1, n_depth)).clone()
        ranks[:, :, d] = rank
        level_scores.append(scores)
        level_ranks.append(ranks)
        level_parent.append(parent_ids.gather(1, par))
        level_depth.append(torch.full_like(par, d + 1))
        parent_scores, parent_ranks = scores, ranks
        parent_ids = offset + torch.arange(keep, device=device).expand(r_count, keep)
        offset += keep

    out_m = n + 1
    tokens = torch.zeros(r_count, out_m, dtype=torch.int64, device=device)
    tokens[:, 0] = root_tokens.to(device=device, dtype=torch.int64)
    parents = torch.full((r_count, out_m), -1, dtype=torch.int64, device=device)
    depth = torch.zeros(r_count, out_m, dtype=torch.int64, device=device)
    scores = torch.full((r_count, out_m), float("-inf"), dtype=torch.float64, device=device)
    scores[:, 0] = 0.0
    if offset == 0:
        n_nodes = torch.ones(r_count, dtype=torch.int64, device=device)
        vis = torch.eye(out_m, dtype=torch.bool, device=device).expand(r_count, -1, -1).clone()
        return DraftTreeBatch(tokens, parents, depth, scores, vis, n_nodes)

    all_scores = torch.cat(level_scores, 1)  # [R, T]
    all_ranks = torch.cat(level_ranks, 1)  # [R, T, L], -1 padded
    all_parent = torch.cat(level_parent, 1)  # [R, T], -1 = root
    all_depth = torch.cat(level_depth, 1)
    all_tokens = tok[batch, all_depth - 1, all_ranks.gather(2, (all_depth - 1)[:, :, None])[..., 0]]
    finite = torch.isfinite(all_scores)
    # Order: finite first, then score desc, then rank tuple asc. Stable sorts from the least
    # significant key to the most significant one.
    perm = torch.arange(all_scores.shape[1], device=device).expand(r_count, -1)
    for col in reversed(range(n_depth)):
        key = all_ranks[:, :, col].gather(1, perm)
        perm = perm.gather(1, torch.sort(key, dim=1, stable=True).indices)
    key = torch.where(finite, -all_scores, torch.full_like(all_scores, float("inf"))).gather(
        1, perm
    )
    perm = perm.gather(1, torch.sort(key, dim=1, stable=True).indices)
    perm = perm[:, :n]
    take = perm.shape[1]
    # new index (1-based, root 0) of each level node that was taken
    new_index = torch.full_like(all_scores, -1, dtype=torch.int64)
    new_index.scatter_(1, perm, torch.arange(1, take + 1, device=device).expand(r_count, -1))
    sel_parent = all_parent.gather(1, perm)
    sel_parent_new = torch.where(
        sel_parent < 0, torch.zeros_like(sel_parent), new_index.gather(1, sel_parent.clamp(min=0))
    )
    valid = finite.gather(1, perm)
    n_nodes = 1 + valid.sum(1)
    tokens[:, 1 : take + 1] = torch.where(valid, all_tokens.gather(1, perm), 0)
    parents[:, 1 : take + 1] = torch.where(valid, sel_parent_new, -1)
    depth[:, 1 : take + 1] = torch.where(valid, all_depth.gather(1, perm), 0)
    scores[:, 1 : take + 1] = torch.where(valid, all_scores.gather(1, perm), float("-inf"))
    # visibility by pointer jumping: L rounds, each adds the current ancestor of every node
    vis = torch.eye(out_m, dtype=torch.bool, device=device).expand(r_count, -1, -1).clone()
    rows = torch.arange(out_m, device=device).expand(r_count, -1)
    anc = parents.clone()
    for _ in range(n_depth):
        has = anc >= 0
        vis[batch, rows, anc.clamp(min=0)] |= has
        anc = torch.where(has, parents.gather(1, anc.clamp(min=0)), anc)
    return DraftTreeBatch(tokens, parents, depth, scores, vis, n_nodes)
