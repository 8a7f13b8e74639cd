"""The decode loop: greedy chain and DDTree equal AR token for token; sampled decoding follows
the target's distribution; stop conditions; stage timings and records."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.engine import ContextLengthError, DecodeConfig, engine_run_record, generate
from ddtree.records import STEP_STAGES, read_records, write_records
from ddtree.tree import backend, process_logits

from .helpers import ScriptedDrafter, random_dflash_drafter, tiny_hf_target, tiny_mla_target

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]]


@pytest.fixture(scope="module")
def target():
    return tiny_mla_target(seed=0)


def _ar(target, prompt, n=40, **kw):
    return generate(target, None, prompt, DecodeConfig(policy="ar", max_new_tokens=n, **kw))


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("budget", [1, 4, 32, 128])
def test_greedy_ddtree_and_chain_equal_autoregressive(target, block, budget):
    for i, prompt in enumerate(PROMPTS):
        ar = _ar(target, prompt)
        script = prompt + ar.tokens
        for policy in ("chain", "ddtree"):
            drafter = ScriptedDrafter(script, target.info.vocab_size, block, seed=i)
            cfg = DecodeConfig(policy=policy, block_size=block, budget=budget, max_new_tokens=40)
            out = generate(target, drafter, prompt, cfg)
            assert out.tokens == ar.tokens, (policy, block, budget, i)
            assert sum(out.taus) >= len(out.tokens) - 1  # the first token comes from prefill
            assert all(1 <= t <= block for t in out.taus)


def test_a_perfect_drafter_commits_whole_blocks(target):
    prompt = PROMPTS[0]
    ar = _ar(target, prompt, n=33)
    drafter = ScriptedDrafter(prompt + ar.tokens, target.info.vocab_size, 8, hit=1.0)
    out = generate(target, drafter, prompt, DecodeConfig("chain", block_size=8, max_new_tokens=33))
    assert out.tokens == ar.tokens
    assert out.taus == [8, 8, 8, 8]  # 1 (prefill) + 4 * 8 = 33 tokens


def test_ddtree_recovers_second_ranked_tokens_that_chain_misses(target):
    prompt = PROMPTS[0]
    ar = _ar(target, prompt, n=60)
    script = prompt + ar.tokens
    taus = {}
    for policy in ("chain", "ddtree"):
        drafter = ScriptedDrafter(script, target.info.vocab_size, 8, hit=0.5, seed=3)
        cfg = DecodeConfig(policy=policy, block_size=8, budget=32, max_new_tokens=60)
        taus[policy] = generate(target, drafter, prompt, cfg).mean_tau
    assert taus["ddtree"] > taus["chain"] + 0.5


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    prompt=st.lists(st.integers(0, 60), min_size=1, max_size=9),
    block=st.sampled_from([2, 4, 8]),
    budget=st.integers(1, 24),
    hit=st.floats(0.0, 1.0),
)
def test_property_greedy_lossless_over_random_models_and_prompts(seed, prompt, block, budget, hit):
    target = tiny_mla_target(seed=seed % 7, scale=0.2 + (seed % 5) / 10)
    ar = _ar(target, prompt, n=20)
    drafter = ScriptedDrafter(prompt + ar.tokens, 61, block, hit=hit, seed=seed)
    cfg = DecodeConfig("ddtree", block_size=block, budget=budget, max_new_tokens=20)
    assert generate(target, drafter, prompt, cfg).tokens == ar.tokens


def _chi2_threshold(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _exact_two_token_distribution(target, prompt, temperature, top_p):
    # P(t1, t2 | prompt) from the target's own processed distributions
    target.reset()
    first = process_logits(
        target.prefill(torch.tensor(prompt)).logits[-1], temperature, None, top_p
    )
    probs = {}
    for t1 in range(first.shape[0]):
        target.reset()
        logits = target.prefill(torch.tensor(prompt + [t1])).logits[-1]
        second = process_logits(logits, temperature, None, top_p)
        for t2 in range(second.shape[0]):
            probs[(t1, t2)] = float((first[t1] + second[t2]).exp())
    return probs


@pytest.mark.parametrize(
    "policy, budget, top_p", [("chain", 0, 1.0), ("ddtree", 6, 1.0), ("ddtree", 6, 0.9)]
)
def test_sampled_decoding_follows_the_target_distribution(policy, budget, top_p):
    vocab, temperature, samples = 4, 1.0, 1200
    target = tiny_mla_target(seed=1, scale=0.3, vocab_size=vocab)
    prompt = [1, 2, 3]
    exact = _exact_two_token_distribution(target, prompt, temperature, top_p)
    counts = dict.fromkeys(exact, 0)
    script = [0] * 16  # the drafter's guesses are noise: acceptance does the work
    for seed in range(samples):
        drafter = ScriptedDrafter(script, vocab, 4, hit=0.5, seed=seed)
        cfg = DecodeConfig(
            policy,
            block_size=4,
            budget=budget,
            max_new_tokens=2,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
        )
        counts[tuple(generate(target, drafter, prompt, cfg).tokens)] += 1
    cells = [(counts[c], exact[c] * samples) for c in exact if exact[c] * samples >= 5]
    rare = [c for c in exact if 0 < exact[c] * samples < 5]  # pooled into one cell
    cells.append((sum(counts[c] for c in rare), sum(exact[c] for c in rare) * samples))
    cells = [(o, e) for o, e in cells if e > 0]
    assert sum(counts[c] for c in exact if exact[c] == 0) == 0  # filtered tokens never appear
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    assert chi2 < _chi2_threshold(len(cells) - 1), (chi2, len(cells))


class _WordTokenizer:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_stop_conditions(target):
    prompt = PROMPTS[0]
    ar = _ar(target, prompt, n=30)
    eos = ar.tokens[7]
    first = ar.tokens.index(eos)
    script = prompt + ar.tokens
    cfg = dict(block_size=8, budget=16, max_new_tokens=30)
    for policy in ("ar", "ddtree"):
        drafter = ScriptedDrafter(script, 61, 8, hit=0.9) if policy != "ar" else None
        out = generate(target, drafter, prompt, DecodeConfig(policy, eos_token_ids=(eos,), **cfg))
        assert out.stop_reason == "eos" and out.tokens == ar.tokens[: first + 1]
        drafter = ScriptedDrafter(script, 61, 8, hit=0.9) if policy != "ar" else None
        stop = f"w{ar.tokens[4]} w{ar.tokens[5]}"
        out = generate(
            target,
            drafter,
            prompt,
            DecodeConfig(policy, stop_strings=(stop,), **cfg),
            tokenizer=_WordTokenizer(),
        )
        assert out.stop_reason == "stop_string"
        assert stop in _WordTokenizer().decode(out.tokens)
        assert stop not in _WordTokenizer().decode(out.tokens[:-1])
        for n in (1, 2, 13):
            drafter = ScriptedDrafter(script, 61, 8, hit=0.9) if policy != "ar" else None
            out = generate(
                target, drafter, prompt, DecodeConfig(policy, **dict(cfg, max_new_tokens=n))
            )
            assert out.tokens == ar.tokens[:n] and out.stop_reason == "max_new_tokens"


def test_bad_requests_get_clear_errors(target):
    with pytest.raises(ContextLengthError, match="max_position 512"):
        generate(target, None, list(range(500)), DecodeConfig("ar", max_new_tokens=20))
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, [1], DecodeConfig("ddtree"))
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(target, None, [], DecodeConfig("ar"))
    with pytest.raises(ValueError, match="policy 'beam'"):
        DecodeConfig("beam")
    drafter = ScriptedDrafter([1, 2], 61, 4)
    with pytest.raises(ValueError, match="block_size 8 != the drafter's block_size 4"):
        generate(target, drafter, [1], DecodeConfig("ddtree", block_size=8))


def test_stage_timings_add_up_and_the_record_round_trips(target, tmp_path):
    prompt = PROMPTS[0]
    ar = _ar(target, prompt)
    drafter = ScriptedDrafter(prompt + ar.tokens, 61, 8)
    cfg = DecodeConfig("ddtree", block_size=8, budget=16, max_new_tokens=40)
    out = generate(target, drafter, prompt, cfg)
    for step in out.steps:
        assert set(step.stage_s) == set(STEP_STAGES)
        assert all(v >= 0 for v in step.stage_s.values())
        assert math.isclose(sum(step.stage_s.values()), step.step_s, rel_tol=1e-9)
        assert step.stage_s["verify"] > 0 and step.stage_s["draft"] > 0
    record = engine_run_record([out], cfg, target.info, None, drafter.info, None)
    path = tmp_path / "run.jsonl"
    write_records(path, [record])
    (back,) = read_records(path)
    assert back.config["policy"] == "ddtree" and back.config["budget"] == 16
    assert back.config["tree_backend"] == backend()  # which tree core ran
    assert [p["tau"] for p in back.points] == out.taus
    assert back.summary["mean_tau"] == pytest.approx(out.mean_tau)
    assert back.summary["tokens_per_s"] == pytest.approx(sum(out.taus) / out.decode_s)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "deepseek_v3"])
def test_greedy_lossless_on_hugging_face_targets(kind):
    target = tiny_hf_target(kind)
    for i, prompt in enumerate(PROMPTS[:2]):
        ar = _ar(target, prompt, n=30, eos_token_ids=())
        assert len(set(ar.tokens)) > 3  # not a degenerate repetition
        for block, budget in ((4, 1), (8, 32), (16, 128)):
            for policy in ("chain", "ddtree"):
                drafter = ScriptedDrafter(prompt + ar.tokens, 61, block, seed=i)
                cfg = DecodeConfig(
                    policy, block_size=block, budget=budget, max_new_tokens=30, eos_token_ids=()
                )
                assert generate(target, drafter, prompt, cfg).tokens == ar.tokens, (policy, block)


@pytest.mark.parametrize("block", [4, 8, 16])
def test_greedy_lossless_with_a_random_dflash_drafter(target, block):
    drafter = random_dflash_drafter(target, block, seed=block, mask_token_id=60)
    for prompt in PROMPTS:
        ar = _ar(target, prompt, n=24)
        for policy, budget in (("chain", 0), ("ddtree", 4), ("ddtree", 32)):
            cfg = DecodeConfig(policy, block_size=block, budget=budget, max_new_tokens=24)
            assert generate(target, drafter, prompt, cfg).tokens == ar.tokens, (policy, budget)
