"""Fault injection for the writers: a write that fails half-way (the disk full, simulated by
a patched write that puts some bytes down and then raises ENOSPC) leaves the old file as it
was, leaves nothing beside it, and the error says so in one line, as the CLI prints it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from tests.replay.helpers import make_trace

import ddtree.files
from ddtree.cli import _describe
from ddtree.records import BenchBandwidth, HardwareInfo, read_records, write_records
from ddtree.replay.trace import load_trace, save_trace
from ddtree.train.state import TrainState, load_checkpoint, save_checkpoint

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _bw(bytes_per_s: float) -> BenchBandwidth:
    hw = HardwareInfo(cpu_model="test cpu", cpu_cores=2)
    return BenchBandwidth(hardware=hw, device="cpu", method="copy", bytes_per_s=bytes_per_s)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _one_line(exc: OSError) -> str:
    line = f"error: {_describe(exc)}"
    assert "\n" not in line
    return line


@pytest.mark.parametrize("after_bytes", [0, 1, 200, -1], ids=["none", "one", "some", "all-but-one"])
def test_records_append_that_fails_half_way_leaves_the_file_as_it_was(
    tmp_path, monkeypatch, after_bytes
):
    path = tmp_path / "runs.jsonl"
    write_records(path, [_bw(1e10), _bw(2e10)])
    before = _files(tmp_path)
    real_write = os.write

    def disk_full(fd, data):
        cut = len(data) - 1 if after_bytes < 0 else after_bytes
        real_write(fd, bytes(data[:cut]))
        raise ENOSPC

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(OSError) as info:
        write_records(path, [_bw(3e10), _bw(4e10)])
    monkeypatch.undo()
    assert _files(tmp_path) == before
    assert info.value.errno == errno.ENOSPC
    assert _one_line(info.value) == (
        f"error: {path}: No space left on device while appending 2 records; none were "
        "written, the file is as it was"
    )
    assert [r.bytes_per_s for r in read_records(path)] == [1e10, 2e10]


def test_records_append_whose_sync_fails_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    write_records(path, [_bw(1e10)])
    before = path.read_bytes()

    def fails(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", fails)
    with pytest.raises(OSError, match="while appending 1 record; none were written"):
        write_records(path, [_bw(3e10)])
    monkeypatch.undo()
    assert path.read_bytes() == before


def _trace(seed: int):
    g = torch.Generator().manual_seed(seed)
    block, k, n = 4, 3, 6
    logprobs = torch.randn(n - 1, block - 1, k, generator=g).log_softmax(-1)
    tokens = torch.randint(0, 50, (n - 1, block - 1, k), generator=g).tolist()
    return make_trace([1, 2, 3], list(range(10, 10 + n)), logprobs.tolist(), tokens, block)


def _disk_full_after_half(monkeypatch):
    """safetensors' save_file, patched to put half the file down and fail as it does when
    the disk is full (its own exception type, the errno in its text)."""
    import safetensors.torch

    real = safetensors.torch.save_file

    def half(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.torch, "save_file", half)


def test_trace_save_that_fails_half_way_leaves_the_old_trace(tmp_path, monkeypatch):
    path = save_trace(_trace(0), tmp_path / "t.safetensors")
    before = _files(tmp_path)
    _disk_full_after_half(monkeypatch)
    with pytest.raises(OSError) as info:
        save_trace(_trace(1), path)
    monkeypatch.undo()
    assert _files(tmp_path) == before
    assert _one_line(info.value) == (
        f"error: {path}: No space left on device while writing it; the old file is as it was"
    )
    assert torch.equal(load_trace(path).topk_logprobs, _trace(0).topk_logprobs)


def test_trace_save_that_fails_half_way_leaves_no_new_file(tmp_path, monkeypatch):
    _disk_full_after_half(monkeypatch)
    with pytest.raises(OSError, match="while writing it; nothing was written there"):
        save_trace(_trace(1), tmp_path / "new" / "t.safetensors")
    assert _files(tmp_path) == {}


def test_checkpoint_save_that_fails_half_way_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, model, opt, TrainState(step=1, losses=[1.0]), {"a": 1})
    before = _files(tmp_path)
    opt.step()
    calls = []
    real = ddtree.files.write_safetensors

    def second_fails(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:  # the weights are written, the optimizer's moments hit a full disk
            Path(path).write_bytes(b"\0" * 10)
            raise ENOSPC
        real(tensors, path, metadata)

    monkeypatch.setattr("ddtree.train.state.write_safetensors", second_fails)
    with pytest.raises(OSError) as info:
        save_checkpoint(tmp_path, model, opt, TrainState(step=2, losses=[1.0, 0.5]), {"a": 1})
    monkeypatch.undo()
    assert _files(tmp_path) == before  # all three files of step 1, nothing beside them
    assert "No space left on device while writing it; the old file is as it was" in _one_line(
        info.value
    )
    assert load_checkpoint(tmp_path, model, opt, {"a": 1}).step == 1
