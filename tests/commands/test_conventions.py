"""What every command shares: one default thread count, said in the output; one meaning per
flag name and one spelling per dtype; defaults in every --help; vLLM's names as aliases;
stdout that holds either the tables or one JSON document; progress on stderr without a
terminal."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from ddtree.cli import COMMANDS, HelpFormatter, build_parser, main
from ddtree.commands import _args, _output


def _command_parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser(list(path))
    for word in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _options(path):
    """The options a user sees in ``--help`` (aliases and renamed flags are hidden)."""
    for action in _command_parser(path)._actions:
        if action.option_strings and action.help is not argparse.SUPPRESS:
            if not isinstance(action, argparse._HelpAction):
                yield action


PATHS = [path for path, _, _ in COMMANDS]


@pytest.mark.parametrize("path", PATHS, ids=" ".join)
def test_every_option_is_explained_and_shows_its_default(path):
    formatter = _command_parser(path)._get_formatter()  # the one --help uses
    for action in _options(path):
        name = f"{' '.join(path)} {action.option_strings[0]}"
        assert action.help, f"{name}: no help"
        if action.default is not None and action.default is not False and action.default != []:
            assert "default" in formatter._get_help_string(action), name


def test_the_formatter_shows_lists_and_zeros_and_skips_what_has_no_default():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--budgets", default=[8, 16], help="budgets")
    p.add_argument("--top-k", default=0, help="sampling top-k (0: off)")
    p.add_argument("--records", help="a file")
    p.add_argument("--json", action="store_true", help="JSON")
    p.add_argument("--rate", default=0.5, help="a rate (default: half)")
    text = " ".join(p.format_help().split())
    assert "budgets (default: 8,16)" in text and "(0: off) (default: 0)" in text
    assert "a file --json" in text and "JSON --rate" in text  # nothing appended
    assert "(default: half)" in text and "(default: half) (default" not in text


def test_threads_default_to_one_or_omp_num_threads_in_every_command(monkeypatch):
    import torch

    with_threads = [p for p in PATHS if any("--threads" in a.option_strings for a in _options(p))]
    assert len(with_threads) >= 14  # every command that runs torch
    for path in with_threads:
        (action,) = [a for a in _options(path) if "--threads" in a.option_strings]
        assert action.default is None and "else 1" in action.help, path
    before = torch.get_num_threads()
    try:
        args = argparse.Namespace(threads=None)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert _args.set_threads(args) == 1 and torch.get_num_threads() == 1
        assert _args.threads_label(args) == "1 thread (default; --threads N for more)"
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert _args.chosen_threads(None) == 2
        assert _args.set_threads(args) == 2 and _args.threads_label(args) == (
            "2 threads ($OMP_NUM_THREADS)"
        )
        monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # a nested setting: not one count
        assert _args.chosen_threads(None) == 1
        assert _args.chosen_threads(3) == 3 and _args.chosen_threads(0) == 0
        args.threads = 1
        _args.set_threads(args)
        assert _args.threads_label(args) == "1 thread (--threads)"
        args.threads = 0
        assert _args.threads_label(args).endswith("(torch's default, --threads 0)")
    finally:
        torch.set_num_threads(before)


def test_engine_run_records_store_the_threads_they_ran_with(tmp_path):
    import torch
    from tests.engine.helpers import tiny_mla_target

    from ddtree.engine import DecodeConfig, engine_run_record, generate
    from ddtree.records import read_records, write_records

    target = tiny_mla_target(seed=0)
    result = generate(target, None, [1, 2, 3], DecodeConfig("ar", max_new_tokens=4))
    record = engine_run_record([result], DecodeConfig("ar", max_new_tokens=4), target.info, None)
    write_records(tmp_path / "r.jsonl", [record])
    (back,) = read_records(tmp_path / "r.jsonl")
    assert back.threads == torch.get_num_threads() and back.config["threads"] == back.threads


def test_one_spelling_per_dtype():
    assert [_args.dtype_name(x) for x in ("bf16", "BFloat16", "fp16", "half", "fp32")] == [
        "bfloat16",
        "bfloat16",
        "float16",
        "float16",
        "float32",
    ]
    with pytest.raises(argparse.ArgumentTypeError, match="float32, bfloat16, float16, got 'fp8'"):
        _args.dtype_name("fp8")
    for path in PATHS:
        for action in _options(path):
            if "--dtype" in action.option_strings:
                assert action.type is _args.dtype_name and action.default in _args.DTYPE_NAMES
    assert build_parser(["bench", "allreduce"]).parse_args(
        ["bench", "allreduce", "--dtype", "bf16"]
    ).dtype == ("bfloat16")


def test_top_k_means_sampling_top_k_wherever_it_is_accepted(capsys):
    for path in PATHS:
        for action in _options(path):
            if "--top-k" in action.option_strings:
                assert "sampling top-k" in action.help, path
    for argv, new in (
        (["replay", "record", "--top-k", "64"], "--candidates"),
        (["bench", "moe", "--top-k", "2"], "--experts-per-token"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--top-k is now {new} here" in err
        assert err.count("\n") == 1


def test_vllm_names_are_aliases_and_errors_name_what_was_typed(capsys):
    parser = build_parser(["generate"])
    argv = ["generate", "--prompt", "x", "--model", "ckpt", "--tensor-parallel-size", "2"]
    args = parser.parse_args(argv)
    assert (args.target, args.tp) == ("ckpt", 2)
    assert parser.parse_args(["generate", "--prompt", "x"]).tp == 1  # the alias sets no default
    help_text = " ".join(_command_parser(("generate",)).format_help().split())
    assert "also --model" in help_text and "also --tensor-parallel-size" in help_text
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--tensor-parallel-size", "0"])
    assert "argument --tensor-parallel-size: expected an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "allreduce", "--tp", "1"])
    assert "argument --tp: expected" in capsys.readouterr().err


def test_json_has_one_meaning_and_never_mixes_with_tables(tmp_path):
    """``bench tree`` as a user runs it, stdout a pipe: the tables in full width (not cut at
    80 columns), no JSON among them; with --json, one JSON document alone."""
    for path in PATHS:
        for action in _options(path):
            if "--json" in action.option_strings and path != ("bench", "shapes"):
                assert isinstance(action, argparse._StoreTrueAction), path
                assert action.help.startswith("print one JSON document to stdout instead")
    cmd = [sys.executable, "-m", "ddtree", "bench", "tree", "--blocks", "4", "--budgets", "8"]
    cmd += ["--vocab", "64", "--batch", "2", "--repeats", "2", "--threads", "1"]
    env_free = {"env": {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}}
    human = subprocess.run(cmd, capture_output=True, text=True, check=True, **env_free)
    lines = human.stdout.splitlines()
    assert not any(line.lstrip().startswith("{") for line in lines)
    header = next(line for line in lines if "builder" in line)
    for col in ("top-k ms", "build+layout", "accept", "vs python"):
        assert col in header  # one line: the table was not squeezed to 80 columns
    assert len(header) > 80 and "…" not in human.stdout
    assert "1 thread (--threads)" in human.stdout
    doc = subprocess.run([*cmd, "--json"], capture_output=True, text=True, check=True).stdout
    assert json.loads(doc)["bench"] == "tree"


def test_progress_without_a_terminal_is_lines_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(_output, "LINE_EVERY_S", 0.0)
    with _output.progress("decoding", total=2) as bar:
        bar.announce("compiling ar")
        bar.advance("prompt 1")
        bar.advance("prompt 2")
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert out.out == ""
    assert [x.split(" (")[0] for x in lines] == [
        "decoding 0/2: compiling ar",
        "decoding 1/2: prompt 1",
        "decoding 2/2: prompt 2",
    ]
    monkeypatch.setattr(_output, "LINE_EVERY_S", 3600.0)  # a quick phase prints nothing
    with _output.progress("loading models"):
        pass
    with _output.progress("decoding", total=2) as bar:
        bar.advance("prompt 1")
        bar.advance("prompt 2")
    assert capsys.readouterr().err == ""


def test_a_dtype_other_than_the_checkpoints_is_said_not_silent(capsys):
    """The bundled target stores bfloat16 weights; the default --dtype float32 says so."""
    from ddtree.cli import main

    assert main(["generate", "--prompt", "def f(", "--max-new-tokens", "2"]) == 0
    assert "stores bfloat16 weights; they run as float32 (--dtype)" in capsys.readouterr().err
    assert main(["generate", "--prompt", "def f(", "--max-new-tokens", "2", "--dtype", "bf16"]) == 0
    assert "they run as" not in capsys.readouterr().err
