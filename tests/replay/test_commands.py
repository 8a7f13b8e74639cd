"""`ddtree replay record | tau | check` on the bundled pair."""

from __future__ import annotations

import json

import pytest

from ddtree.cli import main
from ddtree.records import read_records


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "demo.safetensors"
    argv = ["replay", "record", "--n-prompts", "2", "--max-new-tokens", "16", "--candidates", "64"]
    assert main(argv + ["--threads", "1", "--out", str(path)]) == 0
    return path


def test_record_then_tau_writes_acceptance_records(trace_path, tmp_path, capsys):
    records = tmp_path / "acc.jsonl"
    argv = ["replay", "tau", str(trace_path), "--budgets", "2,8,128", "--json"]
    assert main(argv + ["--records", str(records)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["block_size"] == 8 and out["top_k"] == 64
    points = {(p["policy"], p["budget"]): p for p in out["points"]}
    assert set(points) == {("chain", 7), ("ddtree", 2), ("ddtree", 8), ("ddtree", 128)}
    assert points[("ddtree", 2)]["mean_tau"] <= points[("ddtree", 8)]["mean_tau"]
    # the trace keeps K = 64 per depth: trees that want no more are never limited; a budget
    # of 128 wants K = 128 and some of its trees reach the 64th candidate
    within = (("chain", 7), ("ddtree", 2), ("ddtree", 8))
    assert [points[p]["limited_steps"] for p in within] == [0, 0, 0]
    assert points[("ddtree", 128)]["limited_steps"] > 0
    for p in points.values():
        assert sum(p["histogram"]) == p["steps"] and p["tokens"] == 2 * 15  # 1 from prefill
    acc = read_records(records, kind="acceptance")
    assert [(r.policy, r.budget) for r in acc] == [(p, n) for p, n in points]
    assert {r.trace for r in acc} == {out["trace"]} and acc[0].prompts == 2
    # the prompts' lengths, so tune can tell the trace's workload from the engine runs'
    from ddtree.replay.trace import load_trace

    assert acc[0].prompt_lengths == [p.prompt_tokens for p in load_trace(trace_path).header.prompts]
    assert acc[0].tau_low <= acc[0].mean_tau <= acc[0].tau_high


def test_tau_tables_and_check(trace_path, tmp_path, capsys):
    argv = ["replay", "tau", str(trace_path), "--budgets", "4", "--policies", "ddtree"]
    assert main(argv + ["--records", str(tmp_path / "a.jsonl")]) == 0
    out = capsys.readouterr().out
    assert " d7 " in out and " r8 " in out  # depth and sibling-rank tables
    argv = ["replay", "check", str(trace_path), "--threads", "1", "--budgets", "4"]
    assert main(argv + ["--policies", "ddtree"]) == 0
    assert "mismatch rate 0.00% (0 of" in capsys.readouterr().out


def test_a_trace_checked_against_other_models_is_refused(trace_path, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    argv = ["replay", "tau", str(trace_path), "--target", str(other)]
    assert main(argv + ["--records", str(tmp_path / "a.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "recorded with a different target" in err and str(other) in err
    assert main(["replay", "tau", str(tmp_path / "none.safetensors")]) == 2
    assert "no such trace file" in capsys.readouterr().err
    argv = ["replay", "tau", str(trace_path), "--policies", "ar"]
    with pytest.raises(SystemExit) as exit_:  # argparse: --policies is checked when read
        main(argv + ["--records", str(tmp_path / "a.jsonl")])
    assert exit_.value.code == 2
    assert "chain, ddtree (those a trace replays), got 'ar'" in capsys.readouterr().err
