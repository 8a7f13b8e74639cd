"""Calibration: fit the cost model's free parameters to measured anchors.

Every parameter has a prior (its default and plausible range, from ``cost.default_params``
or the scenario). The fit minimises, in log space,

    sum_anchors (ln(predicted / measured) / sigma_anchor)^2 + sum_params ((ln p - ln p0) / sigma_p)^2

with sigma_p = ln(high / low) / 4 (the range is about +-2 sigma). With few anchors the
priors hold the unconstrained parameters where they were, so any subset of anchors gives an
answer; the Laplace covariance (J^T J)^-1 of the same problem is the uncertainty the Monte
Carlo samples, with the correlations the anchors impose (a larger overhead goes with a
higher efficiency when both must reproduce one step time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree.perf.cost import ParamSpec, moe_layer_s, prefill_cost, step_cost
from ddtree.perf.scenario import Anchor, MoeAnchor, StageAnchor, StepAnchor
from ddtree.records import Stage

ANCHOR_SIGMA = 0.01  # relative measurement noise assumed for an anchor


@dataclass
class Residual:
    anchor: str
    what: str  # "step_s" | "moe_s_per_layer"
    measured: float
    predicted: float

    @property
    def rel_error(self) -> float:
        return self.predicted / self.measured - 1.0


@dataclass
class Calibration:
    names: list[str]  # parameters that were free (in the order of ``mean_log`` / ``cov_log``)
    values: dict[str, float]  # all parameters (free fitted + fixed)
    mean_log: np.ndarray  # [K] ln of the fitted free parameters
    cov_log: np.ndarray  # [K, K] Laplace covariance in log space
    prior_sd_log: np.ndarray  # [K]
    residuals: list[Residual]
    anchors_used: list[str]

    def status(self, name: str) -> str:
        """'fitted', 'partly fitted' (the anchors tie it to others) or 'prior'."""
        i = self.names.index(name)
        ratio = float(np.sqrt(self.cov_log[i, i]) / self.prior_sd_log[i])
        return "fitted" if ratio < 0.5 else "partly fitted" if ratio < 0.9 else "prior"

    def constrained(self, name: str) -> bool:
        """True when the anchors narrowed this parameter to under half its prior width."""
        i = self.names.index(name)
        return bool(np.sqrt(self.cov_log[i, i]) < 0.5 * self.prior_sd_log[i])


def predict(anchor: Anchor, params: dict) -> tuple[str, float | np.ndarray]:
    if isinstance(anchor, StepAnchor):
        return "step_s", step_cost(anchor.model, anchor.point, params, anchor.tau).step_s
    if isinstance(anchor, MoeAnchor):
        return "moe_s_per_layer", moe_layer_s(
            anchor.model, anchor.hardware, anchor.m, params, anchor.tp, anchor.curve
        )
    if isinstance(anchor, StageAnchor):
        if anchor.stage is Stage.PREFILL:
            cost = prefill_cost(anchor.model, anchor.point, params, anchor.prompt_tokens)
        else:
            cost = step_cost(anchor.model, anchor.point, params, anchor.tau)
        return f"{anchor.stage}_s", cost.stage_s(anchor.stage)
    raise TypeError(type(anchor))


def measured(anchor: Anchor) -> float:
    if isinstance(anchor, StepAnchor):
        return anchor.step_s
    if isinstance(anchor, StageAnchor):
        return anchor.seconds
    return anchor.s_per_layer


def _run_of(anchor: Anchor) -> str | None:
    """The engine run an anchor came from (its step anchor's name), if any."""
    if isinstance(anchor, StepAnchor):
        return anchor.name
    if isinstance(anchor, StageAnchor):
        return anchor.run
    return None


def _bounds(spec: ParamSpec) -> tuple[float, float]:
    hi = 1.0 if spec.name.split("@")[0].endswith("efficiency") else spec.high * 10
    return np.log(max(spec.low / 10, 1e-12)), np.log(hi)


def calibrate(
    anchors: Sequence[Anchor],
    specs: dict[str, ParamSpec],
    fixed: dict[str, float] | None = None,
    iterations: int = 60,
) -> Calibration:
    """Fit every parameter not in ``fixed`` (MAP with log-normal priors, Levenberg-Marquardt)."""
    fixed = dict(fixed or {})
    names = [n for n in specs if n not in fixed]
    mu0 = np.log([specs[n].default for n in names])  # [K]
    sd0 = np.array([max(np.log(specs[n].high / specs[n].low) / 4, 1e-3) for n in names])
    lo, hi = np.array([_bounds(specs[n]) for n in names]).reshape(-1, 2).T
    meas = np.array([measured(a) for a in anchors], dtype=float)  # [A]

    def residuals(theta: np.ndarray) -> np.ndarray:
        # theta: [K, S] (S candidate parameter vectors evaluated together) -> [A + K, S]
        params = {**fixed, **{n: np.exp(theta[i]) for i, n in enumerate(names)}}
        rows = [np.log(np.asarray(predict(a, params)[1]) / m) / ANCHOR_SIGMA for a, m in
                zip(anchors, meas, strict=True)]  # fmt: skip
        rows += [(theta[i] - mu0[i]) / sd0[i] for i in range(len(names))]
        return np.array([np.broadcast_to(r, theta.shape[1:]) for r in rows])

    def jac(theta: np.ndarray, eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
        K = len(theta)
        cols = np.repeat(theta[:, None], K + 1, axis=1)  # [K, K+1]
        cols[np.arange(K), np.arange(1, K + 1)] += eps
        r = residuals(cols)  # [A+K, K+1]
        return r[:, 0], (r[:, 1:] - r[:, :1]) / eps

    theta = np.clip(mu0.copy(), lo, hi)
    if not names:
        values = dict(fixed)
        res = [Residual(a.name, predict(a, values)[0], m, float(predict(a, values)[1]))
               for a, m in zip(anchors, meas, strict=True)]  # fmt: skip
        return Calibration([], values, theta, np.zeros((0, 0)), sd0, res, [a.name for a in anchors])
    lam = 1e-3
    r, J = jac(theta)
    cost = float(r @ r)
    for _ in range(iterations):
        A = J.T @ J
        g = J.T @ r
        step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -g)
        cand = np.clip(theta + step, lo, hi)
        r2, J2 = jac(cand)
        c2 = float(r2 @ r2)
        if c2 < cost:
            theta, r, J, lam = cand, r2, J2, max(lam / 3, 1e-9)
            done = cost - c2 < 1e-10 * max(cost, 1.0)
            cost = c2
            if done:
                break
        else:
            lam *= 4
            if lam > 1e8:
                break
    cov = np.linalg.pinv(J.T @ J)
    n_a = len(anchors)
    if n_a > len(names):  # more anchors than parameters: widen by the misfit
        cov *= max(1.0, cost / max(n_a - 0, 1))
    values = {**fixed, **{n: float(np.exp(theta[i])) for i, n in enumerate(names)}}
    preds = [float(predict(a, values)[1]) for a in anchors]
    res = [
        Residual(a.name, predict(a, values)[0], m, p)
        for a, m, p in zip(anchors, meas, preds, strict=True)
    ]
    return Calibration(names, values, theta, cov, sd0, res, [a.name for a in anchors])


@dataclass
class BacktestRow:
    anchor: str
    measured_tokens_per_s: float
    predicted_tokens_per_s: float

    @property
    def rel_error(self) -> float:
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1.0


@dataclass
class Backtest:
    rows: list[BacktestRow]
    mode: str  # "leave-one-out" or "train on budgets ..."

    @property
    def mape(self) -> float:
        return float(np.mean([abs(r.rel_error) for r in self.rows])) if self.rows else float("nan")


def backtest(
    anchors: Sequence[Anchor],
    specs: dict[str, ParamSpec],
    fixed: dict[str, float] | None = None,
    train_budgets: Sequence[int] | None = None,
) -> Backtest:
    """Predict each step anchor from a calibration that did not see it.

    Leave-one-out by default; with ``train_budgets``, calibrate once on step anchors at those
    budgets (plus every non-step anchor) and predict the rest.
    """
    steps = [a for a in anchors if isinstance(a, StepAnchor)]
    budget_of = {a.name: a.point.budget for a in steps}
    rows = []

    def row(a: StepAnchor, cal: Calibration) -> BacktestRow:
        step = float(step_cost(a.model, a.point, cal.values, a.tau).step_s)
        return BacktestRow(a.name, a.tokens_per_s, a.point.concurrency * a.tau / step)

    if train_budgets:
        train = [a for a in anchors if _run_of(a) is None or
                 budget_of.get(_run_of(a), -1) in train_budgets]  # fmt: skip
        cal = calibrate(train, specs, fixed)
        rows = [row(a, cal) for a in steps if a.point.budget not in train_budgets]
        mode = f"calibrated on budgets {', '.join(map(str, train_budgets))}, predicting the rest"
    else:
        for a in steps:
            cal = calibrate([b for b in anchors if _run_of(b) != a.name], specs, fixed)
            rows.append(row(a, cal))
        mode = "leave-one-out"
    return Backtest(rows, mode)
