"""The compiled engine mode (``ddtree.models.static``): the same decode loop through
``torch.compile``d forwards at static shapes is as lossless as eager, and its logits match
eager's within float tolerance.

Compiling is the cost here (tens of seconds per graph on a 2-core CPU), so the tests share a
few graphs: one tiny target per module with a single width bucket, which every policy pads
into (AR's width 1 and chain's width B included: padding is exercised on every step).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.trees import make_tree

from ddtree.engine import DecodeConfig, generate
from ddtree.models.static import EnginePlan

from .helpers import ScriptedDrafter, tiny_mla_target
from .test_loop import PROMPTS
from .test_sampled import PROMPT, _chi2_threshold, _exact_distribution

pytestmark = pytest.mark.slow

WIDTH = 9  # the one bucket: ddtree budget 8 fills it; AR (1), chain B=4 (4), budget 4 (5) pad
TOL = 1e-5


@pytest.fixture(scope="module")
def target():
    return tiny_mla_target(seed=0)


def _cfg(policy, mode, **kw):
    kw = {"block_size": 4, "budget": 8, "max_new_tokens": 24, "buckets": (WIDTH,), **kw}
    return DecodeConfig(policy, engine_mode=mode, **kw)


def test_compiled_greedy_ddtree_and_chain_equal_compiled_and_eager_ar(target):
    compile_s = {}
    for i, prompt in enumerate(PROMPTS):
        eager_ar = generate(target, None, prompt, _cfg("ar", "eager"))
        ar = generate(target, None, prompt, _cfg("ar", "compiled"))
        assert ar.tokens == eager_ar.tokens, i
        compile_s.setdefault("ar", []).append(ar.compile_s)
        script = prompt + ar.tokens
        for policy, budget in (("chain", 0), ("ddtree", 4), ("ddtree", 8)):
            drafter = ScriptedDrafter(script, target.info.vocab_size, 4, seed=i)
            out = generate(target, drafter, prompt, _cfg(policy, "compiled", budget=budget))
            assert out.tokens == ar.tokens, (policy, budget, i)
            assert all(1 <= t <= 4 for t in out.taus)
            compile_s.setdefault("drafted", []).append(out.compile_s)
            # a compile inside a step would take seconds; compiled steps here take ms
            assert max(s.step_s for s in out.steps) < 0.1 * max(compile_s["drafted"])
    # each graph (width 9 without / with the drafter's capture layers) compiled once, in the
    # warm-up of the first request that needed it, and is reused afterwards
    assert compile_s["ar"][0] > 0 and compile_s["drafted"][0] > 0
    assert not any(compile_s["ar"][1:]) and not any(compile_s["drafted"][1:])


def test_compiled_forwards_match_eager_within_float_tolerance(target):
    """Prefill, verify, commit, verify again: logits, hidden states and committed cache rows."""
    prompt = torch.tensor(PROMPTS[2])
    trees = [make_tree([12, 40, 7, 55, 40, 19, 3], [-1, 0, 0, 1, 1, 3, 2]), make_tree([4], [-1])]
    runs = {}
    for mode in ("eager", "compiled"):
        target.set_capture_layers([1])  # the scripted drafter's: the same graph
        target.set_engine_mode(EnginePlan(mode, (WIDTH,), max_len=64))
        outs = [target.prefill(prompt)]
        for tree, accepted in zip(trees, ([0, 1, 3, 5], [0]), strict=True):
            outs.append(target.verify(tree, target.layout(tree)))
            target.commit(torch.tensor(accepted))
        outs.append(target.prefill(torch.tensor([30, 31])))
        runs[mode] = (outs, target.cache.rows[:, : target.seq_len].clone())
    (eager, eager_rows), (compiled, compiled_rows) = runs["eager"], runs["compiled"]
    for e, c in zip(eager, compiled, strict=True):
        assert e.logits.shape == c.logits.shape and e.hidden.shape == c.hidden.shape
        assert (e.logits - c.logits).abs().max() <= TOL
        assert (e.hidden - c.hidden).abs().max() <= TOL
    assert (eager_rows - compiled_rows).abs().max() <= TOL


def test_a_tree_wider_than_every_bucket_is_refused(target):
    target.set_capture_layers([])
    target.set_engine_mode(EnginePlan("compiled", (WIDTH,), max_len=64))
    target.prefill(torch.tensor(PROMPTS[0]))
    wide = make_tree(list(range(WIDTH + 1)), [-1] + [0] * WIDTH)
    with pytest.raises(ValueError, match=r"width 10 exceeds the largest width bucket 9"):
        target.layout(wide)


@pytest.mark.parametrize("policy", ["chain", "ddtree"])
def test_compiled_sampled_decoding_follows_the_target_distribution(target, policy):
    """Two sampled tokens under top-k 2 (at most 4 outcomes) against the exact distribution;
    the drafter proposes the greedy continuation half the time, so trees hold the likely
    tokens and both acceptance and rejection happen."""
    temperature, top_k, samples, prompt = 1.0, 2, 1000, PROMPT
    target.set_engine_mode(EnginePlan())
    exact = _exact_distribution(target, 2, temperature, top_k, 1.0)
    script = prompt + generate(target, None, prompt, _cfg("ar", "eager", max_new_tokens=4)).tokens
    counts = dict.fromkeys(exact, 0)
    for seed in range(samples):
        drafter = ScriptedDrafter(script, target.info.vocab_size, 4, hit=0.5, seed=seed)
        cfg = _cfg(policy, "compiled", max_new_tokens=2, temperature=temperature, top_k=top_k)
        counts[tuple(generate(target, drafter, prompt, replace(cfg, seed=seed)).tokens)] += 1
    assert sum(counts[c] for c in exact if exact[c] == 0) == 0  # outside the top 2: never
    cells = [(counts[c], exact[c] * samples) for c in exact if exact[c] > 0]
    assert len(cells) == 4 and min(e for _, e in cells) >= 5
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    assert chi2 < _chi2_threshold(len(cells) - 1), (chi2, counts)


def _random_dflash(target, block: int):
    from ddtree.models.adapters.dflash import DFlashDrafter
    from ddtree.models.nn.dflash import DFlashConfig, DFlashModel

    raw = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 61,
        "rope_theta": 10000.0,
        "block_size": block,
        # capture layer 1 in HF indexing, as the scripted drafter: the target's graph is shared
        "dflash_config": {"mask_token_id": 60, "target_layer_ids": [0]},
    }
    torch.manual_seed(block)
    model = DFlashModel(DFlashConfig.from_dict(raw))
    return DFlashDrafter(model, target.embed_tokens, target.lm_head, capacity=8)


def test_compiled_dflash_propose_matches_eager_and_decodes_losslessly(target):
    drafter = _random_dflash(target, 4)
    torch.manual_seed(0)
    # a first context longer than the block (appended eagerly, then the last B rows padded),
    # then every new-context length a step can commit (1..B), growing past the capacity
    chunks = [torch.randn(n, 32) for n in (11, 1, 4, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4)]
    proposals = {}
    for mode in ("eager", "compiled"):
        drafter.set_engine_mode(EnginePlan(mode, (WIDTH,), max_len=16))
        proposals[mode] = [drafter.propose(c, 7 + i) for i, c in enumerate(chunks)]
    for i, (e, c) in enumerate(zip(proposals["eager"], proposals["compiled"], strict=True)):
        assert e.shape == c.shape == (3, 61)
        assert (e - c).abs().max() <= TOL, i
    for prompt in PROMPTS:
        ar = generate(target, None, prompt, _cfg("ar", "compiled"))
        for policy in ("chain", "ddtree"):
            out = generate(target, drafter, prompt, _cfg(policy, "compiled"))
            assert out.tokens == ar.tokens, (policy, prompt)


def test_compiled_dflash_with_a_draft_vocabulary_matches_eager_and_decodes_losslessly(target):
    drafter = _random_dflash(target, 4)
    ids = torch.arange(0, 61, 3)  # K = 21 of V = 61
    torch.manual_seed(1)
    chunks = [torch.randn(n, 32) for n in (11, 1, 4, 2, 3)]
    full = []
    drafter.set_engine_mode(EnginePlan("eager", (WIDTH,), max_len=16))
    full = [drafter.propose(c, 7 + i) for i, c in enumerate(chunks)]
    drafter.restrict_vocab(ids)
    drafter.set_engine_mode(EnginePlan("compiled", (WIDTH,), max_len=16))
    for i, c in enumerate(chunks):
        cut = drafter.propose(c, 7 + i)
        assert cut.shape == (3, 21)
        assert (cut - full[i][:, ids]).abs().max() <= TOL, i
    for prompt in PROMPTS:
        ar = generate(target, None, prompt, _cfg("ar", "compiled"))
        for policy in ("chain", "ddtree"):
            out = generate(target, drafter, prompt, _cfg(policy, "compiled"))
            assert out.tokens == ar.tokens, (policy, prompt)
