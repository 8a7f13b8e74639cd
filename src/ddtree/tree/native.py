"""The compiled tree core: checks every tensor, then hands raw data pointers and element
strides to the C++ kernels in ``_native.cpp`` (which never see a Python object but integers).

Host tensors only: ``fill_layout`` and ``accept_greedy`` hand tensors on other devices to the
torch code; ``build_tree`` copies its small [L, K] inputs to the host, as the Python builder
does. Results equal the Python backend's bit for bit (tests/tree/test_native.py).
"""

from __future__ import annotations

import functools

import torch

from ddtree.tree.accept import accept_greedy_torch, check_target_tokens
from ddtree.tree.build import check_topk
from ddtree.tree.mask import check_layout_shapes, fill_layout_torch
from ddtree.tree.types import AcceptResult, BackendUnavailable, DraftTree

ABI_VERSION = 1  # kAbiVersion in _native.cpp

try:
    from ddtree.tree import _native
except ImportError as err:
    raise BackendUnavailable(
        f"the extension ddtree.tree._native is not built ({err}); "
        "`make test` or `pip install -e .` builds it"
    ) from err
if getattr(_native, "ABI_VERSION", None) != ABI_VERSION:
    raise BackendUnavailable(
        f"ddtree.tree._native is a stale build (ABI {getattr(_native, 'ABI_VERSION', None)}, "
        f"expected {ABI_VERSION}); `pip install -e .` rebuilds it"
    )

_NAN, _UNSORTED = -1, -2  # build_tree status codes (kNaN, kUnsorted)


def _host(t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """``t`` on the CPU in one of ``dtypes`` (the first when converting; widening is exact).
    Only the data pointer is read, so a CPU tensor of a listed dtype is used as it is."""
    if t.device.type == "cpu" and t.dtype in dtypes:
        return t
    return t.detach().to("cpu", dtypes[0])


def _max_nodes(n_depth: int, k: int, budget: int) -> int:
    """Non-root nodes a build can return: min(budget, k + k^2 + .. + k^L)."""
    total, level = 0, 1
    for _ in range(n_depth):
        level *= k
        total += level
        if total >= budget:
            return budget
    return total


def build_tree(
    root_token: int,
    topk_logprobs: torch.Tensor,  # [L, K] float, sorted descending per depth
    topk_tokens: torch.Tensor,  # [L, K] int64
    budget: int,
) -> DraftTree:
    """``ddtree.tree.build_tree`` in C++ (same nodes, order and float64 scores)."""
    check_topk(topk_logprobs, topk_tokens, budget, values=False)
    assert topk_logprobs.dim() == 2, "build_tree takes one request [L, K]; see ddtree.tree.batched"
    lp = _host(topk_logprobs, (torch.float64, torch.float32))
    tok = _host(topk_tokens, (torch.int64,))
    n_depth, k = lp.shape
    cap = 1 + _max_nodes(n_depth, min(k, budget), budget)
    ints = torch.empty(3, cap, dtype=torch.int64)  # tokens, parents, depth
    scores = torch.empty(cap, dtype=torch.float64)
    vis = torch.empty(cap, cap, dtype=torch.bool)  # the first M * M bytes: [M, M]
    m = _native.build_tree(
        int(root_token),
        lp.data_ptr(),
        lp.dtype == torch.float64,
        *lp.stride(),
        tok.data_ptr(),
        *tok.stride(),
        n_depth,
        k,
        budget,
        cap,
        ints.data_ptr(),
        scores.data_ptr(),
        vis.data_ptr(),
    )
    if m in (_NAN, _UNSORTED):
        check_topk(topk_logprobs, topk_tokens, budget)  # raises the ValueError naming it
        raise AssertionError(f"native build_tree status {m} but check_topk passed")
    if m < cap:  # fewer finite candidates than the budget (few views: each costs ~1 µs)
        ints, scores, vis = ints[:, :m], scores[:m], vis.view(-1)[: m * m].view(m, m)
    tokens, parents, depth = ints.unbind(0)
    return DraftTree(tokens, parents, depth, scores, vis)


@functools.cache
def _hidden_bits(dtype: torch.dtype) -> int:
    """Bit pattern of finfo(dtype).min, as a signed integer of the same width."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    return int(torch.tensor(torch.finfo(dtype).min, dtype=dtype).view(as_int))


def fill_layout(
    visibility: torch.Tensor,  # [M, M] bool
    depth: torch.Tensor,  # [M] int64
    start: int,
    mask: torch.Tensor,  # [1, .., M, start + M] float, written
    positions: torch.Tensor,  # [M] int64, written
) -> None:
    """``ddtree.tree.mask.fill_layout_torch`` in C++ for host tensors."""
    check_layout_shapes(visibility, depth, start, mask, positions)
    m = visibility.shape[0]
    native_ok = (
        visibility.device.type == depth.device.type == mask.device.type == "cpu"
        and positions.device.type == "cpu"
        and mask.numel() == m * (start + m)
        and visibility.dtype == torch.bool
        and (visibility.stride(1) == 1 or m == 1)
        and depth.dtype == torch.int64
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and mask.is_contiguous()
        and mask.itemsize in (2, 4, 8)
    )
    if not native_ok:
        fill_layout_torch(visibility, depth, start, mask, positions)
        return
    _native.fill_layout(
        visibility.data_ptr(),
        m,
        visibility.stride(0),
        depth.data_ptr(),
        depth.stride(0),
        start,
        mask.itemsize,
        _hidden_bits(mask.dtype),
        mask.data_ptr(),
        positions.data_ptr(),
    )


def accept_greedy(tree: DraftTree, target_tokens: torch.Tensor) -> AcceptResult:
    """``ddtree.tree.accept_greedy`` as one C++ scan for host tensors."""
    check_target_tokens(tree, target_tokens)
    tensors = (tree.tokens, tree.parents, target_tokens)
    if any(t.device.type != "cpu" for t in tensors):
        return accept_greedy_torch(tree, target_tokens)
    if tree.parents.shape != tree.tokens.shape:
        raise ValueError(
            f"tree.parents {tuple(tree.parents.shape)} != tree.tokens {tuple(tree.tokens.shape)}"
        )
    tokens, parents, target = (t if t.dtype == torch.int64 else t.long() for t in tensors)
    m = tree.n_nodes
    out = torch.empty(m, dtype=torch.int64)
    tau, bonus = _native.accept_greedy(
        tokens.data_ptr(),
        tokens.stride(0),
        parents.data_ptr(),
        parents.stride(0),
        target.data_ptr(),
        target.stride(0),
        m,
        out.data_ptr(),
    )
    if tau < 0:
        raise ValueError("tree.parents: every node's parent must come before it (parents[i] < i)")
    return AcceptResult(accepted=out[:tau], bonus_token=bonus, tau=tau)
