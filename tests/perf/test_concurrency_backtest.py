"""The estimator's C-scaling against our own batched runs (issue 29): calibrated on the
C = 1 runs of `bench engine --concurrency 1,2,4,8` on the bundled pair (committed under
measurements/batched/), it predicts the C = 2, 4, 8 runs it never saw. A model that did not
price concurrency (C rows per step: C x tau tokens, a verify of C trees) would predict each
run at its C = 1 rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.perf.projection.estimate import load, run_backtest
from ddtree.records import read_records

RUNS = Path(__file__).resolve().parents[2] / "measurements" / "batched"
RECORDS = RUNS / "engine_concurrency_demo.jsonl"


@pytest.fixture(scope="module")
def backtest():
    sf = load(None, [str(RECORDS)])
    sf.anchors = [a for a in sf.anchors if a.from_records]
    return run_backtest(sf, train_concurrency=[1])


def test_calibrated_on_one_request_it_predicts_the_batched_runs(backtest):
    runs = {r.anchor: r for r in backtest.rows}
    assert len(runs) >= 9 and "concurrency 1" in backtest.mode  # C = 2, 4, 8, each config
    assert backtest.mape < 0.2, [(r.anchor, round(r.rel_error, 3)) for r in backtest.rows]
    assert all(abs(r.rel_error) < 0.5 for r in backtest.rows)


def test_it_beats_reading_the_one_request_rate_as_the_batched_one(backtest):
    """The naive prediction: every batched run at its config's C = 1 tokens/s."""
    records = [r for r in read_records(RECORDS) if r.kind == "engine_run"]
    alone = {
        (r.policy, r.budget): r.tokens_per_s for r in records if r.concurrency == 1
    }  # budgets of --budget auto runs are the trees they verified, so not every key has one
    naive = [
        abs(alone[(r.policy, r.budget)] / r.tokens_per_s - 1)
        for r in records
        if r.concurrency > 1 and (r.policy, r.budget) in alone
    ]
    assert naive and backtest.mape < 0.5 * sum(naive) / len(naive)
