"""`ddtree bench tree`: structure of its points, JSON line and record (never its timings)."""

from __future__ import annotations

import json
import subprocess
import sys

from ddtree.bench.tree import bench_tree
from ddtree.records import read_records


def test_bench_tree_yields_one_point_per_builder_and_request_count():
    points = list(bench_tree([4, 8], [3, 16], vocab_size=64, batch_sizes=(1, 4), repeats=1))
    keys = [(p.block_size, p.budget, p.builder, p.requests) for p in points]
    assert keys == [
        (b, n, builder, r)
        for b in (4, 8)
        for n in (3, 16)
        for builder, r in (("cpu", 1), ("batched", 1), ("batched", 4))
    ]
    for p in points:
        assert p.topk_s > 0 and p.build_s > 0 and p.layout_s > 0
        assert abs(p.build_layout_s - (p.build_s + p.layout_s)) < 1e-12


def test_bench_tree_command_prints_json_and_writes_a_valid_record(tmp_path):
    records = tmp_path / "tree.jsonl"
    cmd = [sys.executable, "-m", "ddtree", "bench", "tree", "--blocks", "4", "--budgets", "8"]
    cmd += ["--vocab", "64", "--batch", "2", "--repeats", "2", "--records", str(records)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = json.loads(out.strip().splitlines()[-1])
    assert line["bench"] == "tree" and line["vocab_size"] == 64
    assert [(p["builder"], p["requests"]) for p in line["points"]] == [("cpu", 1), ("batched", 2)]
    (record,) = read_records(records)
    assert record.kind == "bench_tree" and record.config["device"] == "cpu"
    assert record.points == line["points"]


def test_bench_tree_rejects_a_malformed_list():
    cmd = [sys.executable, "-m", "ddtree", "bench", "tree", "--budgets", "8,x"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
