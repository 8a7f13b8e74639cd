"""`ddtree bench attention`: one layer's tree-verify attention, split (maskless prefix + masked
tail, merged) against the dense additive [M, S+M] mask it replaced: time and peak memory at
each context length S and budget N, both methods in turns in one run."""

from __future__ import annotations

import argparse

from ddtree.commands._args import (
    add_dtype_argument,
    add_json_argument,
    add_threads_argument,
    device,
    int_list,
    positive_int,
    records_file,
    set_threads,
    threads_label,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--contexts",
        type=int_list,
        default=[512, 4096],
        help="context lengths S (default %(default)s)",
    )
    p.add_argument(
        "--budgets", type=int_list, default=[32, 256, 1024], help="budgets N (default %(default)s)"
    )
    p.add_argument("--heads", type=positive_int, default=32, help="query heads (Qwen3-8B: 32)")
    p.add_argument("--kv-heads", type=positive_int, default=8, help="KV heads (Qwen3-8B: 8)")
    p.add_argument("--head-dim", type=positive_int, default=128, help="head dim (default 128)")
    add_dtype_argument(p, "bfloat16", "queries, keys and values")
    p.add_argument(
        "--device", type=device(), default="cpu", help="torch device (default: %(default)s)"
    )
    p.add_argument(
        "--repeats", type=positive_int, default=10, help="timed calls per point (default: 10)"
    )
    add_threads_argument(p)
    p.add_argument(
        "--records", type=records_file, help="append a bench_attention record to this file"
    )
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from ddtree.bench.attention import AttentionShape, attention_result, bench_attention
    from ddtree.commands._bench import measure, report

    if args.heads % args.kv_heads:
        raise ValueError(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    set_threads(args)
    shape = AttentionShape(args.heads, args.kv_heads, args.head_dim)
    dtype = getattr(torch, args.dtype)
    config = {
        "device": args.device,
        "dtype": args.dtype,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
    }
    result = measure(
        args,
        bench_attention(args.contexts, args.budgets, shape, dtype, args.device, args.repeats),
        3 * len(args.contexts) * len(args.budgets),
        lambda pt: f"S={pt.context} N={pt.budget} {pt.method}",
        lambda points: attention_result(config, args.contexts, args.budgets, points),
    )
    return report(args, result, lambda: _table(args, result))


def _table(args: argparse.Namespace, result):
    from rich.table import Table

    c = result.config
    table = Table(
        title=f"ddtree bench attention ({args.device}, {args.dtype}, {threads_label(args)}; "
        f"heads {c['heads']}/{c['kv_heads']}, head dim {c['head_dim']})",
        caption="one layer, mask building included. split: prefix + tail merged (ours now); "
        "dense: additive [M, S+M] mask + fused SDPA; math: the same mask on materialised "
        "scores (our targets before). MB: peak bytes allocated beyond the inputs. "
        "x/split > 1: split is better",
    )
    for col in ("S", "N", "split ms", "dense ms", "math ms", "split MB", "dense MB",
                "math MB", "dense/split time", "dense/split mem", "math/split mem",
                "max |diff|"):  # fmt: skip
        table.add_column(col, justify="right")
    by_key = {(p.context, p.budget, p.method): p for p in result.points}
    for key, ratios in result.summary.items():
        s, n = (int(x) for x in key[1:].split("_N"))
        split, dense, math = (by_key[(s, n, m)] for m in ("split", "dense", "dense-math"))
        table.add_row(
            str(s),
            str(n),
            *(f"{p.median_s * 1e3:.2f}" for p in (split, dense, math)),
            *(f"{p.peak_bytes / 1e6:.1f}" for p in (split, dense, math)),
            f"{ratios['time_dense_over_split']:.2f}x",
            f"{ratios['memory_dense_over_split']:.1f}x",
            f"{ratios['memory_math_over_split']:.1f}x",
            f"{split.max_abs_diff:.2g}",
        )
    return table
