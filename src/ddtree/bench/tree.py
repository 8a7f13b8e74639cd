"""`ddtree bench tree`: top-k over [L, V] logits, tree build, verify layout and greedy accept,
per (B, N), for every tree backend side by side in one run (``python``, ``native``) and for
the batched torch builder (the device path)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial

import torch

from ddtree.bench.timing import time_call
from ddtree.tree import (
    DraftTree,
    LayoutBuffer,
    TreeBackend,
    accept_greedy_batch,
    build_trees,
    load_backend,
    topk_logprobs,
    verify_layout,
)
from ddtree.tree.types import BackendUnavailable


@dataclass
class TreeBenchPoint:
    block_size: int
    budget: int
    builder: str  # a tree backend ("python", "native": heap, one request) or "batched" (torch)
    requests: int  # R
    topk_s: float  # top-k over [L, V] for one request (log_softmax + topk)
    build_s: float  # per request
    layout_s: float  # per request: positions + additive mask into a reused LayoutBuffer
    layout_alloc_s: float  # the same into a newly allocated mask (no buffer)
    build_layout_s: float  # build_s + layout_s
    accept_s: float  # per request: greedy accept walk (the path of first children)

    def as_dict(self) -> dict:
        return asdict(self)


def available_backends() -> list[TreeBackend]:
    """The tree backends that load here, the Python reference first."""
    out = []
    for name in ("python", "native"):
        try:
            out.append(load_backend(name))
        except BackendUnavailable:
            pass
    return out


def first_child_targets(tree: DraftTree) -> torch.Tensor:
    """[M] int64 target tokens under which the walk follows each node's first child: the
    longest path the best-first order puts first (a high-acceptance step)."""
    target = torch.zeros_like(tree.tokens)
    for j in reversed(range(1, tree.n_nodes)):  # the smallest child index writes last
        target[tree.parents[j]] = tree.tokens[j]
    return target


def bench_tree(
    block_sizes: list[int],
    budgets: list[int],
    vocab_size: int = 151936,
    batch_sizes: tuple[int, ...] = (1, 64),
    repeats: int = 20,
    prefix_len: int = 128,
    seed: int = 0,
    backends: list[TreeBackend] | None = None,
    device: str = "cpu",
) -> Iterator[TreeBenchPoint]:
    """Yield one point per (B, N, builder, R). Logits are random normal; top-k and the batched
    builder run on ``device`` (the heap backends on the host, as the engine runs them). Every
    builder times the same inputs in the same run, so their ratios are comparable."""
    backends = available_backends() if backends is None else backends
    g = torch.Generator().manual_seed(seed)
    # The first point a process times can run slow (one-time dispatch and allocator set-up):
    # one untimed call of everything first, so row order does not matter.
    warm = topk_logprobs(torch.randn(block_sizes[0] - 1, vocab_size), budgets[0])
    for _ in _heap_points(block_sizes[0], budgets[0], warm, backends, 1, prefix_len, 0.0):
        pass
    for block in block_sizes:
        depth = block - 1
        logits = torch.randn(depth, vocab_size, generator=g).to(device)  # [L, V]
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else None
        for budget in budgets:
            topk = partial(topk_logprobs, logits, budget)
            topk_t = time_call(topk, max(3, repeats // 4), sync=sync)
            top = topk_logprobs(logits, budget)
            host = type(top)(top.logprobs.cpu(), top.tokens.cpu())
            yield from _heap_points(
                block, budget, host, backends, repeats, prefix_len, topk_t.median_s
            )
            yield from _batched_points(
                block, budget, top, batch_sizes, repeats, prefix_len, topk_t.median_s, sync
            )


def _heap_points(
    block, budget, top, backends, repeats, prefix_len, topk_s
) -> Iterator[TreeBenchPoint]:
    """Each tree backend on one request: heap build, layout (reused buffer and fresh mask),
    greedy accept."""
    buffer = LayoutBuffer(budget + 1, prefix_len + budget + 1)
    for be in backends:
        build_t = time_call(partial(be.build_tree, 0, top.logprobs, top.tokens, budget), repeats)
        tree = be.build_tree(0, top.logprobs, top.tokens, budget)
        layout = partial(verify_layout, tree, prefix_len, backend=be)
        layout_t = time_call(partial(layout, out=buffer), repeats)
        alloc_t = time_call(layout, repeats)
        target = first_child_targets(tree)
        accept_t = time_call(partial(be.accept_greedy, tree, target), repeats)
        yield TreeBenchPoint(
            block,
            budget,
            be.name,
            1,
            topk_s,
            build_t.median_s,
            layout_t.median_s,
            alloc_t.median_s,
            build_t.median_s + layout_t.median_s,
            accept_t.median_s,
        )


def _batched_points(
    block, budget, top, batch_sizes, repeats, prefix_len, topk_s, sync=None
) -> Iterator[TreeBenchPoint]:
    """The torch batched builder (the device path), on the device ``top`` lives on: build,
    the torch layout of its first tree (the layout is per tree), batched greedy acceptance."""
    python = load_backend("python")
    device = top.logprobs.device
    for r in batch_sizes:
        lp = top.logprobs.expand(r, -1, -1).contiguous()
        ids = top.tokens.expand(r, -1, -1).contiguous()
        roots = torch.zeros(r, dtype=torch.int64, device=device)
        few = max(3, repeats // 4)
        bt = time_call(partial(build_trees, roots, lp, ids, budget), few, sync=sync)
        batch = build_trees(roots, lp, ids, budget)
        tree = batch.tree(0)
        buffer = LayoutBuffer(tree.n_nodes, prefix_len + tree.n_nodes, device=device)
        layout = partial(verify_layout, tree, prefix_len, backend=python)
        layout_t = time_call(partial(layout, out=buffer), few, sync=sync)
        alloc_t = time_call(layout, few, sync=sync)
        target = first_child_targets(tree).expand(r, -1).contiguous()
        args = (batch.tokens, batch.parents, batch.visibility, target)
        accept_t = time_call(partial(accept_greedy_batch, *args), few, sync=sync)
        yield TreeBenchPoint(
            block,
            budget,
            "batched",
            r,
            topk_s,
            bt.median_s / r,
            layout_t.median_s,
            alloc_t.median_s,
            bt.median_s / r + layout_t.median_s,
            accept_t.median_s / r,
        )


def tree_result(points: list[TreeBenchPoint], config: dict, hardware_label: str):
    """The bench_tree result (no summary: the points are the figures); its ``--json`` line
    carries the hardware label and the config at the top."""
    from ddtree.bench.result import BenchResult

    document = {
        "bench": "tree",
        "hardware": hardware_label,
        **config,
        "points": [p.as_dict() for p in points],
    }
    return BenchResult("bench_tree", config, {}, points, document)
