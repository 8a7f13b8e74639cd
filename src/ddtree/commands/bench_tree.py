"""`ddtree bench tree`: time top-k, tree build and verify layout."""

from __future__ import annotations

import argparse
import json

from ddtree.commands._args import int_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int_list, default=[8, 16], help="block sizes B (default 8,16)")
    p.add_argument(
        "--budgets", type=int_list, default=[16, 32, 64, 128, 256, 512, 1024], help="budgets N"
    )
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size V (Qwen3: 151936)")
    p.add_argument(
        "--batch", type=int_list, default=[1, 64], help="batched-builder request counts R"
    )
    p.add_argument("--repeats", type=int, default=20, help="timed calls per point (median)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--records", help="append a bench_tree measurement record to this JSONL file")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from ddtree.bench.tree import bench_tree, to_record
    from ddtree.records import HardwareInfo, write_records

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    table = Table(
        title=f"ddtree bench tree (V={args.vocab}, CPU, {torch.get_num_threads()} threads)"
    )
    for col in (
        "B",
        "N",
        "builder",
        "R",
        "top-k ms",
        "build µs/req",
        "layout µs",
        "build+layout µs/req",
    ):
        table.add_column(col, justify="right")
    points = []
    with console.status("timing...") as status:
        for pt in bench_tree(
            args.blocks, args.budgets, args.vocab, tuple(args.batch), args.repeats
        ):
            status.update(f"B={pt.block_size} N={pt.budget} {pt.builder} R={pt.requests}")
            points.append(pt)
            table.add_row(
                str(pt.block_size),
                str(pt.budget),
                pt.builder,
                str(pt.requests),
                f"{pt.topk_s * 1e3:.2f}",
                f"{pt.build_s * 1e6:.0f}",
                f"{pt.layout_s * 1e6:.0f}",
                f"{pt.build_layout_s * 1e6:.0f}",
            )
    console.print(table)
    hw = HardwareInfo.collect()
    config = {
        "device": "cpu",
        "vocab_size": args.vocab,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "warmup": 3,
        "statistic": "median",
    }
    record = to_record(points, hw, config)
    print(json.dumps({"bench": "tree", "hardware": hw.label, **config, "points": record.points}))
    if args.records:
        write_records(args.records, [record])
    return 0
