"""`ddtree bench tree`: time top-k, tree build, verify layout and greedy accept, for every
tree backend side by side."""

from __future__ import annotations

import argparse
import json

from ddtree.commands._args import int_list, non_negative_int, output_file, positive_int, threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int_list, default=[8, 16], help="block sizes B (default 8,16)")
    p.add_argument(
        "--budgets", type=int_list, default=[16, 32, 64, 128, 256, 512, 1024], help="budgets N"
    )
    p.add_argument(
        "--vocab", type=positive_int, default=151936, help="vocabulary size V (Qwen3: 151936)"
    )
    p.add_argument(
        "--batch", type=int_list, default=[1, 64], help="batched-builder request counts R"
    )
    p.add_argument(
        "--prefix", type=non_negative_int, default=128, help="committed tokens S before the tree"
    )
    p.add_argument(
        "--repeats", type=positive_int, default=20, help="timed calls per point (median)"
    )
    p.add_argument(
        "--threads",
        type=threads,
        default=1,
        help="torch threads (default 1: the tree core is single-threaded; 0: torch's default)",
    )
    p.add_argument(
        "--records",
        type=output_file,
        help="append a bench_tree measurement record to this JSONL file",
    )


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from ddtree.bench.tree import available_backends, bench_tree, to_record
    from ddtree.records import HardwareInfo, write_records
    from ddtree.tree import backend

    for name in ("vocab", "prefix", "repeats"):
        if getattr(args, name) < (1 if name != "prefix" else 0):
            raise SystemExit(f"ddtree bench tree: --{name} must be >= 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    backends = available_backends()
    table = Table(
        title=f"ddtree bench tree (V={args.vocab}, S={args.prefix}, CPU, "
        f"{torch.get_num_threads()} threads; backend in use: {backend()})",
        caption="µs per request (top-k in ms). layout: into a reused LayoutBuffer; new mask: "
        "freshly allocated. vs python: the python row's build+layout / this row's",
    )
    columns = ["B", "N", "builder", "R", "top-k ms", "build", "layout", "new mask"]
    for col in columns + ["build+layout", "accept", "vs python"]:
        table.add_column(col, justify="right")
    points = []
    python_s: dict[tuple[int, int], float] = {}
    with console.status("timing...") as status:
        for pt in bench_tree(
            args.blocks,
            args.budgets,
            args.vocab,
            tuple(args.batch),
            args.repeats,
            args.prefix,
            backends=backends,
        ):
            status.update(f"B={pt.block_size} N={pt.budget} {pt.builder} R={pt.requests}")
            points.append(pt)
            key = (pt.block_size, pt.budget)
            if pt.builder == "python":
                python_s[key] = pt.build_layout_s
            ratio = python_s.get(key, float("nan")) / pt.build_layout_s
            table.add_row(
                str(pt.block_size),
                str(pt.budget),
                pt.builder,
                str(pt.requests),
                f"{pt.topk_s * 1e3:.2f}",
                f"{pt.build_s * 1e6:.0f}",
                f"{pt.layout_s * 1e6:.0f}",
                f"{pt.layout_alloc_s * 1e6:.0f}",
                f"{pt.build_layout_s * 1e6:.0f}",
                f"{pt.accept_s * 1e6:.0f}",
                f"{ratio:.1f}x",
            )
    console.print(table)
    hw = HardwareInfo.collect()
    config = {
        "device": "cpu",
        "vocab_size": args.vocab,
        "prefix_len": args.prefix,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "warmup": 3,
        "statistic": "median",
        "tree_backend": backend(),
        "tree_backends_timed": [b.name for b in backends],
    }
    record = to_record(points, hw, config)
    print(json.dumps({"bench": "tree", "hardware": hw.label, **config, "points": record.points}))
    if args.records:
        write_records(args.records, [record])
    return 0
