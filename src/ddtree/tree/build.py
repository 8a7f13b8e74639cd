"""Best-first draft-tree construction (DDTree's surrogate).

Inputs per request: the root token, per-depth top-K log-probs ``[L, K]`` sorted descending and
their token ids ``[L, K]``, and a budget N. A node at depth d is a rank tuple ``(r_1, .., r_d)``
(rank r_i in depth i's list) with path score ``lp[0, r_1] + .. + lp[d-1, r_d]``, accumulated in
float64 from the root outwards (inputs are widened first; ``DraftTree.scores`` is float64). Every depth reuses the same ranked list whatever the parent.

The tree is the N best rank tuples under the order: higher score first, ties broken by the
lexicographically smaller rank tuple (a proper prefix is smaller than its extensions). Because
log-probs are <= 0 and sorted descending, a parent and an elder sibling always precede a node in
this order, so the N best are closed under prefixes and the best-first walk that pops a node and
pushes its next sibling and its first child visits them in order.

Worked example (L = 2, K = 2, N = 3)::

    lp = [[-0.1, -2.0],     depth 1: tokens [7, 8]
          [-0.5, -0.7]]     depth 2: tokens [3, 4]
    candidates: (0)=-0.1, (0,0)=-0.6, (0,1)=-0.8, (1)=-2.0, ...
    tree (root first): root, (0)->7, (0,0)->3, (0,1)->4 ; parents [-1, 0, 1, 1]

Node ordering is the output order: node 0 is the root; nodes follow in that order.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from ddtree.tree.types import DraftTree


def check_topk(
    topk_logprobs: torch.Tensor, topk_tokens: torch.Tensor, budget: int, values: bool = True
) -> None:
    """Validate one request's or a batch's top-K inputs ([.., L, K]); raise ValueError naming
    the argument. ``values=False`` checks shapes and dtypes only (no read of the data: no host
    synchronisation, nothing that breaks a captured graph)."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if topk_logprobs.shape != topk_tokens.shape or topk_logprobs.dim() < 2:
        raise ValueError(
            f"topk_logprobs {tuple(topk_logprobs.shape)} and topk_tokens "
            f"{tuple(topk_tokens.shape)} must share one shape [.., L, K]"
        )
    if not topk_logprobs.is_floating_point():
        raise ValueError(f"topk_logprobs must be floating point, got {topk_logprobs.dtype}")
    if not values:
        return
    values = _cheap_view(topk_logprobs)  # numpy or torch: the same expressions work on both
    if (values != values).any():
        raise ValueError("topk_logprobs contains NaN (expected log-probabilities or -inf)")
    if (values[..., 1:] > values[..., :-1]).any():
        raise ValueError("topk_logprobs must be sorted descending along the last dimension (K)")


def _cheap_view(values: torch.Tensor):
    """A numpy view of a CPU float32/64 tensor (numpy reductions and widening cost ~1 µs where
    torch's cost ~5 µs on these small inputs); other tensors are returned as they are."""
    values = values.detach()
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return values.numpy()
    return values


def _host_float64(values: torch.Tensor) -> np.ndarray:
    """A float64 numpy copy on the host."""
    view = _cheap_view(values)
    if isinstance(view, np.ndarray):
        return view.astype(np.float64)
    return view.to("cpu", torch.float64).numpy()


def _visibility_from_masks(masks: list[int], m: int) -> torch.Tensor:
    """[M, M] bool from per-node ancestor-or-self bitmasks (bit j of masks[i]: j visible)."""
    nbytes = (m + 7) // 8
    raw = b"".join(x.to_bytes(nbytes, "little") for x in masks)
    bits = np.unpackbits(
        np.frombuffer(raw, dtype=np.uint8).reshape(m, nbytes), axis=1, bitorder="little"
    )
    return torch.from_numpy(bits[:, :m].astype(bool))


def build_tree_python(
    root_token: int,
    topk_logprobs: torch.Tensor,  # [L, K] float, sorted descending per depth
    topk_tokens: torch.Tensor,  # [L, K] int64
    budget: int,
) -> DraftTree:
    """The Python heap builder: the reference the compiled core is tested against, and the
    fallback where it is not built."""
    check_topk(topk_logprobs, topk_tokens, budget)
    assert topk_logprobs.dim() == 2, "build_tree takes one request [L, K]; see build_trees"
    n_depth, k = topk_logprobs.shape
    k = min(k, budget)  # rank >= budget has `budget` better siblings: never chosen
    # Python floats are float64: path scores accumulate in float64 (see module docstring)
    lp = _host_float64(topk_logprobs[:, :k]).tolist()
    tok = topk_tokens[:, :k].detach().cpu().numpy().tolist()
    inf = float("inf")
    # The tie-break "lexicographically smaller rank tuple" as one integer: rank r at depth d is
    # the digit r + 1 at place (K + 1) ** (L - d), absent depths are 0, so a prefix sorts before
    # its extensions. Example K = 2, L = 2: (0,) -> 3, (0, 0) -> 4, (0, 1) -> 5, (1,) -> 6.
    place = [(k + 1) ** (n_depth - d) for d in range(n_depth + 1)]
    tokens, parents, depth, scores, masks = [int(root_token)], [-1], [0], [0.0], [1]
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, rank key, parent, depth, rank)
    if budget > 0 and n_depth > 0 and k > 0 and lp[0][0] > -inf:
        heap.append((-lp[0][0], place[1], 0, 1, 0))
    pop, push = heapq.heappop, heapq.heappush
    while heap and len(tokens) <= budget:
        neg_score, key, parent, d, r = pop(heap)
        node = len(tokens)
        row = lp[d - 1]
        tokens.append(tok[d - 1][r])
        parents.append(parent)
        depth.append(d)
        scores.append(-neg_score)
        masks.append(masks[parent] | (1 << node))
        if r + 1 < k and row[r + 1] > -inf:
            push(heap, (-(scores[parent] + row[r + 1]), key + place[d], parent, d, r + 1))
        if d < n_depth and lp[d][0] > -inf:
            push(heap, (neg_score - lp[d][0], key + place[d + 1], node, d + 1, 0))
    m = len(tokens)
    ints = torch.tensor([tokens, parents, depth], dtype=torch.int64)  # [3, M]
    return DraftTree(
        tokens=ints[0],
        parents=ints[1],
        depth=ints[2],
        scores=torch.tensor(scores, dtype=torch.float64),
        visibility=_visibility_from_masks(masks, m),
    )
