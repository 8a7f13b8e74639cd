"""Acceptance: walk the tree from the root while the target's token is a child.

Greedy: the target's token at node i is its argmax after the path to i. Sampled: the target's
token at every node is drawn from its own processed distribution (temperature, top-k, top-p);
walking by match then commits exactly a sample of the target (each committed token is the
target's own draw given the committed prefix), so sampled DDTree is lossless.
"""

from __future__ import annotations

import torch

from ddtree.tree.types import AcceptResult, DraftTree


def process_logits(
    logits: torch.Tensor,  # [..., V] float
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Log-probabilities after temperature, top-k and top-p (nucleus) filtering; removed
    tokens get -inf. ``temperature`` must be > 0 here (0 means greedy: use argmax)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    scaled = logits.to(torch.float32) / temperature
    if top_k is not None and 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        scaled = _top_p_filter(scaled, top_p)
    return torch.log_softmax(scaled, dim=-1)


TOP_P_HEADS = (64, 512)  # candidate counts tried, in order, before a full sort


def _top_p_filter(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep a token if the probability mass of the tokens ranked before it is < top_p (the
    first is always kept). When the top ``h`` tokens of every row already hold ``top_p`` of the
    mass, every later token is dropped, so only they need ranking: ``topk(h)`` instead of a
    full sort (on a CPU a sort of [9, 2048] costs ~1 ms, topk(64) ~40 µs). Same result."""
    v = scaled.shape[-1]
    row_probs = torch.softmax(scaled, dim=-1)
    for head in [h for h in TOP_P_HEADS if h < v] + [v]:
        order = torch.topk(scaled, head, dim=-1).indices  # sorted descending; head = v: all
        probs = row_probs.gather(-1, order)
        if head == v or bool((probs.sum(-1) >= top_p).all()):
            break
    before = torch.cumsum(probs, dim=-1) - probs
    keep = torch.zeros_like(scaled, dtype=torch.bool).scatter(-1, order, before < top_p)
    return scaled.masked_fill(~keep, float("-inf"))


def sample_token(
    logits: torch.Tensor,  # [V] or [M, V] float
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row: argmax when temperature == 0, else a draw. Returns [] or [M] int64."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = process_logits(logits, temperature, top_k, top_p).exp()
    flat = probs.reshape(-1, probs.shape[-1]).to(torch.float64)  # [rows, V]
    # inverse CDF: the first token whose cumulative mass exceeds u ~ U[0, total). A token of
    # probability 0 adds nothing to the cumulative sum, so it can never be the first to
    # exceed u. (torch.multinomial costs ~0.4 ms for [9, 2048] on a CPU; this ~25 µs.)
    cdf = torch.cumsum(flat, dim=-1)
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)
    draws = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    draws = draws.clamp_(max=flat.shape[-1] - 1)
    return draws.reshape(probs.shape[:-1])


def accepted_mask(
    tokens: torch.Tensor,  # [..., M] int64
    parents: torch.Tensor,  # [..., M] int64, -1 at the root
    visibility: torch.Tensor,  # [..., M, M] bool
    target_tokens: torch.Tensor,  # [..., M] int64, target's token after each node
) -> torch.Tensor:
    """[..., M] bool: nodes on the accepted path (root included). Node j > 0 matches when its
    token equals the target's token at its parent; it is accepted when it and all its
    non-root ancestors match."""
    parent_target = target_tokens.gather(-1, parents.clamp(min=0))
    match = (tokens == parent_target) | (parents < 0)
    return ~(visibility & ~match[..., None, :]).any(-1)


def check_target_tokens(tree: DraftTree, target_tokens: torch.Tensor) -> None:
    m = tree.n_nodes
    if target_tokens.shape != (m,):
        raise ValueError(
            f"target_tokens must be [{m}] (one per node), got {tuple(target_tokens.shape)}"
        )


def accept_greedy_torch(tree: DraftTree, target_tokens: torch.Tensor) -> AcceptResult:
    """Greedy acceptance in torch (any device): the reference for the native walk."""
    check_target_tokens(tree, target_tokens)
    ok = accepted_mask(tree.tokens, tree.parents, tree.visibility, target_tokens)
    # nodes are ordered parents-first, so the accepted path in index order is root -> leaf
    accepted = ok.nonzero().squeeze(1)
    tau = int(accepted.shape[0])
    return AcceptResult(accepted=accepted, bonus_token=int(target_tokens[accepted[-1]]), tau=tau)


def accept_greedy_batch(
    tokens: torch.Tensor,  # [R, M] int64
    parents: torch.Tensor,  # [R, M] int64
    visibility: torch.Tensor,  # [R, M, M] bool
    target_tokens: torch.Tensor,  # [R, M] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched greedy acceptance without host synchronisation.

    Returns (accepted_mask [R, M] bool, tau [R] int64, bonus_token [R] int64). Padding nodes
    (parent -1 beyond the root) must have visibility only on their own diagonal and a token
    that cannot match, or be excluded by the caller with ``n_nodes``.
    """
    ok = accepted_mask(tokens, parents, visibility, target_tokens)
    ok[:, 1:] &= parents[:, 1:] >= 0
    tau = ok.sum(-1)
    index = torch.arange(ok.shape[1], device=ok.device).expand_as(ok)
    last = torch.where(ok, index, -1).max(-1).values
    bonus = target_tokens.gather(1, last[:, None]).squeeze(1)
    return ok, tau, bonus
