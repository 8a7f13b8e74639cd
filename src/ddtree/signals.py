"""Interrupts lose nothing: SIGINT and SIGTERM end a command the same way, through one
exception, and the CLI says in one line what was kept and where.

- ``handle_signals()`` (the CLI's ``main`` runs every command inside it): SIGINT and SIGTERM
  raise ``Interrupted`` in the main thread. It is a ``KeyboardInterrupt``, so every
  ``finally`` and ``except KeyboardInterrupt`` runs for a ``kill`` (SIGTERM) as for Ctrl-C.
  The CLI exits with ``exit_code``: 128 + the signal's number, 130 for SIGINT and 143 for
  SIGTERM, as a shell reports a process that signal ended.
- ``deferred()``: a section a signal must not cut in half (appending a record, renaming a
  checkpoint's files into place, an optimizer update). A signal that arrives inside is raised
  when the section ends; a second one is raised at once (the user insists).
- ``keep(where, what)``: a command says what it has kept so far (records appended, a
  checkpoint, a partial trace); ``interrupted_line`` names it all in the line the CLI prints.

A signal the process ignores (SIG_IGN: started under ``nohup``, or in the background of a
non-interactive shell) stays ignored. SIGTERM keeps its default in a rank that torchrun
launched (``RANK`` and ``WORLD_SIZE`` set): the launcher ends its ranks with it, and a rank
blocked in a collective would not run a Python handler until the collective returns.

Stdlib only: the CLI imports this before any command.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

LAUNCHER_VARS = ("RANK", "WORLD_SIZE")  # set by torchrun in every rank it starts


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _State:
    installed: bool = False
    depth: int = 0  # nesting of deferred() sections
    pending: int | None = None  # a signal that arrived inside one
    kept: dict[str, str] = field(default_factory=dict)  # where -> what


_state = _State()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise(signum: int, _frame) -> None:
    if _state.depth and _state.pending is None:
        _state.pending = signum
        return
    raise Interrupted(signum)


@contextmanager
def handle_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``Interrupted`` inside; what was kept starts empty. The
    previous handlers come back on exit. Outside the main thread it does nothing (Python runs
    signal handlers there only)."""
    if not _main_thread():
        yield
        return
    signums = [signal.SIGINT]
    if not all(name in os.environ for name in LAUNCHER_VARS):
        signums.append(signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signums}
    _state.installed, _state.depth, _state.pending = True, 0, None
    _state.kept.clear()
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _raise)
    try:
        yield
    finally:
        _state.installed = False
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


@contextmanager
def deferred() -> Iterator[None]:
    """A section no signal cuts in half: one that arrives inside is raised at its end (a
    second one at once). Only under ``handle_signals`` in the main thread; elsewhere the
    section runs as it is (a library caller keeps Python's own SIGINT behaviour)."""
    if not (_state.installed and _main_thread()):
        yield
        return
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if _state.depth == 0 and _state.pending is not None:
            signum, _state.pending = _state.pending, None
            raise Interrupted(signum)


def keep(where: object, what: str) -> None:
    """Record that ``what`` (``"3 engine_run records"``) is kept at ``where`` (a path); a later
    call for the same place replaces it."""
    _state.kept[str(where)] = what


def kept() -> dict[str, str]:
    """where -> what, as ``keep`` was told since ``handle_signals`` started."""
    return dict(_state.kept)


def signal_number(exc: BaseException) -> int:
    """The signal behind an interrupt: ``Interrupted.signum``, SIGINT for a plain
    ``KeyboardInterrupt`` (Python's own SIGINT handler)."""
    return getattr(exc, "signum", signal.SIGINT)


def exit_code(exc: BaseException) -> int:
    """128 + the signal's number: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signal_number(exc))


def interrupted_line(exc: BaseException) -> str:
    """One line: which signal, and what was kept where (or that nothing was)."""
    name = signal.Signals(signal_number(exc)).name
    if not _state.kept:
        return f"interrupted by {name} before any result was written"
    where = "; ".join(f"{what} in {path}" for path, what in _state.kept.items())
    return f"interrupted by {name}: kept {where}"
