"""Sampled decoding follows the target's distribution exactly: the engine's joint distribution
of the first new tokens, over many seeds, against the exact one computed from the target's
own processed (temperature, top-k, top-p) distributions, by a chi-square test."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ddtree.engine import DecodeConfig, generate
from ddtree.tree import process_logits

from .helpers import ScriptedDrafter, random_dflash_drafter, tiny_mla_target

VOCAB, PROMPT, BLOCK = 4, [1, 2, 3], 4


def _chi2_threshold(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _exact_distribution(target, n: int, temperature, top_k, top_p) -> dict[tuple, float]:
    """P(t1..tn | prompt) from the target's own processed distributions, one prefill per
    prefix."""

    def logprobs(prefix: tuple) -> torch.Tensor:  # [V]
        target.reset()
        logits = target.prefill(torch.tensor(PROMPT + list(prefix))).logits[-1]
        return process_logits(logits, temperature, top_k, top_p)

    probs = {(): 0.0}  # log-probability of each prefix
    for _ in range(n):
        longer = {}
        for prefix, lp in probs.items():
            if lp == float("-inf"):
                continue  # filtered out: its continuations never occur
            step = logprobs(prefix)
            longer.update({prefix + (t,): lp + float(step[t]) for t in range(step.shape[0])})
        probs = longer
    return {seq: math.exp(lp) for seq, lp in probs.items()}


def _chi2_against_exact(
    policy, budget, n, samples, temperature, top_k=0, top_p=1.0, draft_tokens=None
):
    """``draft_tokens`` [K]: a random DFlash drafter proposing over those ids only (a draft
    vocabulary) instead of the scripted one."""
    target = tiny_mla_target(seed=1, scale=0.3, vocab_size=VOCAB)
    dflash = None
    if draft_tokens is not None:
        dflash = random_dflash_drafter(target, BLOCK, target_layer_ids=(0,), output_multiplier=0.1)
        dflash.restrict_vocab(torch.tensor(draft_tokens))
    exact = _exact_distribution(target, n, temperature, top_k, top_p)
    exact.update({s: 0.0 for s in itertools.product(range(VOCAB), repeat=n) if s not in exact})
    counts = dict.fromkeys(exact, 0)
    script = [0] * 16  # the drafter's guesses are noise: acceptance does the work
    for seed in range(samples):
        drafter = dflash or ScriptedDrafter(script, VOCAB, BLOCK, hit=0.5, seed=seed)
        cfg = DecodeConfig(
            policy,
            block_size=BLOCK,
            budget=budget,
            max_new_tokens=n,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        )
        counts[tuple(generate(target, drafter, PROMPT, cfg).tokens)] += 1
    assert sum(counts[c] for c in exact if exact[c] == 0) == 0  # filtered tokens never appear
    cells = [(counts[c], exact[c] * samples) for c in exact if exact[c] * samples >= 5]
    rare = [c for c in exact if 0 < exact[c] * samples < 5]  # pooled into one cell
    cells.append((sum(counts[c] for c in rare), sum(exact[c] for c in rare) * samples))
    cells = [(o, e) for o, e in cells if e > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    assert chi2 < _chi2_threshold(len(cells) - 1), (chi2, len(cells))


@pytest.mark.parametrize(
    "policy, budget, top_p", [("chain", 0, 1.0), ("ddtree", 6, 1.0), ("ddtree", 6, 0.9)]
)
def test_sampled_decoding_follows_the_target_distribution(policy, budget, top_p):
    _chi2_against_exact(policy, budget, n=2, samples=1200, temperature=1.0, top_p=top_p)


def test_sampled_decoding_with_a_draft_vocabulary_follows_the_target_distribution():
    # the drafter proposes ids 0 and 2 only (its LM head computes 2 of 4 rows); tokens 1 and
    # 3 come from the target's own draws, and the joint distribution is still the target's
    _chi2_against_exact("ddtree", 6, n=2, samples=1200, temperature=1.0, draft_tokens=[0, 2])


@pytest.mark.slow
@pytest.mark.parametrize(
    "temperature, top_k, top_p, budget",
    [(0.7, 3, 1.0, 3), (0.7, 0, 0.85, 12), (1.0, 3, 1.0, 12), (1.0, 0, 0.85, 3)],
)
def test_sampled_ddtree_three_token_distribution(temperature, top_k, top_p, budget):
    # three tokens: what a step accepts at depth 2 enters the joint distribution
    _chi2_against_exact("ddtree", budget, 3, 1500, temperature, top_k, top_p)
