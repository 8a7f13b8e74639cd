"""Verify attention without a dense mask (ddtree.models.nn.attention) against plain softmax
attention over every key under the dense ancestor mask it replaces."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.models.nn.attention import (
    AttentionInputs,
    attention_lse,
    attention_lse_math,
    grouped_attention,
    merge_attention,
)


def dense_reference(q, k, v, visible, scale):
    """softmax(q k^T * scale) v over all K keys with a [L, K] bool visibility, float64."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1) @ v.double()


def random_visibility(m: int, gen: torch.Generator) -> torch.Tensor:
    """[M, M] ancestor-or-self relation of a random tree (parents before children)."""
    vis = torch.eye(m, dtype=torch.bool)
    for i in range(1, m):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        vis[i] |= vis[parent]
    return vis


def test_attention_inputs_worked_example():
    """The module docstring's example: chunk 4, S = 6 committed, a tree of 2 rows (root and
    its child): P = 4, tail slots 4..9; slots 4, 5 prefix, 6, 7 the tree, 8, 9 hidden."""
    start = torch.tensor(6)
    visibility = torch.tensor([[True, False], [True, True]])
    inputs = AttentionInputs.build(start, visibility, torch.arange(4), 4 + 2, torch.float32)
    assert inputs.tail_slots.tolist() == [4, 5, 6, 7, 8, 9]
    assert inputs.write_slots.tolist() == [6, 7]
    visible = (inputs.tail_mask == 0).tolist()
    assert visible == [
        [True, True, True, False, False, False],
        [True, True, True, True, False, False],
    ]


@settings(max_examples=80, deadline=None)
@given(
    prefix=st.integers(0, 40),
    extra=st.integers(0, 9),  # committed keys between P and S, attended in the tail
    m=st.integers(1, 12),
    pad=st.integers(0, 5),  # tail keys past the new rows (hidden)
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    dv=st.sampled_from([8, 16]),
    kernel=st.sampled_from(["cpu", "math"]),
    seed=st.integers(0, 2**16),
)
def test_grouped_attention_equals_dense_attention_under_the_ancestor_mask(
    prefix, extra, m, pad, kv_heads, group, dv, kernel, seed
):
    """Every committed key visible, the tree's ancestors-or-self, nothing past them; query head
    j*G + g reads KV head j (transformers' repeat_kv)."""
    gen = torch.Generator().manual_seed(seed)
    start, tail_len = prefix + extra, extra + m + pad
    nh, d = kv_heads * group, 16 if kernel == "cpu" else 8
    dv = d if kernel == "cpu" else dv  # the fused kernel takes one head size
    q = torch.randn(nh, m, d, generator=gen)
    k = torch.randn(kv_heads, prefix + tail_len, d, generator=gen)
    v = torch.randn(kv_heads, prefix + tail_len, dv, generator=gen)
    vis = random_visibility(m, gen)
    inputs = AttentionInputs.build(
        torch.tensor(start), vis, torch.arange(prefix), tail_len, torch.float32
    )
    fn = {"cpu": attention_lse, "math": attention_lse_math}[kernel]
    out = grouped_attention(q, k, v, inputs, 0.3, attention=fn)
    visible = torch.zeros(m, prefix + tail_len, dtype=torch.bool)
    visible[:, :start] = True
    visible[:, start : start + m] = vis
    k_rep, v_rep = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    ref = dense_reference(q[None], k_rep[None], v_rep[None], visible, 0.3)[0]
    assert out.shape == (nh, m, dv)
    assert (out.double() - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_cpu_kernel_equals_the_reference_math(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).to(dtype) for n in (7, 30, 30))
    mask = torch.zeros(7, 30).masked_fill(torch.rand(7, 30, generator=gen) < 0.4, -1e30)
    mask[:, 0] = 0  # every row sees a key
    out, lse = attention_lse(q, k, v, mask.to(dtype), 0.25)
    ref_out, ref_lse = attention_lse_math(q, k, v, mask, 0.25)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (out.float() - ref_out.float()).abs().max() <= tol
    assert (lse - ref_lse).abs().max() <= tol
    assert lse.dtype == torch.float32 or dtype == torch.float64


def test_merging_two_halves_is_attention_over_both():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, n, 8, generator=gen) for n in (5, 20, 20))
    a = attention_lse_math(q, k[:, :, :13], v[:, :, :13], None, 0.5)
    b = attention_lse_math(q, k[:, :, 13:], v[:, :, 13:], None, 0.5)
    whole = attention_lse_math(q, k, v, None, 0.5)[0]
    assert (merge_attention(*a, *b) - whole).abs().max() <= 1e-6
