"""`ddtree bench tree`: time top-k, tree build, verify layout and greedy accept, for every
tree backend side by side."""

from __future__ import annotations

import argparse

from ddtree.commands._args import (
    add_json_argument,
    add_threads_argument,
    device,
    int_list,
    non_negative_int,
    positive_int,
    records_file,
    set_threads,
    threads_label,
)


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
    add_threads_argument(p, what="torch CPU threads (the tree core itself is single-threaded)")
    p.add_argument(
        "--device",
        type=device(),
        default="cpu",
        help="where top-k and the batched builder run, e.g. cuda (the heap backends run on "
        "the host, as the engine runs them) (default %(default)s)",
    )
    p.add_argument(
        "--records",
        type=records_file,
        help="append a bench_tree measurement record to this JSONL file",
    )
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from ddtree.bench.tree import available_backends, bench_tree, tree_result
    from ddtree.commands._bench import measure, report
    from ddtree.provenance import this_hardware
    from ddtree.tree import backend

    set_threads(args)
    backends = available_backends()
    config = {
        "device": args.device,
        "vocab_size": args.vocab,
        "prefix_len": args.prefix,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "warmup": 3,
        "statistic": "median",
        "tree_backend": backend(),
        "tree_backends_timed": [b.name for b in backends],
    }
    hardware = this_hardware().label
    points = bench_tree(
        args.blocks, args.budgets, args.vocab, tuple(args.batch), args.repeats, args.prefix,
        backends=backends, device=args.device,
    )  # fmt: skip
    result = measure(
        args,
        points,
        None,
        lambda pt: f"B={pt.block_size} N={pt.budget} {pt.builder} R={pt.requests}",
        lambda points: tree_result(points, config, hardware),
    )
    return report(args, result, lambda: _table(args, result.points))


def _table(args: argparse.Namespace, points):
    from rich.table import Table

    from ddtree.tree import backend

    table = Table(
        title=f"ddtree bench tree (V={args.vocab}, S={args.prefix}, top-k and batched on "
        f"{args.device}, heap on the CPU, {threads_label(args)}; backend in use: {backend()})",
        caption="µs per request (top-k in ms). layout: into a reused LayoutBuffer; new mask: "
        "freshly allocated. vs python: the python row's build+layout / this row's",
    )
    columns = ["B", "N", "builder", "R", "top-k ms", "build", "layout", "new mask"]
    for col in columns + ["build+layout", "accept", "vs python"]:
        table.add_column(col, justify="right")
    python_s: dict[tuple[int, int], float] = {}
    for pt in points:
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
    return table
