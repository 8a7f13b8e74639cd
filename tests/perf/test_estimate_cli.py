import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.commands import estimate as cmd
from ddtree.perf.estimate import bundled_seed_path, estimate, load
from ddtree.perf.scenario import ScenarioError, load_scenario
from ddtree.records import BenchBandwidth, EngineRun, HardwareInfo, write_records

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seed_kimi_b300.toml"


def _run(capsys, *argv):
    import argparse

    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    rc = cmd.run(p.parse_args(list(argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_seed_arithmetic_step_time_is_tau_over_tokens_per_s():
    # the seed's slip: 303 tok/s at tau 4.4 is 14.5 ms per step, not 3.3 ms (that is per token)
    sf = load_scenario(EXAMPLE)
    b300 = next(a for a in sf.anchors if a.name == "b300-b8")
    assert b300.step_s == pytest.approx(4.4 / 303, rel=1e-12)
    assert b300.step_s * 1e3 == pytest.approx(14.5, abs=0.05)
    assert abs(b300.step_s - 1 / 303) > 0.01
    pro = next(a for a in sf.anchors if a.name == "pro6000-b8")
    assert pro.step_s * 1e3 == pytest.approx(32.4, abs=0.05)


def test_bundled_seed_is_the_example():
    assert bundled_seed_path().read_text() == EXAMPLE.read_text()


def test_seed_answers_reproduce_anchors_and_say_overheads_dominate():
    est = estimate(load(None), samples=2000, seed=0)
    assert max(abs(r.rel_error) for r in est.calibration.residuals) < 0.05
    by = {r.case.name: r for r in est.results}
    now = by["B300 now (block 8, budget 8)"]
    assert 13.5e-3 < float(now.point.step_s) < 15.5e-3
    moe = now.point.component("routed MoE")
    moe_kernel_s = float(moe.seconds) - moe.launches * now.point_params["eager.launch"]
    assert 1.5e-3 < moe_kernel_s < 2.5e-3  # the seed: "MoE about 2 ms"
    assert "overheads dominate" in now.amdahl.statement
    strong = by["B300, stronger drafter (block 16, budget 32)"]
    native = by["B300, stronger drafter, native engine"]
    assert strong.tokens_per_s[50] > 2 * now.tokens_per_s[50]
    assert native.tokens_per_s[50] > strong.tokens_per_s[50]
    assert native.amdahl.overhead_fraction < strong.amdahl.overhead_fraction
    assert strong.amdahl.limit_tokens_per_s > native.tokens_per_s[90]


def test_cli_table_json_explain_report(capsys, tmp_path):
    rc, out, _ = _run(capsys, "--samples", "500")
    assert rc == 0 and "tokens/s p10/p50/p90" in out and "physical limit" in out
    rc, out, _ = _run(capsys, str(EXAMPLE), "--json", "--samples", "500")
    doc = json.loads(out)
    names = [s["name"] for s in doc["scenarios"]]
    assert "B300, stronger drafter, native engine" in names
    for s in doc["scenarios"]:
        t = s["tokens_per_s"]
        assert t["p10"] <= t["p50"] <= t["p90"]
        assert s["point_step_s"] == pytest.approx(sum(s["breakdown_s"].values()))
    rc, out, _ = _run(capsys, str(EXAMPLE), "--explain", "--samples", "500")
    for label in ("[measured]", "[catalog (", "[derived", "[assumed", "fitted"):
        assert label in out, label
    assert "E(1-(1-k/E)^(M*C))" in out
    rc, _, err = _run(capsys, "--report", str(tmp_path / "rep"), "--samples", "500")
    assert rc == 0
    files = {p.name for p in (tmp_path / "rep").iterdir()}
    assert {"report.md", "breakdown.png", "tokens_vs_tau.png", "tokens_vs_budget.png"} <= files
    assert (tmp_path / "rep" / "breakdown.png").read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "vs article" in md or "article" in md


_ANCHOR = '[model]\npreset = "kimi-k2"\n[[anchor]]\nhardware="b300"\nblock_size=8\nbudget=8\n'
_CASE = '[model]\npreset = "kimi-k2"\n[[scenario]]\nhardware="b300"\nblock_size=8\nbudget=7\n'

BAD = [
    ('[model]\npreset = "gpt-9"\n', "model.preset"),
    ('[model]\npreset = "kimi-k2"\n[[anchor]]\nhardware="b300"\nblock_size=8\nbudget=8\ntau=4.4\n'
     'step = "3.3 ms/tok"\n', "anchor[0] (anchor0).step"),
    ('[model]\npreset = "kimi-k2"\n[hardware.x]\nhbm_bandwidth = "8 TB"\nbf16_dense = "1 PFLOP/s"\n',
     "hardware.x.hbm_bandwidth"),
    ('[model]\npreset = "kimi-k2"\n[[scenario]]\nhardware="b301"\nblock_size=8\nbudget=8\ntau=4\n',
     "scenario[0] (scenario0).hardware"),
    ('[model]\npreset = "kimi-k2"\n[[anchor]]\nhardware="b300"\nblock_size=8\nbudget=8\ntau=4.4\n'
     'tokens_per_s = "303 tok/s/step"\n', "tokens_per_s"),
    ('[model]\npreset = "kimi-k2"\n[parameters]\nmoe_eff = 0.7\n', "parameters.moe_eff"),
    ('[model]\npreset = "kimi-k2"\n[[scenario]]\nhardware="b300"\nblock_size=8\nbudget=8\n'
     'tau=[16, 12]\n', "increasing"),
    # issue 13: a rate of 0 died in a ZeroDivisionError, a negative one in "SVD did not
    # converge"; tau outside [1, B] was accepted
    (_ANCHOR + 'tau=4.4\ntokens_per_s = "0 tok/s"\n',
     "anchor[0] (anchor0).tokens_per_s: '0 tok/s' must be a positive"),
    (_ANCHOR + 'tau=4.4\ntokens_per_s = "-303 tok/s"\n', "tokens_per_s: '-303 tok/s' must be"),
    (_ANCHOR + 'tau=4.4\nstep = "0 ms"\n', "anchor[0] (anchor0).step: '0 ms' must be"),
    (_ANCHOR + 'tau=0.5\ntokens_per_s = "303 tok/s"\n', "anchor[0] (anchor0).tau: 0.5 is outside [1, 8]"),
    (_ANCHOR + 'tau=9\ntokens_per_s = "303 tok/s"\n', "tau: 9 is outside [1, 8]"),
    (_CASE + 'tau=[12, 20]\n', "scenario[0] (scenario0).tau: [12, 20] is outside [1, 8]"),
    (_CASE + 'tau=4\npolicy="beam"\n', "scenario[0] (scenario0).policy: 'beam'; expected one of ar, chain, ddtree"),
    (_ANCHOR + 'tau=4\npolicy="chain"\nstep = "10 ms"\n', "budget: a chain verifies the B-1 = 7"),
    ('[model]\npreset = "kimi-k2"\n[[scenario]]\nhardware="b300"\npolicy="ar"\nbudget=4\n',
     "budget: an ar step has no draft tree"),
    ('[model]\npreset = "kimi-k2"\n[[scenario]]\nhardware="b300"\npolicy="ar"\ntau=2\n',
     "tau: 2 is outside [1, 1]"),
    (_CASE + 'tau=4\nengine="turbo"\n', "engine: 'turbo'; expected one of eager, graphs, native"),
    (_ANCHOR + 'tau=4.4\ntokens_per_s = "303 tok/s"\nnoise = 2\n', "noise: expected a relative"),
    ('[model]\npreset = "kimi-k2"\n[parameters]\nmoe_efficiency = -0.5\n',
     "parameters.moe_efficiency: a parameter must be positive"),
    ('[model]\npreset = "kimi-k2"\n[deployment]\ncontext = "-5 tok"\n[[scenario]]\n'
     'hardware="b300"\nblock_size=8\nbudget=8\ntau=4\n', "context: '-5 tok' must be >= 0"),
    ('[model]\npreset = "kimi-k2"\n[engine.eager]\nlaunch = "0 us"\n', "engine.eager.launch"),
]  # fmt: skip


@pytest.mark.parametrize("text,field", BAD)
def test_bad_scenarios_name_file_and_field(tmp_path, capsys, text, field):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert str(path) in str(exc.value) and field in str(exc.value)
    rc, _, err = _run(capsys, str(path), "--samples", "50")
    assert rc == 2 and field in err and len(err.strip().splitlines()) == 1


def test_policies_and_the_old_engine_name(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_text(
        '[model]\npreset = "kimi-k2-thinking"\n[deployment]\ntp = 8\nengine = "python"\n'
        "[drafter]\nparams = 1.5e9\nlayers = 3\n"
        '[[scenario]]\nname = "ar"\nhardware = "b200"\npolicy = "ar"\n'
        '[[scenario]]\nname = "chain"\nhardware = "b200"\npolicy = "chain"\nblock_size = 16\n'
        "tau = 6\n"
        '[[scenario]]\nname = "tree"\nhardware = "b200"\nblock_size = 16\nbudget = 32\n'
        'tau = 7\nengine = "graphs"\n'
    )
    rc, out, err = _run(capsys, str(path), "--json", "--samples", "400")
    assert rc == 0
    assert "engine 'python' is now called 'eager'" in err
    doc = json.loads(out)
    by = {s["name"]: s for s in doc["scenarios"]}
    assert by["ar"]["policy"] == "ar" and by["ar"]["speedup_vs_ar"] is None
    assert by["ar"]["budget"] == 0 and by["ar"]["engine"] == "eager"
    assert "drafter forward" not in by["ar"]["breakdown_s"]
    assert by["chain"]["budget"] == 15 and "tree build" in by["chain"]["breakdown_s"]
    for name in ("chain", "tree"):
        sp, tps, ar = (by[name][k] for k in ("speedup_vs_ar", "tokens_per_s", "ar_tokens_per_s"))
        assert sp["p10"] <= sp["p50"] <= sp["p90"]
        assert sp["p50"] == pytest.approx(tps["p50"] / ar["p50"], rel=0.1)
    # the ar step of the same hardware and engine mode: the chain's ar is the ar case
    assert by["chain"]["ar_tokens_per_s"]["p50"] == pytest.approx(
        by["ar"]["tokens_per_s"]["p50"], rel=0.1
    )
    assert by["tree"]["engine"] == "graphs"
    assert by["tree"]["ar_tokens_per_s"]["p50"] > by["ar"]["tokens_per_s"]["p50"]
    rc, out, _ = _run(capsys, str(path), "--samples", "300", "--report", str(tmp_path / "rep"))
    assert rc == 0 and "speedup vs AR p10/p50/p90" in out
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "speedup vs AR p10 / p50 / p90" in md and "| ar |" in md


def _records(tmp_path):
    hw = HardwareInfo(cpu_model="test cpu", cpu_cores=2)
    cfg = {
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 512, "torch_dtype": "float32",
    }  # fmt: skip
    recs = [BenchBandwidth(hardware=hw, device="cpu", method="copy", bytes_per_s=10e9)]
    for n, step_ms, tau in ((4, 2.0, 2.0), (8, 2.2, 2.5), (16, 2.6, 3.0)):
        recs.append(
            EngineRun(
                hardware=hw, policy="ddtree", block_size=8, budget=n, temperature=0.0,
                target={"name": "tiny", "config_json": cfg}, dtype="float32", device="cpu",
                prompt_set={"count": 1, "lengths": [32]}, max_new_tokens=32,
                drafter={"n_params": 50000, "num_layers": 1, "dtype": "float32"},
                mean_tau=tau, tokens_per_s=tau / (step_ms * 1e-3), step_s_mean=step_ms * 1e-3,
                stage_s_mean={}, steps=10, new_tokens=30,
            )
        )  # fmt: skip
    path = tmp_path / "runs.jsonl"
    write_records(path, recs, append=False)
    return path


def test_backtest_over_records(tmp_path, capsys):
    path = _records(tmp_path)
    rc, out, _ = _run(capsys, "--backtest", str(path), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["mode"] == "leave-one-out" and len(doc["rows"]) == 3
    assert doc["mape"] == pytest.approx(sum(abs(r["rel_error"]) for r in doc["rows"]) / 3, rel=1e-9)
    rc, out, _ = _run(capsys, "--backtest", str(path), "--train-budgets", "4,8")
    assert rc == 0 and "MAPE" in out and "N16" in out and "N4" not in out


def test_perf_never_imports_torch():
    code = (
        "import sys, argparse\n"
        "import ddtree.perf, ddtree.perf.report\n"
        "from ddtree.commands import estimate as e\n"
        "p = argparse.ArgumentParser(); e.add_arguments(p)\n"
        "assert e.run(p.parse_args(['--json', '--samples', '200'])) == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_cli_warns_in_one_line_and_keeps_the_good_records(tmp_path, capsys):
    from ddtree.cli import main

    path = _records(tmp_path)
    lines = path.read_text().splitlines()
    newer = {**json.loads(lines[1]), "schema": 99}
    path.write_text("\n".join([*lines, json.dumps(newer), lines[1][:50]]))  # + a cut-off line
    rc = main(["estimate", "--backtest", str(path), "--json"])
    out = capsys.readouterr()
    assert rc == 0 and len(json.loads(out.out)["rows"]) == 3
    warned = [x for x in out.err.splitlines() if x.startswith("warning: ")]
    assert len(warned) == 2, out.err
    assert f"{path}:5: record of schema version 99" in warned[0]
    assert f"{path}:6: truncated last line" in warned[1]
    assert "Traceback" not in out.err
