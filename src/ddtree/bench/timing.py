"""Timing helpers shared by the benchmarks: warm-up, repeats, robust statistics."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    repeats: int
    warmup: int


def time_call(
    fn: Callable[[], object],
    repeats: int = 20,
    warmup: int = 3,
    sync: Callable[[], None] | None = None,
) -> Timing:
    """Median and p10/p90 seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls.
    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each clock read on accelerators."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))]  # noqa: E731
    return Timing(statistics.median(samples), pick(0.1), pick(0.9), repeats, warmup)
