"""`ddtree bench tree`: structure of its points, JSON line and record (never its timings)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.trees import make_tree

from ddtree.bench.tree import available_backends, bench_tree, first_child_targets
from ddtree.records import read_records
from ddtree.tree import load_backend


def test_bench_tree_yields_one_point_per_builder_and_request_count():
    backends = [load_backend("python"), load_backend("python")]  # two rows, same backend
    points = list(
        bench_tree([4, 8], [3, 16], vocab_size=64, batch_sizes=(1, 4), repeats=1, backends=backends)
    )
    keys = [(p.block_size, p.budget, p.builder, p.requests) for p in points]
    assert keys == [
        (b, n, builder, r)
        for b in (4, 8)
        for n in (3, 16)
        for builder, r in (("python", 1), ("python", 1), ("batched", 1), ("batched", 4))
    ]
    for p in points:
        assert p.topk_s > 0 and p.build_s > 0 and p.layout_s > 0 and p.layout_alloc_s > 0
        assert p.accept_s > 0
        assert abs(p.build_layout_s - (p.build_s + p.layout_s)) < 1e-12


def test_first_child_targets_accept_the_path_of_first_children():
    tree = make_tree([5, 7, 8, 3, 4], [-1, 0, 0, 1, 1])  # root -> {7, 8}, 7 -> {3, 4}
    target = first_child_targets(tree)
    assert target.tolist() == [7, 3, 0, 0, 0]
    result = load_backend("python").accept_greedy(tree, target)
    assert result.accepted.tolist() == [0, 1, 3] and result.bonus_token == 0


def test_bench_tree_command_prints_json_and_writes_a_valid_record(tmp_path):
    records = tmp_path / "tree.jsonl"
    cmd = [sys.executable, "-m", "ddtree", "bench", "tree", "--blocks", "4", "--budgets", "8"]
    cmd += ["--vocab", "64", "--batch", "2", "--repeats", "2", "--records", str(records)]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True).stdout
    line = json.loads(out)  # stdout: the JSON document alone
    assert line["bench"] == "tree" and line["vocab_size"] == 64
    builders = [b.name for b in available_backends()]  # python, and native where built
    assert [(p["builder"], p["requests"]) for p in line["points"]] == [
        (name, 1) for name in builders
    ] + [("batched", 2)]
    assert line["tree_backends_timed"] == builders and line["tree_backend"] in builders
    (record,) = read_records(records)
    assert record.kind == "bench_tree" and record.config["device"] == "cpu"
    assert record.points == line["points"]


def test_bench_tree_rejects_a_malformed_list():
    cmd = [sys.executable, "-m", "ddtree", "bench", "tree", "--budgets", "8,x"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
