"""Trace files, the replay walk on hand-made traces, and acceptance statistics with known
answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.replay.simulate import PromptReplay, replay_points
from ddtree.replay.stats import bootstrap_interval, summarize
from ddtree.replay.trace import (
    TraceError,
    check_folders,
    folder_fingerprint,
    load_trace,
    save_trace,
)
from ddtree.tree import build_tree

from .helpers import EXAMPLE, make_trace, replay_prompt


def test_worked_example_of_the_replay_walk():
    trace = make_trace(**EXAMPLE)
    run = replay_prompt(trace, 0, "ddtree", 2)  # tree root -> 6 -> 8: 6 accepted, bonus 7
    assert run.taus.tolist() == [2] and run.accepted.tolist() == [1]
    assert run.positions.tolist() == [2]
    # surrogate: 1 + e^-0.1 + e^-0.6
    assert run.expected_taus[0] == pytest.approx(1 + np.exp(-0.1) + np.exp(-0.6))
    # ranks of the greedy tokens along the accepted path: 6 is rank 0 at depth 1, 7 rank 1 at 2
    assert run.ranks.tolist() == [0, 1]
    # budget 3 adds (0, 1) -> 7: both drafts match, but only 2 tokens remain: tau truncated
    run = replay_prompt(trace, 0, "ddtree", 3)
    assert run.taus.tolist() == [2] and run.accepted.tolist() == [2]
    # chain: top-1 per depth: 6 then 8
    assert replay_prompt(trace, 0, "chain", 0).taus.tolist() == [2]
    # budget 1: the tree is root -> 6; 6 accepted, bonus 7
    run = replay_prompt(trace, 0, "ddtree", 1)
    assert run.taus.tolist() == [2] and run.accepted.tolist() == [1]


def test_a_trace_with_a_small_top_k_flags_trees_that_reach_its_last_rank():
    trace = make_trace(**EXAMPLE)  # K = 2 stored
    assert replay_prompt(trace, 0, "ddtree", 2).limited_steps == 0  # K = min(N, V) = 2
    assert replay_prompt(trace, 0, "ddtree", 3).limited_steps == 1  # wants K = 3 > 2
    with pytest.raises(ValueError, match="replay takes chain, ddtree"):
        replay_prompt(trace, 0, "ar", 1)
    assert replay_points(trace, ["ddtree", "chain"], [4, 1, 4]) == [
        ("ddtree", 4),
        ("ddtree", 1),
        ("chain", 2),
    ]


def test_save_load_round_trip_is_atomic_and_checked(tmp_path):
    trace = make_trace(**EXAMPLE)
    path = save_trace(trace, tmp_path / "sub" / "t.safetensors")
    assert [p.name for p in path.parent.iterdir()] == ["t.safetensors"]  # no partial file
    loaded = load_trace(path)
    assert loaded.header == trace.header and loaded.fingerprint.startswith("trace:")
    for name in ("tokens", "topk_logprobs", "topk_tokens"):
        assert torch.equal(getattr(loaded, name), getattr(trace, name)), name
    assert loaded.topk_tokens.dtype == torch.int64
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # one byte of tensor data
    (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
    with pytest.raises(TraceError, match="bad.safetensors: content hash differs"):
        load_trace(tmp_path / "bad.safetensors")
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(TraceError, match="without a ddtree trace header"):
        load_trace(tmp_path / "plain.safetensors")
    (tmp_path / "text.safetensors").write_text("hello")
    with pytest.raises(TraceError, match="not a readable safetensors file"):
        load_trace(tmp_path / "text.safetensors")


def test_shapes_that_disagree_with_the_header_are_refused():
    bad = dict(EXAMPLE, tokens=[[[6, 9], [8, 7]]])  # one root row, the header implies two
    with pytest.raises(TraceError, match=r"topk_tokens has shape \(1, 2, 2\).*\(2, 2, 2\)"):
        make_trace(**bad)


def test_folder_fingerprints_tell_checkpoints_apart(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, byte in ((a, b"1"), (b, b"2")):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"weights" + byte)
    assert folder_fingerprint(a) != folder_fingerprint(b)
    assert folder_fingerprint(a) == folder_fingerprint(a).strip()
    header = make_trace(**EXAMPLE).header
    header.target.fingerprint = folder_fingerprint(a)
    check_folders(header, "t.safetensors", target=a)  # the same folder: fine
    with pytest.raises(TraceError, match=r"t.safetensors: recorded with a different target"):
        check_folders(header, "t.safetensors", target=b)
    with pytest.raises(TraceError, match="drafter was built in memory"):
        check_folders(header, "t.safetensors", drafter=a)


def _run(taus, accepted, ranks):
    taus = np.array(taus)
    return PromptReplay(
        positions=np.arange(taus.size),
        taus=taus,
        accepted=np.array(accepted),
        expected_taus=np.full(taus.size, 2.5),
        ranks=np.array(ranks),
        limited_steps=0,
    )


def test_statistics_on_constructed_replays():
    runs = [_run([2, 1, 3], [1, 0, 2], [0, 0, 1, -1, 0, 0]), _run([1], [3], [2])]
    s = summarize(runs, "ddtree", block_size=4, budget=8)
    assert s.mean_tau == pytest.approx(7 / 4) and s.steps == 4 and s.tokens == 7
    assert s.histogram == [2, 1, 1, 0]
    # depth stats skip the truncated step (tau 1 with 3 accepted): accepted 1, 0, 2
    assert s.depth_acceptance == [pytest.approx(2 / 3), pytest.approx(1 / 2), 0.0]
    # ranks [0, 0, 1, -1, 0, 0, 2]: p_1 = 4 / 7, p_2 = 1 / 3, p_3 = 1 / 2, p_4 = 0 / 1
    assert s.rank_acceptance[:4] == [
        pytest.approx(4 / 7),
        pytest.approx(1 / 3),
        pytest.approx(1 / 2),
        0.0,
    ]
    assert s.expected_tau == 2.5 and s.realised_tau == pytest.approx((2 + 1 + 3 + 4) / 4)
    assert s.prompt_steps == [3, 1] and s.prompt_tokens == [6, 1]
    assert s.tau_low <= s.mean_tau <= s.tau_high


def test_bootstrap_interval_over_prompts():
    same = bootstrap_interval(np.array([6.0, 6.0, 6.0]), np.array([3.0, 3.0, 3.0]))
    assert same == (2.0, 2.0)
    low, high = bootstrap_interval(np.array([10.0, 20.0, 2.0]), np.array([5.0, 5.0, 2.0]))
    assert 1.0 <= low < 32 / 12 < high <= 4.0  # between the extreme prompts, around the pool
    assert np.isnan(bootstrap_interval(np.array([0.0]), np.array([0.0]))[0])  # no steps


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    depth=st.integers(1, 6),
    k=st.integers(1, 12),
    budgets=st.lists(st.integers(0, 90), min_size=1, max_size=4),
    levels=st.sampled_from([2, 5, 1000]),
)
def test_a_smaller_budget_builds_a_prefix_of_a_larger_budget_tree(seed, depth, k, budgets, levels):
    """What the replay sweep rests on: tree(N) is the first N + 1 nodes of tree(N') for
    N <= N', with K = min(N, stored K) as the policy takes it; log-probs drawn from a few
    levels make ties (broken by rank tuple) common."""
    rng = np.random.default_rng(seed)
    lp = -np.sort(rng.integers(0, levels, size=(depth, k)) / levels * 4, axis=1)
    lp = torch.tensor(lp, dtype=torch.float32)  # [L, K] sorted descending
    tokens = torch.tensor(rng.permuted(np.tile(np.arange(50), (depth, 1)), axis=1)[:, :k])
    big = max(budgets)
    whole = build_tree(3, lp[:, : max(1, min(big, k))], tokens[:, : max(1, min(big, k))], big)
    for n in budgets:
        kn = max(1, min(n, k))
        tree = build_tree(3, lp[:, :kn], tokens[:, :kn], n)
        m = tree.n_nodes
        for name in ("tokens", "parents", "depth", "scores"):
            assert torch.equal(getattr(tree, name), getattr(whole, name)[:m]), (n, name)


@pytest.mark.parametrize(
    "block, vocab, context, heads", [(8, 2048, 300, 4), (16, 32000, 8000, 32), (8, 61, 10**5, 32)]
)
def test_recording_forwards_stay_within_their_memory_bounds(block, vocab, context, heads):
    from ddtree.replay.record import (
        LOGITS_PER_FORWARD,
        MAX_ROOTS_PER_FORWARD,
        SCORES_PER_FORWARD,
        roots_per_forward,
    )

    r = roots_per_forward(block, vocab, context, heads)
    assert 1 <= r <= MAX_ROOTS_PER_FORWARD
    assert r == 1 or r * (block - 1) * vocab <= LOGITS_PER_FORWARD
    assert r == 1 or heads * r * block * (context + r * block) <= SCORES_PER_FORWARD
    # and as many as those bounds allow, up to a factor 2
    assert (
        r == MAX_ROOTS_PER_FORWARD
        or 2 * r * (block - 1) * vocab > LOGITS_PER_FORWARD
        or (heads * 2 * r * block * (context + 2 * r * block) > SCORES_PER_FORWARD)
    )
