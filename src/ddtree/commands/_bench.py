"""What every benchmark command does with its result, in one place: progress while it measures,
then ``--records`` (its records appended), and either one JSON line (``--json``) or its table.
Interrupted (Ctrl-C, SIGTERM) with ``--records``, the points measured so far are appended as a
record marked ``interrupted`` and named (``ddtree.signals.keep``) before the interrupt goes on."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

from ddtree.bench.result import BenchResult
from ddtree.commands._output import Tracker, console, note, progress


def measure(
    args: argparse.Namespace,
    points: Iterable | Callable[[Tracker], Iterable],
    total: int | None,
    label: Callable[[object], str],
    result: Callable[[list], BenchResult],
    title: str = "timing",
) -> BenchResult:
    """``result`` of every point ``points`` yields (``label``: the progress line of each;
    ``total`` None: no count known ahead). ``points`` may be a function of the progress
    tracker, for points that announce their long steps (building a layer, say). Points too few
    for a result (``result`` raises a ValueError) keep no record on an interrupt."""
    from ddtree.signals import keep

    done: list = []
    try:
        with progress(title, total=total) as bar:
            for point in points(bar) if callable(points) else points:
                bar.advance(label(point))
                done.append(point)
    except KeyboardInterrupt:
        if args.records and done:
            try:
                partial = result(done)
            except ValueError:
                raise KeyboardInterrupt from None
            append_record(args.records, partial, f"after {len(done)}{_of(total)} points")
            keep(args.records, f"{partial.what} of the first {len(done)}{_of(total)} points")
        raise
    return result(done)


def _of(total: int | None) -> str:
    return "" if total is None else f" of {total}"


def append_record(path, result: BenchResult, interrupted: str | None = None) -> None:
    """``result`` appended to ``path``, one record (or one per part; ``interrupted``: into
    each one's config), all in one write."""
    from ddtree.provenance import this_hardware, this_process
    from ddtree.records import make_record, write_records

    hardware = this_hardware()
    producer = this_process(f"ddtree {result.kind.replace('_', ' ')}")
    records = []
    for part in result.records:
        config = part.config if interrupted is None else {**part.config, "interrupted": interrupted}
        records.append(make_record(part.kind, hardware, config, part.summary, part.rows, producer))
    write_records(path, records)


def report(args: argparse.Namespace, result: BenchResult, table: Callable[[], object]) -> int:
    """The record (``--records``), then one JSON line (``--json``) or ``table()`` on stdout."""
    import json

    if args.records:
        append_record(args.records, result)
        note(f"wrote {result.what} to {args.records}")
    if args.json:
        print(json.dumps(result.json_document()))
    else:
        console().print(table())
    return 0
