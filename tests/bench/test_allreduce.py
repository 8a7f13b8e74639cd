"""`ddtree bench allreduce`: the latency + bandwidth fit, and the command over 2 gloo ranks."""

from __future__ import annotations

import pytest

from ddtree.bench.allreduce import AllreducePoint, fit_allreduce, ring_factor
from ddtree.cli import main
from ddtree.records import BenchAllreduce, read_records


def point(nbytes: int, seconds: float) -> AllreducePoint:
    return AllreducePoint(0, nbytes, seconds, seconds, seconds, nbytes / seconds, 0.0)


def test_fit_worked_example():
    """The docstring's example: (1 KB, 20 µs), (1 MB, 520 µs) at n = 2."""
    fit = fit_allreduce([point(1000, 20e-6), point(1_000_000, 520e-6)], 2)
    assert fit.latency_s == pytest.approx(19.4995e-6, rel=1e-6)
    assert fit.bus_bytes_per_s == pytest.approx(1.998e9, rel=1e-3)
    assert fit.max_rel_error < 1e-9


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_a_ring_all_reduce(n):
    latency, bus = 30e-6, 50e9
    sizes = [14336 * m for m in (1, 4, 16, 64, 256, 1024)]
    pts = [point(b, latency + ring_factor(n) * b / bus) for b in sizes]
    fit = fit_allreduce(pts, n)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6)
    assert fit.bus_bytes_per_s == pytest.approx(bus, rel=1e-6)


def test_fit_keeps_latency_non_negative():
    # times proportional to size and a little below: the free fit would go negative
    fit = fit_allreduce([point(1000, 0.9e-6), point(100_000, 100e-6)], 2)
    assert fit.latency_s == 0.0 and fit.bus_bytes_per_s > 0
    with pytest.raises(ValueError, match=">= 2 message sizes"):
        fit_allreduce([point(1000, 1e-6)], 2)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tp", "1"], "argument --tp: expected an integer >= 2, got '1'"),
        (["--m", "4,4"], "--m needs >= 2 distinct widths"),
        (["--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    try:
        code = main(["bench", "allreduce", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") <= 1


@pytest.mark.slow
def test_bench_allreduce_over_two_ranks_writes_a_record(tmp_path, capsys):
    records = tmp_path / "ar.jsonl"
    # 1 and 2048 rows (14 KB and 29 MB a message): far enough apart that the larger is slower
    # even on a loaded machine (1 and 256 were not, once, under CI's two test processes)
    argv = ["bench", "allreduce", "--m", "1,2048", "--repeats", "3"]
    argv += ["--warmup", "1", "--iters", "2", "--records", str(records), "--json"]
    assert main(argv) == 0
    (rec,) = read_records(records)
    assert isinstance(rec, BenchAllreduce)
    assert (rec.world_size, rec.backend, rec.dtype, rec.hidden_size) == (
        2,
        "gloo",
        "bfloat16",
        7168,
    )
    assert [p["bytes"] for p in rec.points] == [1 * 7168 * 2, 2048 * 7168 * 2]
    assert all(p["seconds"] > 0 for p in rec.points)
    refit = fit_allreduce([AllreducePoint(**p) for p in rec.points], 2)
    assert (refit.latency_s, refit.bus_bytes_per_s) == (rec.latency_s, rec.bus_bytes_per_s)
    assert '"bench": "allreduce"' in capsys.readouterr().out
