"""The linear layers of one model shape, each kernel of ``ddtree.models.nn.linear`` against verify
width M: what makes a verify of M tokens cost about one token's weight reads.

For each weight shape of a preset (``q/k/v/o``, ``gate/up/down``, the LM head), enough copies
that the set is twice the last-level cache (so every call streams its weight from memory, as a
decode step does), each called at every M in turns, kernel after kernel in one
run. A point is the median over ``repeats`` passes of the seconds per weight; its read rate is
the weight's bytes over that time; ``vs M=1`` is its time over the same kernel's at M = 1.
``max_abs_diff`` is against ``aten`` at the same M (0 for ``aten``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ddtree.bench.timing import time_call
from ddtree.models.nn.linear import ATEN, PackedLinear

MIN_SET_BYTES = 256 * 10**6  # the least set, whatever the cache (an unknown one included)


def default_set_bytes(llc_bytes: int | None) -> int:
    """Bytes of copies per shape: twice the last-level cache, at least :data:`MIN_SET_BYTES`.
    Example: a 480 MiB L3 -> 1007 MB; 32 MiB -> 256 MB."""
    return max(2 * (llc_bytes or 0), MIN_SET_BYTES)


@dataclass(frozen=True)
class LinearShape:
    name: str  # e.g. "gate/up"
    out_features: int
    in_features: int
    per_forward: int  # weights of this shape one forward reads (k/v: 2 per layer)


@dataclass
class LinearPoint:
    shape: str
    out_features: int
    in_features: int
    kernel: str
    m: int  # rows (verify width)
    median_s: float  # per weight
    p10_s: float
    p90_s: float
    bytes_per_s: float  # weight bytes / median_s
    vs_m1: float  # median_s over the same kernel's at M = 1 (1.0 at M = 1)
    max_abs_diff: float


def preset_shapes(target: dict, source: str) -> list[LinearShape]:
    """The distinct linear weights of a dense decoder (a preset's ``target`` config.json
    fields) and how many of each one forward reads."""
    if target.get("num_experts"):
        raise ValueError(
            f"{source}: routed experts are not linear layers here; ddtree bench moe times them"
        )
    h, layers = target["hidden_size"], target["num_hidden_layers"]
    d = target.get("head_dim") or h // target["num_attention_heads"]
    q, kv = target["num_attention_heads"] * d, target["num_key_value_heads"] * d
    inter = target["intermediate_size"]
    return [
        LinearShape("q", q, h, layers),
        LinearShape("k/v", kv, h, 2 * layers),
        LinearShape("o", h, q, layers),
        LinearShape("gate/up", inter, h, 2 * layers),
        LinearShape("down", h, inter, layers),
        LinearShape("lm_head", target["vocab_size"], h, 1),
    ]


def forward_seconds(points: list[LinearPoint], shapes: list[LinearShape]) -> dict:
    """Per kernel, the seconds one forward's linear layers take at each M (every shape's time
    times how many of it a forward reads) and that over the M = 1 time:
    ``{kernel: {"seconds_by_m": {m: s}, "vs_m1": {m: ratio}}}`` (M as a string key)."""
    count = {s.name: s.per_forward for s in shapes}
    out: dict[str, dict] = {}
    for p in points:
        by_m = out.setdefault(p.kernel, {"seconds_by_m": {}})["seconds_by_m"]
        by_m[str(p.m)] = by_m.get(str(p.m), 0.0) + count[p.shape] * p.median_s
    for entry in out.values():
        first = next(iter(entry["seconds_by_m"].values()))
        entry["vs_m1"] = {m: s / first for m, s in entry["seconds_by_m"].items()}
    return out


def copies_for(shape: LinearShape, dtype: torch.dtype, set_bytes: int) -> int:
    """Copies of a weight whose total reaches ``set_bytes``. Example: 2048 x 2048 bf16 (8.4 MB)
    over 128 MB -> 16."""
    one = shape.out_features * shape.in_features * torch.finfo(dtype).bits // 8
    return max(1, -(-set_bytes // one))


def bench_linear(
    shapes: list[LinearShape],
    ms: list[int],
    kernels: list[str],
    dtype: torch.dtype,
    set_bytes: int,
    repeats: int = 5,
    seed: int = 0,
) -> Iterator[LinearPoint]:
    """Points for every (shape, kernel, M), shape by shape (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    for shape in shapes:
        n = copies_for(shape, dtype, set_bytes)
        layers = {ATEN: [_random_linear(shape, dtype, gen) for _ in range(n)]}
        for kernel in kernels:
            if kernel != ATEN:
                layers[kernel] = [PackedLinear(layer) for layer in layers[ATEN]]
        weight_bytes = shape.out_features * shape.in_features * layers[ATEN][0].weight.itemsize
        first: dict[str, float] = {}
        for m in ms:
            x = torch.randn(m, shape.in_features, generator=gen).to(dtype)  # [M, in]
            with torch.inference_mode():
                want = layers[ATEN][0](x)
                for kernel in kernels:
                    group = layers[kernel]
                    t = time_call(lambda g=group, x=x: [f(x) for f in g], repeats, warmup=1)
                    per = t.median_s / n
                    first.setdefault(kernel, per)
                    diff = (group[0](x).float() - want.float()).abs().max().item()
                    yield LinearPoint(
                        shape.name,
                        shape.out_features,
                        shape.in_features,
                        kernel,
                        m,
                        per,
                        t.p10_s / n,
                        t.p90_s / n,
                        weight_bytes / per,
                        per / first[kernel],
                        diff,
                    )


def _random_linear(shape: LinearShape, dtype: torch.dtype, gen: torch.Generator) -> nn.Linear:
    layer = nn.Linear(shape.in_features, shape.out_features, bias=False, device="meta", dtype=dtype)
    layer = layer.to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.normal_(0, 0.02, generator=gen)
    return layer.requires_grad_(False)


def linear_result(config: dict, shapes: list[LinearShape], points: list[LinearPoint]):
    """The bench_linear result: its summary is :func:`forward_seconds` of the points."""
    from ddtree.bench.result import BenchResult

    return BenchResult("bench_linear", config, forward_seconds(points, shapes), points)
