"""The records reader under random input (hypothesis): JSON lines of random types, nesting,
huge numbers, NaN, deep structures, wrong kinds, and real records with fields replaced by
values of the wrong type or removed. Every outcome is records (which write back and read
again unchanged) or a ``RecordError`` in one line naming file:line, never another exception,
within a deadline per case. The fast variant runs in the default suite; the slow one (CI)
runs at least 2000 cases of each property."""

from __future__ import annotations

import json
import re
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree.records import Record, RecordError, RecordWarning, from_dict, read_records
from perf.test_scenario_fuzz import _DELETE, _paths, _set, check_outcome, run_estimate

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE_FILES = [
    ROOT / "measurements" / "cpu" / "engine_modes.jsonl",  # schema 2 engine_run, bandwidth
    ROOT / "tests" / "perf" / "data" / "demo_pair_cpu_runs.jsonl",  # schema 1
]
TEMPLATES = [
    json.loads(line)
    for path in TEMPLATE_FILES
    for line in path.read_text().splitlines()[:3]
    if line.strip()
]

DEADLINE = timedelta(seconds=2)  # per case; a case takes milliseconds
FAST = settings(
    max_examples=100,
    deadline=DEADLINE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SLOW = settings(FAST, max_examples=2000)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**62, max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["", "engine_run", "bench_bandwidth", "acceptance", "ddtree", "cpu"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _dumps(value) -> str:
    return json.dumps(value)  # NaN and Infinity come out as the bare words Python accepts


@st.composite
def raw_tokens(draw) -> str:
    """A JSON text no json.dumps makes: numbers past any float or the int parser's digits,
    nesting deeper than the parser's recursion, bare NaN."""
    kind = draw(st.sampled_from(["digits", "exponent", "deep_list", "deep_object", "nan"]))
    if kind == "digits":
        return "1" * draw(st.integers(300, 6000))
    if kind == "exponent":
        return f"1e{draw(st.integers(300, 100_000))}"
    if kind == "nan":
        return draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
    depth = draw(st.integers(10, 50_000))
    if kind == "deep_list":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


_RAW = "\x00raw\x00"  # a placeholder replaced by a raw token in the dumped text


@st.composite
def mutated(draw, raw_allowed: bool = True):
    """A real record with one to three fields replaced (a random value; in the text, a raw
    token) or removed: (the record, the raw token or None)."""
    record = draw(st.sampled_from(TEMPLATES))
    raw = None
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(record))))
        how = draw(st.sampled_from(["value", "value", "delete", "raw" if raw_allowed else "value"]))
        if how == "delete" and path:
            record = _set(record, path, _DELETE)
        elif how == "raw" and raw is None:
            raw = draw(raw_tokens())
            record = _set(record, path, _RAW)
        else:
            record = _set(record, path, draw(json_values))
    return record, raw


def _text(mutation) -> str:
    record, raw = mutation
    text = _dumps(record)
    return text.replace(json.dumps(_RAW), raw) if raw is not None else text


lines = st.one_of(
    json_values.map(_dumps),
    raw_tokens(),
    mutated().map(_text),
    st.sampled_from(TEMPLATES).map(_dumps),
    st.text(max_size=40).map(lambda t: t.replace("\n", " ")),
)


def _check_read(path: Path, texts: list[str]) -> None:
    path.write_text("".join(t + "\n" for t in texts), encoding="utf-8", errors="surrogatepass")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = read_records(path)
        except RecordError as exc:
            message = str(exc)
            assert "\n" not in message, message
            assert re.match(rf"{re.escape(str(path))}:(\d+: |\s)", message), message
            assert len(message) < 1000, message
            got = None
    assert all(issubclass(w.category, RecordWarning) for w in caught), caught
    for record in got or []:
        assert isinstance(record, Record)
        again = from_dict(json.loads(record.to_json()), "again")  # writes back, reads the same
        assert again == record


@pytest.fixture(scope="module")
def fuzz_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "records.jsonl"


@FAST
@given(texts=st.lists(lines, min_size=1, max_size=3))
def test_reading_random_lines_gives_records_or_one_line_error(fuzz_file, texts):
    _check_read(fuzz_file, texts)


@pytest.mark.slow
@SLOW
@given(texts=st.lists(lines, min_size=1, max_size=3))
def test_reading_random_lines_gives_records_or_one_line_error_many(fuzz_file, texts):
    _check_read(fuzz_file, texts)


def _check_from_dict(value) -> None:
    try:
        record = from_dict(value, "file.jsonl:7")
    except RecordError as exc:
        assert str(exc).startswith("file.jsonl:7: ") and "\n" not in str(exc), str(exc)
        return
    assert from_dict(json.loads(record.to_json()), "again") == record


@FAST
@given(value=json_values | mutated(raw_allowed=False).map(lambda m: m[0]))
def test_from_dict_of_any_value_gives_a_record_or_one_line_error(value):
    _check_from_dict(value)


@pytest.mark.slow
@SLOW
@given(value=json_values | mutated(raw_allowed=False).map(lambda m: m[0]))
def test_from_dict_of_any_value_gives_a_record_or_one_line_error_many(value):
    _check_from_dict(value)


@pytest.mark.parametrize(
    "text, expect",
    [
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
        ('{"kind": ' + "[" * 100 + "]" * 100 + "}", "JSON nested too deeply (over 64 levels)"),
        ('{"kind": ' + "1" * 5000 + "}", "not valid JSON"),
        ('{"kind": NaN}', "not valid JSON (NaN"),
        ('{"x": 1e999}', "not valid JSON (1e999"),
    ],
    ids=["deeper-than-the-parser", "deep", "digits", "nan", "overflow"],
)
def test_what_the_fuzz_found_is_one_line(tmp_path, text, expect):
    path = tmp_path / "r.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(RecordError, match=re.escape(f"{path}:1: {expect}")):
        read_records(path)


# ---- the estimator on random records: anchors, this machine, the backtest ------------------


def _check_estimate(path: Path, texts: list[str], backtest: bool) -> None:
    """``ddtree estimate --records`` (or ``--backtest``) on the lines: a result or exactly one
    error line naming the file (a skipped line's one-line warning aside), never a traceback."""
    path.write_text("".join(t + "\n" for t in texts), encoding="utf-8", errors="surrogatepass")
    argv = ["--backtest", str(path)] if backtest else ["--records", str(path)]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code, errors, stdout = run_estimate(argv, [path])
    if backtest:  # a table or "found no engine_run records to hold out", not the estimate's JSON
        assert code in (0, 2) and len(errors) <= 1, (code, errors)
        assert code == 0 or any(s in errors[0] for s in (str(path), "records", "no engine_run"))
        return
    check_outcome(code, errors, stdout, [str(path), "records"])


record_lines = st.lists(
    st.one_of(mutated().map(_text), st.sampled_from(TEMPLATES).map(_dumps), raw_tokens()),
    min_size=1,
    max_size=4,
)


@FAST
@given(texts=record_lines, backtest=st.booleans())
def test_estimating_on_random_records_gives_a_result_or_one_line_error(fuzz_file, texts, backtest):
    _check_estimate(fuzz_file, texts, backtest)


@pytest.mark.slow
@SLOW
@given(texts=record_lines, backtest=st.booleans())
def test_estimating_on_random_records_gives_a_result_or_one_line_error_many(
    fuzz_file, texts, backtest
):
    _check_estimate(fuzz_file, texts, backtest)
