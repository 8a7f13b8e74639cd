import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.commands import estimate as cmd
from ddtree.perf.cost.step import launch_seconds
from ddtree.perf.inputs.scenario import ScenarioError, load_scenario
from ddtree.perf.projection.estimate import bundled_seed_path, estimate, load
from ddtree.records import BenchBandwidth, EngineRun, HardwareInfo, read_records, write_records

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
    moe_kernel_s = float(moe.seconds) - launch_seconds(
        now.case.point, now.point_params, moe.launches
    )
    # the seed: "MoE about 2 ms". The B300's MoE is projected from the PRO 6000's MoE anchors
    # through the corpus prior's efficiencies (1.5 ms since round 15's corpus; 1.9 ms in round
    # 14): within a factor of 1.5 of the article's figure
    assert 2e-3 / 1.5 < moe_kernel_s < 2e-3 * 1.5
    assert "overheads dominate" in now.amdahl.statement
    strong = by["B300, stronger drafter (block 16, budget 32)"]
    native = by["B300, stronger drafter, native engine"]
    assert strong.tokens_per_s[50] > 2 * now.tokens_per_s[50]
    assert native.tokens_per_s[50] > strong.tokens_per_s[50]
    assert native.amdahl.overhead_fraction < strong.amdahl.overhead_fraction
    assert strong.amdahl.limit_tokens_per_s > native.tokens_per_s[90]


def _row(out: str, name: str) -> list[str]:
    """The cells of the summary table's row that starts with ``name``."""
    (line,) = [x for x in out.splitlines() if x.startswith(f"│ {name} ")]
    return [c.strip() for c in line.strip("│").split("│")]


def test_the_answer_comes_first(capsys, monkeypatch):
    # issue 22: 45 parameter rows came before the first tokens/s
    monkeypatch.setenv("COLUMNS", "250")  # one table row per case
    rc, out, err = _run(capsys, "--samples", "500")
    assert rc == 0 and "warning" not in err  # the seed has anchors
    lines = out.splitlines()
    head = next(i for i, x in enumerate(lines) if "tok/s p10 / p50 / p90" in x)
    assert head <= 3 and lines[0].strip().startswith("Kimi K2.6-class")
    assert [c.strip() for c in lines[head].strip("┃").split("┃")] == [
        "case", "tau", "tok/s p10 / p50 / p90", "speedup vs AR", "binds", "moves it most"
    ]  # fmt: skip
    _, js, _ = _run(capsys, "--samples", "500", "--json")
    doc = json.loads(js)
    rows = lines[head + 2 : head + 2 + len(doc["scenarios"])]
    for s, line in zip(doc["scenarios"], rows, strict=True):
        assert line.startswith(f"│ {s['name']} ")
        cells = _row(out, s["name"])
        t = s["tokens_per_s"]
        assert cells[2].split(" *")[0] == f"{t['p10']:.0f} / {t['p50']:.0f} / {t['p90']:.0f}"
        assert cells[2].endswith("*") == (s["model_form_sigma"] >= 0.01)
        x = s["speedup_vs_ar"]
        assert cells[3] == f"{x['p10']:.2f} / {x['p50']:.2f} / {x['p90']:.2f}x"
        assert cells[4] == s["binds"]
        assert cells[5].startswith(s["tornado"][0]["input"])
    now = _row(out, "B300 now (block 8, budget 8)")
    # the article: 12.5 of 14.5 ms a step outside the MoE kernels (86%)
    share = int(now[4].split("overheads ")[1].split("%")[0])
    # the eager engine's host work (its per-step overhead and the dispatch its GPU work does
    # not hide, "launches") is what binds, not the all-reduces
    first = now[4].split("(")[1].split(" ")[0]
    assert 70 <= share <= 92 and first in ("host", "launches"), now[4]
    native = _row(out, "B300, stronger drafter, native engine")
    # the native engine removes most of the overheads: HBM binds, or what overheads remain
    # (the speculative host costs a TP-8 group multiplies) are well under the eager engine's
    if not native[4].startswith("HBM "):
        assert int(native[4].split("overheads ")[1].split("%")[0]) < share - 20, native[4]
    # the parameters and the breakdown are under --explain, not in the default output
    assert "eager.tree_fixed" not in out and "framework overhead" not in out
    assert len(lines) < head + 2 + len(rows) + 12
    rc, explained, _ = _run(capsys, "--samples", "500", "--explain")
    assert explained.splitlines()[head] == lines[head]  # the same summary first
    assert "eager.tree_fixed = " in explained and "framework overhead: " in explained
    assert "cpp.launch" not in explained  # no anchor or case runs the cpp profile


def test_a_scenario_without_anchors_warns_once(tmp_path, capsys):
    path = tmp_path / "bare.toml"
    head = '[model]\npreset = "kimi-k2"\n[deployment]\ntp = 8\n'
    case = '[[scenario]]\nname = "{}"\nhardware = "{}"\nblock_size = 8\nbudget = 8\ntau = 4\n'
    path.write_text(head + case.format("bare", "b300"))
    rc, out, err = _run(capsys, str(path), "--samples", "300")
    assert rc == 0, err
    warned = [x for x in err.splitlines() if x.startswith("warning: ")]
    assert len(warned) == 1 and "nothing is calibrated" in warned[0]
    assert "calibration: no anchors" in out
    rc, out, err = _run(capsys, str(path), "--samples", "300", "--json")
    assert "nothing is calibrated" in json.loads(out)["warnings"][0]
    # anchors, but a case told to use none of them
    anchor = '[[anchor]]\nhardware = "b300"\nblock_size = 8\nbudget = 8\ntau = 4.4\n'
    anchor += 'tokens_per_s = "303 tok/s"\n'
    path.write_text(head + anchor + case.format("bare", "b200") + "anchors = []\n"
                    + case.format("anchored", "b300"))  # fmt: skip
    rc, out, err = _run(capsys, str(path), "--samples", "300")
    (warned,) = [x for x in err.splitlines() if x.startswith("warning: ")]
    assert "calibrated on no anchor" in warned and warned.endswith(": bare")


def test_cli_table_json_explain_report(capsys, tmp_path):
    rc, out, _ = _run(capsys, "--samples", "500")
    assert rc == 0 and "binds" in out and "calibration: 4 anchors" in out
    rc, out, _ = _run(capsys, str(EXAMPLE), "--json", "--samples", "500")
    doc = json.loads(out)
    names = [s["name"] for s in doc["scenarios"]]
    assert "B300, stronger drafter, native engine" in names
    for s in doc["scenarios"]:
        t, step = s["tokens_per_s"], s["step_s"]
        # the point estimate (posterior means) lies inside the Monte Carlo band, which has width
        assert step["p10"] < s["point_step_s"] < step["p90"], s["name"]
        if isinstance(s["tau"], (int, float)):  # a fixed tau: tokens/s = C x tau / step_s
            rate = s["concurrency"] * s["tau"]
            assert t["p10"] == pytest.approx(rate / step["p90"], rel=1e-4), s["name"]
            assert t["p90"] == pytest.approx(rate / step["p10"], rel=1e-4), s["name"]
    rc, out, _ = _run(capsys, str(EXAMPLE), "--explain", "--samples", "500")
    for label in (
        "[measured]",
        "[catalog (",
        "[derived",
        "[assumed",
        "fitted",
        "corpus fit (prior)",
    ):
        assert label in out, label
    assert "E(1-(1-k/E)^T), T = C x M/D x D^g" in out
    rc, _, err = _run(capsys, "--report", str(tmp_path / "rep"), "--samples", "500")
    assert rc == 0
    files = {p.name for p in (tmp_path / "rep").iterdir()}
    assert {"report.md", "breakdown.png", "tokens_vs_tau.png", "tokens_vs_budget.png"} <= files
    assert (tmp_path / "rep" / "breakdown.png").read_bytes()[:4] == b"\x89PNG"
    md = (tmp_path / "rep" / "report.md").read_text()
    # every scenario with a published answer is compared with it, in its row and its section;
    # the case calibrated on the article's own B300 point overlaps it
    compared = [s for s in doc["scenarios"] if s.get("vs_article")]
    assert len(compared) >= 3 and md.count("\nvs article: ours (") == len(compared)
    (row,) = [line for line in md.splitlines() if line.startswith("| B300 now (block 8")]
    assert "overlaps the article's 303 tok/s" in row


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
    (_ANCHOR + 'tau=4\npolicy="chain"\nstep = "10 ms"\n', "budget: policy 'chain' verifies the B-1 = 7"),
    ('[model]\npreset = "kimi-k2"\n[[scenario]]\nhardware="b300"\npolicy="ar"\nbudget=4\n',
     "budget: policy 'ar' has no draft tree"),
    ('[model]\npreset = "kimi-k2"\n[[scenario]]\nhardware="b300"\npolicy="ar"\ntau=2\n',
     "tau: 2 is outside [1, 1]"),
    (_CASE + 'tau=4\nengine="turbo"\n', "engine: 'turbo'; expected one of eager, graphs, cpp, native"),
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
    # 2000 samples: at 400 the ratio of two sampled medians alone moves by ~8% (seed to seed)
    rc, out, err = _run(capsys, str(path), "--json", "--samples", "2000")
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
        # a drafted step costs more than the AR step, so the speedup stays under tau (its band
        # stops there); at tau 6-7 on a memory-bound Kimi step it is well over 1
        assert 1 < sp["p10"] < sp["p50"] < by[name]["tau"] and sp["p90"] <= by[name]["tau"]
        assert sp["p50"] == pytest.approx(tps["p50"] / ar["p50"], rel=0.1)
    # the ar step of the same hardware and engine mode: the chain's ar is the ar case
    assert by["chain"]["ar_tokens_per_s"]["p50"] == pytest.approx(
        by["ar"]["tokens_per_s"]["p50"], rel=0.1
    )
    assert by["tree"]["engine"] == "graphs"
    assert by["tree"]["ar_tokens_per_s"]["p50"] > by["ar"]["tokens_per_s"]["p50"]
    rc, out, _ = _run(capsys, str(path), "--samples", "300", "--report", str(tmp_path / "rep"))
    assert rc == 0 and "speedup vs AR" in out
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
        "import ddtree.perf, ddtree.perf.report.render\n"
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


def test_records_of_different_setups_warn(tmp_path, capsys):
    import dataclasses

    from ddtree.records import read_records

    path = _records(tmp_path)
    rc, _, err = _run(capsys, "--backtest", str(path), "--json")
    assert rc == 0 and "warning" not in err
    recs = read_records(path)
    recs[-1] = dataclasses.replace(recs[-1], threads=2, device="cuda:0")
    write_records(path, recs, append=False)
    for argv in (["--backtest", str(path)], ["--records", str(path), "--samples", "200"]):
        rc, out, err = _run(capsys, *argv)
        (line,) = [x for x in err.splitlines() if x.startswith("warning: ")]
        assert line == (
            "warning: the records calibrated on differ in device cpu (bench_bandwidth, 2 "
            "engine_run) vs cuda:0 (engine_run): one profile is fitted to runs of different "
            "setups"
        )


def test_records_of_another_machine_are_left_out_of_this_machines_profile(tmp_path):
    path = _records(tmp_path)
    alone = load(None, [str(path)])
    other = HardwareInfo(cpu_model="other cpu", cpu_cores=64, hostname="big")
    older = "2000-01-01T00:00:00+00:00"  # this-machine stays the newest bandwidth record's
    write_records(
        path,
        [dataclasses.replace(r, hardware=other, created_utc=older) for r in read_records(path)],
    )
    sf = load(None, [str(path)])
    assert len(sf.measurements) == len(alone.measurements) == 4
    assert sum(a.from_records for a in sf.anchors) == sum(a.from_records for a in alone.anchors)
    (note,) = [n for n in sf.notes if n.startswith("records: left out")]
    assert "1 bench_bandwidth, 3 engine_run record(s) of another machine (host big: other cpu, " \
        "64 cores): this-machine is test cpu, 2 cores" in note  # fmt: skip
