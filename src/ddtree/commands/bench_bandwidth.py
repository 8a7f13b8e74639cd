"""`ddtree bench bandwidth`: memory bandwidth of this machine (CPU, and CUDA when present)."""

from __future__ import annotations

import argparse

from ddtree.commands._args import (
    add_json_argument,
    add_threads_argument,
    device,
    int_list_upto,
    non_negative_int,
    positive_int,
    records_file,
    set_threads,
    threads_label,
)


def _methods(text: str) -> list[str]:
    from ddtree.bench.bandwidth import METHODS

    names = [x for x in text.split(",") if x]
    bad = [n for n in names if n not in METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {', '.join(bad) or text!r}; expected some of {', '.join(METHODS)}"
        )
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        type=device(("cpu", "cuda"), auto=True, indexed=False),
        default="auto",
        help="auto: the CPU, and CUDA when torch sees it (default auto)",
    )
    p.add_argument(
        "--methods",
        type=_methods,
        default=["copy", "read"],
        help="copy,read,write (default copy,read)",
    )
    p.add_argument(
        "--sizes-mib",
        type=int_list_upto(1 << 20),
        default=[256],
        help="buffer sizes in MiB, well above the last-level cache (default 256)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=10, help="timed samples per point (default 10)"
    )
    p.add_argument(
        "--warmup", type=non_negative_int, default=2, help="untimed samples first (default 2)"
    )
    add_threads_argument(p, what="torch CPU threads (measure at the count the engine runs with)")
    p.add_argument(
        "--records",
        type=records_file,
        help="append bench_bandwidth measurement records to this JSONL file",
    )
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    import sys

    from ddtree.bench.bandwidth import (
        MIB,
        bandwidth_result,
        bench_bandwidth,
        host_conditions,
        last_level_cache_bytes,
        resolve_devices,
    )
    from ddtree.commands._bench import measure, report

    try:
        devices = resolve_devices(args.device)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    threads = set_threads(args)
    host = host_conditions()  # before we load the cores ourselves
    config = {
        "threads": threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "statistic": "median",
        **host,
        "llc_bytes": last_level_cache_bytes(),
    }
    sizes = [mib * MIB for mib in args.sizes_mib]
    result = measure(
        args,
        bench_bandwidth(devices, args.methods, sizes, args.repeats, args.warmup),
        len(devices) * len(args.methods) * len(sizes),
        lambda pt: f"{pt.device} {pt.method} {pt.buffer_bytes // MIB} MiB",
        lambda points: bandwidth_result(config, points),
    )
    return report(args, result, lambda: _table(args, result))


def _table(args: argparse.Namespace, result):
    from rich.table import Table

    from ddtree.bench.bandwidth import MIB

    llc = result.config["llc_bytes"]
    llc_text = f"LLC {llc / MIB:.0f} MiB" if llc else "LLC unknown"
    table = Table(
        title=f"ddtree bench bandwidth ({threads_label(args)}, {llc_text})",
        caption="1 GB/s = 1e9 B/s. bytes/call: buffers moved per call (copy = read + write). "
        "* buffer under 4x the last-level cache: partly cached, not a memory figure.",
    )
    for col in ("device", "method", "buffer MiB", "bytes/call", "median ms", "GB/s", "p10", "p90"):
        table.add_column(col, justify="right")
    for pt in result.points:
        small = pt.device == "cpu" and llc is not None and pt.buffer_bytes < 4 * llc
        table.add_row(
            pt.device,
            pt.method,
            f"{pt.buffer_bytes / MIB:.0f}" + ("*" if small else ""),
            f"{pt.bytes // pt.calls // pt.buffer_bytes}x",
            f"{pt.seconds / pt.calls * 1e3:.2f}",
            f"{pt.bytes_per_s / 1e9:.1f}",
            f"{pt.bytes_per_s_p10 / 1e9:.1f}",
            f"{pt.bytes_per_s_p90 / 1e9:.1f}",
        )
    return table
