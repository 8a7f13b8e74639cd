import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tree.reference import accept_ref, compaction_ref, mask_ref

from ddtree.tree import (
    accept_greedy,
    accept_greedy_batch,
    accept_sampled,
    build_tree,
    build_trees,
    compaction_indices,
    pack_bits,
    process_logits,
    sample_token,
    topk_logprobs,
    verify_layout,
)


def _tree(seed, n_depth=4, k=4, budget=12, vocab=6):
    g = torch.Generator().manual_seed(seed)
    top = topk_logprobs(torch.randn(n_depth, vocab, generator=g), k)
    return build_tree(
        int(torch.randint(vocab, (1,), generator=g)), top.logprobs, top.tokens, budget
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("start", [0, 5])
def test_mask_matches_reference(dtype, start):
    tree = _tree(1)
    layout = verify_layout(tree, start, dtype)
    m = tree.n_nodes
    assert layout.attn_mask.shape == (1, 1, m, start + m) and layout.attn_mask.dtype == dtype
    ref = mask_ref(tree.parents.numpy(), start, float(torch.finfo(dtype).min))
    assert np.array_equal(layout.attn_mask[0, 0].double().numpy(), ref)
    assert layout.position_ids.tolist() == (start + tree.depth).tolist()


def test_pack_bits_worked_example():
    vis = torch.tensor([[True, False, True]])
    assert pack_bits(vis).tolist() == [[5]]
    wide = torch.zeros(1, 70, dtype=torch.bool)
    wide[0, 63] = wide[0, 64] = True
    assert pack_bits(wide).tolist() == [[-(2**63), 1]]


def test_ancestor_bits_round_trip():
    tree = _tree(2, budget=100, k=6, vocab=12, n_depth=6)
    bits = pack_bits(verify_layout(tree, 0).visibility)
    m = tree.n_nodes
    j = torch.arange(m)
    unpacked = ((bits[:, j // 64] >> (j % 64)) & 1).bool()
    assert torch.equal(unpacked, tree.visibility)


@pytest.mark.parametrize("seed", range(30))
def test_greedy_acceptance_matches_the_reference_walk(seed):
    tree = _tree(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    # bias target tokens towards tree tokens so that long paths occur
    target = torch.where(
        torch.rand(tree.n_nodes, generator=g) < 0.7,
        tree.tokens[torch.randint(tree.n_nodes, (tree.n_nodes,), generator=g)],
        torch.randint(6, (tree.n_nodes,), generator=g),
    )
    res = accept_greedy(tree, target)
    path, bonus, tau = accept_ref(tree.tokens.numpy(), tree.parents.numpy(), target.numpy())
    assert res.accepted.tolist() == path.tolist()
    assert (res.bonus_token, res.tau) == (bonus, tau)


def test_greedy_acceptance_worked_example():
    # root 5 -> 7 -> {3, 4}; target says after root: 7, after 7: 4, after 4: 9
    lp = torch.tensor([[-0.1, -2.0], [-0.5, -0.7]])
    tree = build_tree(5, lp, torch.tensor([[7, 8], [3, 4]]), 3)
    res = accept_greedy(tree, torch.tensor([7, 4, 0, 9]))
    assert res.accepted.tolist() == [0, 1, 3] and res.bonus_token == 9 and res.tau == 3
    res = accept_greedy(tree, torch.tensor([8, 4, 0, 9]))
    assert res.accepted.tolist() == [0] and res.bonus_token == 8 and res.tau == 1


def test_batched_greedy_acceptance_matches_single():
    g = torch.Generator().manual_seed(3)
    top = topk_logprobs(torch.randn(4, 3, 6, generator=g), 3)
    roots = torch.tensor([0, 1, 2, 3])
    batch = build_trees(roots, top.logprobs, top.tokens, 10)
    target = torch.randint(6, batch.tokens.shape, generator=g)
    target[:, 0] = batch.tokens[:, 1]  # first child always accepted
    ok, tau, bonus = accept_greedy_batch(batch.tokens, batch.parents, batch.visibility, target)
    for r in range(4):
        tree = batch.tree(r)
        res = accept_greedy(tree, target[r, : tree.n_nodes])
        assert ok[r].nonzero().squeeze(1).tolist() == res.accepted.tolist()
        assert int(tau[r]) == res.tau and int(bonus[r]) == res.bonus_token


@settings(max_examples=40, deadline=None)
@given(start=st.integers(0, 50), picks=st.lists(st.integers(1, 30), max_size=8, unique=True))
def test_compaction_matches_reference(start, picks):
    accepted = torch.tensor([0] + sorted(picks))
    plan = compaction_indices(accepted, start)
    src, dst, new_len = compaction_ref(accepted.numpy(), start)
    assert plan.src.tolist() == src.tolist() and plan.dst.tolist() == dst.tolist()
    assert plan.new_len == new_len
    cache = torch.arange(start + 31)
    compacted = cache.clone()
    compacted[plan.dst] = cache.index_select(0, plan.src)
    assert compacted[: plan.new_len].tolist() == list(range(start)) + (start + accepted).tolist()


def test_compaction_worked_example():
    plan = compaction_indices(torch.tensor([0, 2, 5]), 10)
    assert plan.src.tolist() == [10, 12, 15] and plan.dst.tolist() == [10, 11, 12]
    assert plan.new_len == 13


def test_process_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(process_logits(logits, 1.0, top_k=2)[2:]).all()
    kept = torch.isfinite(process_logits(logits, 1.0, top_p=0.7))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert torch.isfinite(process_logits(logits, 1.0, top_p=0.5)).tolist() == [
        True,
        False,
        False,
        False,
    ]
    with pytest.raises(ValueError, match="temperature"):
        process_logits(logits, 0.0)


def test_sampled_acceptance_is_lossless_on_a_two_token_vocabulary():
    """Exact check: P(first committed token) under sampled acceptance equals the target's."""
    lp = torch.log(torch.tensor([[0.9, 0.1]]))
    tree = build_tree(0, lp, torch.tensor([[1, 0]]), 2)  # root -> {1, 0}
    target_logits = torch.log(torch.tensor([[0.3, 0.7], [0.5, 0.5], [0.5, 0.5]]))
    g = torch.Generator().manual_seed(0)
    n, ones = 4000, 0
    for _ in range(n):
        res = accept_sampled(tree, target_logits, 1.0, generator=g)
        first = int(tree.tokens[res.accepted[1]]) if res.tau > 1 else res.bonus_token
        ones += first == 1
    p = ones / n
    assert abs(p - 0.7) < 4 * (0.7 * 0.3 / n) ** 0.5


def test_sample_token_greedy_and_seeded():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    assert sample_token(logits, 0.0).tolist() == [1, 0]
    a = sample_token(logits, 1.0, generator=torch.Generator().manual_seed(5))
    b = sample_token(logits, 1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def _top_p_keep_ref(logits: np.ndarray, top_p: float) -> np.ndarray:
    # keep a token if the mass of the tokens ranked before it is < top_p (numpy, full sort)
    z = logits - logits.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    order = np.argsort(-logits, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, -1)
    before = np.cumsum(sorted_p, -1) - sorted_p
    keep = np.zeros_like(logits, dtype=bool)
    np.put_along_axis(keep, order, before < top_p, -1)
    return keep


@pytest.mark.parametrize("scale, top_p", [(4.0, 0.9), (0.3, 0.9), (1.0, 0.5), (0.05, 0.99)])
def test_top_p_head_path_and_full_sort_agree_with_the_reference(scale, top_p):
    # scale 4: the nucleus lies in the top 64; 1.0: in the top 512; 0.3 / 0.05: full sort
    g = torch.Generator().manual_seed(0)
    logits = scale * torch.randn(5, 3000, generator=g, dtype=torch.float64)
    kept = torch.isfinite(process_logits(logits, 1.0, top_p=top_p)).numpy()
    ref = _top_p_keep_ref(logits.numpy(), top_p)
    assert (kept == ref).all()


def test_sample_token_draws_follow_the_probabilities_and_skip_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    logits = torch.log(probs)  # -inf where zero
    g = torch.Generator().manual_seed(11)
    draws = sample_token(logits.expand(20000, -1), 1.0, generator=g)
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0
    expected = probs.double() * 20000
    chi2 = float(((counts - expected)[expected > 0] ** 2 / expected[expected > 0]).sum())
    assert chi2 < 13.8  # chi-square, 2 degrees of freedom, p = 0.001
