"""`ddtree diagnose`: the tokens/s ratio of two engine runs attributed to tau, stages and
context length, on constructed records with known answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ddtree.cli import main
from ddtree.perf.validation.diagnose import DiagnoseError, diagnose, pair_runs
from ddtree.records import EngineRun, HardwareInfo, write_records
from ddtree.vocab import STEP_STAGES, Stage

HW = HardwareInfo("test cpu", 2)


def run_record(taus, contexts, stage_of_step, policy="ddtree", budget=8) -> EngineRun:
    """An engine_run whose step i commits taus[i] at context contexts[i] and spends
    stage_of_step(stage, context) seconds in each stage (0 for stages it does not name)."""
    points = []
    for tau, ctx in zip(taus, contexts, strict=True):
        stage_s = {str(s): stage_of_step(s, ctx) for s in STEP_STAGES}
        points.append(
            {"tau": tau, "step_s": sum(stage_s.values()), "stage_s": stage_s, "context_len": ctx}
        )
    steps = len(points)
    step_s = [p["step_s"] for p in points]
    return EngineRun(
        hardware=HW,
        policy=policy,
        block_size=8,
        budget=budget,
        temperature=0.0,
        target={"name": "t"},
        dtype="float32",
        device="cpu",
        mean_tau=sum(taus) / steps,
        tokens_per_s=sum(taus) / sum(step_s),
        step_s_mean=sum(step_s) / steps,
        stage_s_mean={
            s: float(np.mean([p["stage_s"][str(s)] for p in points])) for s in STEP_STAGES
        },
        steps=steps,
        new_tokens=sum(taus),
        points=points,
    )


def costs(verify_fixed, verify_per_token, other):
    table = {Stage.DRAFT: lambda c: 2e-3, Stage.OTHER: lambda c: other}
    table[Stage.VERIFY] = lambda c: verify_fixed + verify_per_token * c

    def stage_of_step(stage, ctx):
        return table.get(stage, lambda c: 0.0)(ctx)

    return stage_of_step


def test_worked_example_of_the_module_docstring():
    a = run_record(
        [4, 4],
        [10, 20],
        lambda s, c: {"verify": 12e-3, "draft": 5e-3, "other": 3e-3}.get(str(s), 0.0),
    )
    b = run_record(
        [3, 3],
        [10, 20],
        lambda s, c: {"verify": 21e-3, "draft": 5e-3, "other": 4e-3}.get(str(s), 0.0),
    )
    d = diagnose(a, b)
    assert d.tokens_per_s_ratio == pytest.approx(0.5)
    assert d.tau_ratio == pytest.approx(0.75) and d.step_ratio == pytest.approx(2 / 3)
    share = {s.stage: s.share for s in d.stages}
    assert share[Stage.VERIFY] == pytest.approx(0.45) and share[Stage.OTHER] == pytest.approx(0.05)
    assert 1 + sum(share.values()) == pytest.approx(1 / d.step_ratio)
    # equal contexts: every difference is "at equal context"
    verify = next(s for s in d.stages if s.stage == Stage.VERIFY)
    assert verify.context_s == pytest.approx(0, abs=1e-12) and verify.other_s == pytest.approx(9e-3)


def test_a_long_context_regression_is_attributed_to_context_and_to_the_rest():
    """The seed's hunt: B runs at ~5k context, its verify grows 2 us per context token as A's
    does, and its host overhead is 0.5 ms worse at any context; tau halves."""
    rng = np.random.default_rng(0)
    ctx_a = rng.integers(100, 300, size=40)
    ctx_b = rng.integers(5000, 5200, size=40)
    a = run_record([4] * 40, ctx_a.tolist(), costs(1e-3, 2e-6, 0.5e-3))
    b = run_record([2] * 40, ctx_b.tolist(), costs(1e-3, 2e-6, 1.0e-3))
    d = diagnose(a, b)
    assert d.tau_ratio == pytest.approx(0.5)
    assert d.tokens_per_s_ratio == pytest.approx(d.tau_ratio * d.step_ratio)
    by = {s.stage: s for s in d.stages}
    gap = ctx_b.mean() - ctx_a.mean()
    assert by[Stage.VERIFY].context_s == pytest.approx(2e-6 * gap, rel=1e-9)
    assert by[Stage.VERIFY].other_s == pytest.approx(0, abs=1e-12)
    assert by[Stage.VERIFY].context_slope_s == pytest.approx(2e-6)
    assert by[Stage.OTHER].context_s == pytest.approx(0, abs=1e-12)
    assert by[Stage.OTHER].other_s == pytest.approx(0.5e-3)
    assert by[Stage.DRAFT].share == pytest.approx(0, abs=1e-12)
    for s in d.stages:  # the two parts add up to the change
        assert s.context_s + s.other_s == pytest.approx(s.b_s - s.a_s, abs=1e-12)
    assert d.context_note == ""


def test_without_context_lengths_the_stage_split_still_holds():
    a = run_record([4, 4], [10, 20], costs(1e-3, 0, 1e-3))
    b = run_record([4, 4], [10, 20], costs(3e-3, 0, 1e-3))
    for run in (a, b):
        for p in run.points:
            del p["context_len"]
    d = diagnose(a, b)
    assert "do not carry context_len" in d.context_note
    assert all(s.context_s is None for s in d.stages)
    assert d.tokens_per_s_ratio == pytest.approx(d.step_ratio) == pytest.approx(4 / 6)  # ms


def test_records_are_paired_by_configuration():
    a8 = run_record([4], [10], costs(1e-3, 0, 0), budget=8)
    a16 = run_record([5], [10], costs(2e-3, 0, 0), budget=16)
    b16 = run_record([5], [10], costs(4e-3, 0, 0), budget=16)
    b32 = run_record([5], [10], costs(4e-3, 0, 0), budget=32)
    assert pair_runs([a8, a16], [b16, b32], "a", "b") == [(a16, b16)]
    assert pair_runs([a8], [b32], "a", "b") == [(a8, b32)]  # one each: compared as they are
    with pytest.raises(DiagnoseError, match=r"no \(policy, block size, budget\) in both"):
        pair_runs([a8, a16], [b32, b32], "a.jsonl", "b.jsonl")
    with pytest.raises(DiagnoseError, match="b.jsonl: no engine_run records"):
        pair_runs([a8], [], "a.jsonl", "b.jsonl")


def test_diagnose_command_prints_a_table_and_json(tmp_path, capsys):
    a = run_record([4] * 5, list(range(100, 105)), costs(1e-3, 2e-6, 1e-3))
    b = run_record([2] * 5, list(range(5000, 5005)), costs(1e-3, 2e-6, 1e-3))
    write_records(tmp_path / "a.jsonl", [a])
    write_records(tmp_path / "b.jsonl", [b])
    assert main(["diagnose", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "tau ratio 0.500" in out and "from context" in out and "largest change: verify" in out
    assert main(["diagnose", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)["diagnoses"]
    assert d["tau_ratio"] == pytest.approx(0.5)
    assert d["tokens_per_s_ratio"] == pytest.approx(d["tau_ratio"] * d["step_ratio"])
    assert main(["diagnose", str(tmp_path / "a.jsonl"), str(tmp_path / "none.jsonl")]) == 2
    assert "no such records file" in capsys.readouterr().err


def test_engine_points_carry_the_context_length_of_each_step():
    from ddtree.engine.loop import GenerationResult
    from ddtree.engine.runrecord import step_points
    from ddtree.engine.timing import StepTimings

    def result(taus):
        steps = [StepTimings(1e-3, {str(s): 0.0 for s in STEP_STAGES}, t) for t in taus]
        return GenerationResult(tokens=[0] * (1 + sum(taus)), text=None, taus=taus, steps=steps)

    points = step_points([result([3, 1, 2]), result([4])], prompt_lens=[5, 9])
    assert [p["context_len"] for p in points] == [5, 8, 9, 9]  # prompt + committed so far
    assert "context_len" not in step_points([result([3])])[0]  # prompt lengths unknown


def test_a_mismatched_pair_warns_in_one_line(tmp_path, capsys):
    import dataclasses

    base = run_record([3, 4, 3], [100, 103, 107], costs(10e-3, 1e-6, 1e-3))
    base = dataclasses.replace(
        base, threads=1, max_new_tokens=64, prompt_set={"count": 2, "lengths": [40, 60]}
    )
    same = dataclasses.replace(base)
    other = dataclasses.replace(base, threads=2, max_new_tokens=128, dtype="bfloat16")
    paths = {}
    for name, rec in (("a", base), ("same", same), ("other", other)):
        paths[name] = tmp_path / f"{name}.jsonl"
        write_records(paths[name], [rec])
    assert main(["diagnose", str(paths["a"]), str(paths["same"])]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["diagnose", str(paths["a"]), str(paths["other"]), "--json"]) == 0
    out = capsys.readouterr()
    (line,) = out.err.strip().splitlines()
    assert line.startswith("warning: A and B differ in max new tokens 64 (A) vs 128 (B); ")
    assert "threads 1 (A) vs 2 (B)" in line and "dtype float32 (A) vs bfloat16 (B)" in line
    assert "prompts" not in line and "device" not in line
    assert json.loads(out.out)["warnings"] == [line.removeprefix("warning: ")]
    # a record from before threads were stored says nothing about them
    old = dataclasses.replace(other, threads=None)
    write_records(paths["other"], [old], append=False)
    assert main(["diagnose", str(paths["a"]), str(paths["other"])]) == 0
    assert "threads" not in capsys.readouterr().err


def test_prompt_sets_of_equal_count_and_total_show_their_lengths():
    import dataclasses

    from ddtree.perf.inputs.consistency import differences

    a = run_record([3], [10], costs(1e-3, 0.0, 0.0))
    a = dataclasses.replace(a, prompt_set={"count": 2, "lengths": [40, 60]})
    b = dataclasses.replace(a, prompt_set={"count": 2, "lengths": [50, 50]})
    c = dataclasses.replace(a, prompt_set={"count": 3, "lengths": [40, 60, 5]})
    (d,) = differences([("A", a), ("B", b)])
    assert (
        d.describe() == "prompts 2 prompts, 100 tok (40, 60) (A) vs 2 prompts, 100 tok (50, 50) (B)"
    )
    (d,) = differences([("A", a), ("C", c), ("C", c)])
    assert d.describe() == "prompts 2 prompts, 100 tok (A) vs 3 prompts, 105 tok (2 C)"
