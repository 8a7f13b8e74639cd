"""`ddtree bench allreduce`: all-reduce latency and bandwidth against message size (M x hidden
x 2 bytes) over N processes: spawned here, or the ranks torchrun started."""

from __future__ import annotations

import argparse

from ddtree.commands._args import (
    add_alias,
    add_dtype_argument,
    add_json_argument,
    add_threads_argument,
    chosen_threads,
    device,
    float_in,
    int_in,
    int_list,
    non_negative_int,
    positive_int,
    records_file,
    set_threads,
    threads_label,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ddtree.bench.allreduce import DEFAULT_HIDDEN, DEFAULT_MS
    from ddtree.distributed import DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S

    tp = p.add_argument(
        "--tp",
        type=int_in(2),
        default=2,
        help="ranks in the group (also --tensor-parallel-size) (default: %(default)s)",
    )
    add_alias(p, tp, "--tensor-parallel-size")
    p.add_argument(
        "--m",
        type=int_list,
        default=list(DEFAULT_MS),
        help="verify widths M: messages of M x hidden elements (default 1,2,4,...,1024)",
    )
    p.add_argument(
        "--hidden",
        type=positive_int,
        default=DEFAULT_HIDDEN,
        help="hidden size (default: %(default)s, Kimi K2 / DeepSeek-V3)",
    )
    add_dtype_argument(p, "bfloat16", "activations all-reduced")
    p.add_argument(
        "--device",
        type=device(("cpu", "cuda"), indexed=False),
        default="cpu",
        help="cpu (gloo) or cuda (NCCL, one GPU per rank) (default: %(default)s)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=20, help="timed samples per size (default 20)"
    )
    p.add_argument(
        "--warmup", type=non_negative_int, default=3, help="untimed samples first (default 3)"
    )
    p.add_argument(
        "--iters", type=positive_int, default=10, help="all-reduces per sample (default 10)"
    )
    add_threads_argument(p, what="torch CPU threads per rank")
    p.add_argument(
        "--timeout",
        type=float_in(MIN_TIMEOUT_S, what="a number of seconds"),
        default=DEFAULT_TIMEOUT_S,
        help="seconds one collective may take before the group fails (default: %(default)s)",
    )
    p.add_argument(
        "--records", type=records_file, help="append a bench_allreduce record to this JSONL file"
    )
    add_json_argument(p)


# Of the memory available, what the messages may take (gloo and NCCL keep buffers of their own).
MEMORY_SHARE = 0.8


def _check(args: argparse.Namespace) -> None:
    """What would fail once the ranks run, refused before the group forms."""
    import os

    import torch

    from ddtree.models.loading.memory import available_bytes

    if len(set(args.m)) < 2:
        raise ValueError(
            f"--m needs >= 2 distinct widths (to fit latency and bandwidth), got {args.m}"
        )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", args.tp))  # ranks on this host
    if args.device == "cuda" and torch.cuda.device_count() < local:
        raise ValueError(
            f"--tp {args.tp} --device cuda: {local} ranks on this host need a GPU each and it "
            f"has {torch.cuda.device_count()}"
        )
    # every rank holds one message of M x hidden at a time; on the CPU all ranks of this host
    # share its memory, on CUDA each has its GPU
    per_rank = max(args.m) * args.hidden * getattr(torch, args.dtype).itemsize
    here = local if args.device == "cpu" else 1
    have = available_bytes(torch.device(args.device))
    if have is not None and per_rank * here > MEMORY_SHARE * have:
        raise ValueError(
            f"--m {max(args.m)}: a message of {max(args.m)} x {args.hidden} {args.dtype} is "
            f"{per_rank / 1e9:,.1f} GB per rank, {here} rank{'s' if here > 1 else ''} on "
            f"{args.device} need {per_rank * here / 1e9:,.1f} GB and it has "
            f"{have / 1e9:,.1f} GB available; ask for smaller --m or --hidden"
        )


def run(args: argparse.Namespace) -> int:
    from ddtree.bench.allreduce import (
        AllreduceSettings,
        allreduce_points,
        allreduce_result,
        follow_allreduce,
    )
    from ddtree.commands._bench import measure, report
    from ddtree.distributed import start_group

    _check(args)
    threads = set_threads(args)  # each rank sets the same count (0: torch's default there)
    settings = AllreduceSettings(
        tuple(args.m), args.hidden, args.dtype, args.repeats, args.warmup, args.iters,
        chosen_threads(args.threads) or threads,
    )  # fmt: skip
    group = start_group(args.tp, follow_allreduce, (settings,), args.device, args.timeout)
    if group is None:  # a rank > 0 under torchrun: it measured along with rank 0
        return 0
    config = {
        "device": args.device,
        "backend": group.backend,
        "world_size": group.world_size,
        "dtype": args.dtype,
        "hidden_size": args.hidden,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "iters": args.iters,
        "threads": settings.threads,
        "launcher": group.launcher,
        "statistic": "median of samples, slowest rank",
    }
    try:
        result = measure(
            args,
            allreduce_points(group, settings),
            len(settings.ms),
            lambda pt: f"M={pt.m}",
            lambda points: allreduce_result(config, points),
            "all-reduce",
        )
    finally:
        group.close()
    return report(args, result, lambda: _table(args, result))


def _table(args: argparse.Namespace, result):
    from rich.table import Table

    from ddtree.bench.allreduce import fit_allreduce

    n = result.config["world_size"]
    fit = fit_allreduce(result.points, n)
    table = Table(
        title=f"ddtree bench allreduce: {n} ranks, {result.config['backend']} on {args.device}, "
        f"{args.dtype}, hidden {args.hidden}, {threads_label(args)} per rank",
        caption=f"fit: latency {fit.latency_s * 1e6:.1f} µs + 2(n-1)/n x bytes / "
        f"{fit.bus_bytes_per_s / 1e9:.2f} GB/s (worst point {fit.max_rel_error:.0%} off). "
        "busbw = algbw x 2(n-1)/n (nccl-tests); 1 GB/s = 1e9 B/s",
    )
    for col in ("M", "bytes", "median µs", "p10 µs", "p90 µs", "algbw GB/s", "busbw GB/s"):
        table.add_column(col, justify="right")
    for p in result.points:
        table.add_row(
            str(p.m),
            f"{p.bytes:,}",
            f"{p.seconds * 1e6:.1f}",
            f"{p.p10_s * 1e6:.1f}",
            f"{p.p90_s * 1e6:.1f}",
            f"{p.algbw_bytes_per_s / 1e9:.3f}",
            f"{p.bus_bytes_per_s / 1e9:.3f}",
        )
    return table
