"""A rank that dies, stalls, or never joins fails the group with a clear error, not a hang
(own groups: one torch.distributed group per process, so not beside test_parallel_group)."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch

from ddtree.commands._decode import DEMO_DIR
from ddtree.distributed import join_launched_group
from ddtree.errors import DistributedError
from ddtree.models.adapters.parallel import load_parallel_target

TARGET = DEMO_DIR / "target"
TIMEOUT_S = 60.0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_dead_or_stalled_rank_is_a_clear_error(how):
    """SIGKILL of rank 1: the next call fails at once, naming its exit code. SIGSTOP: it fails
    after the collective timeout, saying so."""
    timeout_s = 3.0 if how == "stalls" else TIMEOUT_S
    target = load_parallel_target(TARGET, tp=2, timeout_s=timeout_s)
    follower = target.group.processes[0]
    prompt = torch.arange(3, 20)
    target.prefill(prompt)
    os.kill(follower.pid, signal.SIGKILL if how == "dies" else signal.SIGSTOP)
    start = time.monotonic()
    expected = "rank 1 exited with code -9" if how == "dies" else "past the 3 s collective timeout"
    with pytest.raises(DistributedError, match=expected):
        target.reset()
        target.prefill(prompt)
    assert time.monotonic() - start < timeout_s + 10
    if how == "stalls":
        os.kill(follower.pid, signal.SIGKILL)
    target.close()
    assert not follower.is_alive()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launcher_world_size_must_equal_tp(monkeypatch):
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(DistributedError, match="WORLD_SIZE=3 .* --tp 2.* --nproc-per-node 2"):
        join_launched_group(2)


@pytest.mark.slow
def test_a_missing_rank_is_a_timeout_not_a_hang(monkeypatch):
    """Rank 0 of a 2-rank launch whose rank 1 never comes: an error after the timeout."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    start = time.monotonic()
    with pytest.raises(DistributedError, match="did not form within 1 s"):
        join_launched_group(2, timeout_s=1.0, ready_timeout_s=1.0)
    assert time.monotonic() - start < 10
