"""The heart of replay: per-step taus replayed from a trace equal the engine's
``GenerationResult.taus`` for the same prompts, policies and budgets (greedy decoding)."""

from __future__ import annotations

import pytest
from tests.engine.helpers import random_dflash_drafter, tiny_hf_target, tiny_mla_target
from tests.replay.helpers import record_trace, replay_prompt

from ddtree.replay.check import check_against_engine

# A 12-token vocabulary lets trees of 12..150 nodes cover whole depths, so random pairs
# accept 2-3 draft tokens per step at the larger budgets.
VOCAB = 12
PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2]]


def assert_exact(target, drafter, prompts, budgets, max_new_tokens, eos=None, deepest=3):
    trace = record_trace(target, drafter, prompts, max_new_tokens, eos_token_ids=eos)
    report = check_against_engine(trace, target, drafter, ("chain", "ddtree"), budgets)
    assert report.lossless  # the engine reproduces the trace's greedy continuation
    assert report.walks_equal  # trees shared across budgets give each budget's taus
    assert report.mismatched_steps == 0, [(r.policy, r.budget, r.mismatched) for r in report.runs]
    taus = [
        t for i in range(len(prompts)) for t in replay_prompt(trace, i, "ddtree", max(budgets)).taus
    ]
    assert max(taus) >= deepest  # the check covers steps that accept several draft tokens
    return report


def test_replay_equals_the_engine_on_a_random_mla_pair():
    target = tiny_mla_target(seed=1, vocab_size=VOCAB)
    drafter = random_dflash_drafter(target, 4, seed=2, layers=2, output_multiplier=0.1)
    report = assert_exact(target, drafter, PROMPTS[:2], [2, 12, 150], 16)
    assert report.steps > 40


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, output_multiplier", [("qwen3", 0.1), ("llama", 1.0), ("mla", 0.1), ("mla", 1.0)]
)
def test_replay_equals_the_engine_on_random_pairs(kind, output_multiplier):
    if kind == "mla":
        target = tiny_mla_target(seed=3, vocab_size=VOCAB)
    else:
        target = tiny_hf_target(kind, seed=3, vocab_size=VOCAB)
    drafter = random_dflash_drafter(
        target, 8, seed=4, layers=2, output_multiplier=output_multiplier
    )
    report = assert_exact(target, drafter, PROMPTS, [1, 4, 24, 150], 20)
    assert report.steps > 80


def test_replay_stops_where_the_engine_stops_at_eos():
    target = tiny_mla_target(seed=1, vocab_size=VOCAB)
    drafter = random_dflash_drafter(target, 4, seed=2, layers=2, output_multiplier=0.1)
    full = record_trace(target, drafter, PROMPTS[:1], 24)
    eos = int(full.sequence(0)[len(PROMPTS[0]) + 9])  # a token the continuation reaches
    trace = record_trace(target, drafter, PROMPTS[:1], 24, eos_token_ids=[eos])
    assert trace.header.prompts[0].stop_reason == "eos"
    assert trace.header.prompts[0].new_tokens <= 10
    assert_exact(target, drafter, PROMPTS[:1], [2, 40], 24, eos=[eos], deepest=2)


@pytest.mark.slow
def test_replay_equals_the_engine_on_the_bundled_pair():
    from ddtree.commands._decode import DEMO_DIR, TextCodec, demo_prompts
    from ddtree.models import load_drafter, load_target

    target = load_target(DEMO_DIR / "target")
    drafter = load_drafter(DEMO_DIR / "drafter", target)
    codec = TextCodec(DEMO_DIR / "target")
    prompts = [codec.encode(p) for p in demo_prompts()[:2]]
    report = assert_exact(target, drafter, prompts, [1, 8, 32, 256], 40, deepest=8)
    assert report.steps > 60
