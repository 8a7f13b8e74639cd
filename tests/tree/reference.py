"""Plain numpy reference implementations for the tree tests, small and obviously correct,
that the torch and native versions are tested bit-exact against."""

from __future__ import annotations

import itertools

import numpy as np


def build_tree_ref(root_token: int, lp: np.ndarray, tok: np.ndarray, budget: int):
    """Enumerate every rank tuple, score it in float64 from the root outwards, sort by
    (score desc, rank tuple asc), keep the first ``budget`` finite ones.

    Returns (tokens [M], parents [M], depth [M], scores [M] float64). Exponential: small inputs.
    """
    lp = np.asarray(lp, dtype=np.float64)
    n_depth, k = lp.shape
    nodes = []
    for d in range(1, n_depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = np.float64(0.0)
            for i, r in enumerate(ranks):
                score = np.float64(score + lp[i, r])
            if np.isfinite(score):
                nodes.append((-score, ranks))
    nodes.sort()
    chosen = [ranks for _, ranks in nodes[:budget]]
    index = {(): 0}
    tokens, parents, depth, scores = [int(root_token)], [-1], [0], [np.float64(0.0)]
    for ranks in chosen:
        index[ranks] = len(tokens)
        tokens.append(int(tok[len(ranks) - 1, ranks[-1]]))
        parents.append(index[ranks[:-1]])
        depth.append(len(ranks))
        s = np.float64(0.0)
        for i, r in enumerate(ranks):
            s = np.float64(s + lp[i, r])
        scores.append(s)
    return (
        np.array(tokens, dtype=np.int64),
        np.array(parents, dtype=np.int64),
        np.array(depth, dtype=np.int64),
        np.array(scores, dtype=np.float64),
    )


def visibility_ref(parents: np.ndarray) -> np.ndarray:
    """[M, M] bool: walk each node's parent chain."""
    m = len(parents)
    vis = np.zeros((m, m), dtype=bool)
    for i in range(m):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


def mask_ref(parents: np.ndarray, start: int, dtype_min: float) -> np.ndarray:
    """[M, start+M] additive mask: row i sees the prefix and its ancestors-or-self."""
    vis = visibility_ref(parents)
    m = len(parents)
    mask = np.full((m, start + m), dtype_min, dtype=np.float64)
    mask[:, :start] = 0.0
    mask[:, start:][vis] = 0.0
    return mask


def accept_ref(tokens: np.ndarray, parents: np.ndarray, target_tokens: np.ndarray):
    """Walk from the root: move to the child whose token is the target's token, while any."""
    path = [0]
    while True:
        here = path[-1]
        children = [j for j in range(len(tokens)) if parents[j] == here]
        nxt = [j for j in children if tokens[j] == target_tokens[here]]
        if not nxt:
            break
        path.append(nxt[0])
    return np.array(path, dtype=np.int64), int(target_tokens[path[-1]]), len(path)


def compaction_ref(accepted: np.ndarray, start: int):
    src = [start + int(a) for a in accepted]
    dst = [start + i for i in range(len(accepted))]
    return np.array(src), np.array(dst), start + len(accepted)
