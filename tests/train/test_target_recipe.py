"""The target recipe on a corpus slice: tokenizer, loss goes down, resume is exact, both
loaders read the export and agree."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ddtree.train.corpus import heldout_prompts, list_corpus, read_texts, sample_windows
from ddtree.train.target import TargetTrainConfig, train_target
from ddtree.train.tokenizer import EOS_TOKEN, MASK_TOKEN, special_id, train_tokenizer


def tiny_cfg(steps: int) -> TargetTrainConfig:
    return TargetTrainConfig(
        steps=steps,
        batch_size=4,
        seq_len=32,
        lr=1e-2,
        warmup_steps=1,
        vocab_size=300,
        max_files=30,
        save_every=3,
        log_every=3,
        eval_windows=2,
    )


def test_corpus_split_is_by_file_and_sorted():
    split = list_corpus(max_files=45)
    assert len(split.train) + len(split.heldout) == 45
    assert not set(split.train) & set(split.heldout)
    names = [f.relative_to(split.root).as_posix() for f in split.train]
    assert names == sorted(names)
    assert all("test" not in f.relative_to(split.root).parts[:-1] for f in split.train)


def test_heldout_prompts_avoid_eos():
    stream = torch.arange(2, 202).repeat(3)
    stream[::50] = 0  # EOS every 50 tokens
    prompts = heldout_prompts(stream, 5, 20, seed=3, eos_id=0)
    assert prompts.shape == (5, 20) and not bool((prompts == 0).any())
    assert torch.equal(prompts, heldout_prompts(stream, 5, 20, seed=3, eos_id=0))
    with pytest.raises(ValueError, match="too short"):
        heldout_prompts(stream, 5, 60, seed=3, eos_id=0)


def test_tokenizer_round_trips_and_has_specials():
    texts = read_texts(list_corpus(max_files=10).train)
    tok = train_tokenizer(texts, 400)
    assert tok.get_vocab_size() == 400
    assert {special_id(tok, EOS_TOKEN), special_id(tok, MASK_TOKEN)} == {0, 1}
    sample = texts[0][:500]
    assert tok.decode(tok.encode(sample).ids) == sample
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, 100)


def test_sample_windows_is_deterministic():
    stream = torch.arange(1000)
    a, b = sample_windows(stream, 3, 10, seed=7), sample_windows(stream, 3, 10, seed=7)
    assert torch.equal(a, b) and a.shape == (3, 10)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(3, 9, dtype=torch.int64))


@pytest.mark.slow
def test_target_trains_resumes_exactly_and_loads(tmp_path, tiny_shape):
    torch.set_num_threads(1)
    straight = train_target(tiny_cfg(6), tmp_path / "a", shape=tiny_shape, show_progress=False)
    assert straight.losses[-1] < straight.losses[0]
    # a run stopped after 3 steps and resumed to 6 ends with the same weights
    stopped = train_target(
        tiny_cfg(6), tmp_path / "b", shape=tiny_shape, show_progress=False, stop_at=3
    )
    assert stopped.steps == 3 and not (tmp_path / "b" / "model.safetensors").exists()
    resumed = train_target(
        tiny_cfg(6), tmp_path / "b", shape=tiny_shape, resume=True, show_progress=False
    )
    assert resumed.steps == 6
    wa = load_file(str(tmp_path / "a" / "checkpoint" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "checkpoint" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-6, msg=name)

    out = tmp_path / "a"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["first_k_dense_replace"] == 1
    weights = load_file(str(out / "model.safetensors"))
    # transformers writes experts one by one, as published DeepSeek checkpoints are
    assert weights["model.layers.1.mlp.experts.3.gate_proj.weight"].dtype == torch.bfloat16
    bias = weights["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # balancing moved it

    from transformers import AutoModelForCausalLM

    from ddtree.models.adapters.mla_moe import MlaMoeTarget

    ours = MlaMoeTarget.from_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(ours.prefill(ids).logits, ref, rtol=1e-4, atol=1e-4)


def test_resume_refuses_a_different_config(tmp_path, tiny_shape):
    torch.set_num_threads(1)
    train_target(tiny_cfg(1), tmp_path, shape=tiny_shape, show_progress=False)
    other = TargetTrainConfig(**{**tiny_cfg(2).__dict__, "lr": 5e-3})
    with pytest.raises(ValueError, match="lr"):
        train_target(other, tmp_path, shape=tiny_shape, resume=True, show_progress=False)
