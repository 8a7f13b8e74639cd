"""Estimating from the records ``ddtree serve --records`` writes: one engine_run per request,
hundreds of them. Runs of one setup are merged into one anchor per context octave before
calibration (a thousand records used to make ten thousand anchors and minutes of fitting),
and argument checks come before any fitting."""

from __future__ import annotations

import numpy as np
import pytest
from tests.perf.served_records import write_served_records

from ddtree.cli import main
from ddtree.perf.inputs.fromrecords import _context, anchors_from_records, merge_runs
from ddtree.perf.inputs.scenario import StageAnchor, StepAnchor
from ddtree.records import EngineRun, read_records


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return write_served_records(300, tmp_path_factory.mktemp("served") / "served.jsonl")


def test_served_runs_of_one_setup_become_a_few_anchors(served):
    records = read_records([served])
    runs = [r for r in records if isinstance(r, EngineRun)]
    anchors, _ = anchors_from_records(records)
    steps = [a for a in anchors if isinstance(a, StepAnchor)]
    octaves = {int(np.floor(np.log2(_context(r)))) for r in runs}
    assert len(steps) == len(octaves) <= 8  # one per context octave, not one per request
    assert len(anchors) <= 10 * len(steps)
    assert all(isinstance(a, (StepAnchor, StageAnchor)) for a in anchors)


def test_a_merged_run_weights_every_step_alike(served):
    runs = [r for r in read_records([served]) if isinstance(r, EngineRun)][:20]
    merged = merge_runs(runs)
    steps = sum(r.steps for r in runs)
    assert merged.steps == steps and merged.prompts == len(runs)
    assert merged.step_s_mean == pytest.approx(sum(r.step_s_mean * r.steps for r in runs) / steps)
    assert merged.mean_tau == pytest.approx(sum(r.mean_tau * r.steps for r in runs) / steps)
    verify = sum(r.stage_s_mean["verify"] * r.steps for r in runs) / steps
    assert merged.stage_s_mean["verify"] == pytest.approx(verify)
    context = sum(_context(r) * r.steps for r in runs) / steps
    assert _context(merged) == pytest.approx(context, abs=1.0)
    assert merge_runs(runs[:1]) is runs[0]


def test_estimate_from_served_records_finishes(served, capsys):
    assert main(["estimate", "--records", str(served), "--samples", "200"]) == 0
    assert "calibration:" in capsys.readouterr().out


def test_train_budgets_covering_every_run_fail_before_any_fitting(served, capsys, monkeypatch):
    def no_fit(*args, **kwargs):
        raise AssertionError("calibrated before checking --train-budgets")

    monkeypatch.setattr("ddtree.perf.projection.calibrate.calibrate", no_fit)
    assert main(["estimate", "--backtest", str(served), "--train-budgets", "8"]) == 2
    err = capsys.readouterr().err
    assert "--train-budgets" in err and "no run to predict" in err and "Traceback" not in err
