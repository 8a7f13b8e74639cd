"""Output files written safely, one way for every writer (records, traces, checkpoints,
reports).

- ``check_output_file(path, what)``: what a writer would refuse, checked before any work, so
  a bad output path fails at the start of a run and not after it. Only regular files are
  written: an existing folder, device node, named pipe (FIFO) or socket is refused, and so is
  a read-only file (its mode says "keep this"). A symlink is followed, as a shell's ``>`` and
  ``>>`` follow it: its target is checked and written, the link stays a link; a dangling link
  is refused, and so is a symlink loop (``ln -s loop loop``). A missing file is fine when its nearest existing parent is a writable folder
  (the writers create the folders between).
- ``check_output_folder(path, what)``: the same for a folder a command writes files into.
- ``check_input_file(path, what)`` and ``read_input_bytes(path, what, limit)``: a file to
  read must be a regular file, checked before it is opened (a FIFO would block the reader
  forever, ``/dev/zero`` would fill the memory); ``limit`` caps how much is read.
- ``replace_atomically(path)``: a temporary file beside the target; after the caller has
  written it, it takes the old file's mode and is renamed over the target in a section no
  signal cuts in half (``ddtree.signals.deferred``). If writing fails (a full disk, an
  interrupt), the temporary file is removed and the old file is left as it was; an
  ``OSError`` then says so in one line (``file: No space left on device; ... as it was``).
- ``write_safetensors(tensors, path)``: safetensors' ``save_file`` with its I/O errors as
  ``OSError`` (it raises its own exception type, naming the errno only in its text).
- ``staging_folder(out)`` and ``publish(folder, out)``: files written into a temporary folder
  inside ``out``, then moved into ``out`` one rename each in one deferred section (an
  exported model: config, weights, metadata).

Stdlib only at import (``write_safetensors`` imports safetensors when called).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ddtree.signals import deferred

_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _refuse(path: Path, why: str, what: str) -> OSError:
    return OSError(errno.EINVAL, f"{why}; expected {what}", str(path))


def resolve_output(path: str | os.PathLike, what: str) -> Path:
    """``path`` with a symlink followed to its target (a dangling one refused)."""
    path = Path(path)
    if path.is_symlink():
        try:
            target = path.resolve()
        except (OSError, RuntimeError):  # RuntimeError: pathlib's "Symlink loop" (3.11)
            raise _refuse(path, "is a symlink loop (following it never ends)", what) from None
        if _loops(target):
            raise _refuse(path, "is a symlink loop (following it never ends)", what)
        if not target.exists():
            raise _refuse(path, f"is a symlink to {target}, which does not exist", what)
        return target
    return path


def _loops(path: Path) -> bool:
    """Whether following ``path`` (or a folder on the way) goes round a symlink loop."""
    try:
        path.stat()
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def check_output_file(path: str | os.PathLike, what: str = "a regular file to write") -> Path:
    """The file a writer may write at ``path`` (a symlink followed); an ``OSError`` naming the
    path and ``what`` was expected otherwise. Creates nothing."""
    path = resolve_output(path, what)
    try:
        st = path.stat()
    except FileNotFoundError:
        _check_new(path, what)
        return path
    kind = _KINDS.get(stat.S_IFMT(st.st_mode))
    if kind is not None:
        raise _refuse(path, f"is {kind}", what)
    if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(
        path, os.W_OK
    ):
        raise _refuse(path, f"is read-only (mode {stat.S_IMODE(st.st_mode):04o})", what)
    return path


def check_output_folder(path: str | os.PathLike, what: str = "a folder to write into") -> Path:
    """A folder a writer may create files in: an existing writable folder, or a path whose
    nearest existing parent is one. Creates nothing."""
    path = resolve_output(path, what)
    if path.exists():
        if not path.is_dir():
            raise _refuse(path, "is not a folder", what)
        if not os.access(path, os.W_OK | os.X_OK):
            raise _refuse(path, "is a read-only folder", what)
        return path
    _check_new(path, what)
    return path


def _check_new(path: Path, what: str) -> None:
    parent = path.parent
    while not parent.exists():
        if parent.is_symlink():  # a dangling link on the way
            raise _refuse(path, f"{parent} is a symlink to nowhere", what)
        parent = parent.parent
    if not parent.is_dir():
        raise _refuse(path, f"{parent} is not a folder", what)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _refuse(path, f"its folder {parent} is not writable", what)


def check_input_file(path: str | os.PathLike, what: str = "a regular file to read") -> Path:
    """``path`` when it is a regular file (a symlink followed), checked without opening it: a
    named pipe (FIFO) would block the reader until a writer comes, and a device may never end
    (``/dev/zero``), so a folder, FIFO, device, socket or symlink loop is an ``OSError``
    naming the path and ``what`` was expected. A missing file is ``FileNotFoundError``."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "is a symlink loop (following it never ends)", what) from None
        raise
    kind = _KINDS.get(stat.S_IFMT(st.st_mode))
    if kind is not None:
        raise _refuse(path, f"is {kind}", what)
    return path


def read_input_bytes(
    path: str | os.PathLike, what: str = "a regular file to read", limit: int | None = None
) -> bytes:
    """The bytes of the regular file ``path`` (``check_input_file``), at most ``limit`` of
    them: a longer file is an ``OSError`` naming it, read no further than the limit. Opened
    without blocking and checked again once open, so a FIFO put there in between is refused
    too."""
    path = check_input_file(path, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refuse(path, "is not a regular file", what)
        os.set_blocking(fd, True)
        data = fh.read() if limit is None else fh.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise _refuse(path, f"is larger than {limit:,} bytes", what)
    return data


def failed_write(exc: OSError, path: Path, doing: str, kept: str) -> OSError:
    """``exc`` as one line naming ``path``: what failed, and what was left as it was."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return OSError(exc.errno, f"{reason} while {doing}; {kept}", str(path))


@contextmanager
def replace_atomically(
    path: str | os.PathLike,
    what: str = "a regular file to write",
    on_replaced: Callable[[Path], None] | None = None,
) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (a symlink followed) for the caller to write;
    on success it replaces ``path`` (keeping its mode), on any failure it is removed and
    ``path`` is as it was. Creates the parent folders. ``on_replaced(path)`` runs in the same
    section as the replace, so a signal cannot fall between the file appearing and the caller
    counting it (``ddtree.signals.keep``)."""
    target = check_output_file(path, what)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    existed = target.exists()
    try:
        yield partial
        if existed:
            shutil.copymode(target, partial)
        with deferred():
            os.replace(partial, target)
            if on_replaced is not None:
                on_replaced(target)
    except OSError as exc:
        kept = "the old file is as it was" if existed else "nothing was written there"
        raise failed_write(exc, target, "writing it", kept) from None
    finally:
        partial.unlink(missing_ok=True)


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file``, raising ``OSError`` (errno and reason) when the disk
    fails it, as ``open().write`` would."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        match = _OS_ERROR.search(str(exc))
        if match is None:
            raise
        code = int(match.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


@contextmanager
def staging_folder(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder inside ``out`` (created) for files that ``publish`` then moves into
    ``out``; removed on exit, whatever happened."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    folder = out / f".partial-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def publish(folder: Path, out: Path) -> list[Path]:
    """Move every file of ``folder`` into ``out``, one rename each, in one deferred section
    (a signal waits until all are in place). Returns the paths written."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    targets = [check_output_file(out / name) for name in names]
    with deferred():
        for name, target in zip(names, targets, strict=True):
            os.replace(folder / name, target)
    return [out / name for name in names]
