"""The standard streams of a ``ddtree`` command, made safe at its start (``prepare``).

- Text the terminal's encoding cannot hold (``µ`` or ``—`` under ``LC_ALL=C`` or a latin-1
  locale) is written with replacement characters (``?``) instead of stopping the command
  half-way with a ``UnicodeEncodeError``. Files are always read and written as UTF-8,
  whatever the locale (every ``open``/``read_text``/``write_text`` names its encoding).
- A stream closed before the command started (``>&-``, ``<&-``) is refused when it is used,
  as one line (``stdout: Bad file descriptor; ...``), not as an ``AttributeError`` on
  ``None``, and not silently (Python drops writes to a missing stdout: the answer was lost
  and the command exited 0). The closed descriptor is held open on ``/dev/null`` so that the
  next file the command opens cannot take its number (a library writing to fd 1 would then
  write into a record file).
- A stdout whose reader has gone (``ddtree generate | head -c 5``): ``broken_stdout`` says
  so, and ``quiet_broken_stdout`` points it at ``/dev/null`` so that the interpreter's last
  flush prints nothing; the command then exits 141, as a program killed by ``SIGPIPE`` does
  in a shell (``yes | head``), with nothing on stderr.
"""

from __future__ import annotations

import errno
import io
import os
import select
import signal
import sys

# the status a shell gives a program that SIGPIPE ended: 128 + 13
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE


class ClosedStream(io.TextIOBase):
    """A standard stream that was closed when the command started: every read or write is an
    ``OSError`` naming it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _closed(self, *_args, **_kwargs):
        raise OSError(
            errno.EBADF, f"{os.strerror(errno.EBADF)}; it was closed when ddtree started", self.name
        )

    write = read = readline = _closed

    @property
    def buffer(self):
        self._closed()

    def isatty(self) -> bool:
        return False

    def flush(self) -> None:  # nothing was written
        pass


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def prepare() -> None:
    """At the start of a command run from the command line: closed standard streams held on
    ``/dev/null`` and refused when used; unencodable output replaced, not fatal."""
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        if _fd_open(fd):
            continue
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if name == "stderr":  # notes and errors have nowhere to go (print(file=None) would
            # write them to stdout, into the answer)
            sys.stderr = open(fd, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        else:
            setattr(sys, name, ClosedStream(name))
    # Under the C locale Python's own choice is surrogateescape, which stops at "µ" as strict
    # does; an explicit PYTHONIOENCODING=...:backslashreplace is kept.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors in ("strict", "surrogateescape"):
            try:
                stream.reconfigure(errors="replace")
            except (ValueError, OSError):  # already written to in another way: keep it
                pass


def broken_stdout() -> bool:
    """Whether stdout is a pipe that nobody reads any more."""
    try:
        fd = sys.__stdout__.fileno() if sys.__stdout__ is not None else 1
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def quiet_broken_stdout() -> None:
    """Point stdout at ``/dev/null``: what is still buffered for it goes nowhere, quietly
    (Python's own flush at exit would print ``Exception ignored ... BrokenPipeError``)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, sys.__stdout__.fileno() if sys.__stdout__ is not None else 1)
    finally:
        os.close(null)
