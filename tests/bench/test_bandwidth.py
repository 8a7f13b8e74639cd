import json

import pytest
import torch

from ddtree.bench.bandwidth import (
    METHODS,
    MIB,
    measure,
    peak_from_records,
    resolve_devices,
    to_records,
)
from ddtree.cli import main
from ddtree.provenance import this_hardware
from ddtree.records import read_records


@pytest.mark.parametrize("method", sorted(METHODS))
def test_bytes_counted_are_reads_plus_writes(method):
    pt = measure("cpu", method, MIB, repeats=2, warmup=1, calls=3)
    expected_factor = {"copy": 2, "read": 1, "write": 1}[method]
    assert pt.buffer_bytes == MIB
    assert pt.bytes == expected_factor * MIB * 3
    assert pt.bytes_per_s == pytest.approx(pt.bytes / pt.seconds)
    assert pt.bytes_per_s_p10 <= pt.bytes_per_s <= pt.bytes_per_s_p90


def test_buffer_rounds_down_to_whole_elements():
    pt = measure("cpu", "read", 4 * 1000 + 3, repeats=1, warmup=0)
    assert pt.buffer_bytes == 4000


def test_kernels_do_what_they_are_credited_for():
    src = torch.arange(16, dtype=torch.float32)
    dst = torch.zeros(16)
    METHODS["copy"].make(src, dst)()
    assert torch.equal(dst, src)
    METHODS["write"].make(src, dst)()
    assert torch.equal(dst, torch.ones(16))
    assert float(METHODS["read"].make(src, dst)()) == float(src.sum())


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="method 'triad'"):
        measure("cpu", "triad", MIB)
    with pytest.raises(ValueError, match="--device"):
        resolve_devices("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_devices("cuda")
    assert resolve_devices("cpu") == ["cpu"]
    assert resolve_devices("auto")[0] == "cpu"


def test_records_summarise_the_largest_buffer():
    pts = [measure("cpu", "read", s * MIB, repeats=1, warmup=0) for s in (1, 2)]
    (record,) = to_records(pts, this_hardware(), {"threads": 1})
    assert record.config["method"] == "read" and record.config["device"] == "cpu"
    assert record.summary["buffer_bytes"] == 2 * MIB
    assert record.summary["bytes_per_s"] == pts[1].bytes_per_s
    assert len(record.points) == 2


def test_peak_prefers_the_read_method():
    hw = this_hardware()
    pts = [measure("cpu", m, MIB, repeats=1, warmup=0) for m in ("copy", "read")]
    records = to_records(pts, hw, {})
    peak = peak_from_records(records, "cpu", "bw.jsonl")
    assert peak.bytes_per_s == pts[1].bytes_per_s
    assert "read" in peak.source and "bw.jsonl" in peak.source
    one_thread = to_records(pts[:1], hw, {"threads": 1})  # only copy was measured at 1 thread
    picked = peak_from_records(records + one_thread, "cpu", "bw.jsonl", threads=1)
    assert picked.bytes_per_s == pts[0].bytes_per_s and "copy, 1 threads" in picked.source
    assert peak_from_records(records, "cpu", threads=7).bytes_per_s == pts[1].bytes_per_s
    with pytest.raises(ValueError, match="bw.jsonl: no bench_bandwidth record for device 'cuda'"):
        peak_from_records(records, "cuda", "bw.jsonl")


def test_command_writes_valid_records_and_one_json_document(tmp_path, capsys):
    out = tmp_path / "bw.jsonl"
    argv = ["bench", "bandwidth", "--device", "cpu", "--sizes-mib", "1,2"]
    argv += ["--repeats", "2", "--methods", "copy,read", "--records", str(out), "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)  # stdout: the JSON document alone
    assert data["bench"] == "bandwidth" and len(data["points"]) == 4
    records = read_records(out, kind="bench_bandwidth")
    assert sorted(r.config["method"] for r in records) == ["copy", "read"]
    for r in records:
        assert [p["buffer_bytes"] for p in r.points] == [MIB, 2 * MIB]
        assert r.summary["bytes_per_s"] > 0
        assert {"load_avg_1min", "omp_wait_policy", "threads"} <= set(r.config)


def test_command_rejects_unknown_method(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "bandwidth", "--methods", "copy,triad"])
    assert "triad" in capsys.readouterr().err
