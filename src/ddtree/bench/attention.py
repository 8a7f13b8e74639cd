"""Tree-verify attention of one layer, the way it runs now against the dense additive mask it
replaced, side by side: time and peak memory over context length S and budget N.

- ``dense``: the transformers wrapper's way (and the best a dense mask allows): the
  ``[1, 1, M, S + M]`` additive mask laid out by ``ddtree.tree.verify_layout``, then one fused
  SDPA over the whole cache (grouped-query heads by ``enable_gqa``);
- ``dense-math``: what our own targets' eager verify did before this module: the same mask
  added to materialised float32 scores ``[nh, M, S + M]``, softmax, then the values;
- ``split``: ``ddtree.models.nn.attention``: the tail's ``[M, M]`` mask built from the tree's
  visibility, a maskless flash attention over the prefix, a masked one over the tail, merged by
  log-sum-exp.

Each call includes building its mask (the dense layout is allocated fresh, as a request's
first step does; the engine's eager mode used to refill a reused buffer of that size, which
stays resident). Peak memory is what the call allocates beyond its inputs: the largest sum of
live allocations during it, from the torch profiler's allocation events on the CPU (CUDA:
``max_memory_allocated``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.bench.result import BenchResult
from ddtree.bench.timing import time_call
from ddtree.models.nn.attention import AttentionInputs, grouped_attention
from ddtree.tree.layout import verify_layout
from ddtree.tree.types import DraftTree

METHODS = ("dense", "dense-math", "split")


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer: query heads, KV heads, head dim (default: Qwen3-8B's)."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128


@dataclass
class AttentionPoint:
    context: int  # S committed tokens
    budget: int  # N: the tree has M = N + 1 nodes
    method: str
    median_s: float
    p10_s: float
    p90_s: float
    peak_bytes: int  # allocated beyond the inputs during one call
    max_abs_diff: float  # against the dense method's output (0 for dense itself)


def random_tree(m: int, gen: torch.Generator) -> DraftTree:
    """A random tree of M nodes (parents before children), as the builder would give."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, m)]
    vis = torch.eye(m, dtype=torch.bool)
    depth = [0] * m
    for i in range(1, m):
        vis[i] |= vis[parents[i]]
        depth[i] = depth[parents[i]] + 1
    return DraftTree(
        tokens=torch.randint(0, 1000, (m,), generator=gen),
        parents=torch.tensor(parents),
        depth=torch.tensor(depth),
        scores=torch.zeros(m, dtype=torch.float64),
        visibility=vis,
    )


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes ``fn()`` allocates beyond what was live before it, at its peak."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


@dataclass
class Case:
    """One (S, N) point's inputs: a random tree of M = N + 1 nodes after S committed rows, the
    layer's query and its cache (the tree's rows written at S .. S+M-1)."""

    context: int
    tree: DraftTree
    q: torch.Tensor  # [nh, M, D]
    k_cache: torch.Tensor  # [kvh, S + M, D]
    v_cache: torch.Tensor  # [kvh, S + M, D]
    scale: float

    @classmethod
    def random(cls, s: int, n: int, shape, dtype, device, gen: torch.Generator) -> Case:
        m, d = n + 1, shape.head_dim
        tree = random_tree(m, gen)
        tree = DraftTree(*(t.to(device) for t in (tree.tokens, tree.parents, tree.depth)),
                         scores=tree.scores, visibility=tree.visibility.to(device))  # fmt: skip
        k, v = (torch.randn(shape.kv_heads, s + m, d, generator=gen) for _ in range(2))
        q = torch.randn(shape.heads, m, d, generator=gen)
        k, v, q = (t.to(device, dtype) for t in (k, v, q))
        return cls(s, tree, q, k, v, d**-0.5)

    def dense(self) -> torch.Tensor:
        mask = verify_layout(self.tree, self.context, self.q.dtype).attn_mask  # [1, 1, M, S+M]
        out = F.scaled_dot_product_attention(
            self.q[None], self.k_cache[None], self.v_cache[None], attn_mask=mask,
            scale=self.scale, enable_gqa=True,
        )  # fmt: skip
        return out[0]  # [nh, M, D]

    def dense_math(self) -> torch.Tensor:
        mask = verify_layout(self.tree, self.context, self.q.dtype).attn_mask[0, 0]
        g = self.q.shape[0] // self.k_cache.shape[0]
        k = self.k_cache.repeat_interleave(g, 0)  # [nh, S+M, D]
        v = self.v_cache.repeat_interleave(g, 0)
        scores = (self.q @ k.transpose(1, 2)) * self.scale + mask  # [nh, M, S+M]
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.q.dtype) @ v

    def split(self) -> torch.Tensor:
        start = torch.tensor(self.context, device=self.q.device)
        m = self.tree.n_nodes
        keys = torch.arange(self.context, device=self.q.device)
        inputs = AttentionInputs.build(start, self.tree.visibility, keys, m, self.q.dtype)
        return grouped_attention(self.q, self.k_cache, self.v_cache, inputs, self.scale)


def bench_attention(
    contexts: list[int],
    budgets: list[int],
    shape: AttentionShape = AttentionShape(),
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    repeats: int = 10,
    seed: int = 0,
) -> Iterator[AttentionPoint]:
    """Both methods at every (S, N), taking turns per repeat so machine load hits both."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    for s in contexts:
        for n in budgets:
            case = Case.random(s, n, shape, dtype, device, gen)
            runs = {"dense": case.dense, "dense-math": case.dense_math, "split": case.split}
            reference = case.dense()
            timings: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(repeats):
                for name, fn in runs.items():
                    timings[name].append(time_call(fn, repeats=1, warmup=1, sync=sync).median_s)
            for name, fn in runs.items():
                samples = sorted(timings[name])
                yield AttentionPoint(
                    context=s,
                    budget=n,
                    method=name,
                    median_s=samples[len(samples) // 2],
                    p10_s=samples[int(0.1 * len(samples))],
                    p90_s=samples[min(len(samples) - 1, int(0.9 * len(samples)))],
                    peak_bytes=peak_bytes(fn, device),
                    max_abs_diff=(fn().float() - reference.float()).abs().max().item(),
                )


def attention_result(
    config: dict, contexts: list[int], budgets: list[int], points: list[AttentionPoint]
) -> BenchResult:
    """The bench_attention result: per ``S{s}_N{n}`` whose three methods were all timed,
    dense's and math's time and peak memory over split's (x > 1: split is better)."""
    by_key = {(p.context, p.budget, p.method): p for p in points}
    summary = {}
    for s in contexts:
        for n in budgets:
            if any((s, n, m) not in by_key for m in METHODS):
                continue
            split, dense, math = (by_key[(s, n, m)] for m in ("split", "dense", "dense-math"))
            summary[f"S{s}_N{n}"] = {
                "time_dense_over_split": dense.median_s / split.median_s,
                "time_math_over_split": math.median_s / split.median_s,
                "memory_dense_over_split": dense.peak_bytes / max(split.peak_bytes, 1),
                "memory_math_over_split": math.peak_bytes / max(split.peak_bytes, 1),
            }
    return BenchResult("bench_attention", config, summary, points)
