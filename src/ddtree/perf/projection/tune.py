"""Which budget should I run on this hardware with this drafter? tokens/s(N) from measured
acceptance and the calibrated cost model, per hardware, with ranges.

For every hardware and every (policy, budget) the acceptance records hold::

    tokens/s(N) = C x tau(N) / step_s(N)

``tau(N)`` is measured (``ddtree replay tau``: a bootstrap interval over prompts, drawn as a
triangular range); ``step_s(N)`` is the estimator's cost model at the scenario's deployment
on that hardware, calibrated on the anchors (posterior samples). p10/p50/p90 come from one
Monte Carlo over both (``ddtree.perf.projection.uncertainty.run_case``). The best budget maximises the
p50; the *flat region* is every budget whose p50 is within 5% of it (where the choice hardly
matters). "Why" compares the best budget with the largest one: tau's gain against the step's
growth, and the cost component that grows most.

Held-out check (``--train-budgets``): calibrate only on the engine runs at those budgets,
predict every other measured budget, and compare with the measured engine runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree.perf.inputs.acceptance import MeasuredTau
from ddtree.perf.inputs.scenario import ScenarioCase, ScenarioError, ScenarioFile, StepAnchor
from ddtree.perf.projection.calibrate import Calibration
from ddtree.perf.projection.uncertainty import run_case
from ddtree.vocab import Policy

FLAT_WITHIN = 0.05  # a budget is in the flat region when its p50 is within 5% of the best


@dataclass
class TunePoint:
    hardware: str
    policy: Policy
    block_size: int
    budget: int
    tau: MeasuredTau
    tokens_per_s: dict[int, float]  # p10/p50/p90 [derived: C x tau / step]
    step_s: dict[int, float]  # p10/p50/p90
    components_s: dict[str, float]  # the step's cost components at the point estimate
    bounds: dict[str, str]  # component -> memory / compute / link / host on this hardware


@dataclass
class TuneCurve:
    """One hardware, one policy and block size: tokens/s against the budget."""

    hardware: str
    policy: Policy
    block_size: int
    points: list[TunePoint]  # by increasing budget
    best: TunePoint
    flat: list[int]  # budgets whose p50 is within FLAT_WITHIN of the best's
    why: str
    concurrency: int = 1  # requests decoded together (C); tokens/s is all of theirs


@dataclass
class HeldOutRow:
    policy: Policy
    budget: int
    measured_tokens_per_s: float
    predicted_tokens_per_s: float  # the tuner's p50 on this hardware
    measured_tau: float  # the engine run's own
    replayed_tau: float  # the acceptance record's (the tuner's input)

    @property
    def rel_error(self) -> float:
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1.0


@dataclass
class HeldOut:
    hardware: str
    train_budgets: list[int]
    rows: list[HeldOutRow]
    measured_best: int | None  # the ddtree budget with the highest measured tokens/s
    predicted_flat: list[int]
    predicted_best: int | None
    # measured tokens/s at the predicted best budget over the measured best's: what
    # following the tuner costs (1.0: nothing)
    measured_share_of_best: float | None

    @property
    def mape(self) -> float:
        return float(np.mean([abs(r.rel_error) for r in self.rows])) if self.rows else float("nan")

    @property
    def best_in_flat(self) -> bool:
        return self.measured_best in self.predicted_flat


def tune_curve(
    sf: ScenarioFile,
    cal: Calibration,
    hardware: str,
    measured: Sequence[MeasuredTau],
    samples: int = 4000,
    seed: int = 0,
    concurrency: int | None = None,
) -> TuneCurve:
    """tokens/s against the budget on ``hardware`` for one policy and block size (the
    ``measured`` taus, one per budget), at the scenario's C or at ``concurrency``."""
    points = []
    for i, m in enumerate(sorted(measured, key=lambda m: m.budget)):
        point = sf.point_at(hardware, m.policy, m.block_size, m.budget)
        if concurrency is not None:
            point = dataclasses.replace(point, concurrency=concurrency)
        case = ScenarioCase(f"{hardware} {m.policy} N={m.budget}", point, m.value, None, {})
        r = run_case(sf.model, case, cal, samples, seed + i)
        points.append(
            TunePoint(
                hardware=hardware,
                policy=m.policy,
                block_size=m.block_size,
                budget=m.budget,
                tau=m,
                tokens_per_s=r.tokens_per_s,
                step_s=r.step_s,
                components_s={c.name: float(c.seconds) for c in r.point.components},
                bounds={c.name: str(c.bound) for c in r.point.components},
            )
        )
    best = max(points, key=lambda p: p.tokens_per_s[50])
    flat = [
        p.budget for p in points if p.tokens_per_s[50] >= (1 - FLAT_WITHIN) * best.tokens_per_s[50]
    ]
    first = points[0]
    c = point.concurrency
    return TuneCurve(
        hardware, first.policy, first.block_size, points, best, flat, _why(points, best), c
    )


def _why(points: list[TunePoint], best: TunePoint) -> str:
    """Tau's gain against the step's growth from the best budget to the largest one, and the
    component that grows most (with what bounds it on this hardware)."""
    last = points[-1]
    if len(points) == 1:
        return "one budget measured"
    if last is best:
        first = points[0]
        return (
            f"still rising at the largest budget measured (N={last.budget}): from N="
            f"{first.budget}, tau grows x{last.tau.mean / first.tau.mean:.2f} and the step only "
            f"x{last.step_s[50] / first.step_s[50]:.2f}"
        )
    growth = {
        name: last.components_s.get(name, 0.0) - best.components_s.get(name, 0.0)
        for name in last.components_s
    }
    name = max(growth, key=growth.get)
    step_gain = last.step_s[50] / best.step_s[50]
    return (
        f"past N={best.budget}, tau grows x{last.tau.mean / best.tau.mean:.2f} up to N="
        f"{last.budget} but the step grows x{step_gain:.2f}, most of it {name} "
        f"(+{growth[name] * 1e3:.3g} ms, {last.bounds.get(name, '?')}-bound here)"
    )


def tune(
    sf: ScenarioFile,
    cal: Calibration,
    hardware: Sequence[str],
    measured: Sequence[MeasuredTau],
    samples: int = 4000,
    seed: int = 0,
    concurrency: Sequence[int] = (),
) -> list[TuneCurve]:
    """One curve per hardware and (policy, block size) the acceptance records hold, and per
    request count C in ``concurrency`` (default: the scenario's): the best budget N*(C)."""
    unknown = [h for h in hardware if h not in sf.hardware]
    if unknown:
        hint = (
            " (this-machine needs bench_bandwidth records: --records)"
            if "this-machine" in unknown
            else ""
        )
        raise ScenarioError(
            f"unknown hardware {unknown}{hint}; known: {', '.join(sorted(sf.hardware))}"
        )
    groups: dict[tuple, dict[int, MeasuredTau]] = {}
    for m in measured:
        groups.setdefault((m.policy, m.block_size), {})[m.budget] = m  # the last one wins
    return [
        tune_curve(sf, cal, h, list(by_budget.values()), samples, seed, c)
        for h in hardware
        for by_budget in groups.values()
        for c in (concurrency or [None])
    ]


def held_out(
    curves: Sequence[TuneCurve], anchors: Sequence, hardware: str, train_budgets: Sequence[int]
) -> HeldOut:
    """Compare the tuner's p50 on ``hardware`` with the measured engine runs there at the
    budgets it was not calibrated on (same policy and block size as a curve)."""
    mine = {(c.policy, c.block_size): c for c in curves if c.hardware == hardware}
    rows = []
    runs = [
        a
        for a in anchors
        if isinstance(a, StepAnchor) and a.from_records and a.point.hardware.key == hardware
    ]
    for a in runs:
        curve = mine.get((a.point.policy, a.point.block_size))
        if curve is None or a.point.budget in train_budgets:
            continue
        tp = next((p for p in curve.points if p.budget == a.point.budget), None)
        if tp is not None:
            rows.append(
                HeldOutRow(a.point.policy, a.point.budget, a.tokens_per_s, tp.tokens_per_s[50],
                           a.tau, tp.tau.mean)
            )  # fmt: skip
    measured = {a.point.budget: a.tokens_per_s for a in runs if a.point.policy.uses_budget}
    measured_best = max(measured, key=measured.get) if measured else None
    curve = next((c for c in mine.values() if c.policy.uses_budget), None)
    flat = curve.flat if curve else []
    predicted_best = curve.best.budget if curve else None
    share = None
    if measured and predicted_best in measured:
        share = measured[predicted_best] / measured[measured_best]
    return HeldOut(hardware, list(train_budgets), rows, measured_best, flat, predicted_best, share)
