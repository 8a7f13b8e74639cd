"""Replay a trace: decode every prompt again for a policy and budget, from the recorded
drafter candidates, without running a model.

At root position p the step builds the tree exactly as the engine does (``ddtree.tree``'s
builder over the first ``K = policy.candidates(N, V)`` stored candidates per depth), walks it
against the recorded greedy tokens (``accept_greedy`` with the greedy token after each node,
``seq[p + depth + 1]``), and moves to ``p + tau``. For greedy decoding this is exact: the
committed text is the AR text whatever the budget, so the target's token after every node on
the accepted path is known; nodes off the path never matter. The last step's tau counts only
the tokens the engine returns (truncated at max_new_tokens or EOS), as ``GenerationResult.taus``.

Worked example (B = 3, L = 2, budget 2, one prompt of T = 2 tokens, continuation [5, 6, 7]):
root 5 at position 2; candidates depth 1 [6, 9], depth 2 [8, 7]; tree root -> 6 -> 8; 6
matches seq[3], 8 does not match seq[4] = 7: tau 2 (6 and the bonus 7), the run ends (3 new
tokens: 1 from the prefill + 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ddtree import tree as tree_core
from ddtree.engine.policies import Policy, get_policy
from ddtree.replay.trace import Trace

REPLAY_POLICIES = ("chain", "ddtree")


@dataclass
class PromptReplay:
    """One prompt replayed under one policy and budget, one entry per step."""

    positions: np.ndarray  # [steps] int64, root position of each step
    taus: np.ndarray  # [steps] int64, tokens committed (last step truncated like the engine)
    accepted: np.ndarray  # [steps] int64, draft nodes accepted before truncation (<= B-1)
    expected_taus: np.ndarray  # [steps] float64, the surrogate's 1 + sum_v exp(score_v)
    # Rank (0-based) of the greedy token in the drafter's list at each depth d+1 along the
    # accepted path, for d = 0 .. min(accepted, L-1): -1 when outside the stored top-K.
    ranks: np.ndarray  # [events] int64
    limited_steps: int  # steps whose tree reached the last stored rank while K_stored < K


def check_policy(name: str) -> Policy:
    if name not in REPLAY_POLICIES:
        raise ValueError(
            f"policy {name!r}: replay takes {', '.join(REPLAY_POLICIES)} (ar commits 1 per step)"
        )
    return get_policy(name)


def greedy_ranks(trace: Trace, index: int) -> np.ndarray:
    """[n-1, L] int64: at root j (position T + j), the rank of the greedy token at position
    T + j + d + 1 in the drafter's stored list for depth d + 1; -1 when outside the top-K or
    past the end of the continuation."""
    info = trace.header.prompts[index]
    depth_count = trace.header.block_size - 1
    seq = trace.sequence(index)
    tokens = trace.topk_tokens[trace.roots(index)]  # [n-1, L, K]
    first = info.prompt_tokens
    padded = torch.cat([seq, torch.full((depth_count,), -1, dtype=torch.int64)])
    after = first + 1 + torch.arange(info.roots)[:, None] + torch.arange(depth_count)  # [n-1, L]
    hit = tokens == padded[after][..., None]  # [n-1, L, K]
    return torch.where(hit.any(-1), hit.int().argmax(-1), -1).numpy()


def replay_prompt(trace: Trace, index: int, policy: str, budget: int) -> PromptReplay:
    """Replay prompt ``index`` of ``trace`` under ``policy`` (chain, ddtree) at ``budget``."""
    pol = check_policy(policy)
    header = trace.header
    n_nodes = pol.budget(header.block_size, budget)
    k_policy = pol.candidates(n_nodes, header.target.vocab_size)
    k = min(k_policy, header.top_k)
    info = header.prompts[index]
    depth_count = header.block_size - 1
    rows = trace.roots(index)
    logprobs = trace.topk_logprobs[rows, :, :k]  # [n-1, L, k] views, one per step below
    tokens = trace.topk_tokens[rows, :, :k]
    seq = trace.sequence(index).numpy()  # [T + n]
    # greedy token after a node at depth d of the tree rooted at p: seq[p + d + 1]; -1 past
    # the end (never matches: the engine stops there)
    padded = np.concatenate([seq, np.full(depth_count + 1, -1, dtype=np.int64)])
    first, end = info.prompt_tokens, info.prompt_tokens + info.new_tokens - 1
    positions, taus, accepted, expected = [], [], [], []
    limited = 0
    check_limit = k_policy > header.top_k
    p = first
    while p < end:
        j = p - first
        tree = tree_core.build_tree(int(seq[p]), logprobs[j], tokens[j], n_nodes)
        depth = tree.depth.numpy()
        result = tree_core.accept_greedy(tree, torch.from_numpy(padded[p + 1 + depth]))
        if check_limit and tree.n_nodes > 1:
            last = trace.topk_tokens[rows.start + j, depth[1:] - 1, header.top_k - 1]
            limited += bool((tree.tokens[1:] == last).any())
        positions.append(p)
        accepted.append(result.tau - 1)
        expected.append(1.0 + float(np.exp(tree.scores.numpy()[1:]).sum()))
        tau = min(result.tau, end - p)
        taus.append(tau)
        p += tau
    positions = np.asarray(positions, dtype=np.int64)
    accepted = np.asarray(accepted, dtype=np.int64)
    # events: the accepted path's nodes at depth d = 0 .. accepted (< L), each asking for the
    # greedy token's rank at depth d + 1 (-1 entries past the end are not events)
    ranks = greedy_ranks(trace, index)[positions - first]  # [steps, L]
    asked = np.arange(depth_count) <= accepted[:, None]
    known = positions[:, None] + 1 + np.arange(depth_count) <= end
    return PromptReplay(
        positions=positions,
        taus=np.asarray(taus, dtype=np.int64),
        accepted=accepted,
        expected_taus=np.asarray(expected, dtype=np.float64),
        ranks=ranks[asked & known],
        limited_steps=limited,
    )


def replay(trace: Trace, policy: str, budget: int) -> list[PromptReplay]:
    """Every prompt of ``trace`` under one policy and budget."""
    return [replay_prompt(trace, i, policy, budget) for i in range(len(trace.header.prompts))]


def replay_points(
    trace: Trace, policies: Sequence[str], budgets: Sequence[int]
) -> list[tuple[str, int]]:
    """The (policy, budget) points a sweep replays: chain once (its budget is B-1)."""
    for name in policies:
        check_policy(name)
    points = []
    for name in dict.fromkeys(policies):
        if name == "chain":
            points.append((name, trace.header.block_size - 1))
        else:
            points.extend((name, int(n)) for n in dict.fromkeys(budgets))
    return points
