"""Bad input typed on the command line, table-driven, beside ``test_bad_input.py`` (whose
``Case``, fixture folder ``world`` and checks this file reuses): every case exits 2 with
exactly one line on stderr naming the argument, file or field and what was expected, no
traceback, and leaves every file as it was.

Classes covered (issue 21): ``--device`` strings that are no device here (CUDA on a CPU-only
torch, unknown, empty, ``meta``, an index past the GPUs) in every command that takes one;
prompts, prompt files and messages that are not UTF-8 (undecodable bytes, lone surrogates);
empty policy lists; all-reduce timeouts and message sizes that cannot work; drafter training
with too few new tokens or a target with too few layers; sampling values that underflow
float32; ``--train-budgets`` absent from the records. (A learning rate that turns training
NaN is ``tests/train/test_nonfinite.py``: it writes the tokenizer before it can know.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ddtree.cli import main
from test_bad_input import GEN, Case, _flag, run_bad_input, world  # noqa: F401

# Case.argv is split on spaces; these tokens stand for what a space-split cannot hold.
# <surrogate>: surrogateescape's form of byte 0xff
TOKENS = {"<empty>": "", "<surrogate>": "a\udcff", "<tab-key>": "k\tey"}
RUNS = Path(__file__).parent / "perf" / "data" / "demo_pair_cpu_runs.jsonl"
HUGE = "1000000000000"
MACHINE = "expected a device this machine has ("

# ---- --device: one argparse type (ddtree.commands._args.device) in every command -----------

DEVICE_COMMANDS = {  # command -> the device strings tried there
    GEN: ("cuda", "bogus", "<empty>", "meta", "cuda:7"),
    "serve": ("cuda", "bogus", "meta"),
    "bench engine": ("<empty>", "cuda:7"),
    "replay record": ("bogus", "cuda"),
    "replay check {w}/nowhere.safetensors": ("meta",),
    "demo": ("cuda",),
    "bench serve": ("bogus",),
    "bench allreduce": ("cuda", "cuda:0", "bogus"),
    "bench attention": ("cuda",),
    "bench shapes": ("meta",),
    "bench tree": ("bogus",),
    "bench bandwidth": ("cuda",),
    "bench moe": ("cuda", "mps"),
}
WHY = {"bogus": "not a torch device", "<empty>": "an empty device", "meta": "hold no data"}
DEVICE_CASES = [
    Case(
        f"{command.split(' {')[0].replace(' ', '-')}--device={value.strip('<>')}",
        f"{command} --device {value}",
        ("--device", MACHINE, "cpu", WHY.get(value, f"got {TOKENS.get(value, value)!r}")),
    )
    for command, values in DEVICE_COMMANDS.items()
    for value in values
]

# ---- text: UTF-8 checked before a tokenizer sees it ----------------------------------------

TEXT = "not valid UTF-8 text"
TEXT_CASES = [
    Case("generate--prompt=surrogate", "generate --prompt <surrogate>", ("--prompt:", TEXT, "at character 1")),
    Case("generate--messages=surrogate", "generate --messages {w}/cli/messages.json", ("--messages", "messages.json", "message 0: content", TEXT)),
    Case("replay-record--prompts=surrogate", "replay record --prompts {w}/cli/surrogate.json", ("--prompts", "surrogate.json", "prompt 1", TEXT)),
    Case("replay-record--prompts=bytes", "replay record --prompts {w}/cli/bytes.json", ("--prompts", "bytes.json", "not UTF-8 text", "at byte 11")),
    Case("replay-record--prompts=missing", "replay record --prompts {w}/cli/nope.json", ("--prompts", "nope.json", "not found")),
    Case("bench-engine--prompts=surrogate", "bench engine --prompts {w}/cli/surrogate.json", ("--prompts", "surrogate.json", "prompt 1", TEXT)),
    Case("bench-serve--prompts=bytes", "bench serve --prompts {w}/cli/bytes.json", ("--prompts", "bytes.json", "at byte 11")),
]  # fmt: skip

# ---- commands: what used to fail once the work had started ---------------------------------

POLICIES = "expected a comma-separated list of"
DRAFTER = "train drafter --target {w}/target --out {w}/work/drafter"
TRAIN = "--train-budgets"
COMMAND_CASES = [
    Case("replay-tau--policies=empty", "replay tau {w}/nowhere.safetensors --policies <empty>", ("--policies", POLICIES, "chain, ddtree")),
    Case("replay-tau--policies=comma", "replay tau {w}/nowhere.safetensors --policies ,", ("--policies", POLICIES)),
    Case("replay-check--policies=empty", "replay check {w}/nowhere.safetensors --policies <empty>", ("--policies", POLICIES)),
    Case("bench-engine--policies=empty", "bench engine --policies <empty>", ("--policies", POLICIES, "ar, chain, ddtree")),
    Case("bench-engine--policies=commas", "bench engine --policies ,,", ("--policies", POLICIES)),
    _flag("bench allreduce", "--timeout", "1e-9", "expected a finite number of seconds >= 1"),
    _flag("bench allreduce", "--timeout", "0.5", "seconds >= 1"),
    Case("bench-allreduce--m=huge", f"bench allreduce --m 1,{HUGE}", ("--m", "GB per rank", "available")),
    Case("bench-allreduce--m=huge-hidden", "bench allreduce --m 1,1000000 --hidden 1000000000", ("--m 1000000", "--hidden")),
    Case("train-drafter--new-tokens=3", f"{DRAFTER} --new-tokens 3", ("--new-tokens 3", "block of 8", "at least 7")),
    Case("train-drafter--new-tokens=6", f"{DRAFTER} --new-tokens 6", ("--new-tokens 6", "at least 7")),
    Case("train-drafter--new-tokens=huge", f"{DRAFTER} --new-tokens 100000", ("--new-tokens 100000", "max_position_embeddings=2048")),
    Case("train-drafter--target=2-layers", "train drafter --target {w}/cli/t_layers2 --out {w}/work/drafter", ("--target", "t_layers2/config.json", "num_hidden_layers=2", "[1, 3]")),
    Case("estimate--train-budgets=absent", f"estimate --backtest {RUNS} {TRAIN} 999", (TRAIN, "budget 999", "8, 16, 32, 64, 128, 256")),
    Case("estimate--train-budgets=one-absent", f"estimate --backtest {RUNS} {TRAIN} 8,999", (TRAIN, "budget 999")),
    Case("serve--api-key=non-ascii", "serve --port 0 --api-key kéy", ("--api-key", "printable ASCII")),
    Case("serve--api-key=control", "serve --port 0 --api-key <tab-key>", ("--api-key", "printable ASCII")),
    Case("estimate--train-budgets=all", f"estimate --backtest {RUNS} {TRAIN} 8,16,32,64,128,256", (TRAIN, "no run to predict")),
    Case("estimate--train-concurrency=absent", f"estimate --backtest {RUNS} --train-concurrency 4", ("--train-concurrency", "concurrency 4", "runs at concurrency 1")),
    Case("estimate--train-concurrency=all", f"estimate --backtest {RUNS} --train-concurrency 1", ("--train-concurrency", "no run to predict")),
    Case("estimate--train-both", f"estimate --backtest {RUNS} {TRAIN} 8 --train-concurrency 1", ("--train-concurrency", "not allowed with")),
]  # fmt: skip

# ---- sampling values float32 cannot hold (the floors in ddtree.vocab) ---------------------

TEMPERATURE = "expected 0 (greedy) or a finite number >= 1e-30"
TOP_P = "expected a finite probability in 1e-30..1"
SAMPLING_CASES = [
    _flag(GEN, "--temperature", "1e-45", TEMPERATURE, "float32"),
    _flag(GEN, "--temperature", "1e-40", TEMPERATURE),
    _flag(GEN, "--top-p", "1e-300", TOP_P, "float32"),
    _flag(GEN, "--top-p", "1e-31", TOP_P),
    _flag("serve", "--temperature", "1e-45", TEMPERATURE),
    _flag("demo", "--temperature", "1e-45", TEMPERATURE),
    _flag("bench engine", "--top-p", "1e-300", TOP_P),
    _flag("bench serve", "--top-p", "1e-300", TOP_P),
]

# ---- --draft-vocab K: a token count >= 1 (ddtree.models.adapters.draft_vocab) ---------------------

DRAFT_VOCAB = "expected an integer >= 1"
DRAFT_VOCAB_CASES = [
    _flag(GEN, "--draft-vocab", "0", DRAFT_VOCAB, "got '0'"),
    _flag(GEN, "--draft-vocab", "-5", DRAFT_VOCAB),
    _flag(GEN, "--draft-vocab", "2.5", DRAFT_VOCAB, "got '2.5'"),
    _flag(GEN, "--draft-vocab", "many", DRAFT_VOCAB),
    _flag("bench engine", "--draft-vocab", "0", DRAFT_VOCAB),
    _flag("bench shapes", "--draft-vocab", "1.5", DRAFT_VOCAB),
    _flag("serve", "--draft-vocab", "0", DRAFT_VOCAB),
]

CASES = DEVICE_CASES + TEXT_CASES + COMMAND_CASES + SAMPLING_CASES + DRAFT_VOCAB_CASES


def _build_cli(w: Path) -> None:
    """What this table adds to ``world``: prompt files and a target with two layers."""
    cli = w / "cli"
    cli.mkdir()
    (cli / "surrogate.json").write_text('["fine", "\\udcff"]')
    (cli / "bytes.json").write_bytes(b'["fine", "a\xff"]')
    (cli / "messages.json").write_text('[{"role": "user", "content": "\\udcff"}]')
    shutil.copytree(w / "target", cli / "t_layers2")
    config = json.loads((cli / "t_layers2" / "config.json").read_text())
    (cli / "t_layers2" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))


@pytest.fixture(scope="module")
def cli_world(world) -> Path:  # noqa: F811
    _build_cli(world)
    return world


def test_the_table_covers_every_class_with_unique_ids():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_exits_2_with_one_line_naming_what_was_expected(
    case, cli_world, capsys, monkeypatch
):
    if "cuda" in case.argv and torch.cuda.is_available():
        pytest.skip("the case is of a machine without CUDA")
    monkeypatch.chdir(cli_world / "work")  # commands with default output paths write here
    monkeypatch.delenv("DDTREE_DEBUG", raising=False)
    torch.set_num_threads(1)
    argv = [TOKENS.get(x, x) for x in case.argv.format(w=cli_world).split()]
    run_bad_input(argv, cli_world, case.expect, capsys)


def test_ddtree_debug_still_raises(monkeypatch):
    monkeypatch.setenv("DDTREE_DEBUG", "1")
    with pytest.raises(ValueError, match="--train-budgets"):
        main(["estimate", "--backtest", str(RUNS), "--train-budgets", "999"])
