"""`ddtree bench allreduce`: latency and bandwidth of an all-reduce against message size.

The sizes are those a tensor-parallel decode step all-reduces: ``M x hidden`` activations in
bf16 (2 bytes), for verify widths ``M`` from 1 to 1024. Every rank of the group runs
:func:`measure_allreduce`; a sample times ``iters`` back-to-back all-reduces of one buffer
(after ``warmup`` untimed ones), and a size's time is the median sample over ``repeats`` divided
by ``iters``, the slowest rank's (a collective ends when its last rank does).

Bandwidths follow the nccl-tests convention:

- ``algbw = bytes / seconds``;
- ``bus bandwidth = algbw x 2(n-1)/n``: what each link carries in a ring all-reduce of ``n``
  ranks, comparable across group sizes.

:func:`fit_allreduce` fits ``seconds = latency + 2(n-1)/n x bytes / bus_bw`` (least squares on
relative error), the form the estimator's all-reduce component uses, so a record's
``latency_s`` and ``bus_bytes_per_s`` are its anchors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from ddtree.bench.timing import time_call

DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_HIDDEN = 7168  # Kimi K2 / DeepSeek-V3 hidden size


def ring_factor(world_size: int) -> float:
    """2(n-1)/n: the share of a buffer each rank sends (and receives) in a ring all-reduce."""
    return 2.0 * (world_size - 1) / world_size


@dataclass
class AllreducePoint:
    m: int  # verify width (rows of the hidden-size activations)
    bytes: int  # message size per rank
    seconds: float  # median per all-reduce, slowest rank
    p10_s: float
    p90_s: float
    algbw_bytes_per_s: float
    bus_bytes_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AllreduceSettings:
    """What every rank runs (sent to spawned ranks as their entry's argument)."""

    ms: tuple[int, ...] = DEFAULT_MS
    hidden: int = DEFAULT_HIDDEN
    dtype: str = "bfloat16"  # a torch dtype's name
    repeats: int = 20
    warmup: int = 3
    iters: int = 10
    threads: int = 1


def measure_allreduce(
    group, settings: AllreduceSettings, progress: Callable[[int], None] | None = None
) -> list[AllreducePoint]:
    """Time the all-reduce at every size on every rank of ``group`` (a ddtree Group); every
    rank returns the same points. ``progress(m)`` is called after each size."""
    points = []
    for point in allreduce_points(group, settings):
        points.append(point)
        if progress is not None:
            progress(point.m)
    return points


def allreduce_points(group, settings: AllreduceSettings) -> Iterator[AllreducePoint]:
    """:func:`measure_allreduce`'s points, one size at a time."""
    dtype = getattr(torch, settings.dtype)
    n = group.world_size
    sync = torch.cuda.synchronize if group.device.type == "cuda" else None
    for m in settings.ms:
        buf = torch.zeros(m, settings.hidden, dtype=dtype, device=group.device)

        def burst(buf=buf) -> None:
            for _ in range(settings.iters):
                dist.all_reduce(buf)

        timing = time_call(burst, settings.repeats, settings.warmup, sync)
        # the slowest rank's figures, on every rank
        mine = torch.tensor([timing.median_s, timing.p10_s, timing.p90_s], dtype=torch.float64)
        mine = mine.to(group.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        median_s, p10_s, p90_s = (float(x) / settings.iters for x in mine.tolist())
        nbytes = buf.numel() * buf.element_size()
        algbw = nbytes / median_s
        yield AllreducePoint(m, nbytes, median_s, p10_s, p90_s, algbw, algbw * ring_factor(n))


def follow_allreduce(group, settings: AllreduceSettings) -> None:
    """Entry of ranks > 0: the same measurements as rank 0, nothing printed."""
    torch.set_num_threads(settings.threads)
    measure_allreduce(group, settings)


@dataclass(frozen=True)
class AllreduceFit:
    latency_s: float  # intercept: the time of an empty all-reduce
    bus_bytes_per_s: float  # slope: bus bandwidth (inf when the slope is not positive)
    max_rel_error: float  # worst |fit - measured| / measured over the points


def fit_allreduce(points: list[AllreducePoint], world_size: int) -> AllreduceFit:
    """Least squares on relative error of ``seconds = latency + ring x bytes / bus_bw``.

    Example: points (1 KB, 20 µs) and (1 MB, 520 µs) at n = 2 (ring 1) fit latency 19.5 µs
    and bus bandwidth 2.0 GB/s. Latency is kept >= 0."""
    if len(points) < 2:
        raise ValueError(f"fitting needs >= 2 message sizes, got {len(points)}")
    x = np.array([p.bytes * ring_factor(world_size) for p in points], dtype=float)
    t = np.array([p.seconds for p in points], dtype=float)
    w = 1.0 / t  # minimise relative error: every size counts alike
    design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if a < 0:  # refit through the origin
        a, b = 0.0, float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    bus = 1.0 / b if b > 0 else float("inf")
    fit_t = a + x * (b if b > 0 else 0.0)
    return AllreduceFit(float(a), float(bus), float(np.max(np.abs(fit_t - t) / t)))


def allreduce_result(config: dict, points: list[AllreducePoint]):
    """The bench_allreduce result: ``config`` (device, backend, world_size, dtype, hidden_size,
    then the rest) and the :func:`fit_allreduce` of ``points``; a ValueError where the times do
    not grow with the message size (no bandwidth to fit)."""
    from ddtree.bench.result import BenchResult

    fit = fit_allreduce(points, config["world_size"])
    if not np.isfinite(fit.bus_bytes_per_s):
        ms = [p.m for p in points]
        raise ValueError(
            f"all-reduce times do not grow with the message size over --m {ms}: no "
            "bandwidth to fit; include larger widths"
        )
    summary = {
        "latency_s": fit.latency_s,
        "bus_bytes_per_s": fit.bus_bytes_per_s,
        "fit_max_rel_error": fit.max_rel_error,
    }
    rows = [p.as_dict() for p in points]
    document = {"bench": "allreduce", **config, **summary, "points": rows}
    return BenchResult("bench_allreduce", config, summary, points, document)
