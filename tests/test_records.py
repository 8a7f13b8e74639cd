import contextlib
import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from ddtree import records as rec_mod
from ddtree.provenance import this_process
from ddtree.records import (
    RECORD_KINDS,
    SCHEMA_VERSION,
    BenchBandwidth,
    EngineRun,
    HardwareInfo,
    Provenance,
    Record,
    RecordError,
    RecordWarning,
    check_records_file,
    config_field,
    make_record,
    read_records,
    summary_field,
    write_records,
)
from ddtree.vocab import STEP_STAGES, EngineMode, Stage

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


@contextlib.contextmanager
def _alarm(seconds: int):
    """Fail instead of hanging (a FIFO opened for writing blocks until a reader comes)."""

    def fail(*_):
        raise TimeoutError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _line(record: Record) -> str:
    return record.to_json() + "\n"


def test_round_trip_keeps_typed_fields_extras_and_provenance(tmp_path):
    prov = Provenance("ddtree bench bandwidth", "ddtree bench bandwidth --threads 1", "0.1", None)
    rec = _bw(provenance=prov, config_extra={"threads_note": "one"}, summary_extra={"p10": 1.0})
    path = write_records(tmp_path / "r.jsonl", [rec, dataclasses.replace(rec, bytes_per_s=2e10)])
    back = read_records(path)
    assert len(back) == 2 and isinstance(back[0], BenchBandwidth)
    assert back[0] == rec
    assert back[0].bytes_per_s == 1.5e10 and back[0].summary["p10"] == 1.0
    assert back[0].config == {"device": "cpu", "method": "copy", "threads": None,
                              "threads_note": "one"}  # fmt: skip
    wire = json.loads(path.read_text().splitlines()[0])
    assert wire["schema"] == SCHEMA_VERSION and wire["provenance"]["producer"] == prov.producer
    assert read_records(tmp_path, kind="engine_run") == []


def test_this_process_names_producer_command_and_version():
    p = this_process("ddtree bench tree")
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


@pytest.mark.parametrize(
    "change,field",
    [
        ({"prompt_set": {"count": 4, "lengths": [None, 63]}}, r"config.prompts.lengths\[0\]"),
        ({"prompt_set": {"count": "4", "lengths": [63]}}, "config.prompts.count"),
        ({"prompt_set": {"lengths": [63, -1]}}, "config.prompts.lengths"),
        ({"width_buckets": [16, "32"]}, r"config.width_buckets\[1\]"),
    ],
)
def test_list_items_and_the_prompt_set_are_typed(change, field):
    """Each item of a list field is checked (a null prompt length reached the estimator's
    arithmetic as a TypeError), and the prompt set's count and lengths are counts."""
    (run,) = read_records(V1_FILE, kind="engine_run")[:1]
    with pytest.raises(RecordError, match=rf"field '{field}"):
        dataclasses.replace(run, **change)


@pytest.mark.parametrize(
    "section,key,value",
    [("target", "ep", "two"), ("target", "config_json", [1]), ("drafter", "n_params", 1.5)],
)
def test_the_model_fields_readers_compute_with_are_typed(section, key, value):
    (run,) = read_records(V1_FILE, kind="engine_run")[:1]
    model = {**(getattr(run, section) or {}), key: value}
    with pytest.raises(RecordError, match=rf"field 'config.{section}.{key}'"):
        dataclasses.replace(run, **{section: model})
    assert dataclasses.replace(run, **{section: {**model, key: None}})  # null: not recorded


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


def test_an_interrupt_half_way_through_an_append_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    write_records(path, [_bw(1e10)])
    before = path.read_bytes()
    real_write = rec_mod.os.write

    def interrupted(fd, data):
        real_write(fd, bytes(data[:25]))  # a part of the first new line reaches the file
        raise KeyboardInterrupt

    monkeypatch.setattr(rec_mod.os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_records(path, [_bw(2e10), _bw(3e10)])
    monkeypatch.undo()
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


# ---- where records are written: regular records files only, in place, under a lock ----------


SEED_TOML = Path(__file__).resolve().parents[1] / "examples" / "seed_kimi_b300.toml"


def _make_folder(p: Path) -> Path:
    p.mkdir()
    return p


def _make_fifo(p: Path) -> Path:
    os.mkfifo(p)
    return p


def _make_device_link(p: Path) -> Path:
    p.symlink_to("/dev/null")  # a link, so that nothing here can touch /dev/null itself
    return p


def _make_dangling_link(p: Path) -> Path:
    p.symlink_to(p.parent / "nowhere" / "runs.jsonl")
    return p


def _make_symlink_loop(p: Path) -> Path:
    p.symlink_to(p)  # pathlib's resolve() raised RuntimeError("Symlink loop"): a traceback
    return p


def _make_hard_link(p: Path) -> Path:
    write_records(p.parent / "original.jsonl", [_bw(1e10)])
    os.link(p.parent / "original.jsonl", p)
    return p


def _make_read_only(p: Path) -> Path:
    write_records(p, [_bw(1e10)])
    p.chmod(0o444)
    return p


def _make_scenario(p: Path) -> Path:
    shutil.copy(SEED_TOML, p)
    return p


def _make_trace_like(p: Path) -> Path:
    p.write_bytes(b"\x80\x00\x00\x00\x00\x00\x00\x00" + b'{"__metadata__":{}}' + b"\x00" * 64)
    return p


REFUSED = [
    (_make_folder, "is a folder"),
    (_make_fifo, "is a named pipe (FIFO)"),
    (_make_device_link, "/dev/null: is a character device"),
    (_make_dangling_link, "which does not exist"),
    (_make_symlink_loop, "is a symlink loop"),
    (_make_hard_link, "has 2 hard links"),
    (_make_read_only, "is read-only (mode 0444)"),
    (_make_scenario, "is not a records file"),
    (_make_trace_like, "is not a records file"),
]


@pytest.mark.parametrize("make, why", REFUSED, ids=[m.__name__[6:] for m, _ in REFUSED])
def test_only_regular_records_files_are_written(tmp_path, make, why):
    path = make(tmp_path / "runs.jsonl")

    def snapshot():
        return {
            p.name: (p.is_symlink(), p.lstat().st_mode, p.read_bytes() if p.is_file() else None)
            for p in tmp_path.iterdir()
            if p.is_symlink() or not p.is_fifo()
        }

    before = snapshot()
    with _alarm(10):  # a FIFO opened for writing would block for a reader forever
        with pytest.raises(OSError) as info:
            write_records(path, [_bw(2e10)])
        with pytest.raises(OSError):
            check_records_file(path)
    line = f"{info.value.filename}: {info.value.strerror}"
    assert why in line and "expected" in line and "\n" not in line, line
    assert snapshot() == before  # nothing replaced, nothing beside it


def test_a_symlink_is_followed_and_stays_a_link(tmp_path):
    real = tmp_path / "store" / "cpu.jsonl"
    write_records(real, [_bw(1e10)])
    link = tmp_path / "latest.jsonl"
    link.symlink_to(real)
    write_records(link, [_bw(2e10)])
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert [r.bytes_per_s for r in read_records(real)] == [1e10, 2e10]


def test_appending_keeps_the_mode_and_a_new_file_follows_the_umask(tmp_path):
    path = tmp_path / "runs.jsonl"
    write_records(path, [_bw(1e10)])
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    path.chmod(0o640)
    write_records(path, [_bw(2e10)])
    write_records(path, [_bw(3e10)], append=False)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


APPENDER = """
import sys, time
from pathlib import Path
from ddtree.records import BenchBandwidth, HardwareInfo, write_records

path, tag, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
hw = HardwareInfo(cpu_model="test cpu", cpu_cores=2)
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
for i in range(n):
    rec = BenchBandwidth(hardware=hw, device="cpu", method=f"{tag}-{i}", bytes_per_s=1e9 + i,
                         points=[{"pad": tag * 4000}])
    write_records(path, [rec])
"""


def test_two_processes_appending_at_once_keep_every_record_whole(tmp_path):
    path, go, n = tmp_path / "shared.jsonl", tmp_path / "go", 150
    children = [
        subprocess.Popen(
            [sys.executable, "-c", APPENDER, str(path), tag, str(n), str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for tag in ("a", "b")
    ]
    for child in children:
        assert child.stdout.readline().strip() == "ready"
    go.touch()  # both start appending at the same moment
    for child in children:
        assert child.wait(timeout=120) == 0
    methods = [r.method for r in read_records(path)]
    assert sorted(methods) == sorted(f"{t}-{i}" for t in "ab" for i in range(n))
    assert methods.index("a-0") < methods.index("a-1")  # each process's own order kept
    assert len(path.read_text().splitlines()) == 2 * n


# ---- reading: each record counts once ------------------------------------------------------


def test_a_record_read_twice_counts_once_with_one_warning_per_file(tmp_path):
    a = write_records(tmp_path / "runs" / "a.jsonl", [_bw(1e10), _bw(2e10)])
    copy = tmp_path / "runs" / "copy.jsonl"
    shutil.copy(a, copy)
    write_records(copy, [_bw(3e10)])
    with pytest.warns(RecordWarning) as caught:
        got = read_records([a, tmp_path / "runs"])  # a named, then again in its folder
    assert [r.bytes_per_s for r in got] == [1e10, 2e10, 3e10]
    lines = [str(w.message) for w in caught]
    assert len(lines) == 2, lines  # a.jsonl again, then copy.jsonl
    assert f"{a}:1: the same record as {a}:1 (and 1 more such lines in {a})" in lines[0]
    assert f"{copy}:1: the same record as {a}:1 (and 1 more" in lines[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_records(copy)) == 3  # one file alone: nothing to skip


def test_a_line_separator_inside_a_string_does_not_end_the_record(tmp_path):
    rec = _bw(provenance=Provenance("ddtree bench bandwidth", "echo 'a\u2028b\x85c'"))
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rec.to_dict(), ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_records(path) == [rec]


def test_an_error_quotes_a_huge_value_short(tmp_path):
    data = json.loads(_bw().to_json())
    data["config"]["threads"] = "1" * 1_000_000
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(data) + "\n")
    with pytest.raises(RecordError) as info:
        read_records(path)
    assert str(info.value).startswith(f"{path}:1: field 'config.threads'")
    assert len(str(info.value)) < 300
