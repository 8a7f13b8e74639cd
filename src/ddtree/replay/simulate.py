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


@dataclass
class ReplayStep:
    tau: int  # tokens committed (truncated at the end of the continuation)
    accepted: int  # draft nodes accepted before truncation
    expected_tau: float  # the drafter surrogate's 1 + sum_v exp(score_v)
    limited: bool  # the tree reached the last stored rank while K_stored < K


class PromptReplayer:
    """One prompt of a trace under one policy and budget: ``step(p)`` replays the step whose
    root is at position p; ``run()`` decodes the whole continuation."""

    def __init__(self, trace: Trace, index: int, policy: str, budget: int) -> None:
        pol = check_policy(policy)
        header = trace.header
        self.trace, self.index = trace, index
        self.n_nodes = pol.budget(header.block_size, budget)
        k_policy = pol.candidates(self.n_nodes, header.target.vocab_size)
        k = min(k_policy, header.top_k)
        self.check_limit = k_policy > header.top_k
        info = header.prompts[index]
        self.depth_count = header.block_size - 1
        self.rows = trace.roots(index)
        self.logprobs = trace.topk_logprobs[self.rows, :, :k]  # [n-1, L, k]
        self.tokens = trace.topk_tokens[self.rows, :, :k]  # [n-1, L, k]
        self.seq = trace.sequence(index).numpy()  # [T + n]
        # the greedy token after a node at depth d of the tree rooted at p is seq[p + d + 1];
        # -1 past the end (never matches: the engine stops there)
        self.padded = np.concatenate([self.seq, np.full(self.depth_count + 1, -1, np.int64)])
        self.first = info.prompt_tokens
        self.end = info.prompt_tokens + info.new_tokens - 1  # position of the last token

    def step(self, p: int) -> ReplayStep:
        if not self.first <= p < self.end:
            raise ValueError(f"root position {p} outside {self.first}..{self.end - 1}")
        j = p - self.first
        tree = tree_core.build_tree(
            int(self.seq[p]), self.logprobs[j], self.tokens[j], self.n_nodes
        )
        depth = tree.depth.numpy()
        result = tree_core.accept_greedy(tree, torch.from_numpy(self.padded[p + 1 + depth]))
        limited = False
        if self.check_limit and tree.n_nodes > 1:
            top_k = self.trace.header.top_k
            last = self.trace.topk_tokens[self.rows.start + j, depth[1:] - 1, top_k - 1]
            limited = bool((tree.tokens[1:] == last).any())
        return ReplayStep(
            tau=min(result.tau, self.end - p),
            accepted=result.tau - 1,
            expected_tau=1.0 + float(np.exp(tree.scores.numpy()[1:]).sum()),
            limited=limited,
        )

    def run(self) -> PromptReplay:
        positions, steps = [], []
        p = self.first
        while p < self.end:
            positions.append(p)
            steps.append(self.step(p))
            p += steps[-1].tau
        positions = np.asarray(positions, dtype=np.int64)
        accepted = np.asarray([s.accepted for s in steps], dtype=np.int64)
        # events: the accepted path's nodes at depth d = 0 .. accepted (< L), each asking for
        # the greedy token's rank at depth d + 1 (entries past the end are not events)
        ranks = greedy_ranks(self.trace, self.index)[positions - self.first]  # [steps, L]
        asked = np.arange(self.depth_count) <= accepted[:, None]
        known = positions[:, None] + 1 + np.arange(self.depth_count) <= self.end
        return PromptReplay(
            positions=positions,
            taus=np.asarray([s.tau for s in steps], dtype=np.int64),
            accepted=accepted,
            expected_taus=np.asarray([s.expected_tau for s in steps], dtype=np.float64),
            ranks=ranks[asked & known],
            limited_steps=sum(s.limited for s in steps),
        )


def replay_prompt(trace: Trace, index: int, policy: str, budget: int) -> PromptReplay:
    """Replay prompt ``index`` of ``trace`` under ``policy`` (chain, ddtree) at ``budget``."""
    return PromptReplayer(trace, index, policy, budget).run()


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
