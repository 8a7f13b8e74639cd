"""`ddtree bench bandwidth`: memory bandwidth of this machine, per device and kernel.

Each method is one torch kernel over buffers much larger than the last-level cache, and
counts the bytes it must move through memory, honestly:

| method | kernel | bytes counted per call |
| --- | --- | --- |
| ``copy`` | ``dst.copy_(src)`` | read ``src`` + write ``dst`` = 2 x buffer |
| ``read`` | ``src.sum()`` | read ``src`` = 1 x buffer |
| ``write`` | ``dst.fill_(1)`` | write ``dst`` = 1 x buffer |

A CPU store to a line not in the cache usually reads it first (write-allocate), so ``copy`` and
``write`` may move more bytes than they are credited with; the counted figure is the useful
bandwidth a kernel of that shape gets, which is what the estimator needs. Rates are SI:
``bytes_per_s`` (1 GB/s = 1e9 bytes/s).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ddtree.bench.timing import time_call

MIB = 1 << 20  # buffer sizes are binary (MiB); rates are SI (bytes/s)
BUFFER_DTYPE = torch.float32


@dataclass(frozen=True)
class BandwidthMethod:
    name: str
    bytes_per_buffer: int  # bytes counted per call, in buffer sizes (copy: read + write = 2)
    make: Callable[[torch.Tensor, torch.Tensor], Callable[[], object]]  # (src, dst) -> kernel


METHODS: dict[str, BandwidthMethod] = {
    m.name: m
    for m in (
        BandwidthMethod("copy", 2, lambda src, dst: lambda: dst.copy_(src)),
        BandwidthMethod("read", 1, lambda src, dst: lambda: src.sum()),
        BandwidthMethod("write", 1, lambda src, dst: lambda: dst.fill_(1.0)),
    )
}


@dataclass
class BandwidthPoint:
    device: str  # "cpu" or "cuda"
    method: str
    buffer_bytes: int  # size of one buffer
    calls: int  # kernel calls per timed sample (several on an accelerator, to hide the sync)
    bytes: int  # bytes counted per timed sample
    seconds: float  # median seconds per sample
    p10_s: float
    p90_s: float
    bytes_per_s: float  # bytes / median seconds
    bytes_per_s_p10: float  # from the p90 time (slow end)
    bytes_per_s_p90: float  # from the p10 time (fast end)

    def as_dict(self) -> dict:
        return asdict(self)


def available_devices() -> list[str]:
    """``["cpu"]`` plus ``"cuda"`` when torch sees a CUDA device."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def resolve_devices(spec: str) -> list[str]:
    """``auto`` -> every available device; ``cpu``, ``cuda`` -> that one (cuda must exist)."""
    if spec == "auto":
        return available_devices()
    if spec not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected auto, cpu or cuda, got {spec!r}")
    if spec == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device on this machine")
    return [spec]


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache (Linux sysfs), or None if unknown."""
    best = None
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size_file.read_text(encoding="utf-8").strip()
        try:
            value = int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]]
        except (KeyError, ValueError):
            continue
        best = value if best is None else max(best, value)
    return best


def host_conditions() -> dict:
    """What else shaped a CPU measurement: the 1-minute load average (other processes on the
    cores) and ``OMP_WAIT_POLICY`` (with more busy threads than cores, OpenMP's default
    spin-waiting can make a multi-threaded run 100x slower; ``PASSIVE`` avoids it)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "load_avg_1min": load,
        "cpu_cores": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


def measure(
    device: str,
    method: str,
    buffer_bytes: int,
    repeats: int = 10,
    warmup: int = 2,
    calls: int | None = None,
) -> BandwidthPoint:
    """Time one method on one device over a buffer of ``buffer_bytes`` (rounded down to whole
    float32 elements). ``calls`` per sample defaults to 1 on the CPU and 10 on CUDA."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {', '.join(METHODS)}")
    if buffer_bytes < BUFFER_DTYPE.itemsize:
        raise ValueError(f"buffer_bytes must be >= {BUFFER_DTYPE.itemsize}, got {buffer_bytes}")
    spec = METHODS[method]
    numel = buffer_bytes // BUFFER_DTYPE.itemsize
    src = torch.ones(numel, dtype=BUFFER_DTYPE, device=device)  # [numel] float32
    dst = torch.empty_like(src) if method != "read" else src
    kernel = spec.make(src, dst)
    if calls is None:
        calls = 10 if device == "cuda" else 1
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")

    def sample() -> None:
        for _ in range(calls):
            kernel()

    sync = torch.cuda.synchronize if device == "cuda" else None
    t = time_call(sample, repeats=repeats, warmup=warmup, sync=sync)
    counted = spec.bytes_per_buffer * numel * BUFFER_DTYPE.itemsize * calls
    return BandwidthPoint(
        device=device,
        method=method,
        buffer_bytes=numel * BUFFER_DTYPE.itemsize,
        calls=calls,
        bytes=counted,
        seconds=t.median_s,
        p10_s=t.p10_s,
        p90_s=t.p90_s,
        bytes_per_s=counted / t.median_s,
        bytes_per_s_p10=counted / t.p90_s,
        bytes_per_s_p90=counted / t.p10_s,
    )


def bench_bandwidth(
    devices: list[str],
    methods: list[str],
    buffer_bytes: list[int],
    repeats: int = 10,
    warmup: int = 2,
) -> Iterator[BandwidthPoint]:
    """One point per (device, method, buffer size), in that nesting order."""
    for device in devices:
        for method in methods:
            for size in buffer_bytes:
                yield measure(device, method, size, repeats=repeats, warmup=warmup)


def _by_method(points: list[BandwidthPoint]) -> dict[tuple[str, str], list[BandwidthPoint]]:
    groups: dict[tuple[str, str], list[BandwidthPoint]] = {}
    for p in points:
        groups.setdefault((p.device, p.method), []).append(p)
    return groups


def to_records(points: list[BandwidthPoint], hardware, extra_config: dict) -> list:
    """The bandwidth benchmark's record builder: one ``bench_bandwidth`` record per (device,
    method). Its summary is the point at the largest buffer (the one furthest above the
    caches); ``points`` keep every size."""
    from ddtree.provenance import this_process
    from ddtree.records import make_record

    records = []
    for (device, method), pts in _by_method(points).items():
        top = max(pts, key=lambda p: p.buffer_bytes)
        config = {
            "device": device,
            "method": method,
            "bytes_per_buffer": METHODS[method].bytes_per_buffer,
            "dtype": str(BUFFER_DTYPE).removeprefix("torch."),
            **extra_config,
        }
        summary = {
            "bytes_per_s": top.bytes_per_s,
            "bytes_per_s_p10": top.bytes_per_s_p10,
            "bytes_per_s_p90": top.bytes_per_s_p90,
            "buffer_bytes": top.buffer_bytes,
        }
        records.append(
            make_record(
                "bench_bandwidth",
                hardware,
                config,
                summary,
                [asdict(p) for p in pts],
                this_process("ddtree bench bandwidth"),
            )
        )
    return records


def bandwidth_result(config: dict, points: list[BandwidthPoint]):
    """The bench_bandwidth result: one record per (device, method) (:func:`to_records`), and
    the ``--json`` document of all of them."""
    from ddtree.bench.result import BenchResult
    from ddtree.provenance import this_hardware

    hw = this_hardware()
    records = to_records(points, hw, config)
    groups = list(_by_method(points).values())
    parts = [
        BenchResult("bench_bandwidth", r.config, r.summary, pts)
        for r, pts in zip(records, groups, strict=True)
    ]
    document = {
        "bench": "bandwidth",
        "hardware": hw.label,
        **config,
        "summary": [{**r.config, **r.summary} for r in records],
        "points": [p.as_dict() for p in points],
    }
    return BenchResult("bench_bandwidth", config, {}, points, document, parts)


@dataclass
class PeakBandwidth:
    bytes_per_s: float
    source: str  # where the figure came from, for the record and the table title


def peak_from_records(
    records: list, device: str, where: str = "records", threads: int | None = None
) -> PeakBandwidth:
    """The peak to compare a kernel against: from ``bench_bandwidth`` records of ``device``
    (those measured with ``threads`` CPU threads when there are any), the ``read`` method when
    present (weight streaming is a read), else the fastest method."""
    mine = [r for r in records if r.kind == "bench_bandwidth" and r.config.get("device") == device]
    if not mine:
        raise ValueError(f"{where}: no bench_bandwidth record for device {device!r}")
    same_threads = [r for r in mine if threads is not None and r.config.get("threads") == threads]
    mine = same_threads or mine
    reads = [r for r in mine if r.config.get("method") == "read"]
    best = max(reads or mine, key=lambda r: float(r.summary["bytes_per_s"]))
    return PeakBandwidth(
        float(best.summary["bytes_per_s"]),
        f"{where} ({device}, {best.config.get('method')}, "
        f"{best.config.get('threads')} threads, {best.created_utc})",
    )
