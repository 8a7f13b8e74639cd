"""Bad input over the whole command line, table-driven: every case must exit non-zero with
exactly one line on stderr that names the file, field or argument and what was expected, no
traceback, and leave every file as it was (no output half-written, no input touched).

Classes covered (docs/bad-input.md lists them too): numeric flags at 0, negative, NaN, inf and huge;
estimate scenario files (missing, not TOML, unknown fields, missing sections, quantities with
the wrong unit, no unit, zero, negative, NaN, out of range, unknown names); records files
(missing, empty, a folder, binary, truncated, not JSON objects, another kind, a newer schema
version); checkpoint folders (missing, no config.json, broken config.json, pickled weights,
truncated safetensors, a tensor missing or of the wrong shape, NaN weights) and drafter/target
mismatches (architecture, hidden size, vocabulary, target layers, mask token, block size);
output paths that cannot be written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddtree.cli import main
from ddtree.commands._decode import DEMO_DIR

NOTICE = "compiled tree core unavailable"  # a one-time backend notice, not the error
HUGE = "1000000000000"


@dataclass(frozen=True)
class Case:
    id: str
    argv: str  # "{w}" is the fixture folder
    expect: tuple[str, ...]  # the one line names these (file/field/argument, expectation)


def _flag(command: str, flag: str, value: str, *expect: str, extra: str = "") -> Case:
    name = f"{command.replace(' ', '-')}{flag}={value}"
    return Case(name, f"{command} {extra} {flag} {value}".replace("  ", " "), (flag, *expect))


GEN = "generate --prompt hi"
INT1 = "expected an integer >= 1"
INT0 = "expected an integer >= 0"
FLOAT0 = "expected a finite number >= 0"
FLOATPOS = "expected a finite number > 0"
THREADS = "expected a thread count"
SEED = "expected a seed in 0.."
BUDGET = "expected a budget in 1..8192 or 'auto'"

FLAG_CASES = [
    _flag(GEN, "--block", "0", INT1),
    _flag(GEN, "--block", "-3", INT1),
    _flag(GEN, "--budget", "0", BUDGET),
    _flag(GEN, "--budget", "nan", BUDGET),
    _flag(GEN, "--budget", "automatic", BUDGET),
    Case("generate--budget=huge", f"{GEN} --budget {HUGE}", ("budget", "1..8192")),
    _flag(GEN, "--temperature", "-1", FLOAT0),
    _flag(GEN, "--temperature", "nan", FLOAT0),
    _flag(GEN, "--temperature", "inf", FLOAT0),
    _flag(GEN, "--top-k", "-1", INT0),
    _flag(GEN, "--top-p", "0", "expected a finite probability in (0, 1]"),
    _flag(GEN, "--top-p", "1.5", "(0, 1]"),
    _flag(GEN, "--top-p", "nan", "(0, 1]"),
    _flag(GEN, "--seed", "-1", SEED),
    _flag(GEN, "--seed", "1" + "0" * 30, SEED),
    _flag(GEN, "--max-new-tokens", "0", INT1),
    _flag(GEN, "--max-new-tokens", "-5", INT1),
    Case("generate--max-new-tokens=huge", f"{GEN} --max-new-tokens {HUGE}", ("max_position",)),
    _flag(GEN, "--threads", "-1", THREADS),
    _flag(GEN, "--threads", HUGE, THREADS),
    _flag(GEN, "--tp", "0", INT1),
    _flag(GEN, "--engine-mode", "graphs", "invalid choice", "eager", "compiled"),
    _flag(GEN, "--buckets", "9,0", "comma-separated integers"),
    _flag("bench engine", "--engine-modes", "eager,graphs", "subset of eager,compiled"),
    _flag("bench engine", "--budgets", "0", BUDGET),
    _flag("bench engine", "--budgets", "8,-1", BUDGET),
    _flag("bench engine", "--budgets", ",", "expected comma-separated budgets"),
    _flag("bench engine", "--concurrency", "0", "comma-separated integers, each in 1..256"),
    _flag("bench engine", "--n-prompts", "-1", INT0),
    _flag("serve", "--port", "70000", "expected a port (0: any free one) in 0..65535"),
    _flag("serve", "--port", "-1", "in 0..65535"),
    _flag("serve", "--max-queue", "-1", INT0),
    _flag("serve", "--max-body-bytes", "0", INT1),
    _flag("serve", "--host", "no.such.host.invalid", "cannot listen there"),
    _flag("bench serve", "--requests", "0", INT1),
    _flag("bench serve", "--concurrency", "0", INT1),
    _flag("bench serve", "--repeats", "-2", INT1),
    _flag("bench serve", "--url", "http://127.0.0.1:1", "not a ddtree server here"),
    _flag("bench tree", "--vocab", "0", INT1),
    _flag("bench tree", "--repeats", "nan", INT1),
    _flag("bench tree", "--prefix", "-1", INT0),
    Case(
        "bench-tree--vocab=huge",
        f"bench tree --vocab {HUGE} --blocks 8 --budgets 16 --batch 1 --repeats 1",
        ("out of memory", "GB"),
    ),
    _flag("bench bandwidth", "--repeats", "0", INT1),
    _flag("bench bandwidth", "--warmup", "-1", INT0),
    _flag("bench bandwidth", "--sizes-mib", HUGE, "integers, each in 1..1048576"),
    _flag("bench moe", "--hidden", "0", INT1),
    _flag("bench moe", "--experts", "-8", INT1),
    _flag("bench moe", "--peak-bytes-per-s", "nan", FLOATPOS),
    _flag("bench moe", "--peak-bytes-per-s", "0", FLOATPOS),
    Case("bench-moe--experts=huge", f"bench moe --experts {HUGE}", ("--experts", "GiB")),
    _flag("estimate", "--samples", "0", INT1),
    _flag("estimate", "--samples", "nan", INT1),
    Case("estimate--samples=huge", f"estimate --samples {HUGE}", ("out of memory",)),
    _flag("estimate", "--seed", "-1", SEED),
    _flag("train target", "--lr", "nan", FLOATPOS),
    _flag("train target", "--lr", "0", FLOATPOS),
    _flag("train target", "--steps", "-1", INT1),
    _flag("train target", "--threads", HUGE, THREADS),
    _flag("train drafter", "--loss-gamma", "inf", FLOATPOS),
    _flag("train drafter", "--eval-prompts", "0", INT1),
    _flag("demo", "--n-prompts", "0", INT1),
    _flag("demo", "--show", "-1", INT0),
]

# ---- estimate scenario files: one valid base, one change per case ------------------------

SCENARIO = """\
[model]
preset = "kimi-k2-thinking"

[deployment]
tp = 8

[[anchor]]
name = "a"
hardware = "b300"
block_size = 8
budget = 8
tau = 4.4
tokens_per_s = "303 tok/s"

[[scenario]]
name = "s"
hardware = "b300"
block_size = 16
budget = 32
tau = 6.0
"""

SCENARIO_CHANGES = {  # id -> (text replaced, replacement, expected in the message)
    "rate-zero": ('"303 tok/s"', '"0 tok/s"', ("tokens_per_s", "positive")),
    "rate-negative": ('"303 tok/s"', '"-303 tok/s"', ("tokens_per_s", "positive")),
    "rate-nan": ('"303 tok/s"', '"nan tok/s"', ("tokens_per_s", "token rate")),
    "rate-wrong-unit": ('"303 tok/s"', '"303 ms"', ("tokens_per_s", "is a time")),
    "rate-no-unit": ('"303 tok/s"', "303", ("tokens_per_s", "unit")),
    "anchor-tau-below-1": ("tau = 4.4", "tau = 0.5", ("anchor[0]", "tau", "1 <= tau")),
    "anchor-tau-above-B": ("tau = 4.4", "tau = 9", ("anchor[0]", "tau", "block_size = 8")),
    "scenario-tau-above-B": ("tau = 6.0", "tau = 17", ("scenario[0]", "tau")),
    "scenario-tau-nan": ("tau = 6.0", "tau = nan", ("scenario[0]", "tau")),
    "scenario-tau-range-reversed": ("tau = 6.0", "tau = [12, 3]", ("tau", "increasing")),
    "block-size-1": ("block_size = 16", "block_size = 1", ("block_size", "integer >= 2")),
    "budget-0": ("budget = 32", "budget = 0", ("budget", "integer >= 1")),
    "tp-0": ("tp = 8", "tp = 0", ("tp", "integer >= 1")),
    "tp-not-a-number": ("tp = 8", 'tp = "eight"', ("tp", "integer >= 1")),
    "context-negative": ("tp = 8", 'tp = 8\ncontext = "-5 tok"', ("context", ">= 0")),
    "context-wrong-unit": ("tp = 8", 'tp = 8\ncontext = "5 GB"', ("context", "token count")),
    "hardware-unknown": ('hardware = "b300"\nblock_size = 16', 'hardware = "b301"\nblock_size = 16', ("hardware", "b301")),
    "preset-unknown": ('"kimi-k2-thinking"', '"kimi-k9"', ("kimi-k9",)),
    "no-model": ('[model]\npreset = "kimi-k2-thinking"\n', "", ("[model]",)),
    "unknown-field": ("[model]", 'colour = "blue"\n[model]', ("colour",)),
    "unknown-model-field": ("[deployment]", 'colour = "blue"\n[deployment]', ("model", "colour")),
    "not-toml": ("[model]", "[model", ("not valid TOML",)),
    "unknown-parameter": ("[deployment]", '[parameters]\nwarp = 9\n[deployment]', ("warp",)),
    "step-and-rate": ('tokens_per_s = "303 tok/s"', 'tokens_per_s = "303 tok/s"\nstep = "14 ms"', ("exactly one of",)),
}  # fmt: skip

SCENARIO_CASES = [
    Case(f"scenario-{name}", f"estimate {{w}}/scenarios/{name}.toml", ("scenarios/", *expect))
    for name, (_, _, expect) in SCENARIO_CHANGES.items()
] + [
    Case("scenario-missing", "estimate {w}/scenarios/nope.toml", ("nope.toml", "no such")),
    Case(
        "scenario-report-not-written",
        "estimate {w}/scenarios/rate-zero.toml --report {w}/work/report",
        ("tokens_per_s",),
    ),
]

# ---- records files -------------------------------------------------------------------------

RECORDS_CASES = [
    Case("records-missing", "estimate --records {w}/records/nope.jsonl", ("nope.jsonl", "no such")),
    Case("records-binary", "estimate --records {w}/records/binary.jsonl", ("binary.jsonl", "text")),
    Case("records-not-json", "estimate --records {w}/records/garbage.jsonl", ("garbage.jsonl:1", "JSON")),
    Case("records-not-object", "estimate --records {w}/records/list.jsonl", ("list.jsonl:1", "object")),
    Case("records-bad-field", "estimate --records {w}/records/bad_field.jsonl", ("bad_field.jsonl:1", "field")),
    Case("backtest-empty", "estimate --backtest {w}/records/empty.jsonl", ("no engine_run records",)),
    Case("backtest-empty-folder", "estimate --backtest {w}/records/folder", ("no engine_run records",)),
    Case("backtest-another-kind", "estimate --backtest {w}/records/bandwidth.jsonl", ("no engine_run records",)),
    Case("backtest-truncated-only", "estimate --backtest {w}/records/truncated.jsonl", ("truncated.jsonl:1", "truncated")),
    Case("backtest-newer-schema", "estimate --backtest {w}/records/newer.jsonl", ("newer.jsonl:1", "schema version 99")),
]  # fmt: skip

# ---- checkpoints ---------------------------------------------------------------------------

AR = f"{GEN} --policy ar --max-new-tokens 2"
DD = f"{GEN} --max-new-tokens 4 --target {{w}}/target"
CHECKPOINT_CASES = [
    Case("target-missing", f"{AR} --target {{w}}/nowhere", ("nowhere", "does not exist")),
    Case("target-no-config", f"{AR} --target {{w}}/t_noconfig", ("t_noconfig/config.json",)),
    Case("target-config-not-json", f"{AR} --target {{w}}/t_badjson", ("t_badjson/config.json", "JSON")),
    Case("target-pickled", f"{AR} --target {{w}}/t_pickle", ("t_pickle", "pickle")),
    Case("target-truncated", f"{AR} --target {{w}}/t_truncated", ("t_truncated", "safetensors")),
    Case("target-shape", f"{AR} --target {{w}}/t_shape", ("t_shape", "model.norm.weight")),
    Case("target-missing-tensor", f"{AR} --target {{w}}/t_notensor", ("t_notensor", "lm_head.weight")),
    Case("target-nan", f"{AR} --target {{w}}/t_nan --records {{w}}/work/run.jsonl", ("NaN/inf in logits",)),
    Case("target-quant-method", f"{AR} --target {{w}}/t_awq", ("t_awq/config.json", "quant_method='awq'")),
    Case("target-fp8-no-scale", f"{AR} --target {{w}}/t_fp8_noscale", ("t_fp8_noscale/model.safetensors", "o_proj.weight_scale_inv is missing")),
    Case("drafter-missing", f"{DD} --drafter {{w}}/nowhere", ("nowhere",)),
    Case("drafter-architecture", f"{DD} --drafter {{w}}/d_arch", ("d_arch/config.json", "architectures")),
    Case("drafter-hidden-size", f"{DD} --drafter {{w}}/d_hidden", ("d_hidden/config.json", "hidden_size=128", "hidden_size=256")),
    Case("drafter-vocab", f"{DD} --drafter {{w}}/d_vocab", ("d_vocab/config.json", "vocab_size")),
    Case("drafter-target-layers", f"{DD} --drafter {{w}}/d_layers", ("d_layers/config.json", "target_layer_ids")),
    Case("drafter-mask-token", f"{DD} --drafter {{w}}/d_mask", ("d_mask/config.json", "mask_token_id")),
    Case("drafter-block-size", f"{DD} --drafter {{w}}/d_block4", ("block_size 8", "block_size 4")),
    Case("drafter-shape", f"{DD} --drafter {{w}}/d_shape", ("d_shape", "fc.weight")),
    Case("drafter-nan", f"{DD} --drafter {{w}}/d_nan --records {{w}}/work/run.jsonl", ("drafter", "NaN/inf")),
    Case("records-output-is-a-folder", f"{AR} --target {{w}}/target --records {{w}}/work", ("--records", "folder")),
    Case("drafter-draft-vocab-no-counts", f"{DD} --drafter {{w}}/d_nocounts --draft-vocab 64", ("--draft-vocab", "d_nocounts/draft_vocab.json not found")),
    Case("drafter-draft-vocab-short-counts", f"{DD} --drafter {{w}}/d_shortcounts --draft-vocab 64", ("--draft-vocab", "d_shortcounts/draft_vocab.json", "token_counts", "2048 integers", "got 3 entries")),
    Case("drafter-draft-vocab-not-json", f"{DD} --drafter {{w}}/d_badcounts --draft-vocab 64", ("--draft-vocab", "d_badcounts/draft_vocab.json", "not a readable JSON file")),
]  # fmt: skip

# ---- the replay, diagnose and all-reduce commands ------------------------------------------

RUNS = "{w}/records/bandwidth.jsonl"
TUNE = str(Path(__file__).resolve().parents[1] / "examples" / "demo_pair_tune.toml")
OTHER_CASES = [
    Case("replay-tau-missing-trace", "replay tau {w}/nowhere.safetensors", ("nowhere.safetensors", "no such trace")),
    Case("replay-tau-records-as-trace", f"replay tau {RUNS}", ("bandwidth.jsonl", "safetensors")),
    Case("replay-check-scenario-as-trace", "replay check {w}/scenarios/rate-zero.toml", ("rate-zero.toml", "safetensors")),
    _flag("replay record", "--candidates", "0", INT1),
    _flag("replay record", "--out", "{w}/work", "folder"),
    Case("diagnose-missing-records", "diagnose {w}/nowhere.jsonl {w}/nowhere.jsonl", ("nowhere.jsonl", "no such")),
    _flag(f"diagnose {RUNS} {RUNS}", "--budget", "-1", INT0),
    _flag("bench allreduce", "--tp", "1", "expected an integer >= 2"),
    _flag("bench allreduce", "--repeats", "-1", INT1),
    _flag("bench allreduce", "--records", "{w}/work", "folder"),
    Case("estimate-validate-missing", "estimate --validate {w}/nowhere", ("nowhere", "no such")),
    Case("tune-acceptance-missing", f"tune {TUNE} --acceptance {{w}}/nowhere.jsonl", ("nowhere.jsonl", "no such")),
    Case("tune-no-acceptance", f"tune {TUNE}", ("--acceptance", "required")),
    _flag(f"tune {TUNE} --acceptance {{w}}/nowhere.jsonl", "--samples", "0", INT1),
    _flag("bench linear", "--ms", "0", "comma-separated integers"),
    _flag("bench linear", "--repeats", "0", INT1),
    _flag("bench linear", "--set-mb", "-1", INT1),
    _flag("bench linear", "--preset", "qwen9", "invalid choice", "tiny-qwen3"),
    _flag("bench shapes", "--preset", "qwen9", "invalid choice", "qwen3-1.7b"),
    _flag("bench shapes", "--budgets", "0", BUDGET),
    Case("bench-shapes-too-big", "bench shapes --preset qwen3-30b-a3b --dtype float32 --threads 1", ("qwen3-30b-a3b", "needs", "GB", "available")),
    _flag("bench attention", "--contexts", "0", "comma-separated integers"),
    Case("generate-own-target-no-drafter", "generate --prompt hi --target {w}/target", ("--drafter DIR", "--policy ar")),
    Case("bench-attention-heads", "bench attention --heads 3 --kv-heads 2", ("--heads 3", "multiple of --kv-heads 2")),
]  # fmt: skip

CASES = FLAG_CASES + SCENARIO_CASES + RECORDS_CASES + CHECKPOINT_CASES + OTHER_CASES


def _edit_config(src: Path, dst: Path, **changes) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key in ("mask_token_id", "target_layer_ids"):
            config["dflash_config"][key] = value
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))


def _edit_tensors(src: Path, dst: Path, edit) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")


def _build(w: Path) -> None:
    target, drafter = DEMO_DIR / "target", DEMO_DIR / "drafter"
    shutil.copytree(target, w / "target")
    shutil.copytree(target, w / "t_noconfig")
    (w / "t_noconfig" / "config.json").unlink()
    shutil.copytree(target, w / "t_badjson")
    (w / "t_badjson" / "config.json").write_text("{not json")
    shutil.copytree(target, w / "t_pickle", ignore=shutil.ignore_patterns("*.safetensors"))
    (w / "t_pickle" / "pytorch_model.bin").write_bytes(b"\x80\x04pickled")
    shutil.copytree(target, w / "t_truncated")
    weights = w / "t_truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _edit_tensors(target, w / "t_shape", lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    _edit_tensors(target, w / "t_notensor", lambda t: t.pop("lm_head.weight"))
    _edit_tensors(target, w / "t_nan", lambda t: t["lm_head.weight"].fill_(float("nan")))
    _edit_config(target, w / "t_awq", quantization_config={"quant_method": "awq"})
    # an fp8 checkpoint (DeepSeek-V3's quantization_config) whose o_proj lost its scale
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    _edit_config(target, w / "t_fp8_noscale", quantization_config=fp8)
    fp8_weights = w / "t_fp8_noscale" / "model.safetensors"
    tensors = load_file(fp8_weights)
    tensors[o_proj] = tensors[o_proj].to(torch.float8_e4m3fn)
    save_file(tensors, fp8_weights)
    _edit_config(drafter, w / "d_arch", architectures=["LlamaForCausalLM"])
    _edit_config(drafter, w / "d_hidden", hidden_size=128)
    _edit_config(drafter, w / "d_vocab", vocab_size=1000)
    _edit_config(drafter, w / "d_layers", target_layer_ids=[1, 9])
    _edit_config(drafter, w / "d_mask", mask_token_id=5000)
    _edit_config(drafter, w / "d_block4", block_size=4)
    _edit_tensors(drafter, w / "d_shape", lambda t: t.update({"fc.weight": torch.ones(3, 3)}))
    _edit_tensors(drafter, w / "d_nan", lambda t: t["fc.weight"].fill_(float("nan")))
    # --draft-vocab's token counts (draft_vocab.json beside the drafter): absent, short, not JSON
    shutil.copytree(drafter, w / "d_nocounts")
    (w / "d_nocounts" / "draft_vocab.json").unlink()
    shutil.copytree(drafter, w / "d_shortcounts")
    short = {"source": "test", "vocab_size": 3, "token_counts": [1, 2, 3]}
    (w / "d_shortcounts" / "draft_vocab.json").write_text(json.dumps(short))
    shutil.copytree(drafter, w / "d_badcounts")
    (w / "d_badcounts" / "draft_vocab.json").write_text("{not json")
    (w / "scenarios").mkdir()
    for name, (old, new, _) in SCENARIO_CHANGES.items():
        assert old in SCENARIO, name
        (w / "scenarios" / f"{name}.toml").write_text(SCENARIO.replace(old, new, 1))
    records = w / "records"
    (records / "folder").mkdir(parents=True)
    real = (Path(__file__).parent / "perf" / "data" / "demo_pair_cpu_runs.jsonl").read_text()
    lines = real.splitlines()
    bandwidth = [x for x in lines if json.loads(x)["kind"] == "bench_bandwidth"]
    engine = next(x for x in lines if json.loads(x)["kind"] == "engine_run")
    (records / "empty.jsonl").write_text("")
    (records / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x01" * 16)
    (records / "garbage.jsonl").write_text("this is not json\n")
    (records / "list.jsonl").write_text("[1, 2, 3]\n")
    (records / "bad_field.jsonl").write_text(json.dumps({**json.loads(engine), "kind": 7}) + "\n")
    (records / "bandwidth.jsonl").write_text("\n".join(bandwidth) + "\n")
    (records / "truncated.jsonl").write_text(engine[: len(engine) // 2])
    (records / "newer.jsonl").write_text(json.dumps({**json.loads(engine), "schema": 99}) + "\n")
    (w / "work").mkdir()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("bad_input")
    _build(w)
    return w


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)  # a loop has no stat
        for p in sorted(root.rglob("*"))
    }


def _error_lines(stderr: str) -> list[str]:
    """stderr's lines, less the tree backend's one-time notice."""
    return [line for line in stderr.splitlines() if line.strip() and NOTICE not in line]


def test_the_table_covers_at_least_60_cases_with_unique_ids():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


def run_bad_input(
    argv: list[str], root: Path, expect: tuple[str, ...], capsys, ignore: tuple[str, ...] = ()
) -> str:
    """``ddtree argv`` in this process must exit 2 with one error line on stderr naming each of
    ``expect``, no traceback, and every file under ``root`` as it was (nothing written, nothing
    half-written). Lines starting with ``ignore`` are not counted; returns stdout.

    Besides the error line stderr may hold one-line warnings (a skipped record names its
    file:line) and notes (a loaded checkpoint's dtype)."""
    before = _snapshot(root)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    captured = capsys.readouterr()
    err = captured.err
    lines = [x for x in _error_lines(err) if not (ignore and x.startswith(ignore))]
    assert code == 2, err
    assert "Traceback" not in err
    assert len([x for x in lines if not x.startswith(("warning: ", "note: "))]) == 1, err
    for part in expect:
        assert any(part in x for x in lines), (part, lines)
    assert _snapshot(root) == before
    return captured.out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_gets_one_line_naming_what_was_expected(case, world, capsys, monkeypatch):
    monkeypatch.chdir(world / "work")  # commands with default output paths write here
    monkeypatch.delenv("DDTREE_DEBUG", raising=False)
    torch.set_num_threads(1)
    run_bad_input(case.argv.format(w=world).split(), world, case.expect, capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--top-p", "nan"],
        ["estimate", "--samples", "-1"],
        ["generate", "--prompt", "hi", "--policy", "ar", "--target", "nowhere"],
    ],
)
def test_the_installed_entry_point_prints_one_line_too(argv, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DDTREE_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(_error_lines(proc.stderr)) == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []
