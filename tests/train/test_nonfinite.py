"""A learning rate that blows the weights up stops training at the first non-finite loss or
weight, with one line naming the step and --lr, and saves nothing of the broken model."""

from __future__ import annotations

import pytest
import torch

from ddtree.cli import main
from ddtree.train.loop import NonFiniteTraining
from ddtree.train.target import TargetTrainConfig, train_target


def _cfg(**changes) -> TargetTrainConfig:
    base = dict(steps=3, batch_size=2, seq_len=32, lr=1e30, warmup_steps=0, vocab_size=300,
                max_files=5, log_every=1, eval_windows=1)  # fmt: skip
    return TargetTrainConfig(**{**base, **changes})


def test_a_huge_lr_stops_at_the_first_nan_and_saves_no_checkpoint(tiny_shape, tmp_path):
    torch.set_num_threads(1)
    with pytest.raises(NonFiniteTraining, match=r"target step \d: .* \(--lr 1e\+30\)"):
        train_target(_cfg(), tmp_path, shape=tiny_shape, show_progress=False)
    assert not (tmp_path / "checkpoint").exists()
    assert not list(tmp_path.glob("*.safetensors"))  # no exported model either


def test_the_command_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DDTREE_DEBUG", raising=False)
    out = tmp_path / "out"
    argv = ["train", "target", "--lr", "1e30", "--steps", "3", "--max-files", "5",
            "--batch-size", "2", "--seq-len", "32", "--vocab-size", "300",
            "--warmup-steps", "0", "--out", str(out), "--no-progress", "--threads", "1"]  # fmt: skip
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--lr 1e+30" in err[0] and "step" in err[0], err
    assert "Traceback" not in err[0]
    assert not (out / "checkpoint").exists() and not (out / "model.safetensors").exists()
