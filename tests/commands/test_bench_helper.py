"""commands/_bench.py: a benchmark's result goes to --records, one --json line or its table,
and an interrupt keeps the points measured so far as a record marked interrupted."""

from __future__ import annotations

import argparse
import json

import pytest

from ddtree import signals
from ddtree.bench.attention import AttentionPoint, attention_result
from ddtree.commands._bench import measure, report
from ddtree.records import read_records

CONFIG = {"device": "cpu", "dtype": "float32", "heads": 2, "kv_heads": 1, "head_dim": 4}


def point(method: str, median_s: float, peak: int = 100) -> AttentionPoint:
    return AttentionPoint(64, 8, method, median_s, median_s, median_s, peak, 0.0)


def result(points):
    return attention_result(CONFIG, [64], [8], points)


def test_an_interrupt_keeps_the_points_measured_so_far(tmp_path):
    path = tmp_path / "r.jsonl"
    args = argparse.Namespace(records=path, json=False)

    def points():
        yield point("dense", 2e-3)
        yield point("dense-math", 4e-3)
        raise KeyboardInterrupt

    signals._state.kept.clear()
    with pytest.raises(KeyboardInterrupt):
        measure(args, points(), 3, lambda p: p.method, result)
    (record,) = read_records(path)
    assert record.kind == "bench_attention"
    assert record.config_extra["interrupted"] == "after 2 of 3 points"
    assert [p["method"] for p in record.points] == ["dense", "dense-math"]
    assert signals.kept() == {str(path): "a bench_attention record of the first 2 of 3 points"}


def test_json_is_one_line_and_no_table(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    args = argparse.Namespace(records=path, json=True)
    points = [point("dense", 2e-3, 300), point("dense-math", 4e-3, 600), point("split", 1e-3)]
    done = measure(args, iter(points), 3, lambda p: p.method, result)
    assert done.summary == {
        "S64_N8": {
            "time_dense_over_split": 2.0,
            "time_math_over_split": 4.0,
            "memory_dense_over_split": 3.0,
            "memory_math_over_split": 6.0,
        }
    }
    assert report(args, done, lambda: pytest.fail("a table with --json")) == 0
    out = capsys.readouterr()
    (line,) = out.out.splitlines()
    assert json.loads(line)["summary"] == done.summary
    assert f"wrote a bench_attention record to {path}" in out.err
    assert "interrupted" not in read_records(path)[0].config_extra


def test_a_run_of_several_records_keeps_each_on_interrupt(tmp_path, capsys):
    from ddtree.bench.bandwidth import BandwidthPoint, bandwidth_result

    path = tmp_path / "bw.jsonl"
    args = argparse.Namespace(records=path, json=True)

    def bw(method: str) -> BandwidthPoint:
        return BandwidthPoint("cpu", method, 1 << 20, 1, 1 << 20, 1e-3, 1e-3, 1e-3, 1e9, 1e9, 1e9)

    def points():
        yield bw("copy")
        yield bw("read")
        raise KeyboardInterrupt

    def result(done):
        return bandwidth_result({"threads": 1}, done)

    signals._state.kept.clear()
    with pytest.raises(KeyboardInterrupt):
        measure(args, points(), 3, lambda p: p.method, result)
    records = read_records(path)
    assert [r.config["method"] for r in records] == ["copy", "read"]
    assert {r.config_extra["interrupted"] for r in records} == {"after 2 of 3 points"}
    assert signals.kept() == {str(path): "2 bench_bandwidth records of the first 2 of 3 points"}
    path.unlink()
    assert report(args, result([bw("copy"), bw("read")]), lambda: pytest.fail("a table")) == 0
    assert f"wrote 2 bench_bandwidth records to {path}" in capsys.readouterr().err
    assert len(read_records(path)) == 2


def test_points_that_announce_get_the_progress_tracker_and_keep_each_precision(tmp_path, capsys):
    from ddtree.bench.moe import MoeBenchPoint, moe_result

    path = tmp_path / "moe.jsonl"
    args = argparse.Namespace(records=path, json=True)
    pt = MoeBenchPoint(1, 1e-3, 1e-3, 1e-3, 2.0, 2.0, 100, 10, 4, 114, 1.14e5, 0.5)
    configs = {
        p: {"device": "cpu", "precision": p, "hidden_size": 4, "moe_intermediate_size": 2,
            "n_routed_experts": 4, "top_k": 2}
        for p in ("bfloat16", "int4")
    }  # fmt: skip

    def points(bar):
        for precision in configs:
            bar.announce(f"building the {precision} layer")
            yield precision, pt
        raise KeyboardInterrupt

    signals._state.kept.clear()
    with pytest.raises(KeyboardInterrupt):
        measure(args, points, 3, lambda p: p[0], lambda done: moe_result(done, configs, 1e9, "x"))
    assert "building the int4 layer" in capsys.readouterr().err
    records = read_records(path)
    assert [r.config["precision"] for r in records] == ["bfloat16", "int4"]
    assert {r.config_extra["interrupted"] for r in records} == {"after 2 of 3 points"}
    assert signals.kept() == {str(path): "2 bench_moe records of the first 2 of 3 points"}
