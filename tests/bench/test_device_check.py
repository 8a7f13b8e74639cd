"""The prepared device check (scripts/device_check.sh) runs end to end on a CPU with --smoke:
every step passes and leaves its records, in the flat folder the device tool brings back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.sh"


@pytest.mark.slow
def test_device_check_smoke_runs_every_step_and_writes_their_records(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, DEVICE_CHECK_SECONDS="400")
    done = subprocess.run(
        [str(SCRIPT), str(out), "--smoke"], env=env, capture_output=True, text=True, timeout=600
    )
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, summary + (out / "log.txt").read_text()[-3000:]
    steps = {line.split(":")[0] for line in summary.splitlines() if ": ok" in line}
    assert steps >= {"env", "bandwidth", "shapes-tiny-qwen3", "tree", "attention", "demo"}
    kinds = [json.loads(line)["kind"] for line in (out / "records.jsonl").read_text().splitlines()]
    assert {"bench_bandwidth", "engine_run", "bench_tree", "bench_attention"} <= set(kinds)
    shapes = json.loads((out / "shapes-tiny-qwen3.json").read_text().splitlines()[-1])
    assert shapes["synthetic_drafter"] and {r["policy"] for r in shapes["rows"]} == {
        "ar",
        "chain",
        "ddtree",
    }
    # what the device tool brings back: at most 8 files, no subfolders
    files = list(out.iterdir())
    assert len(files) <= 8 and all(f.is_file() for f in files)
    assert done.stdout.startswith("env: ok")


def test_device_check_refuses_an_unknown_mode(tmp_path):
    done = subprocess.run([str(SCRIPT), str(tmp_path), "--fast"], capture_output=True, text=True)
    assert done.returncode == 2 and "expected --smoke or nothing, got --fast" in done.stderr
