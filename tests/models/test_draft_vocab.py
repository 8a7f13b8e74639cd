"""A reduced draft vocabulary (``--draft-vocab K``, ``ddtree.models.adapters.draft_vocab``): the K ids,
the K-row head, the drafter's proposes over them, the trees built from them, and greedy
output equal to AR on a tiny random pair and on the bundled demo pair."""

from __future__ import annotations

import json

import pytest
import torch
from tests.engine.helpers import random_dflash_drafter, tiny_mla_target
from torch import nn

from ddtree import tree as tree_core
from ddtree.engine import DecodeConfig, generate
from ddtree.engine.propose import proposer_for
from ddtree.engine.timing import StageClock
from ddtree.models.adapters.draft_vocab import (
    COUNTS_FILE,
    DraftVocabError,
    check_draft_vocab,
    draft_vocab_ids,
    head_rows,
    load_token_counts,
    most_frequent,
    save_token_counts,
    token_counts,
)
from ddtree.models.nn.linear import PackedLinear, packed_unavailable
from ddtree.vocab import get_policy


def test_token_counts_worked_example():
    assert token_counts([[3, 1, 3], [1, 3]], 5).tolist() == [0, 2, 0, 3, 0]
    assert token_counts([torch.tensor([4, 4])], 5).tolist() == [0, 0, 0, 0, 2]
    with pytest.raises(DraftVocabError, match="outside the vocabulary 0..4"):
        token_counts([[1, 5]], 5)


def test_most_frequent_worked_example():
    counts = torch.tensor([0, 2, 0, 3, 0])
    assert most_frequent(counts, 2, always=(0,)).tolist() == [0, 3]  # EOS in at count 0
    assert most_frequent(counts, 3, always=(0,)).tolist() == [0, 1, 3]
    assert most_frequent(counts, 4, always=(0,)).tolist() == [0, 1, 2, 3]  # 2 and 4 tie: 2
    assert most_frequent(counts, 2).tolist() == [1, 3]
    assert most_frequent(counts, 5) is None and most_frequent(counts, 99) is None  # K >= V
    with pytest.raises(DraftVocabError, match="fewer than the 2 special tokens"):
        most_frequent(counts, 1, always=(0, 4))


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True, None])
def test_a_token_count_below_one_or_not_an_integer_names_the_flag(bad):
    with pytest.raises(DraftVocabError, match="--draft-vocab: expected a token count >= 1"):
        check_draft_vocab(bad)


def test_no_flag_or_k_at_least_v_is_the_full_vocabulary_and_reads_no_counts():
    def never():
        raise AssertionError("counts read for the full vocabulary")

    assert draft_vocab_ids(None, 5, never) is None
    assert draft_vocab_ids(5, 5, never) is None
    assert draft_vocab_ids(2, 5, lambda: torch.tensor([0, 2, 0, 3, 0])).tolist() == [1, 3]


def test_counts_round_trip_and_a_wrong_file_is_named(tmp_path):
    counts = torch.tensor([5, 0, 7])
    path = save_token_counts(tmp_path, counts, "three tokens")
    assert path.name == COUNTS_FILE and json.loads(path.read_text())["source"] == "three tokens"
    assert load_token_counts(tmp_path, 3).tolist() == [5, 0, 7]
    with pytest.raises(DraftVocabError, match="expected a list of 4 integers >= 0"):
        load_token_counts(tmp_path, 4)
    path.write_text(json.dumps({"token_counts": [1, -1, 2]}))
    with pytest.raises(DraftVocabError, match="token_counts: expected a list of 3"):
        load_token_counts(tmp_path, 3)
    path.unlink()
    with pytest.raises(DraftVocabError, match=f"{COUNTS_FILE} not found"):
        load_token_counts(tmp_path, 3)


def test_the_k_row_head_computes_those_columns_of_the_full_head():
    torch.manual_seed(0)
    head = nn.Linear(16, 40, bias=True)
    ids = torch.tensor([0, 3, 17, 39])
    x = torch.randn(5, 16)
    cut = head_rows(head, ids)
    assert cut.weight.shape == (4, 16)
    torch.testing.assert_close(cut(x), head(x)[:, ids])
    with pytest.raises(DraftVocabError, match="only a linear head"):
        head_rows(nn.Embedding(40, 16), ids)


@pytest.mark.skipif(
    packed_unavailable(torch.device("cpu"), torch.bfloat16) is not None,
    reason="no oneDNN bfloat16 here",
)
def test_a_packed_head_is_cut_and_packed_again():
    torch.manual_seed(0)
    head = nn.Linear(64, 300, bias=False).to(torch.bfloat16)
    ids = torch.tensor([1, 2, 150, 299])
    cut = head_rows(PackedLinear(head), ids)
    assert isinstance(cut, PackedLinear) and cut.out_features == 4
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(cut(x), head(x)[:, ids], atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(1)
    target = tiny_mla_target(seed=3)
    return target, random_dflash_drafter(target, block=4, seed=2, output_multiplier=0.3)


def test_propose_returns_the_k_columns_and_the_tree_holds_only_those_ids(pair):
    target, drafter = pair
    ids = torch.tensor([0, 2, 5, 7, 11, 13, 20, 31, 40, 59])  # K = 10 of V = 61
    prompt = torch.arange(3, 13)
    target.set_capture_layers(drafter.target_layer_ids)
    target.reset()
    hidden = target.prefill(prompt).hidden  # [10, F]
    drafter.restrict_vocab(None)
    drafter.reset()
    full = drafter.propose(hidden, 13)  # [B-1, V]
    drafter.restrict_vocab(ids)
    assert drafter.info.draft_vocab == 10 and drafter.draft_tokens.tolist() == ids.tolist()
    proposer = proposer_for(get_policy("ddtree"), drafter, 4, 12, target.device)
    proposer.observe(hidden)
    tree = proposer.propose(13, StageClock(sync_cuda=False, profile=False))
    drafter.reset()
    cut = drafter.propose(hidden, 13)  # [B-1, K]
    torch.testing.assert_close(cut, full[:, ids])
    assert set(tree.tokens[1:].tolist()) <= set(ids.tolist())
    # the same tree as the full drafter's logits with every other id at -inf
    masked = torch.full_like(full, float("-inf"))
    masked[:, ids] = full[:, ids]
    top = tree_core.topk_logprobs(masked, 12)
    expected = tree_core.build_tree(13, top.logprobs, top.tokens, 12)
    assert tree.tokens.tolist() == expected.tokens.tolist()
    assert tree.parents.tolist() == expected.parents.tolist()
    torch.testing.assert_close(tree.scores, expected.scores)
    drafter.restrict_vocab(None)
    assert drafter.draft_tokens is None and drafter.info.draft_vocab == 0


@pytest.mark.parametrize("k", [1, 8, 30])
def test_greedy_output_with_a_draft_vocabulary_equals_ar_on_a_tiny_random_pair(pair, k):
    target, drafter = pair
    prompts = [[5, 9, 2, 44, 17, 3], list(range(20, 32))]
    ar = [generate(target, None, p, DecodeConfig("ar", max_new_tokens=24)).tokens for p in prompts]
    counts = token_counts(ar, 61)  # the ids the target actually emits count most
    drafter.restrict_vocab(most_frequent(counts, k))
    try:
        for prompt, want in zip(prompts, ar, strict=True):
            for policy, budget in (("chain", 3), ("ddtree", 16)):
                cfg = DecodeConfig(policy, block_size=4, budget=budget, max_new_tokens=24)
                assert generate(target, drafter, prompt, cfg).tokens == want, (k, policy)
    finally:
        drafter.restrict_vocab(None)


def test_greedy_output_with_a_draft_vocabulary_equals_ar_on_the_demo_pair():
    from ddtree.commands._decode import DEMO_DIR, TextCodec, demo_prompts
    from ddtree.models import load_drafter, load_target

    torch.set_num_threads(1)
    target = load_target(DEMO_DIR / "target", dtype=torch.float32)
    codec = TextCodec(DEMO_DIR / "target")
    prompts = [codec.encode(p) for p in demo_prompts()[:2]]
    ar = [generate(target, None, p, DecodeConfig("ar", max_new_tokens=32)).tokens for p in prompts]
    for k in (64, 512):
        drafter = load_drafter(DEMO_DIR / "drafter", target, draft_vocab=k)
        assert drafter.info.draft_vocab == k and drafter.draft_head.out_features == k
        assert set(target.info.eos_token_ids) <= set(drafter.draft_tokens.tolist())
        cfg = DecodeConfig("ddtree", block_size=8, budget=32, max_new_tokens=32)
        for prompt, want in zip(prompts, ar, strict=True):
            assert generate(target, drafter, prompt, cfg).tokens == want, k
    full = load_drafter(DEMO_DIR / "drafter", target, draft_vocab=4096)  # K >= V: no-op
    assert full.draft_tokens is None and full.info.draft_vocab == 0
