"""Calibration: fit the cost model's free parameters to measured anchors.

Every parameter has a prior (its default and plausible range, from ``cost.default_params``
or the scenario). The fit works on theta = ln p, or logit p for an efficiency (a fraction of a
peak: the logit keeps every draw strictly between 0 and 1, so no Monte Carlo sample reaches
or passes the roofline and none is clipped onto it), and minimises

    sum_anchors (ln(predicted / measured) / sigma_anchor)^2 + sum_params ((theta - theta0) / sigma_p)^2

with sigma_anchor its relative measurement noise (``noise``) and sigma_p = (theta(high) -
theta(low)) / 4 (the range is about +-2 sigma). With few anchors the priors hold the unconstrained
parameters where they were, so any subset of anchors gives an answer; the Laplace
covariance (J^T J)^-1 of the same problem is the uncertainty the Monte Carlo samples, with
the correlations the anchors impose (a larger overhead goes with a higher efficiency when
both must reproduce one step time). When the anchors disagree with each other more than
their noise allows, the covariance is widened by the misfit per degree of freedom: the
anchors' chi-square over (anchors - effective parameters), the latter the trace of the
anchors' share of the fit (hat matrix), so a fit with as many free parameters as anchors is
not called precise.

The model is not linear in the parameters, so the Laplace Gaussian is only a proposal:
``posterior_samples`` weights its draws by the true posterior over the proposal
(importance resampling), which keeps a calibrated case on its own anchor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from threadpoolctl import threadpool_limits

from ddtree.perf.cost.step import ParamSpec, moe_layer_s, prefill_cost, step_cost
from ddtree.perf.inputs.scenario import Anchor, MoeAnchor, StageAnchor, StepAnchor
from ddtree.vocab import Stage


def one_blas_thread(fn: Callable) -> Callable:
    """Run ``fn`` with BLAS on one thread: its matrices are parameters x parameters (about
    100 x 100), where a threaded BLAS only adds start-up and, on a busy machine, spins (a
    120 x 120 pinv measured 1 s with 4 jobs on 2 cores, 2 ms on one thread)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with threadpool_limits(1, user_api="blas"):
            return fn(*args, **kwargs)

    return wrapped


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
    mean_log: np.ndarray  # [K] theta (ln, logit for an efficiency) of the fitted free parameters
    cov_log: np.ndarray  # [K, K] Laplace covariance in theta (widened by the misfit)
    prior_sd_log: np.ndarray  # [K]
    residuals: list[Residual]
    anchors_used: list[str]
    prior_mean_log: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [K]
    anchors: list = field(default_factory=list)  # the anchors themselves (for resampling)
    misfit_scale: float = 1.0  # chi-square per degree of freedom, when > 1 (else 1)
    effective_params: float = 0.0  # trace of the anchors' hat matrix
    fixed: dict[str, float] = field(default_factory=dict)
    robust: float | None = None  # the anchors' loss scale (``robust_residual``); None: squares

    def status(self, name: str) -> str:
        """'fitted', 'partly fitted' (the anchors tie it to others) or 'prior'."""
        i = self.names.index(name)
        ratio = float(np.sqrt(self.cov_log[i, i]) / self.prior_sd_log[i])
        return "fitted" if ratio < 0.5 else "partly fitted" if ratio < 0.9 else "prior"

    def constrained(self, name: str) -> bool:
        """True when the anchors narrowed this parameter to under half its prior width."""
        i = self.names.index(name)
        return bool(np.sqrt(self.cov_log[i, i]) < 0.5 * self.prior_sd_log[i])


def anchor_seconds(a: StepAnchor, params: dict):
    """What a step anchor measured, predicted: the step time, or for an e2e figure one
    request's wall time (its TTFT the measured one, else the predicted prefill)."""
    step = step_cost(a.model, a.point, params, a.tau).step_s
    if not a.e2e:
        return step
    prefill = 0.0
    if a.metric.ttft_s is None:
        prefill = prefill_cost(a.model, a.point, params, a.metric.prompt_tokens).step_s
    return a.metric.wall_s(step, a.tau, prefill)


def anchor_tokens_per_s(a: StepAnchor, params: dict):
    """Predicted tokens/s in the anchor's own metric."""
    secs = anchor_seconds(a, params)
    return a.tokens_per_s_at(secs, secs) if a.e2e else a.tokens_per_s_at(secs)


def predict(anchor: Anchor, params: dict) -> tuple[str, float | np.ndarray]:
    if isinstance(anchor, StepAnchor):
        return ("e2e_s" if anchor.e2e else "step_s"), anchor_seconds(anchor, params)
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
        return anchor.wall_s if anchor.e2e else anchor.step_s
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


def is_efficiency(name: str) -> bool:
    """A fraction of a hardware peak (``moe_efficiency``, ``weights_efficiency@...``)."""
    return name.split("@")[0].endswith("efficiency")


def to_theta(name: str, value):
    """The fit's coordinate: logit for an efficiency, ln otherwise."""
    v = np.asarray(value, dtype=float)
    return np.log(v / (1.0 - v)) if is_efficiency(name) else np.log(v)


def from_theta(name: str, theta):
    """The inverse of ``to_theta``: an efficiency comes back in (0, 1), never 1."""
    t = np.asarray(theta, dtype=float)
    return 1.0 / (1.0 + np.exp(-t)) if is_efficiency(name) else np.exp(t)


def _range(spec: ParamSpec) -> tuple[float, float]:
    """The prior's (low, high); an efficiency's held inside (0, 1) (a fraction of a peak)."""
    if is_efficiency(spec.name):
        return max(spec.low, 1e-6), min(spec.high, 1.0 - 1e-6)
    return spec.low, spec.high


def _bounds(spec: ParamSpec) -> tuple[float, float]:
    if is_efficiency(spec.name):
        return to_theta(spec.name, spec.low / 10), to_theta(spec.name, 1.0 - 1e-6)
    return np.log(max(spec.low / 10, 1e-12)), np.log(spec.high * 10)


def robust_residual(r, scale: float | None):
    """A residual in noise units as a robust fit weighs it: scale x asinh(r / scale), so its
    square (the loss) is r^2 near 0 and grows only as ln^2 |r| beyond ``scale``: a few anchors
    the cost model cannot express (a published setup it has no term for) cannot drag every
    parameter to them. None: r itself (least squares). Example: scale 3: r = 1 -> 0.98;
    r = 16 -> 7.1 (loss 50 against 256)."""
    return r if scale is None else scale * np.arcsinh(np.asarray(r) / scale)


def _log_residuals(anchors: Sequence[Anchor], params: dict, robust: float | None = None) -> list:
    """ln(predicted / measured) / noise per anchor (each broadcasts over parameter samples),
    through ``robust_residual``."""
    return [
        robust_residual(np.log(np.asarray(predict(a, params)[1]) / measured(a)) / a.noise, robust)
        for a in anchors
    ]


CONVERGED = 1e-5
CONVERGED_STEPS = 3
"""The fit stops once ``CONVERGED_STEPS`` accepted steps in a row each lower its objective by
less than ``CONVERGED`` of itself (or after ``iterations``). A rejected step does not count: a
Levenberg-Marquardt run often rejects several steps, raising its damping, before it finds the
next large gain. On the corpus's train split (about 2,100 in chi-square) that is a gain under
0.02 a step, what a move of a seventh of a posterior sigma along the best direction gives
(0.14^2). Eleven leave-one-source-out fits of the corpus then took 37-58 iterations instead of
the 51-60 of the old stop (one gain under 1e-10 of the objective, or the cap), and their
objectives ended within 0.016 of those longer runs'."""


@one_blas_thread
def calibrate(
    anchors: Sequence[Anchor],
    specs: dict[str, ParamSpec],
    fixed: dict[str, float] | None = None,
    iterations: int = 60,
    start: np.ndarray | None = None,
    robust: float | None = None,
) -> Calibration:
    """Fit every parameter not in ``fixed`` (MAP with log-normal priors, Levenberg-Marquardt),
    starting from the priors' centres or from ``start`` (theta of the same free parameters,
    e.g. a fit on a superset of the anchors: a leave-one-out refit is then a few steps).
    ``robust``: the anchors' loss scale in noise units (``robust_residual``; a fit on the
    published corpus uses ``CORPUS_ROBUST_SCALE``); None: least squares. It stops at
    ``iterations`` or once converged (``CONVERGED``)."""
    fixed = dict(fixed or {})
    anchors = list(anchors)
    names = [n for n in specs if n not in fixed]
    mu0 = np.array([to_theta(n, specs[n].default) for n in names])  # [K]
    sd0 = np.array([max(float(np.subtract(*to_theta(n, _range(specs[n]))[::-1])) / 4, 1e-3)
                    for n in names])  # fmt: skip
    lo, hi = np.array([_bounds(specs[n]) for n in names]).reshape(-1, 2).T
    n_a = len(anchors)

    def residuals(theta: np.ndarray) -> np.ndarray:
        # theta: [K, S] (S candidate parameter vectors evaluated together) -> [A + K, S]
        params = {**fixed, **{n: from_theta(n, theta[i]) for i, n in enumerate(names)}}
        rows = _log_residuals(anchors, params, robust)
        rows += [(theta[i] - mu0[i]) / sd0[i] for i in range(len(names))]
        return np.array([np.broadcast_to(r, theta.shape[1:]) for r in rows])

    def jac(theta: np.ndarray, eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
        K = len(theta)
        cols = np.repeat(theta[:, None], K + 1, axis=1)  # [K, K+1]
        cols[np.arange(K), np.arange(1, K + 1)] += eps
        r = residuals(cols)  # [A+K, K+1]
        return r[:, 0], (r[:, 1:] - r[:, :1]) / eps

    def result(theta, cov, scale=1.0, k_eff=0.0) -> Calibration:
        values = {**fixed, **{n: float(from_theta(n, theta[i])) for i, n in enumerate(names)}}
        res = [Residual(a.name, predict(a, values)[0], measured(a), float(predict(a, values)[1]))
               for a in anchors]  # fmt: skip
        return Calibration(names, values, theta, cov, sd0, res, [a.name for a in anchors],
                           mu0, anchors, scale, k_eff, fixed, robust)  # fmt: skip

    theta = np.clip(mu0.copy() if start is None else np.asarray(start, float), lo, hi)
    if not names:
        return result(theta, np.zeros((0, 0)))
    lam = 1e-3
    r, J = jac(theta)
    cost = float(r @ r)
    small = 0  # accepted steps in a row that gained under CONVERGED
    for _ in range(iterations):
        A = J.T @ J
        g = J.T @ r
        step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -g)
        cand = np.clip(theta + step, lo, hi)
        r2, J2 = jac(cand)
        c2 = float(r2 @ r2)
        if c2 < cost:
            theta, r, J, lam = cand, r2, J2, max(lam / 3, 1e-9)
            small = small + 1 if cost - c2 < CONVERGED * max(cost, 1.0) else 0
            cost = c2
            if small >= CONVERGED_STEPS:
                break
        else:
            lam *= 4
            if lam > 1e8:
                break
    J_a, J_p = J[:n_a], J[n_a:]
    scale, k_eff = misfit_scale(r[:n_a], J_a, np.linalg.pinv(J.T @ J))
    # the anchors say less when they disagree among themselves: deflate their information
    # (not the priors') by the misfit
    cov = np.linalg.pinv(J_a.T @ J_a / scale + J_p.T @ J_p)
    return result(theta, cov, scale, k_eff)


def misfit_scale(
    anchor_r: np.ndarray, anchor_J: np.ndarray, cov: np.ndarray
) -> tuple[float, float]:
    """(widening, effective parameters) of a fit: the anchors' chi-square per degree of
    freedom, ``sum r_a^2 / (A - k_eff)`` when above 1, where ``k_eff = trace(J_a cov J_a^T)``
    is how many parameters the anchors (not the priors) pinned down. No widening when the
    anchors leave no degree of freedom (A - k_eff < 0.5): the misfit cannot be measured."""
    k_eff = float(np.trace(anchor_J @ cov @ anchor_J.T)) if len(anchor_r) else 0.0
    dof = len(anchor_r) - k_eff
    if dof < 0.5:
        return 1.0, k_eff
    return max(1.0, float(anchor_r @ anchor_r) / dof), k_eff


MIN_ESS_FRACTION = 0.02
MIN_EFFECTIVE_SAMPLES = 100
"""Resampling needs an effective sample size of 2% of the draws or 100, whichever is fewer
(``min_effective``): below it the resampled set would repeat a handful of draws, so the
Laplace draws are kept. At 100 a p10 or p90 of the resampled set is within about +-3
percentile points (sqrt(0.1 x 0.9 / 100))."""


def min_effective(n: int) -> float:
    return min(MIN_EFFECTIVE_SAMPLES, MIN_ESS_FRACTION * n)


@dataclass
class PosteriorDraws:
    params: dict[str, np.ndarray]  # name -> [n]
    effective_samples: float  # of the importance weights (n when none were needed)
    weighted: bool  # importance weights were computed (there were anchors and fitted names)

    @property
    def n(self) -> int:
        return len(next(iter(self.params.values()), [0]))

    @property
    def resampled(self) -> bool:
        return self.weighted and self.effective_samples >= min_effective(self.n)

    def describe(self) -> str:
        ess = f"ESS {self.effective_samples:.0f} of {self.n}"
        if not self.weighted:
            return "Laplace draws (no anchors to weight them by)"
        if self.resampled:
            return f"Laplace draws resampled by the true posterior ({ess})"
        return (
            f"Laplace draws (importance weights too uneven to resample: {ess}); "
            "p50 may sit off the point estimate"
        )


def _params_of(cal: Calibration, draws: np.ndarray) -> dict:
    """theta draws [n, K] -> parameter samples (the fixed ones as they are)."""
    return {**cal.fixed, **{nm: from_theta(nm, draws[:, i]) for i, nm in enumerate(cal.names)}}


def _log_weights(cal: Calibration, draws: np.ndarray, mean: np.ndarray, precision: np.ndarray):
    """ln(posterior / proposal) of theta draws [n, K] from N(mean, cov), up to a constant:
    the fit's own objective (anchor residuals over their noise, deflated by the misfit, plus
    the priors) against the proposal's quadratic form; ``precision``: cov's pseudo-inverse."""
    params = _params_of(cal, draws)
    chi2_a = sum(r**2 for r in _log_residuals(cal.anchors, params, cal.robust)) / cal.misfit_scale
    chi2_p = (((draws - cal.prior_mean_log) / cal.prior_sd_log) ** 2).sum(axis=1)
    d = draws - mean
    chi2_q = ((d @ precision) * d).sum(axis=1)  # d_n^T cov^-1 d_n, one GEMM
    return -0.5 * (chi2_a + chi2_p - chi2_q), params


def _ess(log_w: np.ndarray) -> tuple[float, np.ndarray]:
    """(effective sample size, normalised weights) of ln weights [n], each weight truncated at
    sqrt(n) x their mean (truncated importance sampling, Ionides 2008: a little bias for far
    less variance, so one heavy draw cannot stand for the whole sample). Example: weights
    [1, 1, 1, 100] -> 100 capped at 2 x 25.75 = 51.5, ESS 1.06 -> 1.12."""
    w = np.exp(log_w - log_w.max())
    w = np.minimum(w, np.sqrt(len(w)) * w.mean())
    return float(w.sum() ** 2 / (w**2).sum()), w / w.sum()


IS_ROUNDS = 4
"""Importance-sampling rounds at most (``posterior_samples``); it stops at the first whose
effective sample size reaches ``GOOD_ESS_FRACTION`` of the draws."""
GOOD_ESS_FRACTION = 0.1
MIN_SHIFT_ESS = 50
"""A round's weighted mean moves the next round's proposal only when its effective sample size
is at least this: the mean of a handful of heavy draws is noise, and moving there made the
p50 of one case jump by 6% between seeds (the seed's B300 case: 283 or 300 tok/s)."""


@one_blas_thread
def posterior_samples(cal: Calibration, n: int, rng: np.random.Generator) -> PosteriorDraws:
    """``n`` parameter vectors from the calibration's posterior.

    Adaptive importance sampling: draws from a Gaussian proposal with the Laplace covariance
    are weighted by posterior / proposal (the posterior being the fit's own objective: anchor
    residuals over their noise, deflated by ``misfit_scale``, plus the priors, in theta, so an
    efficiency's draws lie in (0, 1) without clipping). The first proposal is centred on the
    Laplace mean; each next one on the weighted mean of the round before (when that round's
    effective sample size reaches ``MIN_SHIFT_ESS``), so it sits closer to the posterior and
    gives more even weights; at most ``IS_ROUNDS`` rounds, and the one with the largest
    effective sample size is resampled. Where the model is close to linear this is the
    Gaussian; where it is not (a sum of terms that each fall as 1 / efficiency) it removes the
    Gaussian's bias, so a case at an anchor's configuration centres on that anchor. When the
    weights are too uneven even so (effective sample size under ``min_effective(n)``: many
    anchors that disagree), resampling would keep a handful of draws; the Laplace draws are
    kept instead, and say so.
    """
    out = {k: np.full(n, v, dtype=float) for k, v in cal.values.items()}
    if not cal.names:
        return PosteriorDraws(out, float(n), weighted=False)
    mean = cal.mean_log
    draws = rng.multivariate_normal(mean, cal.cov_log, size=n, method="eigh")  # [n, K]
    if not cal.anchors:  # nothing to weigh: the Laplace draws are the posterior's
        params = _params_of(cal, draws)
        out.update({name: params[name] for name in cal.names})
        return PosteriorDraws(out, float(n), weighted=False)
    # every round's proposal has the Laplace covariance: one pseudo-inverse serves them all (the
    # symmetric, eigh-based one: an SVD did not converge on an ill-conditioned 101 x 101 one)
    precision = np.linalg.pinv(cal.cov_log, hermitian=True)  # [K, K]
    rounds = []  # (effective sample size, weights, params) of each round
    for i in range(IS_ROUNDS):
        if i:
            draws = rng.multivariate_normal(mean, cal.cov_log, size=n, method="eigh")
        log_w, params = _log_weights(cal, draws, mean, precision)
        rounds.append((*_ess(log_w), params))
        if max(r[0] for r in rounds) >= GOOD_ESS_FRACTION * n:
            break
        if rounds[-1][0] >= MIN_SHIFT_ESS:
            mean = rounds[-1][1] @ draws  # [K]
    ess, w, params = max(rounds, key=lambda r: r[0])
    if ess >= min_effective(n):
        pick = rng.choice(n, size=n, p=w)
        params = {k: v[pick] if np.ndim(v) else v for k, v in params.items()}
    else:
        params = rounds[0][2]  # the Laplace draws, unweighted
    out.update({name: params[name] for name in cal.names})
    return PosteriorDraws(out, ess, weighted=True)


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


TRAIN_FLAGS = {"budget": "--train-budgets", "concurrency": "--train-concurrency"}
"""What a backtest may calibrate on and hold out by: a step's point field -> its flag."""


def check_train_values(
    anchors: Sequence[Anchor], values: Sequence[int], field: str = "budget"
) -> None:
    """``--train-budgets`` / ``--train-concurrency`` must name values the engine runs were
    measured at: otherwise the calibration sees none of them and the "held-out" error is of
    an uncalibrated model."""
    present = sorted({getattr(a.point, field) for a in anchors if isinstance(a, StepAnchor)})
    absent = [b for b in dict.fromkeys(values) if b not in present]
    if absent:
        raise ValueError(
            f"{TRAIN_FLAGS[field]}: no engine run at {field} {', '.join(map(str, absent))}; "
            f"the records hold runs at {field} {', '.join(map(str, present)) or '(none)'}"
        )


def training_anchors(
    anchors: Sequence[Anchor], values: Sequence[int], field: str = "budget"
) -> list[Anchor]:
    """The anchors a calibration on runs at ``values`` of ``field`` (budget, concurrency)
    sees: every anchor that is not part of an engine run, and the runs (step and stage
    anchors) at those values (each must be present: ``check_train_values``)."""
    check_train_values(anchors, values, field)
    value_of = {a.name: getattr(a.point, field) for a in anchors if isinstance(a, StepAnchor)}
    return [a for a in anchors if _run_of(a) is None or value_of.get(_run_of(a), -1) in values]


def backtest(
    anchors: Sequence[Anchor],
    specs: dict[str, ParamSpec],
    fixed: dict[str, float] | None = None,
    train_budgets: Sequence[int] | None = None,
    train_concurrency: Sequence[int] | None = None,
) -> Backtest:
    """Predict each step anchor from a calibration that did not see it.

    Leave-one-out by default; with ``train_budgets`` (or ``train_concurrency``), calibrate once
    on the step anchors at those budgets (request counts C), plus every non-step anchor, and
    predict the rest: how the model extrapolates in budget (in C)."""
    steps = [a for a in anchors if isinstance(a, StepAnchor)]
    rows = []

    def row(a: StepAnchor, cal: Calibration) -> BacktestRow:
        return BacktestRow(a.name, a.tokens_per_s, float(anchor_tokens_per_s(a, cal.values)))

    field = "budget" if train_budgets else "concurrency"
    values = train_budgets or train_concurrency
    if values:
        # every argument check before the calibration (minutes over many records)
        training = training_anchors(anchors, values, field)
        held_out = [a for a in steps if getattr(a.point, field) not in values]
        if steps and not held_out:
            present = sorted({getattr(a.point, field) for a in steps})
            raise ValueError(
                f"{TRAIN_FLAGS[field]}: calibrating on every measured {field} "
                f"({', '.join(map(str, present))}) leaves no run to predict; leave some out"
            )
        cal = calibrate(training, specs, fixed)
        rows = [row(a, cal) for a in held_out]
        mode = f"calibrated on {field} {', '.join(map(str, values))}, predicting the rest"
    else:
        for a in steps:
            cal = calibrate([b for b in anchors if _run_of(b) != a.name], specs, fixed)
            rows.append(row(a, cal))
        mode = "leave-one-out"
    return Backtest(rows, mode)
