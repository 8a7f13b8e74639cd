"""Measured tau in the estimator (scenario cases, `ddtree tune`) from acceptance records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.cli import main
from ddtree.perf.inputs.acceptance import MeasuredTau, choose_trace, read_acceptance
from ddtree.perf.inputs.scenario import ScenarioError, StepAnchor, load_scenario
from ddtree.perf.projection.calibrate import calibrate
from ddtree.perf.projection.tune import TuneCurve, TunePoint, held_out, tune
from ddtree.records import Acceptance, HardwareInfo, write_records
from ddtree.vocab import POLICIES

EXAMPLE = Path(__file__).parents[2] / "examples" / "demo_pair_tune.toml"


def acceptance(budget, mean, low, high, trace="trace:aaaa", policy="ddtree", block=8):
    return Acceptance(
        hardware=HardwareInfo("test cpu", 2),
        points=[{"steps": 10, "tokens": 10 * mean}],
        policy=policy,
        block_size=block,
        budget=budget,
        trace=trace,
        target={"name": "tiny-target"},
        drafter={"name": "tiny-drafter"},
        top_k=1024,
        max_new_tokens=64,
        mean_tau=mean,
        tau_low=low,
        tau_high=high,
        interval=0.9,
        steps=20,
        prompts=4,
        tokens=int(20 * mean),
        histogram=[1] * block,
        depth_acceptance=[0.5] * (block - 1),
        rank_acceptance=[0.5] * 8,
        expected_tau=mean,
    )


TAUS = {2: 2.0, 4: 2.6, 8: 3.4, 16: 3.9, 32: 4.2, 64: 4.3}


@pytest.fixture
def acc_file(tmp_path):
    path = tmp_path / "acc.jsonl"
    recs = [acceptance(n, t, t - 0.2, t + 0.3) for n, t in TAUS.items()]
    recs.append(acceptance(7, 3.0, 2.8, 3.2, policy="chain"))
    write_records(path, recs)
    return path


def scenario(tmp_path, tau_line: str) -> Path:
    text = EXAMPLE.read_text().replace(
        'config = "../src/ddtree/assets/demo/target/config.json"',
        f'config = "{EXAMPLE.parent.parent / "src/ddtree/assets/demo/target/config.json"}"',
    )
    text += f"""
[[scenario]]
name = "b300 at N=8"
hardware = "b300"
block_size = 8
budget = 8
{tau_line}
"""
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


def test_a_case_takes_its_tau_from_acceptance_records(tmp_path, acc_file, capsys):
    sf = load_scenario(scenario(tmp_path, 'tau = { records = "acc.jsonl" }'))
    (case,) = sf.cases
    # the bootstrap interval, mode at the mean
    assert (case.tau.low, case.tau.mode, case.tau.high) == pytest.approx((3.2, 3.4, 3.7))
    assert "measured: replayed greedy acceptance, trace:aaaa" in case.tau_source
    assert main(["estimate", str(tmp_path / "s.toml"), "--explain", "--samples", "200"]) == 0
    out = capsys.readouterr().out
    assert "[measured: replayed greedy acceptance, trace:aaaa (4 prompts" in out


def test_measured_tau_errors_name_the_field_and_what_exists(tmp_path, acc_file):
    with pytest.raises(
        ScenarioError, match=r"no acceptance record for ddtree at block 8, budget 8"
    ):
        bad = acc_file.parent / "few.jsonl"
        write_records(bad, [acceptance(16, 3.9, 3.7, 4.1)])
        load_scenario(scenario(tmp_path, 'tau = { records = "few.jsonl" }'))
    write_records(acc_file, [acceptance(8, 3.0, 2.9, 3.1, trace="trace:bbbb")])
    with pytest.raises(ScenarioError, match=r"hold 2 traces .* choose one with trace ="):
        load_scenario(scenario(tmp_path, 'tau = { records = "acc.jsonl" }'))
    sf = load_scenario(scenario(tmp_path, 'tau = { records = "acc.jsonl", trace = "trace:bbbb" }'))
    tau = sf.cases[0].tau
    assert (tau.low, tau.mode, tau.high) == pytest.approx((2.9, 3.0, 3.1))
    with pytest.raises(ScenarioError, match=r"scenario\[0\] \(b300 at N=8\).tau: a measured tau"):
        load_scenario(scenario(tmp_path, 'tau = { path = "acc.jsonl" }'))
    with pytest.raises(ScenarioError, match="none.jsonl: no such records file"):
        load_scenario(scenario(tmp_path, 'tau = { records = "none.jsonl" }'))


def test_tune_finds_the_best_budget_and_its_flat_region(tmp_path, acc_file):
    sf = load_scenario(scenario(tmp_path, "tau = 3.0"))
    measured = choose_trace(read_acceptance(acc_file), None, "test")
    cal = calibrate([], sf.specs, sf.fixed)
    curves = tune(sf, cal, ["b300", "h200"], measured, samples=500)
    assert [(c.hardware, str(c.policy)) for c in curves] == [
        ("b300", "ddtree"),
        ("b300", "chain"),
        ("h200", "ddtree"),
        ("h200", "chain"),
    ]
    for c in curves:
        p50 = {p.budget: p.tokens_per_s[50] for p in c.points}
        assert c.best.budget == max(p50, key=p50.get)
        assert c.flat == [n for n, v in p50.items() if v >= 0.95 * p50[c.best.budget]]
        for p in c.points:  # tokens/s = tau / step (C = 1): its p50 inside the inputs' bands
            tau = p.tau.value
            low, high = (tau.low, tau.high) if hasattr(tau, "low") else (tau, tau)
            assert low / p.step_s[90] <= p.tokens_per_s[50] <= high / p.step_s[10]
            assert p.tokens_per_s[10] < p.tokens_per_s[90]
    ddtree = curves[0]
    assert [p.budget for p in ddtree.points] == sorted(TAUS)
    assert ddtree.why  # says which component grows, or that tokens/s still rises
    with pytest.raises(ScenarioError, match="unknown hardware .*this-machine needs"):
        tune(sf, cal, ["this-machine"], measured)


def _point(budget, p50, tau=3.0):
    m = MeasuredTau(
        POLICIES["ddtree"], 8, budget, tau, tau, tau, 0.9, "trace:x", "t", "d", 1, 1, "f"
    )
    return TunePoint("b300", POLICIES["ddtree"], 8, budget, m, {10: p50, 50: p50, 90: p50},
                     {50: 1.0}, {}, {})  # fmt: skip


def test_held_out_compares_predictions_with_measured_runs(tmp_path):
    sf = load_scenario(scenario(tmp_path, "tau = 3.0"))
    points = [_point(4, 100.0), _point(8, 120.0), _point(16, 118.0), _point(32, 90.0)]
    curve = TuneCurve("b300", POLICIES["ddtree"], 8, points, points[1], [8, 16], "")

    def run(budget, tokens_per_s):
        point = sf.point_at("b300", POLICIES["ddtree"], 8, budget)
        return StepAnchor(f"run{budget}", sf.model, point, 3.0, 3.0 / tokens_per_s, "m",
                          from_records=True)  # fmt: skip

    anchors = [run(4, 110.0), run(8, 125.0), run(16, 130.0), run(32, 80.0)]
    check = held_out([curve], anchors, "b300", train_budgets=[4, 8])
    assert [(r.budget, round(r.rel_error, 4)) for r in check.rows] == [
        (16, round(118 / 130 - 1, 4)),
        (32, round(90 / 80 - 1, 4)),
    ]
    assert check.mape == pytest.approx((abs(118 / 130 - 1) + abs(90 / 80 - 1)) / 2)
    assert check.measured_best == 16 and check.best_in_flat
    assert check.predicted_best == 8 and check.measured_share_of_best == pytest.approx(125 / 130)


@pytest.mark.slow
def test_tune_command_json_and_report(tmp_path, acc_file, capsys):
    argv = ["tune", str(scenario(tmp_path, "tau = 3.0")), "--acceptance", str(acc_file)]
    argv += ["--hardware", "b300", "--samples", "300", "--json", "--report", str(tmp_path / "r")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(out[out.index("{") :])
    assert doc["trace"] == "trace:aaaa"
    (ddtree,) = [c for c in doc["curves"] if c["policy"] == "ddtree"]
    assert [p["budget"] for p in ddtree["points"]] == sorted(TAUS)
    assert ddtree["best_budget"] in ddtree["flat_budgets"]
    assert (tmp_path / "r" / "tune_tokens_vs_budget.png").stat().st_size > 1000
    assert "Best N =" in (tmp_path / "r" / "tune.md").read_text()
    argv = ["tune", str(tmp_path / "s.toml"), "--acceptance", str(acc_file), "--hardware", "nope"]
    assert main(argv) == 2
    assert "unknown hardware ['nope']" in capsys.readouterr().err


def test_tune_refuses_a_model_that_does_not_fit_unless_told_to_oversubscribe(
    tmp_path, acc_file, capsys
):
    path = tmp_path / "k2t.toml"
    path.write_text(
        '[model]\npreset = "kimi-k2-thinking"\n'
        '[drafter]\nparams = 1.5e9\nlayers = 3\nprecision = "bf16"\n'
        '[deployment]\ntp = 1\nconcurrency = 1\ncontext = "2048 tok"\nengine = "eager"\n'
    )
    argv = ["tune", str(path), "--acceptance", str(acc_file), "--hardware", "h100-sxm"]
    argv += ["--samples", "100", "--json"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than the 80 GB a GPU has" in err[0]
    assert "(or pass --allow-oversubscribe)" in err[0]
    assert main([*argv, "--allow-oversubscribe"]) == 0
    out = capsys.readouterr()
    assert "warning:" in out.err
    doc = json.loads(out.out[out.out.index("{") :])
    assert {c["hardware"] for c in doc["curves"]} == {"h100-sxm"}


def test_tune_warns_when_the_trace_and_the_runs_differ(tmp_path, capsys):
    import dataclasses

    from ddtree.records import read_records

    runs = Path(__file__).parent / "data" / "demo_pair_cpu_runs.jsonl"
    (engine, *_) = read_records(runs, kind="engine_run")
    assert engine.prompt_lengths == [53, 63, 66, 73] and engine.max_new_tokens == 64
    path = scenario(tmp_path, "tau = 3.0")
    argv = ["tune", str(path), "--records", str(runs), "--hardware", "this-machine"]
    argv += ["--samples", "100", "--json"]

    def warned(**acc) -> list[str]:
        same = {"target": {"name": "target"}, "drafter": {"name": "drafter"}}  # the runs' pair
        recs = [dataclasses.replace(acceptance(n, t, t - 0.2, t + 0.3), **{**same, **acc})
                for n, t in TAUS.items()]  # fmt: skip
        write_records(tmp_path / "acc.jsonl", recs, append=False)
        assert main([*argv, "--acceptance", str(tmp_path / "acc.jsonl")]) == 0
        out = capsys.readouterr()
        lines = [x for x in out.err.splitlines() if x.startswith("warning: ")]
        assert [x.removeprefix("warning: ") for x in lines] == json.loads(out.out)["warnings"]
        return lines

    # the trace replayed the engine runs' prompts and length: nothing to say
    assert warned(prompt_lengths=[53, 63, 66, 73], max_new_tokens=64) == []
    (line,) = warned(prompt_lengths=[20, 30], max_new_tokens=96)
    assert line.startswith("warning: the records tune combines differ in prompts ")
    assert "4 prompts, 255 tok (6 engine_run) vs 2 prompts, 50 tok (6 acceptance)" in line
    assert "max new tokens 64 (6 engine_run) vs 96 (6 acceptance)" in line
    # an acceptance record from before prompt lengths were stored: only what it says
    (line,) = warned(max_new_tokens=96)
    assert "prompts" not in line and "max new tokens" in line
    # a trace of another pair of models
    (line,) = warned(prompt_lengths=[53, 63, 66, 73], max_new_tokens=64, target={"name": "big"})
    assert "differ in target target (6 engine_run) vs big (6 acceptance):" in line


def test_tune_concurrency_prints_the_best_budget_at_each_c(tmp_path, acc_file, capsys):
    """--concurrency: a curve per C on each hardware and the N*(C) table. On a B300 the
    best tree at C = 64 is no larger than at C = 1 (the verify of 64 trees turns
    compute-bound), and each curve's tokens/s counts all C requests."""
    argv = ["tune", str(scenario(tmp_path, "tau = 3.0")), "--acceptance", str(acc_file)]
    argv += ["--hardware", "b300", "--samples", "200", "--concurrency", "1,64"]
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out[out.index("{") :])
    curves = {c["concurrency"]: c for c in doc["curves"] if c["policy"] == "ddtree"}
    assert set(curves) == {1, 64}
    assert curves[64]["best_budget"] <= curves[1]["best_budget"]
    by_n = {c: {p["budget"]: p["tokens_per_s"]["p50"] for p in curves[c]["points"]} for c in curves}
    assert by_n[64][2] > 8 * by_n[1][2]  # 64 requests at once: far more tokens/s in all
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "best budget N*(C)" in text and "C=64" in text
