"""Monte Carlo over uncertain inputs (p10/p50/p90) and a tornado of which input moves most.

Calibrated parameters are sampled from the calibration's Laplace posterior (log-normal, with
the correlations the anchors impose); a scenario's own overrides given as ``[low, high]``
replace that parameter's marginal (uniform, or triangular with a mode); tau given as a range
is uniform. One vectorised cost-model call evaluates every sample.

A case also carries the cost model's own error (``case_model_form``): on a setup no anchor
ran on (another hardware, engine mode, model, TP or deployment) the ``model_form_sigma``
fitted leave-one-source-out on the validation set (``data/model_form.toml``); on an anchor's
setup only what the calibration still misses its anchors there by. Its tokens/s and step
samples are scaled by exp(N(0, sigma)), sigma fitted apart for AR and speculative steps. The
speedup over AR carries its own fitted error (``model_form_sigma("speedup")``: the same model
prices both steps, so a setup's level cancels in the ratio, but a speculative step's own costs
do not).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np

from ddtree.perf.cost.step import Amdahl, StepCost, amdahl, step_cost
from ddtree.perf.inputs.scenario import Range, ScenarioCase, Value
from ddtree.perf.projection.calibrate import Calibration, PosteriorDraws, posterior_samples
from ddtree.perf.shapes.model import ModelShape
from ddtree.vocab import AR

PERCENTILES = (10, 50, 90)


@cache
def _model_form() -> dict:
    text = (
        resources.files("ddtree.perf").joinpath("data/model_form.toml").read_text(encoding="utf-8")
    )
    return tomllib.loads(text)


def model_form_sigma(kind: str = "ar") -> float:
    """The fitted model-form error (relative 1 sigma) of a step of ``kind``
    (``model_form_kind``), or of a speedup over AR ("speedup"): ``data/model_form.toml``."""
    return float(_model_form()["sigma"][kind])


def model_form_kind(point) -> str:
    """'eager', 'speculative' or 'ar': the model-form error is fitted for each apart. A
    speculative step adds costs an AR step has not, so the model's error there is its own; an
    eager engine's step (Python dispatch: HF transformers, eager research code) varies with
    the library's version and the model's code far more than a serving engine's (the corpus's
    eager sources disagree 2-3x on one setup), so its bands are its own, AR or speculative."""
    if point.engine == "eager":
        return "eager"
    return "speculative" if point.policy.needs_drafter else "ar"


def _setup(point) -> tuple:
    return (point.hardware.key, point.engine, point.tp, point.deployment.name)


def case_model_form(model: ModelShape, case: ScenarioCase, cal: Calibration) -> float:
    """The model-form error a case carries: the fitted sigma_m on a setup (hardware, engine
    mode, TP, deployment, model) no anchor ran on; on an anchor's setup, the calibration's own
    misfit there (the rms of its anchors' ln(model / measured)), capped at sigma_m: a setup
    the model reproduces carries next to nothing, one it cannot fit carries what it missed by."""
    misses = {r.anchor: np.log1p(r.rel_error) for r in cal.residuals}
    here = [misses[a.name] for a in cal.anchors if hasattr(a, "point")
            and a.model.name == model.name and _setup(a.point) == _setup(case.point)
            and a.name in misses]  # fmt: skip
    sigma = model_form_sigma(model_form_kind(case.point))
    if not here:
        return sigma
    return float(min(sigma, np.sqrt(np.mean(np.square(here)))))


def _draw(v: Value, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(v, Range) and v.low == v.high:  # [1, 1, 1]: a point (triangular refuses it)
        return np.full(n, float(v.low))
    if isinstance(v, Range):
        if v.mode is not None:
            return rng.triangular(v.low, v.mode, v.high, n)
        return rng.uniform(v.low, v.high, n)
    return np.full(n, float(v))


def point_value(v: Value) -> float:
    return v.mid if isinstance(v, Range) else float(v)


def sample_inputs(
    cal: Calibration, case: ScenarioCase, n: int, seed: int, draws: PosteriorDraws | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray, PosteriorDraws]:
    """-> (parameter samples [n] each, tau samples [n], the posterior draws' diagnostics).
    ``draws``: the calibration's posterior already drawn (``n`` of them), shared by the cases
    of one estimate; None draws them here."""
    rng = np.random.default_rng(seed)
    if draws is None:
        draws = posterior_samples(cal, n, rng)
    elif draws.n != n:
        raise ValueError(f"draws: {draws.n} posterior draws for {n} samples")
    params = dict(draws.params)
    for name, v in case.overrides.items():
        params[name] = _draw(v, n, rng)
    return params, _draw(case.tau, n, rng), draws


@dataclass
class TornadoBar:
    input: str
    low_value: float
    high_value: float
    tokens_per_s_at_low: float
    tokens_per_s_at_high: float

    @property
    def swing(self) -> float:
        return abs(self.tokens_per_s_at_high - self.tokens_per_s_at_low)


@dataclass
class CaseResult:
    case: ScenarioCase
    calibration: Calibration
    point_params: dict[str, float]
    point_tau: float
    point: StepCost  # breakdown at the point estimate
    tokens_per_s: dict[int, float]  # percentile -> value (aggregate over C requests)
    step_s: dict[int, float]
    # tok/s over the ar step's on the same hardware, TP, context and engine mode, with the
    # same parameter samples (None for an ar case)
    speedup_vs_ar: dict[int, float] | None
    ar_tokens_per_s: dict[int, float] | None
    amdahl: Amdahl
    tornado: list[TornadoBar]
    samples: int
    seed: int
    posterior: str = ""  # how the parameter samples were drawn
    model_form_sigma: float = 0.0  # the model-form error its ranges carry (case_model_form)


def _percentiles(x: np.ndarray) -> dict[int, float]:
    return {p: float(np.percentile(x, p)) for p in PERCENTILES}


def run_case(
    model: ModelShape,
    case: ScenarioCase,
    cal: Calibration,
    n: int = 10_000,
    seed: int = 0,
    draws: PosteriorDraws | None = None,
) -> CaseResult:
    """The case's tok/s, step and speedup percentiles over ``n`` samples, its breakdown at the
    point estimate and its tornado. ``draws``: ``sample_inputs``'s."""
    params, tau, draws = sample_inputs(cal, case, n, seed, draws)
    cost = step_cost(model, case.point, params, tau)
    sigma = case_model_form(model, case, cal)
    form = np.exp(np.random.default_rng(seed + 1).normal(0.0, sigma, n))  # [n]
    step = np.broadcast_to(np.asarray(cost.step_s, dtype=float), (n,)) * form
    tps = case.point.concurrency * tau / step  # [n]
    speedup = ar_tps = None
    if case.point.policy != AR:
        ar_step = step_cost(model, case.point.as_ar(), params, 1.0).step_s
        ar = case.point.concurrency / np.broadcast_to(np.asarray(ar_step, dtype=float), (n,))
        # the speedup's own model-form error (fitted on AR-paired speculative points), shrunk
        # as the case's is on a setup its anchors ran on
        full = model_form_sigma(model_form_kind(case.point))
        rel = model_form_sigma("speedup") * (sigma / full if full > 0 else 0.0)
        ratio = np.exp(np.random.default_rng(seed + 2).normal(0.0, rel, n))  # [n]
        # a drafted step costs at least the AR step (its verify carries the AR token and more),
        # so no draw's speedup exceeds its tau, whatever the model-form error
        speedup = _percentiles(np.minimum(tps * form / ar * ratio, tau))
        ar_tps = _percentiles(ar / form)
    pt_params = dict(cal.values)
    pt_params.update({k: point_value(v) for k, v in case.overrides.items()})
    pt_tau = point_value(case.tau)
    pt_cost = step_cost(model, case.point, pt_params, pt_tau)
    return CaseResult(
        case=case,
        calibration=cal,
        point_params=pt_params,
        point_tau=pt_tau,
        point=pt_cost,
        tokens_per_s=_percentiles(tps),
        step_s=_percentiles(step),
        speedup_vs_ar=speedup,
        ar_tokens_per_s=ar_tps,
        amdahl=amdahl(pt_cost, pt_params, pt_tau),
        tornado=tornado(model, case, pt_params, pt_tau, params, tau),
        samples=n,
        seed=seed,
        posterior=draws.describe(),
        model_form_sigma=sigma,
    )


def tornado(
    model: ModelShape,
    case: ScenarioCase,
    pt_params: dict[str, float],
    pt_tau: float,
    samples: dict[str, np.ndarray],
    tau: np.ndarray,
) -> list[TornadoBar]:
    """Move one input at a time to its p10 and p90 (others at the point estimate)."""
    inputs = [("tau", tau)] + [
        (k, v) for k, v in samples.items() if np.ptp(v) > 1e-12 * max(abs(float(v[0])), 1e-30)
    ]
    if len(inputs) == 1 and np.ptp(tau) == 0:
        return []
    lows = {k: float(np.percentile(v, 10)) for k, v in inputs}
    highs = {k: float(np.percentile(v, 90)) for k, v in inputs}
    names = [k for k, _ in inputs]
    K = len(names)
    # column 2i: input i at its p10, column 2i+1: at its p90
    p = {k: np.full(2 * K, v, dtype=float) for k, v in pt_params.items()}
    t = np.full(2 * K, pt_tau)
    for i, k in enumerate(names):
        target = t if k == "tau" else p[k]
        target[2 * i], target[2 * i + 1] = lows[k], highs[k]
    cost = step_cost(model, case.point, p, t)
    tps = case.point.concurrency * t / np.broadcast_to(cost.step_s, (2 * K,))
    bars = [
        TornadoBar(k, lows[k], highs[k], float(tps[2 * i]), float(tps[2 * i + 1]))
        for i, k in enumerate(names)
    ]
    bars = [b for b in bars if b.swing > 0]
    return sorted(bars, key=lambda b: -b.swing)
