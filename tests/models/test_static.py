"""The pure pieces of the compiled engine mode, run eagerly (no compile): bucket choice, the
in-graph attention mask, the padded per-step inputs, the fixed-shape MoE dispatch, and the
engine-mode checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.engine.helpers import tiny_hf_target, tiny_mla_target
from tests.trees import make_tree

from ddtree.engine import DecodeConfig
from ddtree.models.static import (
    EngineModeError,
    EnginePlan,
    StaticTree,
    kv_bucket,
    pick_bucket,
    static_attention_mask,
)
from ddtree.tree import verify_layout


def test_bucket_worked_examples():
    assert pick_bucket(5, (1, 9, 33)) == 9
    assert pick_bucket(1, (1, 9, 33)) == 1
    with pytest.raises(ValueError, match="width 34 exceeds the largest width bucket 33"):
        pick_bucket(34, (1, 9, 33))
    assert kv_bucket(130, 64) == 192
    assert kv_bucket(128, 64) == 128
    assert kv_bucket(0, 64) == 64


def test_static_mask_worked_example():
    visibility = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    mask = static_attention_mask(torch.tensor(2), visibility, torch.arange(5), torch.float32)
    assert (mask == 0).tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
    ]
    assert float(mask.min()) == torch.finfo(torch.float32).min


@settings(max_examples=30, deadline=None)
@given(
    parents=st.lists(st.integers(0, 50), min_size=0, max_size=10),
    start=st.integers(0, 20),
    pad=st.integers(0, 4),
    extra_keys=st.integers(0, 9),
)
def test_padded_static_mask_equals_the_eager_layout_on_the_real_rows(
    parents, start, pad, extra_keys
):
    """Real rows: exactly verify_layout's mask, then hidden padding columns; padded rows: the
    prefix and themselves only (never a row with nothing visible)."""
    parents = [-1] + [p % (i + 1) for i, p in enumerate(parents)]  # parents[i] < i
    tree = make_tree(list(range(len(parents))), parents)
    m = tree.n_nodes
    static = StaticTree(m + pad, torch.device("cpu"))
    assert static.fill(tree.tokens, tree.depth, tree.visibility) == m
    keys = start + m + pad + extra_keys
    mask = static_attention_mask(
        torch.tensor(start), static.visibility, torch.arange(keys), torch.float32
    )
    eager = verify_layout(tree, start).attn_mask[0, 0]  # [M, S+M]
    assert torch.equal(mask[:m, : start + m], eager)
    assert (mask[:m, start + m :] != 0).all()
    visible = mask[m:] == 0
    for r in range(pad):
        expected = torch.zeros(keys, dtype=torch.bool)
        expected[:start] = True
        expected[start + m + r] = True
        assert torch.equal(visible[r], expected)
    assert torch.equal(static.tokens[m:], tree.tokens[:1].expand(pad))
    assert not static.depth[m:].any()


def test_static_tree_refill_clears_a_larger_previous_tree():
    static = StaticTree(6, torch.device("cpu"))
    big = make_tree([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3])
    small = make_tree([7, 8], [-1, 0])
    static.fill(big.tokens, big.depth, big.visibility)
    static.fill(small.tokens, small.depth, small.visibility)
    expected = torch.eye(6, dtype=torch.bool)
    expected[:2, :2] = small.visibility
    assert torch.equal(static.visibility, expected)
    assert static.tokens.tolist() == [7, 8, 7, 7, 7, 7]


@pytest.mark.parametrize("m", [1, 3, 4, 9])  # k = 2, E = 8: gather below 4 tokens, dense from 4
def test_fixed_shape_moe_dispatch_equals_the_sorted_loop(m):
    target = tiny_mla_target(seed=3)
    moe = target.model.model.layers[1].mlp
    torch.manual_seed(m)
    x = torch.randn(m, target.config.hidden_size)
    with torch.no_grad():
        weights, ids = moe.gate(x)
        sorted_loop = moe.experts(x, weights, ids)  # eager: the data-dependent path
        fixed = moe.experts.forward_static(x, weights, ids)
    assert (sorted_loop - fixed).abs().max() <= 1e-5


def test_engine_mode_and_bucket_checks():
    with pytest.raises(ValueError, match="engine_mode 'graphs': expected one of eager, compiled"):
        DecodeConfig(engine_mode="graphs")
    with pytest.raises(ValueError, match="buckets must be >= 1"):
        DecodeConfig(buckets=(0, 8))
    assert DecodeConfig("ar").width_buckets() == (1,)
    assert DecodeConfig("chain", block_size=8).width_buckets() == (8,)
    assert DecodeConfig("ddtree", budget=32).width_buckets() == (33,)
    assert DecodeConfig("ddtree", buckets=(16, 4)).width_buckets() == (16, 4)
    assert EnginePlan("compiled", (16, 4, 16)).widths == (4, 16)
    with pytest.raises(ValueError, match="at least one width bucket"):
        EnginePlan("compiled", ())


def test_the_transformers_target_refuses_compiled_mode_by_name_before_compiling(monkeypatch):
    """The engine checks the declared engine modes once, before set_engine_mode runs."""
    from ddtree.engine import generate

    target = tiny_hf_target("qwen3")
    calls = []
    monkeypatch.setattr(target, "set_engine_mode", lambda plan: calls.append(plan) or 0.0)
    with pytest.raises(
        EngineModeError, match=r"'compiled' is not available for .*\(hf\) \(runs: eager\)"
    ):
        generate(target, None, [1, 2, 3], DecodeConfig("ar", engine_mode="compiled"))
    assert calls == []
    generate(target, None, [1, 2, 3], DecodeConfig("ar", max_new_tokens=2))
    assert [p.mode for p in calls] == ["eager"]
