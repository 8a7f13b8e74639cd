"""Issue 5 "Accuracy": calibrated on engine runs at budgets 8 and 16, the projection of
budgets 32-256 has at most 10% mean absolute percentage error.

Two checks: records generated from a known ground-truth cost model (deterministic, with a
few percent of seeded measurement noise), where the fit must recover the truth closely; and a
trimmed copy of this machine's real records of the demo pair (tests/perf/data, per-step
points dropped: the estimator reads only the summaries).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ddtree.perf.cost.step import (
    corpus_params,
    params_at,
    prefill_cost,
    scoped_specs,
    step_cost,
)
from ddtree.perf.inputs.fromrecords import anchors_from_records
from ddtree.perf.inputs.scenario import StageAnchor, StepAnchor
from ddtree.perf.projection.calibrate import backtest, calibrate
from ddtree.perf.projection.estimate import estimate, load
from ddtree.perf.report.render import explain
from ddtree.records import read_records, write_records
from ddtree.vocab import STEP_STAGES, EngineMode, Stage

REAL = Path(__file__).parent / "data" / "demo_pair_cpu_runs.jsonl"
BUDGETS = (8, 16, 32, 64, 128, 256)
# the ground truth: this machine's parameters, away from the priors on purpose
TRUTH = {
    "compute_efficiency@this-machine": 0.62,
    "weights_efficiency@this-machine": 0.25,
    "moe_efficiency@this-machine": 0.4,
    "eager.launch@this-machine": 7e-6,
    "eager.step_overhead@this-machine": 40e-6,
    "eager.tree_fixed@this-machine": 220e-6,
    "eager.tree_per_node@this-machine": 2.5e-6,
    "eager.accept_per_node@this-machine": 2.0e-6,
}


def _load_backtest(path: Path, train=(8, 16)):
    sf = load(None, [str(path)])
    sf.anchors = [a for a in sf.anchors if a.from_records]
    # the synthetic runs carry no experts-touched curve (bench moe measures one on the real
    # router, and it replaces the routing exponent): the routing of the demo pair's 8 experts
    # is given, at the truth's value, as such a curve would give it
    g = "routing_locality@this-machine"
    sf.fixed = {**sf.fixed, g: sf.specs[g].default}
    return sf, backtest(sf.anchors, sf.specs, sf.fixed, list(train))


# a compiled (torch.compile) run of the same pair: a fraction of the per-op dispatch
GRAPHS_TRUTH = {
    "graphs.launch@this-machine": 2e-6,
    "graphs.step_overhead@this-machine": 15e-6,
}


def _synthetic_records(tmp_path: Path, modes=(EngineMode.EAGER,)) -> Path:
    """Engine runs of the demo pair's shapes whose stage times come from TRUTH (and
    GRAPHS_TRUTH for compiled runs), one per budget and engine mode."""
    real = read_records(REAL)
    template = next(r for r in real if r.kind == "engine_run")
    bandwidth = [r for r in real if r.kind == "bench_bandwidth"]
    rng = np.random.default_rng(5)
    skeletons = [
        replace(template, budget=n, mean_tau=2.8 + 0.45 * np.log2(n / 8), engine_mode=mode)
        for mode in modes
        for n in BUDGETS
    ]
    anchors, machine = anchors_from_records(bandwidth + skeletons)
    # the truth's GPU-side parameters (not the machine's own, which the records identify) sit
    # where a scenario's priors are centred: the corpus fit
    specs = scoped_specs(corpus_params(), machine.key, ("eager", "graphs"))
    truth = {**params_at(specs), **TRUTH, **GRAPHS_TRUTH}
    steps = [a for a in anchors if isinstance(a, StepAnchor)]
    recs = list(bandwidth)
    for skel, a in zip(skeletons, steps, strict=True):
        cost = step_cost(a.model, a.point, truth, a.tau)
        noise = lambda: float(rng.normal(1.0, 0.02))  # noqa: E731 - 2% timing noise
        stage_s = {s: noise() * float(cost.stage_s(s)) for s in STEP_STAGES}
        lens = skel.prompt_lengths
        pre_cost = prefill_cost(a.model, a.point, truth, sum(lens) / len(lens))
        prefill_s = noise() * float(pre_cost.stage_s(Stage.PREFILL))
        step_s = sum(stage_s.values())
        recs.append(
            replace(skel, stage_s_mean=stage_s, step_s_mean=step_s, tokens_per_s=a.tau / step_s,
                    prefill_s_mean=prefill_s)
        )  # fmt: skip
    path = tmp_path / "synthetic.jsonl"
    write_records(path, recs, append=False)
    return path


def test_compiled_runs_fit_a_graphs_profile_of_their_own_and_share_the_device(tmp_path):
    path = _synthetic_records(tmp_path, (EngineMode.EAGER, EngineMode.COMPILED))
    sf = load(None, [str(path)])
    steps = [a for a in sf.anchors if isinstance(a, StepAnchor) and a.from_records]
    assert sorted({a.point.engine for a in steps}) == ["eager", "graphs"]
    assert "graphs.launch@this-machine" in sf.specs and "eager.launch@this-machine" in sf.specs
    est = estimate(sf, samples=200)
    cal = est.calibration
    for name in ("eager.step_overhead@this-machine", "graphs.step_overhead@this-machine",
                 "compute_efficiency@this-machine"):  # fmt: skip
        assert cal.values[name] == pytest.approx({**GRAPHS_TRUTH, **TRUTH}[name], rel=0.25), name
    # the launch time trades off against the (shared, weakly identified) bandwidth efficiencies
    # (weights_efficiency@this-machine stays at its corpus-centred prior, 0.89 against a truth
    # of 0.25, and the launches take up the difference); the mode difference is found all the
    # same: truth 2 us against 7 us
    eager, graphs = (cal.values[f"{m}.launch@this-machine"] for m in ("eager", "graphs"))
    assert graphs < 0.6 * eager and 0.5 < graphs / GRAPHS_TRUTH["graphs.launch@this-machine"] < 3
    assert cal.status("graphs.launch@this-machine") == "fitted"
    assert not any(n.startswith("graphs.") and "efficiency" in n for n in cal.names)
    text = explain(est)
    assert (
        "graphs profile on this-machine (host costs of its own): fitted from 6 engine_run "
        "record(s) with engine_mode compiled" in text
    ), text[:3000]


def test_stage_anchors_come_from_each_run():
    sf = load(None, [str(REAL)])
    stages = [a for a in sf.anchors if isinstance(a, StageAnchor)]
    steps = [a for a in sf.anchors if isinstance(a, StepAnchor) and a.from_records]
    assert len(steps) == 6
    for a in steps:
        mine = {s.stage for s in stages if s.run == a.name}
        assert mine == set(Stage), a.name
    prefill = next(s for s in stages if s.stage is Stage.PREFILL)
    assert prefill.prompt_tokens == pytest.approx(63.75)  # the mean of prompts 53, 63, 66, 73


def test_backtest_recovers_ground_truth_model(tmp_path):
    path = _synthetic_records(tmp_path)
    sf, bt = _load_backtest(path)
    assert [r.anchor.rsplit("N", 1)[1] for r in bt.rows] == ["32", "64", "128", "256"]
    assert bt.mape < 0.03, [round(r.rel_error, 4) for r in bt.rows]  # records carry 2% noise
    assert max(abs(r.rel_error) for r in bt.rows) < 0.05
    train = [a for a in sf.anchors if getattr(a, "run", a.name).split(":")[-1]
             in ("N8", "N16")]  # fmt: skip
    cal = calibrate(train, sf.specs, sf.fixed)
    # the compute rate is what carries budgets 8-16 to 256: the fit must find it
    got = cal.values["compute_efficiency@this-machine"]
    assert got == pytest.approx(TRUTH["compute_efficiency@this-machine"], rel=0.15)


def test_backtest_on_real_demo_pair_records_within_issue_bound():
    _, bt = _load_backtest(REAL)
    assert len(bt.rows) == 4
    assert bt.mape <= 0.10, [round(r.rel_error, 4) for r in bt.rows]


def test_real_records_are_small_and_summaries_only():
    assert REAL.stat().st_size < 50_000
    for line in REAL.read_text().splitlines():
        assert json.loads(line)["points"] == []


def test_topk_grows_with_the_budget_and_large_verifies_fit_the_real_records():
    sf = load(None, [str(REAL)])
    sf.anchors = [a for a in sf.anchors if a.from_records]
    cal = calibrate(sf.anchors, sf.specs, sf.fixed)
    res = {r.anchor.split(":", 4)[-1]: r for r in cal.residuals}  # "B8:N256:verify" -> row
    topk = [res[f"N{n}:topk"] for n in BUDGETS]
    assert all(a.predicted < b.predicted for a, b in zip(topk, topk[1:], strict=False))
    # measured 0.10 ms at N = 8 and 0.28 ms at N = 256 (K = N candidates per depth)
    assert topk[-1].predicted / topk[0].predicted > 2.0
    assert abs(res["N256:topk"].rel_error) < 0.3
    # verify at N = 256 (M x (context + M) attention scores) was 15% short without the
    # score traffic; it is within 10% now
    assert abs(res["N256:verify"].rel_error) < 0.10
    assert abs(res["N256"].rel_error) < 0.10  # the whole step
