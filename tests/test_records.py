import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from ddtree import records as rec_mod
from ddtree.records import (
    RECORD_KINDS,
    SCHEMA_VERSION,
    STEP_STAGES,
    BenchBandwidth,
    EngineMode,
    EngineRun,
    HardwareInfo,
    Provenance,
    Record,
    RecordError,
    RecordWarning,
    Stage,
    config_field,
    make_record,
    read_records,
    summary_field,
    write_records,
)

V1_FILE = Path(__file__).parent / "perf" / "data" / "demo_pair_cpu_runs.jsonl"


def _hw():
    return HardwareInfo(cpu_model="test cpu", cpu_cores=2)


def _bw(bytes_per_s=1.5e10, **kw):
    return BenchBandwidth(
        hardware=_hw(),
        device="cpu",
        method="copy",
        bytes_per_s=bytes_per_s,
        points=[{"bytes": 1 << 20, "seconds": 1e-4, "bytes_per_s": 1.0e10}],
        **kw,
    )


def _line(record: Record) -> str:
    return record.to_json() + "\n"


def test_round_trip_keeps_typed_fields_extras_and_provenance(tmp_path):
    prov = Provenance("ddtree bench bandwidth", "ddtree bench bandwidth --threads 1", "0.1", None)
    rec = _bw(provenance=prov, config_extra={"threads_note": "one"}, summary_extra={"p10": 1.0})
    path = write_records(tmp_path / "r.jsonl", [rec, rec])
    back = read_records(path)
    assert len(back) == 2 and isinstance(back[0], BenchBandwidth)
    assert back[0] == rec
    assert back[0].bytes_per_s == 1.5e10 and back[0].summary["p10"] == 1.0
    assert back[0].config == {"device": "cpu", "method": "copy", "threads": None,
                              "threads_note": "one"}  # fmt: skip
    wire = json.loads(path.read_text().splitlines()[0])
    assert wire["schema"] == SCHEMA_VERSION and wire["provenance"]["producer"] == prov.producer
    assert read_records(tmp_path, kind="engine_run") == []


def test_provenance_here_names_producer_command_and_version():
    p = Provenance.here("ddtree bench tree")
    assert p.producer == "ddtree bench tree" and p.command and p.version == "0.1.0"
    assert p.git_commit is None or len(p.git_commit) == 40


def test_version_1_file_reads_as_eager_runs_of_unknown_producer():
    runs = read_records(V1_FILE, kind="engine_run")
    assert len(runs) == 6 and all(isinstance(r, EngineRun) for r in runs)
    for r in runs:
        assert r.engine_mode is EngineMode.EAGER
        assert r.provenance.producer.startswith("unknown")
        assert set(r.stage_s_mean) == set(STEP_STAGES)
        assert all(isinstance(k, Stage) for k in r.stage_s_mean)
        assert r.prompt_lengths == [53, 63, 66, 73] and r.prompts == 4
        assert r.config_extra == {"identical_to_ar": None}
    # written again it is version 2 and reads back equal
    assert [r.budget for r in runs] == [8, 16, 32, 64, 128, 256]


def test_rewriting_a_version_1_file_loses_nothing(tmp_path):
    runs = read_records(V1_FILE)
    out = write_records(tmp_path / "v2.jsonl", runs, append=False)
    again = read_records(out)
    assert again == runs
    old = [json.loads(x) for x in V1_FILE.read_text().splitlines()]
    new = [json.loads(x) for x in out.read_text().splitlines()]
    for a, b in zip(old, new, strict=True):
        for section in ("config", "summary"):
            for key, value in a[section].items():
                assert b[section][key] == value, (section, key)


def test_missing_summary_field_is_named():
    with pytest.raises(RecordError, match="bytes_per_s"):
        make_record("bench_bandwidth", _hw(), {"device": "cpu", "method": "x"}, {})


@pytest.mark.parametrize(
    "summary,field",
    [
        ({"bytes_per_s": "fast"}, "summary.bytes_per_s"),
        ({"bytes_per_s": 0}, "summary.bytes_per_s"),
        ({"bytes_per_s": -3.0}, "summary.bytes_per_s"),
        ({"bytes_per_s": True}, "summary.bytes_per_s"),
    ],
)
def test_bad_field_values_name_file_line_and_field(tmp_path, summary, field):
    good = json.loads(_line(_bw()))
    bad = {**good, "summary": summary}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordError, match=rf"bad.jsonl:2: field '{field}'"):
        read_records(path)


def test_unknown_stage_and_engine_mode_are_named():
    (run,) = read_records(V1_FILE, kind="engine_run")[:1]
    with pytest.raises(RecordError, match=r"summary.stage_s_mean.warp"):
        dataclasses.replace(run, stage_s_mean={"warp": 1.0})
    with pytest.raises(RecordError, match=r"config.engine_mode.*eager, compiled"):
        dataclasses.replace(run, engine_mode="turbo")
    assert dataclasses.replace(run, engine_mode="compiled").engine_mode is EngineMode.COMPILED


def test_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(_line(_bw()) + "{not json\n" + _line(_bw()))
    with pytest.raises(RecordError, match=r"bad.jsonl:2: not valid JSON"):
        read_records(path)


def test_unknown_kind():
    with pytest.raises(RecordError, match="kind"):
        make_record("nope", _hw(), {}, {})


def test_newer_schema_is_skipped_with_a_warning_and_the_rest_kept(tmp_path):
    newer = {**json.loads(_line(_bw(2e10))), "schema": SCHEMA_VERSION + 1, "kind": "future"}
    path = tmp_path / "mixed.jsonl"
    path.write_text(_line(_bw(1e10)) + json.dumps(newer) + "\n" + _line(_bw(3e10)))
    with pytest.warns(
        RecordWarning, match=rf"mixed.jsonl:2: .*schema version {SCHEMA_VERSION + 1}"
    ):
        got = read_records(path)
    assert [r.bytes_per_s for r in got] == [1e10, 3e10]


def test_truncated_last_line_is_warned_and_the_rest_kept(tmp_path):
    path = tmp_path / "killed.jsonl"
    full = _line(_bw(1e10)) + _line(_bw(2e10)) + _line(_bw(3e10))
    path.write_text(full[: len(full) - 40])  # the writer died inside the third line
    with pytest.warns(RecordWarning, match=r"killed.jsonl:3: truncated last line"):
        got = read_records(path)
    assert [r.bytes_per_s for r in got] == [1e10, 2e10]
    # appending after the damage drops the fragment (saying so) and keeps the good records
    with pytest.warns(RecordWarning, match=r"killed.jsonl: dropped a truncated last line"):
        write_records(path, [_bw(4e10)])
    assert [r.bytes_per_s for r in read_records(path)] == [1e10, 2e10, 4e10]


def test_write_is_atomic_when_a_record_cannot_be_serialised(tmp_path):
    path = tmp_path / "runs.jsonl"
    write_records(path, [_bw(1e10)])
    before = path.read_bytes()
    bad = _bw(2e10, config_extra={"x": float("nan")})  # JSON has no NaN
    with pytest.raises(ValueError):
        write_records(path, [_bw(5e10), bad])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.jsonl"]


def test_write_is_atomic_when_the_writer_dies_before_the_rename(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    write_records(path, [_bw(1e10)])
    before = path.read_bytes()

    def killed(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(rec_mod.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_records(path, [_bw(2e10)])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.jsonl"]


def test_append_copies_the_old_content(tmp_path):
    path = tmp_path / "sub" / "runs.jsonl"
    write_records(path, [_bw(1e10)])
    write_records(path, [_bw(2e10), _bw(3e10)])
    assert [r.bytes_per_s for r in read_records(path)] == [1e10, 2e10, 3e10]
    write_records(path, [_bw(4e10)], append=False)
    assert [r.bytes_per_s for r in read_records(path)] == [4e10]


def test_a_new_kind_is_one_dataclass_and_one_registry_entry(tmp_path, monkeypatch):
    @dataclass(kw_only=True)
    class BenchAllreduce(Record):
        kind: ClassVar[str] = "bench_allreduce"
        point_keys: ClassVar[tuple[str, ...]] = ("bytes", "seconds")
        device: str = config_field()
        world_size: int = config_field(minimum=2)
        latency_s: float = summary_field(positive=True)

    monkeypatch.setitem(RECORD_KINDS, BenchAllreduce.kind, BenchAllreduce)
    rec = BenchAllreduce(hardware=_hw(), device="cuda", world_size=8, latency_s=8e-6,
                         points=[{"bytes": 1024, "seconds": 9e-6}])  # fmt: skip
    path = write_records(tmp_path / "ar.jsonl", [rec])
    assert read_records(path) == [rec]
    with pytest.raises(RecordError, match=r"config.world_size' is 1; expected at least 2"):
        dataclasses.replace(rec, world_size=1)
    with pytest.raises(RecordError, match=r"points\[0\]' lacks seconds"):
        dataclasses.replace(rec, points=[{"bytes": 1}])


def test_empty_folder_and_missing_file(tmp_path):
    assert read_records(tmp_path) == []
    with pytest.raises(RecordError, match="no such records file"):
        read_records(tmp_path / "nope.jsonl")
    shutil.copy(V1_FILE, tmp_path / "a.jsonl")
    assert len(read_records(tmp_path)) == 8
