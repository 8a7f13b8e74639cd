"""Where a command's output goes, the same in every command.

- stdout holds the answer: tables and result lines, or with ``--json`` one JSON document and
  nothing else. On a terminal, tables fit its width; written to a file or a pipe, they are
  never cut (rich's non-terminal default is 80 columns, which squeezed cells to ``ddtr…``).
- stderr holds progress, notes and warnings. On a terminal, progress is a live bar; without
  one (a log file, CI), it is a line per item at most every ``LINE_EVERY_S`` seconds (so a
  quick command prints none), a line when a phase that can take long starts (compiling), and
  the last item's or the phase's end once any line was printed or the phase took that long.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

# The width of a non-terminal console: no table or line here comes near it, so nothing is
# cut or wrapped. COLUMNS, when set, still wins (rich reads it).
PIPE_WIDTH = 10_000
LINE_EVERY_S = 5.0  # progress lines without a terminal: enough to see it move, few in a log


def console(stderr: bool = False):
    """A rich Console on stdout (default) or stderr that cuts nothing when not a terminal."""
    from rich.console import Console

    out = Console(stderr=stderr, highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = PIPE_WIDTH
    return out


class Tracker:
    """Progress of one phase of work: ``advance`` after each item, ``announce`` when an item
    that may take long starts (a line even without a terminal), ``update`` to relabel."""

    def __init__(self, what: str, total: int | None, bar=None, task=None) -> None:
        self.what, self.total, self.done = what, total, 0
        self._bar, self._task = bar, task
        self._start = self._last_line = time.perf_counter()
        self._lines = 0

    def _line(self, label: str) -> None:
        count = f" {self.done}/{self.total}" if self.total is not None else ""
        elapsed = time.perf_counter() - self._start
        print(f"{self.what}{count}: {label} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
        self._last_line = time.perf_counter()
        self._lines += 1

    def _due(self) -> bool:
        return time.perf_counter() - self._last_line >= LINE_EVERY_S

    def update(self, label: str, advance: int = 0) -> None:
        self.done += advance
        if self._bar is not None:
            self._bar.update(self._task, advance=advance, description=label)
            return
        last = self.total is not None and self.done >= self.total
        if self._due() or (last and self._lines):
            self._line(label)

    def finish(self) -> None:
        """Without a terminal: the phase's end, when it printed lines or took a while."""
        if self._bar is None and (self._lines or self._due()) and self.total is None:
            self._line("done")

    def advance(self, label: str) -> None:
        self.update(label, advance=1)

    def announce(self, label: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=label)
        else:
            self._line(label)


@contextmanager
def progress(what: str, total: int | None = None) -> Iterator[Tracker]:
    """Progress on stderr for ``total`` items (None: no count, a status line)."""
    err = console(stderr=True)
    if not err.is_terminal:
        tracker = Tracker(what, total)
        yield tracker
        tracker.finish()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = [SpinnerColumn(), TextColumn(f"{what}: {{task.description}}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=err, transient=True) as bar:
        yield Tracker(what, total, bar, bar.add_task("started", total=total))


def note(text: str) -> None:
    """A line for the user that is not the answer (what was chosen, what was written)."""
    print(text, file=sys.stderr, flush=True)
