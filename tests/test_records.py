import json

import pytest

from ddtree.records import HardwareInfo, Record, RecordError, read_records, write_records


def _hw():
    return HardwareInfo(cpu_model="test cpu", cpu_cores=2)


def test_round_trip(tmp_path):
    rec = Record(
        kind="bench_bandwidth",
        hardware=_hw(),
        config={"device": "cpu", "method": "copy"},
        summary={"bytes_per_s": 1.5e10},
        points=[{"bytes": 1 << 20, "seconds": 1e-4, "bytes_per_s": 1.0e10}],
    )
    path = write_records(tmp_path / "r.jsonl", [rec, rec])
    back = read_records(path)
    assert len(back) == 2
    assert back[0].summary["bytes_per_s"] == 1.5e10
    assert back[0].hardware.cpu_model == "test cpu"
    assert read_records(tmp_path, kind="engine_run") == []


def test_missing_summary_field_is_named():
    with pytest.raises(RecordError, match="bytes_per_s"):
        Record(
            kind="bench_bandwidth",
            hardware=_hw(),
            config={"device": "cpu", "method": "x"},
            summary={},
        )


def test_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {
        "kind": "bench_tree",
        "hardware": {"cpu_model": "c", "cpu_cores": 1},
        "config": {"device": "cpu"},
        "summary": {},
    }
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(RecordError, match=r"bad.jsonl:2"):
        read_records(path)


def test_unknown_kind():
    with pytest.raises(RecordError, match="kind"):
        Record(kind="nope", hardware=_hw(), config={}, summary={})
