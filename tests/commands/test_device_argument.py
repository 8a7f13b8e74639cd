"""``--device``: the one argparse type every command uses (``ddtree.commands._args.device``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from ddtree.commands._args import device, machine_devices


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine where torch sees two CUDA devices."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def _refusal(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        parse(text)
    return str(exc.value)


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "an empty device"),
        ("bogus", "not a torch device"),
        ("meta", "hold no data"),
        ("cuda:", "not a torch device"),
    ],
)
def test_strings_that_are_no_device_anywhere(text, why):
    message = _refusal(device(), text)
    assert why in message and f"got {text!r}" in message
    assert "this machine has (cpu" in message


def test_cpu_is_accepted_without_asking_torch(monkeypatch):
    monkeypatch.setattr(torch, "device", None)  # the default must not need torch
    assert device()("cpu") == "cpu"
    assert device(auto=True)("auto") == "auto"


def test_cuda_on_a_machine_without_it_lists_what_it_has(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = _refusal(device(), "cuda")
    assert "this machine has (cpu)" in message
    assert "without CUDA" in message or "no CUDA device" in message


def test_an_index_past_the_gpus_names_how_many_there_are(two_gpus):
    assert machine_devices()[:3] == ["cpu", "cuda:0", "cuda:1"]
    assert device()("cuda:1") == "cuda:1"
    assert device()("cuda") == "cuda"
    message = _refusal(device(), "cuda:7")
    assert "torch sees 2 CUDA devices" in message
    assert "(cpu, cuda:0, cuda:1" in message


def test_a_command_that_takes_cpu_or_cuda_only(two_gpus):
    parse = device(("cpu", "cuda"), auto=True, indexed=False)
    assert parse("cuda") == "cuda"
    assert "without an index" in _refusal(parse, "cuda:0")
    assert "(auto, cpu, cuda)" in _refusal(parse, "mps")
    assert "runs on cpu or cuda" in _refusal(parse, "xpu")


def test_argparse_names_the_argument():
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--device", type=device(), default="cpu")
    assert parser.parse_args([]).device == "cpu"
    with pytest.raises(argparse.ArgumentError, match="argument --device: expected a device"):
        parser.parse_args(["--device", "bogus"])


def test_allreduce_on_cuda_needs_a_gpu_per_rank_before_the_group_forms(two_gpus, capsys):
    from ddtree.cli import main

    assert main(["bench", "allreduce", "--tp", "4", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--tp 4 --device cuda: 4 ranks on this host need a GPU each and it has 2" in err
