"""Replay a trace: decode every prompt again for a policy and budget, from the recorded
drafter candidates, without running a model.

At root position p the step builds the tree exactly as the engine does (``ddtree.tree``'s
builder over the first ``K = policy.candidates(N, V)`` stored candidates per depth), walks it
against the recorded greedy tokens (``accept_greedy`` with the greedy token after each node,
``seq[p + depth + 1]``), and moves to ``p + tau``. For greedy decoding this is exact: the
committed text is the AR text whatever the budget, so the target's token after every node on
the accepted path is known; nodes off the path never matter. The last step's tau counts only
the tokens the engine returns (truncated at max_new_tokens or EOS), as ``GenerationResult.taus``.

Several budgets share builds: the tree of budget N is the first N + 1 nodes of the tree of
any larger budget (the builder pops nodes in one total order, score then rank tuple, and a
node of rank >= N never enters the first N), so the walks of all budgets advance together
and a position some walks stand on is built once, at the largest of their budgets. Budget
N's accepted path is then the accepted nodes of index <= N, and its surrogate sum the first
N + 1 terms. (``tests/replay`` checks the prefix property and the taus against the engine.)

Worked example (B = 3, L = 2, budget 2, one prompt of T = 2 tokens, continuation [5, 6, 7]):
root 5 at position 2; candidates depth 1 [6, 9], depth 2 [8, 7]; tree root -> 6 -> 8; 6
matches seq[3], 8 does not match seq[4] = 7: tau 2 (6 and the bonus 7), the run ends (3 new
tokens: 1 from the prefill + 2). Budget 3 adds node (0, 1) -> 7 at index 3: the walk of the
budget-3 tree accepts nodes [0, 1, 3]; for budget 2 only [0, 1] have index <= 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ddtree import tree as tree_core
from ddtree.replay.trace import Trace
from ddtree.vocab import POLICIES, Drafting, Policy, get_policy


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
    """The policy ``name`` if a trace replays it: its drafter proposes every depth from one
    block forward, whose per-depth candidates are what the trace stores (ar drafts nothing)."""
    policy = get_policy(name)
    if policy.drafting is not Drafting.BLOCK:
        replayable = [n for n, p in POLICIES.items() if p.drafting is Drafting.BLOCK]
        raise ValueError(
            f"policy {name!r}: replay takes {', '.join(replayable)} (policies that draft every "
            "depth from one block forward, as the trace recorded it)"
        )
    return policy


@dataclass
class ReplaySteps:
    """Steps rooted at one position, one per budget (arrays [G])."""

    taus: np.ndarray  # int64, tokens committed (truncated at the end of the continuation)
    accepted: np.ndarray  # int64, draft nodes accepted before truncation
    expected_taus: np.ndarray  # float64, the drafter surrogate's 1 + sum_v exp(score_v)
    limited: np.ndarray  # bool, the tree reached the last stored rank while K_stored < K


class PromptReplayer:
    """One prompt of a trace under one policy: ``steps_at(p, budgets)`` replays the steps
    rooted at position p for several budgets with one build; ``run(budgets)`` decodes the
    whole continuation for each budget."""

    def __init__(self, trace: Trace, index: int, policy: str) -> None:
        self.policy = check_policy(policy)
        header = trace.header
        self.trace, self.index = trace, index
        self.vocab_size, self.top_k = header.target.vocab_size, header.top_k
        info = header.prompts[index]
        self.depth_count = header.block_size - 1
        rows = trace.roots(index)
        self.logprobs = trace.topk_logprobs[rows]  # [n-1, L, K]
        self.tokens = trace.topk_tokens[rows]  # [n-1, L, K]
        self.last_rank = self.tokens[:, :, -1].numpy()  # [n-1, L] the last stored candidate
        self.seq = trace.sequence(index).numpy()  # [T + n]
        # the greedy token after a node at depth d of the tree rooted at p is seq[p + d + 1];
        # -1 past the end (never matches: the engine stops there)
        self.padded = np.concatenate([self.seq, np.full(self.depth_count + 1, -1, np.int64)])
        self.first = info.prompt_tokens
        self.end = info.prompt_tokens + info.new_tokens - 1  # position of the last token

    def _sizes(self, budgets: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per budget: the tree's non-root nodes, and whether its K exceeds the stored K."""
        nodes = [self.policy.budget(self.depth_count + 1, n) for n in budgets]
        short = [self.policy.candidates(n, self.vocab_size) > self.top_k for n in nodes]
        return np.array(nodes, dtype=np.int64), np.array(short, dtype=bool)

    def steps_at(self, p: int, budgets: Sequence[int]) -> ReplaySteps:
        """The steps rooted at position p, one per budget, from one tree (the largest)."""
        if not self.first <= p < self.end:
            raise ValueError(f"root position {p} outside {self.first}..{self.end - 1}")
        return self._steps_at(p, *self._sizes(budgets))

    def _steps_at(self, p: int, nodes: np.ndarray, short: np.ndarray) -> ReplaySteps:
        j = p - self.first
        n_build = int(nodes.max())
        k = min(self.policy.candidates(n_build, self.vocab_size), self.top_k)
        tree = tree_core.build_tree(
            int(self.seq[p]), self.logprobs[j, :, :k], self.tokens[j, :, :k], n_build
        )
        depth = tree.depth.numpy()  # [M]
        m = depth.shape[0]
        result = tree_core.accept_greedy(tree, torch.from_numpy(self.padded[p + 1 + depth]))
        path = result.accepted.numpy()[1:]  # node indices, increasing
        accepted = np.searchsorted(path, nodes, side="right")  # nodes of index <= N
        # surrogate: 1 + sum of exp(score) over nodes 1..N (the root's exp(0) is the 1)
        expected = np.cumsum(np.exp(tree.scores.numpy()))[np.minimum(nodes, m - 1)]
        limited = np.zeros_like(short)
        if short.any() and m > 1:
            # the first node whose candidate is the last stored one at its depth
            last = np.flatnonzero(tree.tokens.numpy()[1:] == self.last_rank[j, depth[1:] - 1])
            limited = short & (last[0] + 1 <= nodes) if last.size else limited
        return ReplaySteps(np.minimum(accepted + 1, self.end - p), accepted, expected, limited)

    def step(self, p: int, budget: int) -> int:
        """The tau of the step rooted at position p at ``budget`` (built at that budget)."""
        return int(self.steps_at(p, [budget]).taus[0])

    def run(self, budgets: Sequence[int]) -> list[PromptReplay]:
        """Decode the whole continuation once per budget; the walks advance together."""
        nodes, short = self._sizes(budgets)
        at = np.full(len(budgets), self.first)  # [G] root position of each budget's walk
        taken: list[tuple[np.ndarray, int, ReplaySteps]] = []  # (walks, position, steps)
        while True:
            active = at < self.end
            if not active.any():
                break
            p = int(at[active].min())
            group = np.flatnonzero(at == p)
            steps = self._steps_at(p, nodes[group], short[group])
            taken.append((group, p, steps))
            at[group] = p + steps.taus
        return [self._replay(g, taken) for g in range(len(budgets))]

    def _replay(self, g: int, taken) -> PromptReplay:
        rows = [(p, s, int(np.flatnonzero(group == g)[0])) for group, p, s in taken if g in group]
        positions = np.array([p for p, _, _ in rows], dtype=np.int64)
        accepted = np.array([s.accepted[i] for _, s, i in rows], dtype=np.int64)
        # events: the accepted path's nodes at depth d = 0 .. accepted (< L), each asking for
        # the greedy token's rank at depth d + 1 (entries past the end are not events)
        ranks = self.trace.greedy_ranks()[self.trace.roots(self.index)][positions - self.first]
        asked = np.arange(self.depth_count) <= accepted[:, None]
        known = positions[:, None] + 1 + np.arange(self.depth_count) <= self.end
        return PromptReplay(
            positions=positions,
            taus=np.array([s.taus[i] for _, s, i in rows], dtype=np.int64),
            accepted=accepted,
            expected_taus=np.array([s.expected_taus[i] for _, s, i in rows], dtype=np.float64),
            ranks=ranks[asked & known],
            limited_steps=int(sum(s.limited[i] for _, s, i in rows)),
        )


def replay_points(
    trace: Trace, policies: Sequence[str], budgets: Sequence[int]
) -> list[tuple[str, int]]:
    """The (policy, budget) points a sweep replays: a policy whose tree N does not size (chain)
    once, at its own budget (B-1)."""
    rules = {name: check_policy(name) for name in policies}
    points = []
    for name, policy in rules.items():
        if policy.uses_budget:
            points.extend((name, int(n)) for n in dict.fromkeys(budgets))
        else:
            points.append((name, policy.budget(trace.header.block_size, 0)))
    return points


def budgets_by_policy(
    trace: Trace, policies: Sequence[str], budgets: Sequence[int]
) -> dict[str, list[int]]:
    """:func:`replay_points` grouped by policy, in order: policy -> its budgets."""
    out: dict[str, list[int]] = {}
    for policy, n in replay_points(trace, policies, budgets):
        out.setdefault(policy, []).append(n)
    return out
