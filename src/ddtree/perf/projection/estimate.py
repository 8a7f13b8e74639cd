"""Load a scenario, read records, calibrate, and project every scenario case."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from ddtree.perf.cost.step import scoped_specs
from ddtree.perf.inputs.consistency import mismatch_warning
from ddtree.perf.inputs.fromrecords import anchors_from_records, measured_links, one_machine
from ddtree.perf.inputs.scenario import ScenarioFile, StepAnchor, load_scenario
from ddtree.perf.projection.calibrate import (
    Backtest,
    Calibration,
    PosteriorDraws,
    backtest,
    calibrate,
    posterior_samples,
)
from ddtree.perf.projection.uncertainty import CaseResult, run_case
from ddtree.records import BenchBandwidth, EngineRun, read_records

BUNDLED_SEED = "seed_kimi_b300.toml"


def bundled_seed_path() -> Path:
    """The seed example shipped inside the package (a copy of examples/seed_kimi_b300.toml)."""
    return Path(str(resources.files("ddtree.perf").joinpath(f"data/{BUNDLED_SEED}")))


@dataclass
class Estimate:
    scenario: ScenarioFile
    calibration: Calibration  # on every anchor
    results: list[CaseResult]
    record_anchors: int = 0
    notes: list[str] = field(default_factory=list)


def load(
    path: str | Path | None,
    records: list[str] | None = None,
    allow_oversubscribe: bool = False,
) -> ScenarioFile:
    recs = []
    paths = list(records or [])
    sf0 = None
    if path is None:
        path = bundled_seed_path()
    if not paths:
        sf0 = load_scenario(path, allow_oversubscribe=allow_oversubscribe)
        paths = sf0.records
    machine = left_out = None
    records_hw: dict = {}
    rec_anchors: list = []
    if paths:
        recs, left_out = one_machine(read_records(paths))
        rec_anchors, machine = anchors_from_records(recs)
        records_hw = measured_links(recs)  # catalog GPUs with measured all-reduce figures
        if machine is not None:
            records_hw["this-machine"] = machine
    sf = load_scenario(path, records_hw or None, allow_oversubscribe)
    sf.anchors.extend(rec_anchors)
    sf.measurements = recs
    if left_out:
        sf.notes.append(left_out)
    if machine is not None:
        ran_here = sorted({a.point.engine for a in rec_anchors if isinstance(a, StepAnchor)
                           and a.point.hardware.key == machine.key})  # fmt: skip
        sf.specs = scoped_specs(sf.specs, machine.key, tuple(ran_here or ["eager"]))
    return sf


def estimate(sf: ScenarioFile, samples: int = 10_000, seed: int = 0) -> Estimate:
    """Every case of ``sf``. Cases calibrated on the same anchors share one calibration and
    one set of posterior draws (the draws are most of an estimate's time, and common draws
    make the cases' differences less noisy)."""
    cache: dict[tuple[str, ...], tuple[Calibration, PosteriorDraws]] = {}

    def cal_for(names: list[str] | None) -> tuple[Calibration, PosteriorDraws]:
        key = tuple(a.name for a in sf.anchors) if names is None else tuple(names)
        if key not in cache:
            chosen = [a for a in sf.anchors if a.name in key]
            cal = calibrate(chosen, sf.specs, sf.fixed)
            rng = np.random.default_rng([seed, len(cache)])
            cache[key] = cal, posterior_samples(cal, samples, rng)
        return cache[key]

    full = cal_for(None)[0]
    results = []
    for i, case in enumerate(sf.cases):
        cal, draws = cal_for(case.anchors)
        results.append(run_case(sf.model, case, cal, samples, seed + i, draws))
    n_rec = sum(1 for a in sf.anchors if a.from_records)
    return Estimate(sf, full, results, n_rec)


def records_warning(sf: ScenarioFile) -> str | None:
    """One line when the engine runs and bandwidth records behind the anchors differ in
    workload or setup (``ddtree.perf.inputs.consistency``)."""
    used = [(r.kind, r) for r in sf.measurements if isinstance(r, (EngineRun, BenchBandwidth))]
    return mismatch_warning(
        "the records calibrated on", used, "one profile is fitted to runs of different setups"
    )


def run_backtest(
    sf: ScenarioFile,
    train_budgets: list[int] | None = None,
    train_concurrency: list[int] | None = None,
) -> Backtest:
    return backtest(sf.anchors, sf.specs, sf.fixed, train_budgets, train_concurrency)
