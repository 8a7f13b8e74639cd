"""Files that are not what a command expects (issue 30 item 9), table-driven like
``tests/test_bad_input.py`` (whose ``Case`` and ``run_bad_input`` this reuses): every case
exits 2 with one line on stderr naming the path and what was expected, no traceback, and
leaves every file as it was.

- A symlink loop (``ln -s loop loop``) as the output path of every command that writes a
  file (``--records``, ``--out``, ``--report``): pathlib's ``RuntimeError`` was a traceback.
- A named pipe (FIFO) or a device where a regular file is read (a checkpoint's
  ``model.safetensors``, ``config.json`` or ``tokenizer.json``, a prompt or prompts file, a
  scenario): refused before it is opened. A FIFO named ``model.safetensors`` hung ``generate``
  forever, deaf to SIGTERM; ``--prompt-file /dev/zero`` read until memory ran out.
- ``replay record --out`` an existing file without ``--force``: it was silently replaced.

A case that blocks on a FIFO again fails after ``HANG_S`` seconds instead of hanging the run:
a watchdog process then opens every FIFO here for writing, which lets the blocked open return
(SIGALRM would not: safetensors' open retries on EINTR, and the command catches SIGTERM).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddtree.commands._decode import DEMO_DIR
from test_bad_input import Case, run_bad_input

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "examples" / "seed_kimi_b300.toml"
LOOP = "is a symlink loop"
FIFO = "is a named pipe (FIFO)"
DEVICE = "is a character device"
HANG_S = 120

WRITERS = {  # a command (with what it needs before its output path) -> its output flag
    "generate --prompt hi": "--records",
    "serve --port 0": "--records",
    "demo": "--records",
    "bench engine": "--records",
    "bench shapes": "--records",
    "bench tree": "--records",
    "bench bandwidth": "--records",
    "bench attention": "--records",
    "bench allreduce": "--records",
    "bench linear": "--records",
    "bench moe": "--records",
    "replay record": "--out",
    "replay tau {w}/nowhere.safetensors": "--records",
    "train target": "--out",
    "train drafter": "--out",
    f"estimate {SEED}": "--report",
    f"tune {SEED}": "--report",
}


def _name(command: str) -> str:
    """``bench engine`` -> ``bench-engine``; ``generate --prompt hi`` -> ``generate``."""
    words = command.split()[:2]
    return "-".join(w for w in words if not w.startswith("-") and "/" not in w)


LOOP_CASES = [
    Case(f"{_name(command)}{flag}=loop", f"{command} {flag} {{w}}/loop", (flag, "loop", LOOP))
    for command, flag in WRITERS.items()
]

GEN = "generate --prompt hi --policy ar --max-new-tokens 2"
FILE_CASES = [
    Case("generate--target=fifo-weights", GEN + " --target {w}/t_fifo_weights", ("t_fifo_weights/model.safetensors", FIFO, "expected a regular file")),
    Case("generate--target=fifo-config", GEN + " --target {w}/t_fifo_config", ("t_fifo_config/config.json", FIFO)),
    Case("generate--target=fifo-tokenizer", GEN + " --target {w}/t_fifo_tok", ("t_fifo_tok/tokenizer.json", FIFO)),
    Case("generate--target=weights-loop", GEN + " --target {w}/t_loop_weights", ("t_loop_weights/model.safetensors", LOOP)),
    Case("generate--drafter=fifo-weights", "generate --prompt hi --max-new-tokens 2 --drafter {w}/d_fifo_weights", ("d_fifo_weights/model.safetensors", FIFO)),
    Case("serve--target=fifo-weights", "serve --port 0 --policy ar --target {w}/t_fifo_weights", ("t_fifo_weights/model.safetensors", FIFO)),
    Case("replay-record--drafter=fifo-weights", "replay record --out {w}/work/t.safetensors --drafter {w}/d_fifo_weights", ("d_fifo_weights/model.safetensors", FIFO)),
    Case("generate--prompt-file=fifo", "generate --prompt-file {w}/fifo", ("--prompt-file", "fifo", FIFO)),
    Case("generate--prompt-file=dev-zero", "generate --prompt-file /dev/zero", ("--prompt-file", "/dev/zero", DEVICE)),
    Case("generate--prompt-file=loop", "generate --prompt-file {w}/loop", ("--prompt-file", "loop", LOOP)),
    Case("generate--messages=fifo", "generate --messages {w}/fifo", ("--messages", "fifo", FIFO)),
    Case("replay-record--prompts=fifo", "replay record --prompts {w}/fifo", ("--prompts", "fifo", FIFO)),
    Case("bench-engine--prompts=dev-zero", "bench engine --prompts /dev/zero", ("--prompts", "/dev/zero", DEVICE)),
    Case("estimate-scenario=fifo", "estimate {w}/fifo", ("fifo", FIFO, "expected a TOML scenario file")),
    Case("estimate-scenario=dev-zero", "estimate /dev/zero", ("/dev/zero", DEVICE)),
    Case("estimate-scenario=not-utf8", "estimate {w}/latin1.toml", ("latin1.toml", "not UTF-8")),
    Case("replay-record--out=exists", "replay record --out {w}/work/kept.safetensors", ("--out", "kept.safetensors", "exists", "--force")),
]  # fmt: skip

CASES = LOOP_CASES + FILE_CASES


def _fifo_in(src: Path, dst: Path, name: str) -> None:
    shutil.copytree(src, dst)
    (dst / name).unlink()
    os.mkfifo(dst / name)


@pytest.fixture(scope="module")
def files_world(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("bad_files")
    (w / "loop").symlink_to(w / "loop")
    os.mkfifo(w / "fifo")
    (w / "latin1.toml").write_bytes(b'title = "caf\xe9"\n')
    target, drafter = DEMO_DIR / "target", DEMO_DIR / "drafter"
    _fifo_in(target, w / "t_fifo_weights", "model.safetensors")
    _fifo_in(target, w / "t_fifo_config", "config.json")
    _fifo_in(target, w / "t_fifo_tok", "tokenizer.json")
    _fifo_in(drafter, w / "d_fifo_weights", "model.safetensors")
    shutil.copytree(target, w / "t_loop_weights")
    (w / "t_loop_weights" / "model.safetensors").unlink()
    (w / "t_loop_weights" / "model.safetensors").symlink_to("model.safetensors")
    (w / "work").mkdir()
    (w / "work" / "kept.safetensors").write_bytes(b"a trace someone wants to keep")
    return w


def test_the_table_covers_every_writer_and_reader_with_unique_ids():
    assert len(LOOP_CASES) == len(WRITERS) >= 17
    assert len({c.id for c in CASES}) == len(CASES)


WATCHDOG = """
import os, sys, time
from pathlib import Path
time.sleep(float(sys.argv[2]))
world = Path(sys.argv[1])
(world / "hung").touch()
while True:
    for fifo in world.rglob("*"):
        if fifo.is_fifo():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    time.sleep(0.5)
"""


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_file_that_is_not_a_regular_file_is_one_line(case, files_world, capsys, monkeypatch):
    monkeypatch.chdir(files_world / "work")
    monkeypatch.delenv("DDTREE_DEBUG", raising=False)
    torch.set_num_threads(1)
    argv = case.argv.format(w=files_world).split()
    watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(files_world), str(HANG_S)])
    try:
        run_bad_input(argv, files_world, case.expect, capsys, ignore=("loading the models (",))
    finally:
        watchdog.kill()
        watchdog.wait()
    assert not (files_world / "hung").exists(), f"blocked on a FIFO for {HANG_S} s"


def test_replay_record_force_replaces_an_existing_trace(tmp_path, capsys, monkeypatch):
    from ddtree.cli import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "t.safetensors"
    out.write_bytes(b"old")
    argv = ["replay", "record", "--n-prompts", "1", "--max-new-tokens", "2", "--candidates", "8"]
    assert main([*argv, "--out", str(out), "--force"]) == 0
    assert out.read_bytes() != b"old"
