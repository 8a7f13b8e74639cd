"""The drafter evaluation decodes through the engine: its outputs are transformers' greedy
``generate`` (EOS honoured) and its taus are the engine's (only returned tokens)."""

from __future__ import annotations

import torch
from tests.engine.helpers import random_dflash_drafter, tiny_hf_target, transformers_greedy

from ddtree.engine import DecodeConfig, generate
from ddtree.train.eval import greedy_acceptance


def test_greedy_acceptance_decodes_as_transformers_and_reports_the_engines_taus():
    target = tiny_hf_target("llama", seed=4, vocab_size=16)
    drafter = random_dflash_drafter(target, block=4, seed=1)
    prompts = torch.randint(0, 16, (3, 6), generator=torch.Generator().manual_seed(2))
    free = transformers_greedy(target.model, prompts, 12)
    eos = free[0][5]  # a token the first prompt's continuation does produce
    target.info.eos_token_ids = (eos,)

    result = greedy_acceptance(target, drafter, prompts, budget=16, max_new_tokens=12)

    assert result.outputs == transformers_greedy(target.model, prompts, 12, (eos,))
    assert result.outputs[0][-1] == eos and len(result.outputs[0]) <= 6
    for prompt, out, taus in zip(prompts, result.outputs, result.taus, strict=True):
        assert sum(taus) == len(out) - 1  # the first token comes from the prefill
        engine = generate(target, drafter, prompt, DecodeConfig("ddtree", 4, 16, 12))
        assert engine.taus == taus
    flat = [t for per in result.taus for t in per]
    assert result.mean_tau == sum(flat) / len(flat) and result.mean_tau > 1  # N=16 >= V
