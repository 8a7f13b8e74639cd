"""bench linear: the weight shapes of a preset and how many a forward reads, the copies that
make a set stream from memory (worked examples), one forward's time from known points, and the
command end to end on the tiny preset (each kernel at each M, equal outputs, its record)."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree.bench.linear import (
    LinearPoint,
    copies_for,
    default_set_bytes,
    forward_seconds,
    preset_shapes,
)
from ddtree.cli import main
from ddtree.models.nn.linear import ATEN, ONEDNN_PACKED, packed_unavailable
from ddtree.models.presets import Preset
from ddtree.records import read_records


def test_qwen3_1_7b_shapes_and_how_many_a_forward_reads():
    shapes = {s.name: s for s in preset_shapes(Preset.load("qwen3-1.7b").target, "x")}
    # hidden 2048, 16 heads / 8 KV heads of 128, intermediate 6144, 28 layers, vocab 151936
    assert (shapes["q"].out_features, shapes["q"].in_features) == (2048, 2048)
    assert (shapes["k/v"].out_features, shapes["k/v"].per_forward) == (1024, 56)
    assert (shapes["down"].out_features, shapes["down"].in_features) == (2048, 6144)
    assert (shapes["gate/up"].per_forward, shapes["lm_head"].per_forward) == (56, 1)
    assert shapes["lm_head"].out_features == 151936
    with pytest.raises(ValueError, match="qwen3-30b-a3b: routed experts .* bench moe"):
        preset_shapes(Preset.load("qwen3-30b-a3b").target, "qwen3-30b-a3b")


def test_copies_fill_the_set_worked_example():
    q = preset_shapes(Preset.load("qwen3-1.7b").target, "x")[0]
    assert copies_for(q, torch.bfloat16, 128 * 10**6) == 16  # 8.4 MB each
    assert copies_for(q, torch.float32, 128 * 10**6) == 8
    assert copies_for(q, torch.bfloat16, 1) == 1


def test_a_forward_is_each_shape_times_how_many_it_reads():
    shapes = preset_shapes(Preset.load("tiny-qwen3").target, "x")  # 4 layers

    def point(shape, m, s):
        return LinearPoint(shape, 1, 1, ATEN, m, s, s, s, 1.0, 1.0, 0.0)

    points = [point(s.name, m, 1e-3 * m) for m in (1, 8) for s in shapes]
    # per M: q 4 + k/v 8 + o 4 + gate/up 8 + down 4 + head 1 = 29 weights of 1 ms x M
    got = forward_seconds(points, shapes)[ATEN]
    assert got["seconds_by_m"] == pytest.approx({"1": 0.029, "8": 0.232})
    assert got["vs_m1"] == pytest.approx({"1": 1.0, "8": 8.0})


def test_bench_linear_command_times_every_kernel_and_writes_its_record(tmp_path, capsys):
    records = tmp_path / "linear.jsonl"
    argv = ["bench", "linear", "--preset", "tiny-qwen3", "--ms", "1,9", "--repeats", "2",
            "--set-mb", "1", "--threads", "1", "--records", str(records), "--json"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    kernels = [ATEN] if packed_unavailable(torch.device("cpu"), torch.bfloat16) else [
        ATEN, ONEDNN_PACKED]  # fmt: skip
    assert doc["config"]["kernels"] == kernels
    assert len(doc["points"]) == 6 * 2 * len(kernels)  # shapes x M x kernels
    assert {(p["shape"], p["kernel"], p["m"]) for p in doc["points"]} == {
        (s.name, k, m) for s in preset_shapes(Preset.load("tiny-qwen3").target, "x")
        for k in kernels for m in (1, 9)}  # fmt: skip
    assert all(p["max_abs_diff"] < 1e-2 for p in doc["points"])  # the same products
    assert all(p["vs_m1"] == 1.0 for p in doc["points"] if p["m"] == 1)
    (record,) = read_records(records)
    assert record.kind == "bench_linear" and record.preset == "tiny-qwen3"
    assert set(record.summary) == set(kernels)


def test_the_default_set_is_twice_the_cache_and_never_small():
    assert default_set_bytes(480 * 2**20) == 2 * 480 * 2**20
    assert default_set_bytes(32 * 2**20) == default_set_bytes(None) == 256 * 10**6
