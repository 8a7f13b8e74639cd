"""Measured acceptance for the estimator: tau at a (policy, block size, budget) from
``acceptance`` records (``ddtree replay tau``), with its bootstrap interval as the range.

A scenario case takes it with ``tau = { records = "runs/acc.jsonl" }`` (optionally
``trace = "trace:..."`` when the file holds several traces); ``ddtree tune`` takes every
budget a file holds. The value is labelled measured, with the trace's fingerprint.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.perf.inputs.values import Range, ScenarioError, Value, text
from ddtree.records import Acceptance, RecordError, read_records
from ddtree.vocab import Policy, get_policy


@dataclass(frozen=True)
class MeasuredTau:
    policy: Policy
    block_size: int
    budget: int
    mean: float
    low: float  # bootstrap interval over prompts
    high: float
    interval: float  # its central mass
    trace: str  # the trace's fingerprint
    target: str
    drafter: str
    prompts: int
    steps: int
    source: str  # the records file
    record: Acceptance | None = field(default=None, compare=False, repr=False)  # read from

    @property
    def value(self) -> Value:
        """A triangular range (low, mean, high), or the mean when the interval is a point."""
        if self.high > self.low:
            return Range(self.low, self.high, self.mean)
        return self.mean

    @property
    def label(self) -> str:
        return (
            f"measured: replayed greedy acceptance, {self.trace} ({self.prompts} prompts, "
            f"{self.steps} steps; target {self.target}, drafter {self.drafter}); range = "
            f"{self.interval:.0%} bootstrap interval over prompts, mode = mean; {self.source}"
        )


def from_record(r: Acceptance, source: str) -> MeasuredTau:
    return MeasuredTau(
        policy=get_policy(r.policy),
        block_size=r.block_size,
        budget=r.budget,
        mean=r.mean_tau,
        low=min(r.tau_low, r.mean_tau),
        high=max(r.tau_high, r.mean_tau),
        interval=r.interval,
        trace=r.trace,
        target=str(r.target.get("name", "?")),
        drafter=str(r.drafter.get("name", "?")),
        prompts=r.prompts,
        steps=r.steps,
        source=source,
        record=r,
    )


def read_acceptance(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[MeasuredTau]:
    """Every acceptance record of the files (or folders); an error when there is none."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out = []
    for path in paths:
        try:
            records = read_records(path, kind="acceptance")
        except RecordError as exc:
            raise ScenarioError(str(exc)) from None
        out.extend(from_record(r, str(path)) for r in records)
    if not out:
        raise ScenarioError(
            f"{', '.join(map(str, paths))}: no acceptance records (write them with "
            "`ddtree replay tau TRACE --records FILE`)"
        )
    return out


def choose_trace(
    measured: Sequence[MeasuredTau], trace: str | None, where: str
) -> list[MeasuredTau]:
    """The records of one trace: ``trace`` when given, else the only one there is."""
    traces = sorted({m.trace for m in measured})
    if trace is not None:
        if trace not in traces:
            raise ScenarioError(f"{where}: trace {trace!r} not in the records; they hold {traces}")
        return [m for m in measured if m.trace == trace]
    if len(traces) > 1:
        raise ScenarioError(
            f"{where}: the records hold {len(traces)} traces {traces}; choose one with "
            'trace = "..." (or --trace)'
        )
    return list(measured)


def find_tau(
    measured: Sequence[MeasuredTau], policy: Policy, block_size: int, budget: int, where: str
) -> MeasuredTau:
    """The record at exactly this configuration (the last one when repeated)."""
    hits = [
        m for m in measured if (m.policy, m.block_size, m.budget) == (policy, block_size, budget)
    ]
    if not hits:
        have = sorted({(str(m.policy), m.block_size, m.budget) for m in measured})
        raise ScenarioError(
            f"{where}: no acceptance record for {policy} at block {block_size}, budget {budget}; "
            f"the records hold (policy, block, budget) {have}"
        )
    return hits[-1]


def tau_from_records(
    spec: dict, policy: Policy, block_size: int, budget: int, base_dir: Path, where: str
) -> MeasuredTau:
    """A scenario's ``tau = { records = "...", trace = "..." }`` at the case's configuration."""
    extra = set(spec) - {"records", "trace"}
    if extra or "records" not in spec:
        raise ScenarioError(
            f'{where}: a measured tau is {{ records = "acc.jsonl" }} with an optional '
            f'trace = "trace:..."; got fields {sorted(spec)}'
        )
    path = Path(text(spec["records"], f"{where}.records"))
    if "trace" in spec:
        text(spec["trace"], f"{where}.trace")
    if not path.is_absolute():
        path = base_dir / path
    measured = choose_trace(read_acceptance(path), spec.get("trace"), where)
    return find_tau(measured, policy, block_size, budget, where)


# ---- modelled tau(N): what a measured tau at one budget says about the others -------------

DEPTH_DECAY = Range(0.6, 1.0, 0.69)
"""Assumed: how fast the drafter's top-1 acceptance falls with depth (``modelled_tau``'s
``decay``). The mode is the bundled pair's replay (B = 8, N = 2..128: a least-squares fit of
top-1 and decay to its seven measured taus gives 0.94 and 0.69); 1 is every depth alike, the
optimistic end; below 0.6 a tau of half the block is out of reach at small budgets."""


def modelled_tau(top1: float, decay: float, block_size: int, budget: int) -> float:
    """Expected tau of the best-first tree of ``budget`` nodes (DDTree's build, depth at most
    B - 1) when, independently at each depth d, the target's token is the drafter's rank r
    with probability a_d (1 - a_d)^(r - 1), a_d = top1 x decay^(d - 1): 1 + the sum of the
    tree's path probabilities (the tree value identity). Path probabilities only fall from a
    node to its children and to its next sibling, so the heap's first N pops are the best tree.

    Worked example: top1 0.5, decay 0.5, B = 3 (a_1 = 0.5, a_2 = 0.25). Depth 1 rank 1 has
    0.5; then its sibling (rank 2) 0.5 x 0.5 = 0.25 and its child 0.5 x 0.25 = 0.125. N = 1:
    tau 1.5; N = 2: 1.75; N = 3: 1.875 (the rank-3 sibling and the child tie at 0.125).
    """
    acc = [top1 * decay**d for d in range(block_size - 1)]  # a_1 .. a_{B-1}
    heap = [(-acc[0], 0)] if acc and budget > 0 else []  # (-path probability, depth index)
    total = 0.0
    for _ in range(budget):
        if not heap:
            break
        neg, d = heapq.heappop(heap)
        p = -neg
        total += p
        heapq.heappush(heap, (-p * (1.0 - acc[d]), d))  # the next sibling: one rank down
        if d + 1 < len(acc):
            heapq.heappush(heap, (-p * acc[d + 1], d + 1))  # the first child
    return 1.0 + total


def fit_top1(tau: float, decay: float, block_size: int, budget: int) -> float | None:
    """The top-1 acceptance at which ``modelled_tau`` gives ``tau`` (bisection; the model is
    increasing in it); None when even top1 = 1 falls short at this decay."""
    if modelled_tau(1.0, decay, block_size, budget) < tau:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(48):  # 2^-48: far below any tau's precision
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if modelled_tau(mid, decay, block_size, budget) < tau else (lo, mid)
    return 0.5 * (lo + hi)


def _reachable_decay(tau: float, decay: float, block_size: int, budget: int) -> float | None:
    """``decay``, or the smallest decay above it at which top1 = 1 reaches ``tau`` (a tau near
    B says the drafter keeps its accuracy deep into the block); None when none does."""
    if modelled_tau(1.0, decay, block_size, budget) >= tau:
        return decay
    if modelled_tau(1.0, 1.0, block_size, budget) < tau:
        return None
    lo, hi = decay, 1.0
    for _ in range(48):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if modelled_tau(1.0, mid, block_size, budget) < tau else (lo, mid)
    return hi


def tau_by_budget(
    tau: Value, block_size: int, budget: int, budgets: Sequence[int], decay: Range = DEPTH_DECAY
) -> dict[int, Value]:
    """tau at other budgets from a tau at ``budget``: ``modelled_tau`` with top-1 fitted to
    the given tau, for each end and the mode of ``decay`` (raised to the smallest one that
    reaches the tau) and of ``tau`` (its point value when it is no range). At each budget the
    range spans those curves, its mode is the curve of the two modes."""
    taus = (tau.low, tau.mid, tau.high) if isinstance(tau, Range) else (float(tau),) * 3
    curves: dict[tuple[int, int], list[float]] = {}
    for i, t in enumerate(taus):
        for j, g in enumerate((decay.low, decay.mid, decay.high)):
            g = _reachable_decay(t, g, block_size, budget)
            if g is None:
                raise ValueError(
                    f"tau {t:g} is out of reach at block {block_size}, budget {budget} "
                    f"(at most {modelled_tau(1.0, 1.0, block_size, budget):g})"
                )
            a = fit_top1(t, g, block_size, budget)
            curves[i, j] = [modelled_tau(a, g, block_size, n) for n in budgets]
    out: dict[int, Value] = {}
    for k, n in enumerate(budgets):
        low, high = min(c[k] for c in curves.values()), max(c[k] for c in curves.values())
        mode = min(max(curves[1, 1][k], low), high)
        out[n] = Range(low, high, mode) if high - low > 1e-9 * high else mode
    return out
