"""`ddtree bench tree`: top-k over [L, V] logits, tree build and verify layout, per (B, N)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial

import torch

from ddtree.bench.timing import time_call
from ddtree.tree import build_tree, build_trees, topk_logprobs, verify_layout


@dataclass
class TreeBenchPoint:
    block_size: int
    budget: int
    builder: str  # "cpu" (heap, one request) or "batched" (torch, R requests)
    requests: int  # R
    topk_s: float  # top-k over [L, V] for one request (log_softmax + topk)
    build_s: float  # per request
    layout_s: float  # per request: positions + additive mask
    build_layout_s: float  # per request

    def as_dict(self) -> dict:
        return asdict(self)


def bench_tree(
    block_sizes: list[int],
    budgets: list[int],
    vocab_size: int = 151936,
    batch_sizes: tuple[int, ...] = (1, 64),
    repeats: int = 20,
    prefix_len: int = 128,
    seed: int = 0,
) -> Iterator[TreeBenchPoint]:
    """Yield one point per (B, N, builder, R). Logits are random normal on the CPU."""
    g = torch.Generator().manual_seed(seed)
    for block in block_sizes:
        depth = block - 1
        logits = torch.randn(depth, vocab_size, generator=g)  # [L, V]
        for budget in budgets:
            topk_t = time_call(partial(topk_logprobs, logits, budget), max(3, repeats // 4))
            top = topk_logprobs(logits, budget)
            build_t = time_call(partial(build_tree, 0, top.logprobs, top.tokens, budget), repeats)
            tree = build_tree(0, top.logprobs, top.tokens, budget)
            layout_t = time_call(partial(verify_layout, tree, prefix_len), repeats)
            yield TreeBenchPoint(
                block,
                budget,
                "cpu",
                1,
                topk_t.median_s,
                build_t.median_s,
                layout_t.median_s,
                build_t.median_s + layout_t.median_s,
            )
            for r in batch_sizes:
                lp = top.logprobs.expand(r, -1, -1).contiguous()
                ids = top.tokens.expand(r, -1, -1).contiguous()
                roots = torch.zeros(r, dtype=torch.int64)
                bt = time_call(partial(build_trees, roots, lp, ids, budget), max(3, repeats // 4))
                yield TreeBenchPoint(
                    block,
                    budget,
                    "batched",
                    r,
                    topk_t.median_s,
                    bt.median_s / r,
                    layout_t.median_s,
                    bt.median_s / r + layout_t.median_s,
                )


def to_record(points: list[TreeBenchPoint], hardware, config: dict):
    """The tree benchmark's record builder: one ``bench_tree`` record for the whole sweep."""
    from ddtree.records import Provenance, make_record

    return make_record(
        "bench_tree",
        hardware,
        config,
        {},
        [p.as_dict() for p in points],
        Provenance.here("ddtree bench tree"),
    )
