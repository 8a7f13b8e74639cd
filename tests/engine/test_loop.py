"""The decode loop: greedy chain and DDTree equal AR token for token; stop conditions; stage
timings and records. (Sampled decoding: test_sampled.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.engine import ContextLengthError, DecodeConfig, engine_run_record, generate
from ddtree.records import read_records, write_records
from ddtree.tree import backend
from ddtree.vocab import STEP_STAGES

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


def test_a_batch_is_refused_never_flattened_into_one_prompt(target):
    import torch

    a = [1, 2, 3]
    cfg = DecodeConfig("ar", max_new_tokens=6)
    for batch in ([a, a], torch.tensor([a, a]), torch.tensor([[a]])):
        with pytest.raises(ValueError, match="generate decodes one request") as e:
            generate(target, None, batch, cfg)
        assert "call it once per prompt" in str(e.value)
    assert "a batch of 2 prompts (shape [2, 3])" in _error(target, [a, a], cfg)
    assert "flat sequence of int token ids" in _error(target, [[1, 2], [3]], cfg)  # ragged
    assert "integer token ids, got torch.float32" in _error(target, [1.0, 2.5], cfg)
    assert "got one number" in _error(target, 7, cfg)
    # one row, as a tokenizer returns it with return_tensors="pt", is that one prompt
    flat = generate(target, None, a, cfg).tokens
    assert generate(target, None, torch.tensor([a]), cfg).tokens == flat
    assert generate(target, None, [a], cfg).tokens == flat
    assert generate(target, None, torch.tensor(a, dtype=torch.int32), cfg).tokens == flat


def _error(target, prompt, cfg) -> str:
    with pytest.raises(ValueError) as e:
        generate(target, None, prompt, cfg)
    return str(e.value)


class _FakeTime:
    """A perf_counter that moves only when a model works: each call of a wrapped method adds
    its cost, so every stage's time is known exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def charging(self, obj, costs: dict[str, float]):
        clock = self

        class Charged:
            def __getattr__(self, name):
                attr = getattr(obj, name)
                if name not in costs:
                    return attr

                def call(*args, **kwargs):
                    clock.now += costs[name]
                    return attr(*args, **kwargs)

                return call

        return Charged()


def test_each_stage_is_charged_what_ran_in_it(target, monkeypatch):
    import ddtree.engine.timing

    fake = _FakeTime()
    monkeypatch.setattr(ddtree.engine.timing, "time", fake)
    prompt = PROMPTS[0]
    ar = _ar(target, prompt)
    costs = {"prefill": 3e-3, "layout": 2e-3, "verify": 7e-3, "commit": 1e-3}
    drafter = fake.charging(ScriptedDrafter(prompt + ar.tokens, 61, 8), {"propose": 5e-3})
    cfg = DecodeConfig("ddtree", block_size=8, budget=16, max_new_tokens=40)
    out = generate(fake.charging(target, costs), drafter, prompt, cfg)
    assert out.tokens == ar.tokens and out.prefill_s == pytest.approx(3e-3)
    want = dict.fromkeys(STEP_STAGES, 0.0) | {"draft": 5e-3, "layout": 2e-3, "verify": 7e-3}
    want["commit"] = 1e-3
    for step in out.steps:
        assert step.stage_s == pytest.approx(want) and step.step_s == pytest.approx(15e-3)
    out = generate(fake.charging(target, costs), None, prompt, DecodeConfig("ar", max_new_tokens=4))
    assert all(s.stage_s == pytest.approx(want | {"draft": 0.0}) for s in out.steps)


def test_a_request_ends_where_on_commit_raises_and_the_next_one_is_unharmed(target):
    prompt = PROMPTS[0]
    ar = _ar(target, prompt)
    cfg = DecodeConfig("ddtree", block_size=8, budget=16, max_new_tokens=40)
    seen: list[int] = []

    class Abort(Exception):
        pass

    def on_commit(tokens: list[int]) -> None:
        seen.extend(tokens)
        if len(seen) >= 5:
            raise Abort

    drafter = ScriptedDrafter(prompt + ar.tokens, 61, 8)
    with pytest.raises(Abort):
        generate(target, drafter, prompt, cfg, on_commit=on_commit)
    assert 5 <= len(seen) < len(ar.tokens) and seen == ar.tokens[: len(seen)]
    drafter = ScriptedDrafter(prompt + ar.tokens, 61, 8)
    assert generate(target, drafter, prompt, cfg).tokens == ar.tokens


def test_the_record_round_trips(target, tmp_path):
    prompt = PROMPTS[0]
    ar = _ar(target, prompt)
    drafter = ScriptedDrafter(prompt + ar.tokens, 61, 8)
    cfg = DecodeConfig("ddtree", block_size=8, budget=16, max_new_tokens=40)
    out = generate(target, drafter, prompt, cfg)
    record = engine_run_record([out], cfg, target.info, None, drafter.info, None)
    path = tmp_path / "run.jsonl"
    write_records(path, [record])
    (back,) = read_records(path)
    assert back.config["policy"] == "ddtree" and back.config["budget"] == 16
    assert back.config["tree_backend"] == backend()  # which tree core ran
    assert back.threads == torch.get_num_threads()  # tune and diagnose compare it
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


def test_a_round_is_in_the_callers_hands_before_its_last_result_is_announced(target):
    """An interrupt right after a progress line that counts a round must keep that round
    (bench engine's SIGTERM test once kept 34 rounds after announcing 35)."""
    from ddtree.engine.sweep import sweep_rounds

    configs = [
        DecodeConfig(policy="ar", max_new_tokens=3),
        DecodeConfig(policy="ar", max_new_tokens=4),
    ]
    held: list[int] = []  # the rounds the caller holds
    seen = []  # (generations announced, rounds held at that moment)
    announced = 0

    def on_result(config, i, result):
        nonlocal announced
        announced += 1
        seen.append((announced, held[-1] if held else 0))

    for points in sweep_rounds(target, None, PROMPTS, configs, on_result=on_result):
        held.append(len(points[0].results))
    assert held == [1, 2, 3]
    assert all(rounds >= n // len(configs) for n, rounds in seen), seen
