"""Losslessness at scale against an independent reference: greedy chain and DDTree output of
the engine equals transformers' own greedy ``generate``, over 1008 random trials.

A trial draws a target (Qwen3, Qwen3-MoE or Llama of a few sizes and vocabularies, random
weights, behind the transformers wrapper or our own decoder with the same weights), a
drafter (a random DFlash drafter on the target's embedding and head, or a scripted drafter
that ranks transformers' continuation first, second, third or not at all, so that deep paths
get accepted too), a block size B, a budget N, a prompt, max_new_tokens and an EOS id (none,
or a token the target does produce). Both policies must return exactly transformers' tokens.

Cost: the reference runs once per group of trials that share a target, a prompt length and
an EOS id, as one batched ``generate`` (equal lengths, so no padding), with the group's
longest max_new_tokens; each trial takes its own prefix (a greedy continuation of l tokens is
the first l tokens of a longer one). A handful of targets serve every trial.

Precision: every model runs in float64. A tree verify and transformers' one-token forwards
sum in different orders; in float32 two logits within ~1e-6 of each other can swap places
between them, a near-tie that is rounding, not a bug in the engine (the fast float32 tests
cover float32). In float64 such swaps would need logits within ~1e-15.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from ddtree.engine import DecodeConfig, generate

from .helpers import (
    ScriptedDrafter,
    decoder_from_hf,
    random_dflash_drafter,
    tiny_hf_target,
    transformers_greedy,
)

GROUPS, TRIALS_PER_GROUP = 42, 24  # 1008 trials
BLOCKS = (2, 3, 4, 6, 8, 12, 16)


@dataclass(frozen=True)
class TargetSpec:
    kind: str  # "qwen3" | "qwen3_moe" | "llama"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    initializer_range: float  # large: peaked, repetitive output; small: flat distributions
    seed: int
    impl: str = "hf"  # the engine's target: "hf" (transformers wrapper) or "decoder" (ours)


TARGETS = (
    TargetSpec("qwen3", 16, 32, 2, 0.5, 0),
    TargetSpec("llama", 61, 32, 2, 0.2, 1, impl="decoder"),
    TargetSpec("qwen3", 257, 48, 3, 0.1, 2, impl="decoder"),
    TargetSpec("llama", 1000, 64, 1, 0.5, 3),
    TargetSpec("qwen3_moe", 61, 32, 2, 0.5, 4, impl="decoder"),
    TargetSpec("qwen3", 16, 32, 2, 0.5, 5, impl="decoder"),
)


@dataclass(frozen=True)
class Trial:
    prompt: list[int]
    max_new_tokens: int
    block: int  # B
    budget: int  # N
    drafter: str  # "dflash" | "scripted"
    drafter_seed: int
    hit: float  # scripted drafter: chance the reference token is ranked first


@dataclass
class Models:
    spec: TargetSpec
    target: object  # HFTarget or DecoderTarget
    reference: object  # the transformers model whose generate is the reference
    frequent: list[int]  # tokens the target produces often: the EOS candidates
    drafters: dict  # (seed, B) -> DFlashDrafter

    def dflash(self, seed: int, block: int):
        key = (seed, block)
        if key not in self.drafters:
            rng = random.Random(seed)
            n_layers = self.spec.num_hidden_layers
            layer_ids = sorted(rng.sample(range(n_layers), rng.randint(1, n_layers)))
            self.drafters[key] = random_dflash_drafter(
                self.target,
                block,
                seed=seed,
                layers=1 + seed % 2,
                target_layer_ids=layer_ids,
                mask_token_id=rng.randrange(self.spec.vocab_size),
            )
        return self.drafters[key]


def _load(spec: TargetSpec) -> Models:
    target = tiny_hf_target(
        spec.kind,
        seed=spec.seed,
        dtype=torch.float64,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2,
        num_hidden_layers=spec.num_hidden_layers,
        initializer_range=spec.initializer_range,
        max_position_embeddings=128,
    )
    gen = torch.Generator().manual_seed(spec.seed)
    probe = torch.randint(0, spec.vocab_size, (8, 6), generator=gen)
    counts = Counter(t for row in transformers_greedy(target.model, probe, 24) for t in row)
    engine_target = decoder_from_hf(target.model) if spec.impl == "decoder" else target
    return Models(spec, engine_target, target.model, [t for t, _ in counts.most_common(6)], {})


def _trials(rng: random.Random, vocab: int, prompt_len: int) -> list[Trial]:
    trials = []
    for _ in range(TRIALS_PER_GROUP):
        block = rng.choice(BLOCKS)
        trials.append(
            Trial(
                prompt=[rng.randrange(vocab) for _ in range(prompt_len)],
                max_new_tokens=rng.randint(1, 24),
                block=block,
                budget=rng.choice([1, 2, block - 1, rng.randint(1, 24), rng.randint(24, 96)]),
                drafter=rng.choice(["dflash", "scripted"]),
                drafter_seed=rng.randrange(3),
                hit=rng.choice([0.5, 0.8, 1.0]),
            )
        )
    return trials


@dataclass
class Outcome:
    trials: int = 0
    mismatches: list = field(default_factory=list)  # (spec, trial, policy, eos, ours, theirs)
    stops: Counter = field(default_factory=Counter)  # stop reason -> runs
    taus: Counter = field(default_factory=Counter)  # tau -> steps


def run_trials(groups: int, seed: int = 13) -> Outcome:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    models = [_load(spec) for spec in TARGETS]
    outcome = Outcome()
    for group in range(groups):
        m = models[group % len(models)]
        vocab = m.spec.vocab_size
        eos = () if rng.random() < 0.25 else (rng.choice(m.frequent),)
        trials = _trials(rng, vocab, prompt_len=rng.randint(1, 24))
        prompts = torch.tensor([t.prompt for t in trials])
        longest = max(t.max_new_tokens for t in trials)
        reference = transformers_greedy(m.reference, prompts, longest, eos)
        for trial, ref in zip(trials, reference, strict=True):
            expected = ref[: trial.max_new_tokens]
            for policy in ("chain", "ddtree"):
                if trial.drafter == "dflash":
                    drafter = m.dflash(trial.drafter_seed, trial.block)
                else:
                    script = trial.prompt + ref
                    drafter = ScriptedDrafter(
                        script, vocab, trial.block, hit=trial.hit, seed=trial.drafter_seed
                    )
                cfg = DecodeConfig(
                    policy,
                    block_size=trial.block,
                    budget=trial.budget,
                    max_new_tokens=trial.max_new_tokens,
                    eos_token_ids=eos,
                )
                out = generate(m.target, drafter, trial.prompt, cfg)
                if out.tokens != expected:
                    outcome.mismatches.append((m.spec, trial, policy, eos, out.tokens, expected))
                outcome.stops[out.stop_reason] += 1
                outcome.taus.update(out.taus)
            outcome.trials += 1
    return outcome


@pytest.mark.slow
def test_greedy_chain_and_ddtree_equal_transformers_generate_over_1000_random_trials():
    out = run_trials(GROUPS)
    assert out.trials >= 1000
    assert not out.mismatches, f"{len(out.mismatches)} mismatches, first: {out.mismatches[0]}"
    # the trials reach what they are meant to: EOS stops (the first token included) and
    # deep accepted paths, not only tau = 1 steps
    assert out.stops["eos"] >= 0.15 * sum(out.stops.values()), out.stops
    deep = sum(n for t, n in out.taus.items() if t >= 4)
    assert max(out.taus) >= 12 and deep >= 200, out.taus
