"""A budget that follows load (``--budget auto``): each step, how many of each request's tree
nodes to verify, from this machine's cost of a verify of W tokens and each request's recent
acceptance.

Each tree is built at the largest budget N. Its nodes come in non-increasing path
probability under the drafter (best-first), so a budget n keeps the first n nodes. Node i of
request r is on the accepted path with probability about ``alpha_r * p_ri`` (``p``: the
drafter's path probability, ``exp(score)``; ``alpha_r``: the request's calibration, recent
accepted nodes over the predicted ones). A step verifying a set of nodes is expected to commit
``C + sum alpha_r p_ri`` tokens (C requests, each with its bonus token) and to cost
``fixed_s + verify_s(W)`` with ``W = C + nodes``. Taking nodes in order of ``alpha_r p_ri``
(within a request, that is its own order), the best step is the prefix of that order with the
most expected tokens per second: as C grows the verify turns compute-bound and the best trees
shrink.

Worked example: two requests with node probabilities [0.9, 0.5, 0.1] and [0.8, 0.2], alpha 1,
fixed 1 ms, verify 1 ms up to W = 4 tokens and 1 ms more per token past it. In order 0.9, 0.8,
0.5, 0.2, 0.1 the prefixes give 2 tokens / 2 ms, 2.9 / 2, 3.7 / 2, 4.2 / 3, 4.4 / 4, 4.5 / 5:
the best is the first two nodes, budgets [1, 1] (a tree of 1 node each).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ddtree.tree.types import DraftTree

CALIBRATION_EMA = 0.3  # weight of the newest step in a request's calibration
MIN_BUILD = 4  # the smallest tree a request builds (its chosen prefix may be smaller)
CALIBRATION_BOUNDS = (0.05, 2.0)


@dataclass(frozen=True)
class VerifyCost:
    """Seconds of one target forward over W tokens, measured at a few widths: linear between
    them, flat below the first, the last segment's slope past the last. ``buckets`` (compiled
    mode): a forward runs at the smallest bucket >= W, so W costs that bucket's time."""

    tokens: tuple[int, ...]  # increasing widths
    seconds: tuple[float, ...]
    buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError("a verify cost curve needs as many widths as times, at least one")
        if list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError(f"verify cost widths must increase, got {list(self.tokens)}")

    def __call__(self, width: int) -> float:
        if self.buckets:
            i = bisect.bisect_left(self.buckets, width)
            width = self.buckets[min(i, len(self.buckets) - 1)] if i < len(self.buckets) else width
        return float(np.interp(width, self.tokens, self.seconds)) + self._past_end(width)

    def _past_end(self, width: int) -> float:
        if width <= self.tokens[-1] or len(self.tokens) < 2:
            return 0.0
        slope = (self.seconds[-1] - self.seconds[-2]) / (self.tokens[-1] - self.tokens[-2])
        return max(slope, 0.0) * (width - self.tokens[-1])


def measure_verify_cost(
    forward: Callable[[int], object], widths: Sequence[int], repeats: int = 3, sync=None
) -> VerifyCost:
    """Time ``forward(w)`` (a target forward over w tokens) at each width, the fastest of
    ``repeats`` after one untimed call; ``sync`` (CUDA) before each reading."""
    sync = sync or (lambda: None)
    seconds = []
    for w in widths:
        forward(w)
        best = float("inf")
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            forward(w)
            sync()
            best = min(best, time.perf_counter() - t0)
        seconds.append(best)
    return VerifyCost(tuple(widths), tuple(seconds))


def cost_widths(largest: int) -> list[int]:
    """Widths a cost curve is measured at: 1, 2, 4, ... and ``largest``. Example: 40 ->
    [1, 2, 4, 8, 16, 32, 40]."""
    out = [1]
    while out[-1] * 2 < largest:
        out.append(out[-1] * 2)
    return sorted({*out, largest})


def allocate(
    probs: Sequence[np.ndarray],  # per request: [n_r] path probabilities, non-increasing
    alpha: Sequence[float],  # per request: its calibration
    cost: VerifyCost,
    fixed_s: float,
    fixed_width: int = 0,  # tokens of requests with a fixed budget in the same forward
) -> list[int]:
    """The budget of each request for this step (see the module docstring): the prefix of
    all nodes in order of ``alpha_r * p`` with the most expected tokens per second."""
    gains = [a * np.asarray(p, dtype=np.float64) for a, p in zip(alpha, probs, strict=True)]
    rows = np.concatenate([np.full(len(g), r) for r, g in enumerate(gains)]).astype(np.int64)
    flat = np.concatenate(gains) if gains else np.zeros(0)
    if not len(flat):
        return [0] * len(probs)
    order = np.lexsort((np.arange(len(flat)), -flat))  # by gain, then the tree's own order
    base = len(probs) + fixed_width  # the roots, and the other requests' tokens
    expected = len(probs) + np.concatenate([[0.0], np.cumsum(flat[order])])
    widths = base + np.arange(len(flat) + 1)
    seconds = np.array([fixed_s + cost(int(w)) for w in widths])
    best = int(np.argmax(expected / seconds))
    chosen = rows[order[:best]]
    return [int(np.sum(chosen == r)) for r in range(len(probs))]


def trim(tree: DraftTree, budget: int) -> DraftTree:
    """The tree of ``budget`` non-root nodes: its first ``budget + 1`` nodes (best-first order
    makes them a tree: every parent comes before its children)."""
    m = budget + 1
    if m >= tree.n_nodes:
        return tree
    return DraftTree(
        tokens=tree.tokens[:m],
        parents=tree.parents[:m],
        depth=tree.depth[:m],
        scores=tree.scores[:m],
        visibility=tree.visibility[:m, :m],
    )


def next_build(chosen_nodes: int, largest: int) -> int:
    """The budget the next tree is built at: twice this step's choice (room to grow), at least
    ``MIN_BUILD``, at most the request's ``largest``, so a request that verifies a few nodes
    does not draft and build 64. Example: 3 chosen of 64 -> 6; 0 -> 4; 40 -> 64."""
    return min(largest, max(MIN_BUILD, 2 * chosen_nodes))


def node_probs(tree: DraftTree) -> np.ndarray:
    """[M - 1] the drafter's path probability of each non-root node."""
    return np.exp(tree.scores[1:].cpu().numpy())


@dataclass
class Calibration:
    """One request's ``alpha``: accepted nodes over the nodes' predicted acceptance, recent."""

    alpha: float = 1.0

    def observe(self, predicted: float, accepted: int) -> None:
        if predicted <= 0:
            return
        ratio = min(max(accepted / predicted, CALIBRATION_BOUNDS[0]), CALIBRATION_BOUNDS[1])
        self.alpha += CALIBRATION_EMA * (ratio - self.alpha)


@dataclass
class AutoBudget:
    """The per-step choice for a set of requests: ``choose`` the trees to verify,
    ``observe`` each request's outcome and the step's time outside the verify."""

    cost: VerifyCost
    fixed_s: float = 0.0  # recent step seconds outside the verify forward

    def choose(
        self,
        trees: Sequence[DraftTree],
        calibrations: Sequence[Calibration],
        fixed_width: int = 0,
    ) -> list[DraftTree]:
        probs = [node_probs(t) for t in trees]
        alpha = [c.alpha for c in calibrations]
        budgets = allocate(probs, alpha, self.cost, self.fixed_s, fixed_width)
        return [trim(t, n) for t, n in zip(trees, budgets, strict=True)]

    def observe_step(self, step_s: float, width: int) -> None:
        outside = max(step_s - self.cost(width), 0.0)
        self.fixed_s += CALIBRATION_EMA * (outside - self.fixed_s)


class FixedBudget:
    """``--budget N``: every tree as the proposer built it."""

    def choose(self, tree: DraftTree) -> DraftTree:
        return tree

    def observe(self, tree: DraftTree, tau: int, step_s: float) -> None:
        pass


@dataclass
class RequestAutoBudget:
    """``--budget auto`` for one request decoded alone (``generate``)."""

    auto: AutoBudget
    calibration: Calibration
    proposer: object  # its budget is where the next tree is built (``next_build``)
    largest: int  # the request's budget: the largest tree it may build

    def choose(self, tree: DraftTree) -> DraftTree:
        chosen = self.auto.choose([tree], [self.calibration])[0]
        self.proposer.budget = next_build(chosen.n_nodes - 1, self.largest)
        return chosen

    def observe(self, tree: DraftTree, tau: int, step_s: float) -> None:
        self.calibration.observe(float(node_probs(tree).sum()), tau - 1)
        self.auto.observe_step(step_s, tree.n_nodes)


def chain_tree(width: int, device) -> DraftTree:
    """A chain of ``width`` tokens (token 0): what a cost curve's forwards verify."""
    import torch

    return DraftTree(
        tokens=torch.zeros(width, dtype=torch.int64, device=device),
        parents=torch.arange(-1, width - 1, device=device),
        depth=torch.arange(width, device=device),
        scores=torch.zeros(width, dtype=torch.float64, device=device),
        visibility=torch.ones(width, width, dtype=torch.bool, device=device).tril(),
    )


def target_verify_cost(target, widths: Sequence[int], buckets: Sequence[int] = ()) -> VerifyCost:
    """The cost curve of ``target.verify`` on its empty cache (then reset): the forward a
    step runs, at ``widths`` (compiled mode: its width buckets)."""
    import torch

    def forward(width: int) -> None:
        target.verify(chain_tree(width, target.device))
        target.reset()

    sync = torch.cuda.synchronize if torch.device(target.device).type == "cuda" else None
    curve = measure_verify_cost(forward, widths, sync=sync)
    return VerifyCost(curve.tokens, curve.seconds, tuple(buckets))


def budget_for(config, target, proposer) -> FixedBudget | RequestAutoBudget:
    """The budget rule of one request, chosen once: fixed, or auto with this target's verify
    cost measured now (eager: widths 1, 2, 4, ... up to the tree's; compiled: its buckets),
    building each tree at ``next_build`` of the last choice (``proposer.budget``)."""
    if not config.auto_budget:
        return FixedBudget()
    widths = config.width_buckets()
    if config.engine_mode == "eager":
        widths = cost_widths(max(widths))
    cost = target_verify_cost(target, widths, () if config.engine_mode == "eager" else widths)
    auto = AutoBudget(cost, fixed_s=cost(1))
    return RequestAutoBudget(auto, Calibration(), proposer, config.tree_budget)
