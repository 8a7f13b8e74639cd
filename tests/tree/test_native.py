"""The compiled tree core (``ddtree.tree.native``) equals the Python reference bit for bit;
the backend is chosen once, can be forced, and falls back with a notice."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tree.reference import accept_ref, build_tree_ref, mask_ref

from ddtree.tree import (
    LayoutBuffer,
    backend,
    build_tree_python,
    load_backend,
    topk_logprobs,
    verify_layout,
)
from ddtree.tree import backends as backend_module
from ddtree.tree.accept import accept_greedy_torch
from ddtree.tree.mask import fill_layout_torch
from ddtree.tree.types import BackendUnavailable

INF = float("-inf")
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _native():
    try:
        return load_backend("native")
    except BackendUnavailable as err:
        pytest.skip(str(err))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (scores and masks are compared bit for bit, -0.0 != 0.0)."""
    return t.contiguous().view(torch.uint8)


def _assert_identical(a, b):
    for field in ("tokens", "parents", "depth", "scores", "visibility"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and x.shape == y.shape, field
        assert torch.equal(_bits(x), _bits(y)), field


def test_the_install_builds_the_native_core():
    """Where a C++ compiler exists, the package install built the extension and it is the
    backend in use (unless DDTREE_TREE_BACKEND forces the Python one)."""
    compiler = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}): the Python backend is expected")
    if backend_module.ENV_VAR in os.environ:
        pytest.skip(f"{backend_module.ENV_VAR} is set")
    assert backend() == "native"


# ---------------------------------------------------------------------------------------------
# build


@settings(max_examples=100, deadline=None)
@given(
    n_depth=st.integers(1, 6),
    k=st.integers(1, 6),
    budget=st.integers(0, 120),
    f64=st.booleans(),
    data=st.data(),
)
def test_native_build_equals_python_bit_for_bit(n_depth, k, budget, f64, data):
    # few distinct values: heavy ties within and across depths; -inf; budgets past all nodes
    vals = st.sampled_from([0.0, -0.25, -0.5, -0.75, -1.0, -2.0, INF])
    rows = [
        sorted(data.draw(st.lists(vals, min_size=k, max_size=k)), reverse=True)
        for _ in range(n_depth)
    ]
    lp = torch.tensor(rows, dtype=torch.float64 if f64 else torch.float32)
    tok = torch.stack([torch.randperm(3 * k)[:k] for _ in range(n_depth)])
    root = data.draw(st.integers(0, 99))
    native = _native().build_tree(root, lp, tok, budget)
    python = build_tree_python(root, lp, tok, budget)
    _assert_identical(native, python)
    if k**n_depth <= 1000:  # the exhaustive reference is exponential
        ref_tokens, ref_parents, _, ref_scores = build_tree_ref(
            root, lp.numpy(), tok.numpy(), budget
        )
        assert native.tokens.tolist() == ref_tokens.tolist()
        assert native.parents.tolist() == ref_parents.tolist()
        assert np.array_equal(native.scores.numpy(), ref_scores)


@pytest.mark.parametrize("budget, block", [(1024, 16), (2048, 6), (300, 33), (1, 2), (64, 2)])
def test_native_equals_python_on_large_trees_with_ties(budget, block):
    # the same logits row at every depth, on a 0.25 grid: path scores tie across depths and
    # orders ((0, 1) vs (1, 0)), deep rank tuples whose base-(K+1) key exceeds 64 bits
    g = torch.Generator().manual_seed(budget + block)
    row = torch.round(torch.randn(4096, generator=g) * 4) / 4
    row[torch.randperm(4096, generator=g)[:4000]] = INF  # 96 finite tokens: -inf in the top-K
    top = topk_logprobs(row.expand(block - 1, -1), budget)
    native = _native().build_tree(7, top.logprobs, top.tokens, budget)
    _assert_identical(native, build_tree_python(7, top.logprobs, top.tokens, budget))
    assert native.n_nodes == budget + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_native_build_widens_other_dtypes_and_reads_strided_inputs(dtype):
    g = torch.Generator().manual_seed(3)
    top = topk_logprobs(torch.randn(5, 200, generator=g), 40)
    wide = top.logprobs.to(dtype)  # [5, 40]
    lp = wide[:, :24]  # a strided view (row stride 40)
    tok = top.tokens[:, :24].t().contiguous().t()  # column-major storage
    assert not lp.is_contiguous() and not tok.is_contiguous()
    native = _native().build_tree(1, lp, tok, 30)
    _assert_identical(native, build_tree_python(1, lp.contiguous(), tok.contiguous(), 30))


@pytest.mark.parametrize(
    "lp, message",
    [
        (torch.tensor([[-0.1, -0.2], [-0.3, float("nan")]]), "NaN"),
        (torch.tensor([[-0.1, -0.2], [-2.0, -0.1]]), "sorted descending"),
    ],
)
def test_native_bad_values_raise_the_python_message(lp, message):
    with pytest.raises(ValueError, match=message):
        _native().build_tree(0, lp, torch.tensor([[1, 2], [3, 4]]), 4)


def test_native_empty_inputs_give_the_root_only():
    native = _native()
    for lp in (torch.zeros(0, 3), torch.zeros(3, 0), torch.full((2, 2), INF)):
        tok = torch.zeros(lp.shape, dtype=torch.int64)
        tree = native.build_tree(9, lp, tok, 5)
        _assert_identical(tree, build_tree_python(9, lp, tok, 5))
        assert tree.tokens.tolist() == [9] and tree.visibility.tolist() == [[True]]


# ---------------------------------------------------------------------------------------------
# layout


def _tree(seed, budget=40, block=6, vocab=30):
    g = torch.Generator().manual_seed(seed)
    top = topk_logprobs(torch.randn(block - 1, vocab, generator=g), max(budget, 1))
    return build_tree_python(seed, top.logprobs, top.tokens, budget)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("start", [0, 7])
def test_native_layout_equals_torch_and_the_reference(dtype, start):
    tree = _tree(4)
    m = tree.n_nodes
    masks, positions = [], []
    for fill in (_native().fill_layout, fill_layout_torch):
        mask = torch.full((1, 1, m, start + m), float("nan"), dtype=dtype)  # stale contents
        pos = torch.full((m,), -5, dtype=torch.int64)
        fill(tree.visibility, tree.depth, start, mask, pos)
        masks.append(mask)
        positions.append(pos)
    assert torch.equal(_bits(masks[0]), _bits(masks[1]))
    assert torch.equal(positions[0], positions[1])
    hidden = float(torch.finfo(dtype).min)
    ref = mask_ref(tree.parents.numpy(), start, hidden)
    assert np.array_equal(masks[0][0, 0].double().numpy(), ref)
    assert positions[0].tolist() == (start + tree.depth).tolist()
    for fill in (_native().fill_layout, fill_layout_torch):  # the exact shape only
        with pytest.raises(ValueError, match=r"mask \[\d+, \d+\] is not"):
            fill(tree.visibility, tree.depth, start, torch.zeros(1, 1, m + 1, start + m), pos)
    assert not torch.signbit(masks[0][masks[0] == 0]).any()  # visible is +0.0


def test_layout_buffer_reused_across_steps_equals_fresh_layouts():
    buf = LayoutBuffer(41, 200, torch.bfloat16)
    buf.mask.fill_(float("nan"))
    for step, (seed, budget, start) in enumerate(
        [(1, 40, 10), (2, 7, 31), (3, 40, 60), (4, 0, 61)]
    ):
        tree = _tree(seed, budget=budget)
        fresh = verify_layout(tree, start, torch.bfloat16)
        reused = verify_layout(tree, start, out=buf)
        assert reused.attn_mask.shape == fresh.attn_mask.shape, step
        assert reused.attn_mask.is_contiguous()
        assert reused.attn_mask.data_ptr() == buf.mask.data_ptr()  # no new storage
        assert torch.equal(_bits(reused.attn_mask), _bits(fresh.attn_mask)), step
        assert torch.equal(reused.position_ids, fresh.position_ids)


def test_layout_errors_name_the_problem():
    tree = _tree(5, budget=10)
    with pytest.raises(ValueError, match="at least 11 rows x 111 cols"):
        verify_layout(tree, 100, out=LayoutBuffer(11, 110))
    with pytest.raises(ValueError, match="dtype"):
        verify_layout(tree, 0, torch.float16, out=LayoutBuffer(11, 20))
    with pytest.raises(ValueError, match="rows <= cols"):
        LayoutBuffer(8, 4)
    with pytest.raises(ValueError, match="start"):
        verify_layout(tree, -1)


# ---------------------------------------------------------------------------------------------
# accept


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(0, 60), match=st.floats(0.0, 1.0))
def test_native_accept_equals_torch_and_the_reference_walk(seed, budget, match):
    tree = _tree(seed % 50, budget=budget, vocab=8)
    g = torch.Generator().manual_seed(seed)
    m = tree.n_nodes
    # the target's token at each node: often one of the tree's tokens, so long paths occur
    target = torch.where(
        torch.rand(m, generator=g) < match,
        tree.tokens[torch.randint(m, (m,), generator=g)],
        torch.randint(8, (m,), generator=g),
    )
    native = _native().accept_greedy(tree, target)
    torch_res = accept_greedy_torch(tree, target)
    path, bonus, tau = accept_ref(tree.tokens.numpy(), tree.parents.numpy(), target.numpy())
    assert native.accepted.tolist() == torch_res.accepted.tolist() == path.tolist()
    assert native.bonus_token == torch_res.bonus_token == bonus
    assert native.tau == torch_res.tau == tau


def test_native_accept_rejects_children_before_parents():
    tree = _tree(6, budget=3)
    tree.parents = torch.tensor([-1, 2, 0, 0])
    with pytest.raises(ValueError, match="parents"):
        _native().accept_greedy(tree, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_tokens must be \\[4\\]"):
        _native().accept_greedy(tree, torch.zeros(3, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# backend choice


def test_backend_env_var_forces_a_backend_and_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv(backend_module.ENV_VAR, "python")
    assert backend_module._choose().name == "python"
    monkeypatch.setenv(backend_module.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="DDTREE_TREE_BACKEND='cuda': expected one of"):
        backend_module._choose()
    with pytest.raises(ValueError, match="unknown tree backend"):
        load_backend("fast")


def _fake_extension(monkeypatch, module):
    """Make the next import of ddtree.tree.native see ``module`` as the extension (None: the
    import fails); monkeypatch restores the real modules afterwards."""
    import ddtree.tree as package

    for name in ("native", "_native"):
        monkeypatch.delattr(package, name, raising=False)
    monkeypatch.delitem(sys.modules, "ddtree.tree.native", raising=False)
    monkeypatch.setitem(sys.modules, "ddtree.tree._native", module)


def test_missing_extension_falls_back_with_a_one_line_notice(monkeypatch, caplog):
    monkeypatch.delenv(backend_module.ENV_VAR, raising=False)
    _fake_extension(monkeypatch, None)  # the import fails: not built
    with caplog.at_level(logging.WARNING, logger="ddtree"):
        chosen = backend_module._choose()
    assert chosen.name == "python"
    (record,) = caplog.records
    assert "compiled tree core unavailable" in record.getMessage()
    assert "not built" in record.getMessage() and "\n" not in record.getMessage()


def test_a_stale_extension_build_is_not_used(monkeypatch):
    _fake_extension(monkeypatch, types.SimpleNamespace(ABI_VERSION=0))
    with pytest.raises(BackendUnavailable, match="stale build"):
        load_backend("native")
