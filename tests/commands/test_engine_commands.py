"""`ddtree generate` and `ddtree bench engine` on a tiny target directory made here."""

from __future__ import annotations

import json

import pytest

from ddtree.cli import main
from ddtree.records import read_records

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    import torch
    from tests.engine.helpers import TINY

    path = tmp_path_factory.mktemp("tiny-target")
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        **{k: v for k, v in TINY.items() if k not in ("architectures", "model_type")},
        initializer_range=0.5,
        eos_token_id=None,
    )
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "prompts.json").write_text(json.dumps(["w1 w2 w3", "w7 w8", "w40 w41 w42 w43"]))
    return path


def test_generate_streams_the_ar_completion(target_dir, tmp_path, capsys):
    argv = ["generate", "--target", str(target_dir), "--policy", "ar", "--prompt", "w1 w2 w3"]
    records = tmp_path / "gen.jsonl"
    assert main(argv + ["--max-new-tokens", "6", "--stats", "--records", str(records)]) == 0
    (rec,) = read_records(records)
    assert rec.config["policy"] == "ar" and rec.summary["new_tokens"] == 6
    out = capsys.readouterr()
    words = out.out.split()
    assert words[:3] == ["w1", "w2", "w3"] and len(words) >= 3 + 6 - 1  # <unk> decodes to nothing
    assert "[ar, eager, 1 thread (" in out.err and "] 6 tokens" in out.err


def test_bench_engine_writes_one_valid_record_per_config(target_dir, tmp_path, capsys):
    records = tmp_path / "runs.jsonl"
    argv = ["bench", "engine", "--target", str(target_dir), "--policies", "ar"]
    argv += ["--prompts", str(target_dir / "prompts.json"), "--max-new-tokens", "5"]
    argv += ["--records", str(records), "--n-prompts", "2"]
    assert main(argv) == 0
    (rec,) = read_records(records)
    assert rec.kind == "engine_run" and rec.config["policy"] == "ar"
    assert rec.config["prompts"]["count"] == 2
    assert rec.summary["new_tokens"] == 10 and rec.summary["mean_tau"] == 1.0
    assert "tok/s" in capsys.readouterr().out


def test_bench_engine_concurrency_records_each_c_with_the_aggregate_rate(
    target_dir, tmp_path, capsys
):
    """--concurrency C: every config at every C (requests decoded together); each record says
    its C, and its tokens/s is all rows' (tokens / the batched steps' seconds): C times the
    per-request rate when every step carries C rows."""
    records = tmp_path / "c.jsonl"
    argv = ["bench", "engine", "--target", str(target_dir), "--policies", "ar"]
    argv += ["--prompts", str(target_dir / "prompts.json"), "--max-new-tokens", "6"]
    argv += ["--records", str(records), "--concurrency", "1,3"]
    assert main(argv) == 0
    one, three = read_records(records)
    assert (one.config["concurrency"], three.config["concurrency"]) == (1, 3)
    assert three.config["identical_to_ar"] is True  # the AR rows equal AR at the same C
    for rec in (one, three):
        assert rec.summary["new_tokens"] == 18
        per_row = rec.summary["mean_tau"] / rec.summary["step_s_mean"]
        rows = rec.config["concurrency"]  # 3 prompts of 6 tokens: every step has all rows
        assert rec.summary["tokens_per_s"] == pytest.approx(rows * per_row, rel=1e-6)
    out = " ".join(capsys.readouterr().out.split())  # the caption wraps
    assert "vs C=1" in out and "tok/s: all C rows'" in out


def test_commands_report_bad_input_without_a_traceback(target_dir, tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path), "--policy", "ar", "--prompt", "w1"]) == 2
    assert "config.json" in capsys.readouterr().err
    bad = tmp_path / "prompts.json"
    bad.write_text('{"not": "a list"}')
    argv = ["bench", "engine", "--target", str(target_dir), "--policies", "ar"]
    assert main(argv + ["--prompts", str(bad)]) == 2
    assert "expected a JSON list of non-empty strings" in capsys.readouterr().err
    assert main(["generate", "--target", str(target_dir), "--prompt", "w1"]) == 2
    assert "--drafter DIR is required by this policy" in capsys.readouterr().err


def test_compiled_mode_is_refused_up_front_for_a_transformers_target(
    target_dir, capsys, monkeypatch
):
    """From config.json alone: the refusal comes before any weights load."""
    import ddtree.models

    monkeypatch.setattr(ddtree.models, "load_target", lambda *a, **k: pytest.fail("loaded"))
    argv = ["generate", "--target", str(target_dir), "--impl", "hf", "--policy", "ar"]
    assert main(argv + ["--prompt", "w1", "--engine-mode", "compiled"]) == 2
    assert "engine mode 'compiled' is not available for" in capsys.readouterr().err
    argv = ["bench", "engine", "--target", str(target_dir), "--impl", "hf", "--policies", "ar"]
    assert main(argv + ["--engine-modes", "eager,compiled"]) == 2
    assert "(impl hf, tp 1) (runs: eager)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv + ["--engine-modes", "eager,graphs"])
    assert "expected a comma-separated subset of eager,compiled" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_engine_sweeps_engine_modes_and_records_them(target_dir, tmp_path, capsys):
    records = tmp_path / "modes.jsonl"
    argv = ["bench", "engine", "--target", str(target_dir), "--policies", "ar"]
    argv += ["--prompts", str(target_dir / "prompts.json"), "--max-new-tokens", "6"]
    argv += ["--records", str(records), "--engine-modes", "eager,compiled", "--buckets", "9"]
    assert main(argv) == 0
    eager, compiled = read_records(records)
    assert (eager.config["engine_mode"], compiled.config["engine_mode"]) == ("eager", "compiled")
    assert compiled.config["width_buckets"] == [9] and eager.config["width_buckets"] == []
    assert eager.summary["compile_s"] == 0 and compiled.summary["compile_s"] > 0
    assert compiled.summary["new_tokens"] == eager.summary["new_tokens"] == 18
    out = capsys.readouterr().out
    assert "compile time (warm-up, not in any step)" in out and "compiled" in out


def test_demo_on_the_bundled_pair_is_lossless_and_writes_records(tmp_path, capsys):
    from ddtree.commands._decode import DEMO_DIR

    if not (DEMO_DIR / "drafter" / "model.safetensors").is_file():
        pytest.skip("demo pair not bundled")
    records = tmp_path / "demo.jsonl"
    argv = ["demo", "--n-prompts", "1", "--max-new-tokens", "12", "--threads", "1"]
    argv += ["--engine-modes", "eager"]  # compiled: tests/engine/test_compiled.py, slow tests
    assert main(argv + ["--records", str(records), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "same as AR" in out and "NO" not in out
    runs = read_records(records)
    assert [r.config["policy"] for r in runs] == ["ar", "chain", "ddtree"]
    assert all(r.config["identical_to_ar"] in (None, True) for r in runs)
    assert runs[2].summary["mean_tau"] > 1.0  # the trained drafter gets tokens accepted


def test_generate_with_a_hugging_face_target_and_a_dflash_drafter_matches_ar(tmp_path, capsys):
    import torch

    from ddtree.models.adapters.dflash import DFlashDrafter
    from ddtree.models.adapters.hf import HFTarget
    from ddtree.models.nn.dflash import DFlashConfig, DFlashModel

    target_dir, drafter_dir = tmp_path / "qwen3", tmp_path / "drafter"
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.5,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=None,
    )
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(target_dir)
    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(target_dir / "tokenizer.json"))
    target = HFTarget.from_pretrained(target_dir)
    raw = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 61,
        "block_size": 4,
        "num_target_layers": 2,
        "dflash_config": {"mask_token_id": 60, "target_layer_ids": [0, 1]},
    }
    model = DFlashModel(DFlashConfig.from_dict(raw))
    DFlashDrafter(model, target.embed_tokens, target.lm_head).save_pretrained(drafter_dir)
    outputs = {}
    for policy in ("ar", "ddtree"):
        argv = ["generate", "--target", str(target_dir), "--drafter", str(drafter_dir)]
        argv += ["--policy", policy, "--block", "4", "--budget", "6", "--prompt", "w3 w4"]
        assert main(argv + ["--max-new-tokens", "12"]) == 0
        outputs[policy] = capsys.readouterr().out
    assert outputs["ddtree"] == outputs["ar"] and len(outputs["ar"].split()) > 2
