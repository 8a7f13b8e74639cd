"""Acceptance statistics of a replay.

- mean tau: tokens committed per step over all steps of all prompts, with a bootstrap
  interval over prompts (prompts resampled with replacement; the statistic is the pooled
  ratio sum(tokens) / sum(steps) of the resample; percentile interval).
- histogram: steps committing tau = 1 .. B tokens.
- acceptance per depth d (1 .. B-1): P(draft node at depth d accepted | depth d-1 accepted),
  over the steps that were not cut short by the end of the continuation.
- acceptance per sibling rank b (Sequoia's positional acceptance vector): at each accepted
  node, the greedy next token ranks b in the drafter's list for the next depth with
  probability p_b given that it does not rank before b:
  ``p_b = #(rank == b) / #(rank >= b or outside the top-K)``.
- the drafter surrogate's expected accepted length per step, 1 + sum over the tree's nodes
  of exp(path score) (the tree value identity), next to the realised one (accepted + 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ddtree.replay.simulate import PromptReplay, PromptReplayer, budgets_by_policy

RANKS_SHOWN = 8
BOOTSTRAP_RESAMPLES = 2000
INTERVAL = 0.9  # central bootstrap interval: p5 .. p95


@dataclass
class TauSummary:
    policy: str
    block_size: int  # B
    budget: int  # N (chain: B-1)
    mean_tau: float
    tau_low: float  # bootstrap interval over prompts, INTERVAL central mass
    tau_high: float
    interval: float
    steps: int
    prompts: int
    tokens: int  # tokens committed by steps (the first token of each prompt is the prefill's)
    histogram: list[int]  # [B] steps with tau = 1 .. B
    depth_acceptance: list[float | None]  # [B-1] depth 1 .. B-1; None: never reached
    rank_acceptance: list[float | None]  # [RANKS_SHOWN] rank 1 .. ; None: never asked
    expected_tau: float  # drafter surrogate, mean over steps
    realised_tau: float  # accepted + 1 before truncation, mean over steps
    prompt_steps: list[int]  # [prompts]
    prompt_tokens: list[int]  # [prompts] tokens committed by the steps
    limited_steps: int  # steps whose tree may differ from the engine's (top-K cap of the trace)


def bootstrap_interval(
    tokens: np.ndarray,  # [P] per-prompt tokens
    steps: np.ndarray,  # [P] per-prompt steps
    interval: float = INTERVAL,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval of sum(tokens)/sum(steps) over prompts resampled with replacement."""
    keep = steps > 0
    tokens, steps = tokens[keep], steps[keep]
    if tokens.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, tokens.size, size=(resamples, tokens.size))  # [S, P]
    ratio = tokens[pick].sum(1) / steps[pick].sum(1)
    tail = 50 * (1 - interval)
    low, high = np.percentile(ratio, [tail, 100 - tail])
    return float(low), float(high)


def _rate(hits: int, tries: int) -> float | None:
    return hits / tries if tries else None


def summarize(
    runs: Sequence[PromptReplay], policy: str, block_size: int, budget: int
) -> TauSummary:
    """Statistics of one (policy, budget) replay over every prompt."""
    taus = np.concatenate([r.taus for r in runs]) if runs else np.zeros(0, np.int64)
    accepted = np.concatenate([r.accepted for r in runs]) if runs else taus
    expected = np.concatenate([r.expected_taus for r in runs]) if runs else taus
    ranks = np.concatenate([r.ranks for r in runs]) if runs else taus
    if taus.size == 0:
        raise ValueError("no decode steps to summarise (every continuation is one token)")
    per_tokens = np.array([r.taus.sum() for r in runs], dtype=np.float64)
    per_steps = np.array([r.taus.size for r in runs], dtype=np.float64)
    low, high = bootstrap_interval(per_tokens, per_steps)
    whole = accepted + 1 == taus  # steps not cut short by the end of the continuation
    full = accepted[whole]
    depth = [
        _rate(int((full >= d).sum()), int((full >= d - 1).sum())) for d in range(1, block_size)
    ]
    outside = int((ranks < 0).sum())
    rank = [
        _rate(int((ranks == b).sum()), int((ranks >= b).sum()) + outside)
        for b in range(RANKS_SHOWN)
    ]
    return TauSummary(
        policy=policy,
        block_size=block_size,
        budget=budget,
        mean_tau=float(taus.sum() / taus.size),
        tau_low=low,
        tau_high=high,
        interval=INTERVAL,
        steps=int(taus.size),
        prompts=len(runs),
        tokens=int(taus.sum()),
        histogram=np.bincount(taus, minlength=block_size + 1)[1 : block_size + 1].tolist(),
        depth_acceptance=depth,
        rank_acceptance=rank,
        expected_tau=float(expected.mean()),
        realised_tau=float((accepted + 1).mean()),
        prompt_steps=[int(x) for x in per_steps],
        prompt_tokens=[int(x) for x in per_tokens],
        limited_steps=sum(r.limited_steps for r in runs),
    )


def replay_sweep(
    trace,
    policies: Sequence[str],
    budgets: Sequence[int],
    on_prompt: Callable[[str, int], None] | None = None,
) -> list[TauSummary]:
    """Replay every (policy, budget) point of ``trace`` (chain once: its budget is B-1);
    ``on_prompt(policy, index)`` after each prompt of each policy (progress bars)."""
    out = []
    for policy, ns in budgets_by_policy(trace, policies, budgets).items():
        runs: list[list[PromptReplay]] = [[] for _ in ns]  # per budget, per prompt
        for i in range(len(trace.header.prompts)):
            for per_budget, run in zip(runs, PromptReplayer(trace, i, policy).run(ns), strict=True):
                per_budget.append(run)
            if on_prompt is not None:
                on_prompt(policy, i)
        out.extend(
            summarize(r, policy, trace.header.block_size, n) for r, n in zip(runs, ns, strict=True)
        )
    return out


def acceptance_record(summary: TauSummary, header, trace_path: str = ""):
    """The ``acceptance`` record (``ddtree.records.Acceptance``) of one replayed point."""
    import dataclasses

    from ddtree.provenance import this_hardware, this_process
    from ddtree.records import Acceptance

    return Acceptance(
        hardware=this_hardware(),
        provenance=this_process("ddtree replay tau"),
        points=[
            {"steps": s, "tokens": t}
            for s, t in zip(summary.prompt_steps, summary.prompt_tokens, strict=True)
        ],
        policy=summary.policy,
        block_size=summary.block_size,
        budget=summary.budget,
        trace=header.fingerprint,
        trace_path=str(trace_path),
        target=dataclasses.asdict(header.target),
        drafter=dataclasses.asdict(header.drafter),
        top_k=header.top_k,
        max_new_tokens=header.max_new_tokens,
        prompt_lengths=[p.prompt_tokens for p in header.prompts],
        mean_tau=summary.mean_tau,
        tau_low=summary.tau_low,
        tau_high=summary.tau_high,
        interval=summary.interval,
        steps=summary.steps,
        prompts=summary.prompts,
        tokens=summary.tokens,
        histogram=summary.histogram,
        depth_acceptance=summary.depth_acceptance,
        rank_acceptance=summary.rank_acceptance,
        expected_tau=summary.expected_tau,
        limited_steps=summary.limited_steps,
    )
