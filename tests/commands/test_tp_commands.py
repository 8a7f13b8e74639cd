"""``--tp`` on the commands: spawned by the CLI and launched by torchrun, the DDTree text at
TP = 2 equals the AR text on one process; bad splits fail before any process starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ddtree.cli import main
from ddtree.models import UnsupportedModelError, load_target
from ddtree.records import read_records

PROMPT = "def fibonacci(n):"
ARGS = ["--threads", "1", "--max-new-tokens", "24", "--prompt", PROMPT]


def _run_cli(argv: list[str], launcher: list[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(launcher + argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_generate_under_torchrun_equals_ar(tmp_path, capsys):
    """``torchrun --nproc-per-node 2 -m ddtree generate --tp 2 --ep 2``: DDTree over the
    split target prints the AR text of one process, and its record says tp 2, ep 2. (The
    CLI's own spawning runs the same ``load_parallel_target`` as test_parallel_faults.)"""
    assert main(["generate", "--policy", "ar", *ARGS]) == 0
    ar_text = capsys.readouterr().out
    records = tmp_path / "tp2.jsonl"
    with socket.socket() as sock:  # a free port: torchrun's default one may be another run's
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--master-port", str(port), "-m", "ddtree"]
    argv = ["generate", "--tp", "2", "--ep", "2", "--budget", "8", *ARGS]
    assert _run_cli(argv + ["--records", str(records)], launcher) == ar_text
    (record,) = read_records(records)
    assert (record.config["target"]["tp"], record.config["target"]["ep"]) == (2, 2)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--tp", "3"], "num_attention_heads=4 does not split into 3"),
        (["--tp", "2", "--ep", "4"], "ep=4 must divide tp=2"),
        (["--ep", "2"], "ep=2 must divide tp=1"),
    ],
)
def test_bad_split_is_a_one_line_error(extra, message, capsys):
    assert main(["generate", *extra, *ARGS]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_tp_needs_the_mla_moe_target(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    )
    with pytest.raises(
        UnsupportedModelError, match="split the mla_moe target only.*qwen3.*one process"
    ):
        load_target(tmp_path, tp=2)
