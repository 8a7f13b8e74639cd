"""`ddtree bench linear`: a preset's linear weights, each linear kernel (``aten``, and
``onednn-packed`` where it runs) against verify width M, in one run: the time per weight, its
read rate, and its cost over one token's (``ddtree.bench.linear``)."""

from __future__ import annotations

import argparse

from ddtree.commands._args import (
    add_dtype_argument,
    add_json_argument,
    add_threads_argument,
    int_list,
    output_file,
    positive_int,
    set_threads,
    threads_label,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ddtree.models.presets import preset_names

    p.add_argument(
        "--preset",
        default="qwen3-1.7b",
        choices=preset_names(),
        help="whose weight shapes (default %(default)s)",
    )
    p.add_argument(
        "--ms",
        type=int_list,
        default=[1, 8, 16, 17, 33, 65, 129, 257],
        help="verify widths M = N + 1 (default %(default)s)",
    )
    add_dtype_argument(p, "bfloat16", "weights and activations")
    p.add_argument(
        "--set-mb",
        type=positive_int,
        default=None,
        help="MB of copies of each weight, so calls stream from memory (default: twice the "
        "last-level cache, at least 256)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed passes per point (default: 5)"
    )
    add_threads_argument(p)
    p.add_argument("--records", type=output_file, help="append a bench_linear record to this file")
    add_json_argument(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from ddtree.bench.bandwidth import last_level_cache_bytes
    from ddtree.bench.linear import bench_linear, default_set_bytes, linear_result, preset_shapes
    from ddtree.commands._bench import measure, report
    from ddtree.commands._output import note
    from ddtree.models.nn.linear import ATEN, ONEDNN_PACKED, packed_unavailable
    from ddtree.models.presets import Preset

    set_threads(args)
    dtype = getattr(torch, args.dtype)
    why_not = packed_unavailable(torch.device("cpu"), dtype)
    kernels = [ATEN] if why_not else [ATEN, ONEDNN_PACKED]
    if why_not:
        note(f"{ONEDNN_PACKED} not timed: {why_not}")
    set_bytes = args.set_mb * 10**6 if args.set_mb else default_set_bytes(last_level_cache_bytes())
    shapes = preset_shapes(Preset.load(args.preset).target, f"--preset {args.preset}")
    config = {
        "preset": args.preset,
        "device": "cpu",
        "dtype": args.dtype,
        "kernels": kernels,
        "threads": torch.get_num_threads(),
        "set_bytes": set_bytes,
        "repeats": args.repeats,
    }
    result = measure(
        args,
        bench_linear(shapes, args.ms, kernels, dtype, set_bytes, args.repeats),
        len(shapes) * len(args.ms) * len(kernels),
        lambda pt: f"{pt.shape} M={pt.m} {pt.kernel}",
        lambda points: linear_result(config, shapes, points),
    )
    return report(args, result, lambda: _table(args, result))


def _table(args: argparse.Namespace, result):
    from rich.table import Table

    table = Table(
        title=f"ddtree bench linear: {args.preset}'s weights ({args.dtype}, cpu, "
        f"{threads_label(args)}; {result.config['set_bytes'] / 1e6:.0f} MB of copies per shape)",
        caption="ms per weight (median), and over the same kernel's time at M = 1; GB/s: its "
        "bytes over that time at M = 1; a forward: every layer's weights and the head, each "
        "shape's time times how many a forward reads. max |diff|: against aten",
    )
    table.add_column("shape")
    table.add_column("kernel")
    for m in args.ms:
        table.add_column(f"M={m}", justify="right")
    table.add_column("GB/s M=1", justify="right")
    table.add_column("max |diff|", justify="right")
    rows = {}
    for p in result.points:
        rows.setdefault((p.shape, p.kernel), {})[p.m] = p
    for (shape, kernel), by_m in rows.items():
        first = by_m[args.ms[0]]
        table.add_row(
            shape,
            kernel,
            *(f"{by_m[m].median_s * 1e3:.2f} ({by_m[m].vs_m1:.2f}x)" for m in args.ms),
            f"{first.bytes_per_s / 1e9:.1f}",
            f"{max(p.max_abs_diff for p in by_m.values()):.2g}",
        )
    for kernel in result.config["kernels"]:
        total = result.summary[kernel]
        table.add_row(
            "a forward",
            kernel,
            *(
                f"{total['seconds_by_m'][str(m)] * 1e3:.2f} ({total['vs_m1'][str(m)]:.2f}x)"
                for m in args.ms
            ),  # fmt: skip
            "",
            "",
        )
    return table
