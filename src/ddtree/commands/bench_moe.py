"""`ddtree bench moe`: one MoE layer forward against verify width M, BF16 and INT4 experts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ddtree.commands._args import (
    DTYPE_ALIASES,
    add_json_argument,
    add_renamed,
    add_threads_argument,
    device,
    int_list,
    non_negative_int,
    positive_float,
    positive_int,
    records_file,
    seed,
    set_threads,
    threads_label,
)

PRECISIONS = ("bfloat16", "int4")  # ddtree.bench.moe.PRECISIONS (not imported: it loads torch)


def _precisions(text: str) -> list[str]:
    names = [DTYPE_ALIASES.get(x, x) for x in text.split(",") if x]
    bad = [n for n in names if n not in PRECISIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown precision(s) {', '.join(bad) or text!r}; expected some of "
            f"{','.join(PRECISIONS)}"
        )
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="a Hugging Face DeepseekV3 / Kimi-K2 config.json (or its folder) for the MoE sizes; "
        "default: Kimi-K2 routing (384 experts, top-8, 1 shared) at hidden 1024, width 256",
    )
    p.add_argument("--hidden", type=positive_int, help="hidden size H (overrides --config)")
    p.add_argument("--moe-intermediate", type=positive_int, help="routed expert width I")
    p.add_argument("--experts", type=positive_int, help="routed experts E")
    p.add_argument(
        "--experts-per-token", type=positive_int, help="routed experts per token k (top-k)"
    )
    add_renamed(p, "--top-k", "--experts-per-token", "--top-k is sampling's top-k in every command")
    p.add_argument("--shared-experts", type=non_negative_int, help="shared experts (always run)")
    p.add_argument(
        "--ms",
        type=int_list,
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        help="verify widths M (default 1,2,4,...,256)",
    )
    p.add_argument(
        "--precisions",
        type=_precisions,
        default=list(PRECISIONS),
        help="expert weights: bfloat16, int4 (weight-only, bfloat16 activations) (default: both)",
    )
    p.add_argument(
        "--group-size", type=positive_int, default=32, help="INT4 scale group (default 32)"
    )
    p.add_argument(
        "--device",
        type=device(("cpu", "cuda"), auto=True, indexed=False),
        default="auto",
        help="auto: CUDA when torch sees it, else the CPU",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="timed forwards per M (default 5)"
    )
    p.add_argument(
        "--warmup", type=non_negative_int, default=1, help="untimed forwards first (default 1)"
    )
    add_threads_argument(p)
    p.add_argument("--seed", type=seed, default=0, help="weights seed (default 0)")
    peak = p.add_mutually_exclusive_group()
    peak.add_argument(
        "--peak-bytes-per-s",
        type=positive_float,
        help="peak memory bandwidth to compare against, SI bytes/s (e.g. 12e9)",
    )
    peak.add_argument(
        "--bandwidth-records",
        help="a JSONL file of `ddtree bench bandwidth` records; its read figure is the peak "
        "(default: measure a 256 MiB read now)",
    )
    p.add_argument(
        "--records",
        type=records_file,
        help="append bench_moe measurement records to this JSONL file",
    )
    add_json_argument(p)


def _shape(args: argparse.Namespace):
    from ddtree.bench.moe import KIMI_SCALED, MoeShape

    base, source = KIMI_SCALED, "built-in"
    if args.config:
        path = Path(args.config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"--config {args.config}: no such file")
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config {path}: not valid JSON ({exc.msg})") from None
        base, source = MoeShape.from_hf(cfg, str(path)), str(path)
    overrides = {
        "hidden_size": args.hidden,
        "moe_intermediate_size": args.moe_intermediate,
        "n_routed_experts": args.experts,
        "top_k": args.experts_per_token,
        "n_shared_experts": args.shared_experts,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return base, source
    name = f"{base.name} (overridden: {', '.join(overrides)})"
    try:
        return dataclasses.replace(base, **overrides, name=name), source
    except ValueError as exc:
        raise ValueError(f"arguments: {exc}") from None


def _peak(args: argparse.Namespace, device: str):
    import torch

    from ddtree.bench.bandwidth import MIB, PeakBandwidth, measure, peak_from_records
    from ddtree.records import read_records

    if args.peak_bytes_per_s:
        return PeakBandwidth(args.peak_bytes_per_s, "--peak-bytes-per-s")
    if args.bandwidth_records:
        threads = torch.get_num_threads() if device == "cpu" else None
        return peak_from_records(
            read_records(args.bandwidth_records), device, args.bandwidth_records, threads
        )
    pt = measure(device, "read", 256 * MIB, repeats=5, warmup=1)
    return PeakBandwidth(pt.bytes_per_s, f"measured now ({device}, read, 256 MiB, median of 5)")


def run(args: argparse.Namespace) -> int:
    from ddtree.bench.bandwidth import host_conditions
    from ddtree.bench.moe import moe_result
    from ddtree.commands._bench import measure, report
    from ddtree.records import RecordError

    device = _device(args)
    set_threads(args)
    host = host_conditions()  # before we load the cores ourselves
    try:
        shape, source = _shape(args)
        _check_memory(args, shape, source, device)
        peak = _peak(args, device)
        configs = _configs(args, device, shape, source, host)
        result = measure(
            args,
            lambda bar: _points(args, shape, device, peak.bytes_per_s, bar),
            len(args.precisions) * len(args.ms),
            lambda point: f"{point[0]} M={point[1].m}",
            lambda points: moe_result(points, configs, peak.bytes_per_s, peak.source),
        )
    except (ValueError, RecordError) as exc:
        print(exc, file=sys.stderr)
        return 2
    return report(args, result, lambda: _table(args, result))


def _device(args: argparse.Namespace) -> str:
    """--device, with auto as CUDA when torch sees it (it is one this machine has: the
    argument's type)."""
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device


def _check_memory(args: argparse.Namespace, shape, source: str, device: str) -> None:
    """A ValueError where one layer's weights need more than 80% of ``device``'s free memory
    (the INT4 layer is packed from a BF16 one, so both exist for a moment)."""
    from ddtree.bench.moe import gib, total_weight_bytes
    from ddtree.models.loading.memory import available_bytes

    need = total_weight_bytes(shape, "bfloat16") + (
        total_weight_bytes(shape, "int4", args.group_size) if "int4" in args.precisions else 0
    )
    free = available_bytes(device)
    if free is not None and need > 0.8 * free:
        raise ValueError(
            f"{source}: one layer's weights need {gib(need):.1f} GiB, {device} has "
            f"{gib(free):.1f} GiB free; scale it down with --hidden/--moe-intermediate/--experts"
        )


def _configs(args: argparse.Namespace, device: str, shape, source: str, host: dict):
    """The bench_moe record's config of each precision."""
    import torch

    from ddtree.bench.bandwidth import last_level_cache_bytes
    from ddtree.bench.moe import total_weight_bytes

    threads = torch.get_num_threads()
    llc = last_level_cache_bytes() if device == "cpu" else None
    return {
        precision: {
            "device": device,
            "precision": precision,
            "hidden_size": shape.hidden_size,
            "moe_intermediate_size": shape.moe_intermediate_size,
            "n_routed_experts": shape.n_routed_experts,
            "top_k": shape.top_k,
            "n_shared_experts": shape.n_shared_experts,
            "n_group": shape.n_group,
            "topk_group": shape.topk_group,
            "group_size": args.group_size if precision == "int4" else None,
            "activation_dtype": "bfloat16",
            "model": shape.name,
            "model_source": source,
            "weights_total_bytes": total_weight_bytes(shape, precision, args.group_size),
            "llc_bytes": llc,
            "threads": threads,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "statistic": "median",
            **host,
            "routing": "random router rows of equal norm, Gaussian tokens, fresh per call",
        }
        for precision in args.precisions
    }


def _points(args: argparse.Namespace, shape, device: str, peak_bytes_per_s: float, bar):
    """(precision, point) at every M, one precision's layer at a time; a layer its sizes cannot
    build (INT4 groups) is a ValueError naming the arguments."""
    from ddtree.bench.moe import bench_moe, build_layer

    for precision in args.precisions:
        bar.announce(f"building the {precision} layer")
        try:
            layer = build_layer(shape, device, args.seed, args.group_size, precision)
        except ValueError as exc:
            raise ValueError(f"arguments: {exc}") from None
        for point in bench_moe(layer, shape, args.ms, peak_bytes_per_s, args.repeats, args.warmup):
            yield precision, point
        del layer


def _table(args: argparse.Namespace, result):
    from rich.table import Table

    config, summary = result.parts[0].config, result.parts[0].summary
    table = Table(
        title=f"ddtree bench moe: H={config['hidden_size']} I={config['moe_intermediate_size']} "
        f"E={config['n_routed_experts']} k={config['top_k']} shared={config['n_shared_experts']}, "
        f"{config['device']}, {threads_label(args)}",
        caption=f"{config['model']}. experts: measured distinct experts per forward; uniform: "
        f"E(1-(1-k/E)^M). MB moved: touched experts + shared + router + activations. "
        f"Peak {summary['peak_bytes_per_s'] / 1e9:.1f} GB/s: {summary['peak_source']}. "
        "1 GB/s = 1e9 B/s.",
    )
    for col in ("prec", "M", "ms", "p10-p90 ms", "experts", "uniform", "MB", "GB/s", "%peak"):
        table.add_column(col, justify="right")
    for part in result.parts:
        for pt in part.points:
            table.add_row(
                part.config["precision"],
                str(pt.m),
                f"{pt.s_per_layer * 1e3:.2f}",
                f"{pt.p10_s * 1e3:.3g}-{pt.p90_s * 1e3:.3g}",
                f"{pt.experts_touched:.1f}",
                f"{pt.experts_touched_uniform:.1f}",
                f"{pt.bytes_moved / 1e6:.1f}",
                f"{pt.bytes_per_s / 1e9:.2f}",
                f"{100 * pt.fraction_of_peak:.0f}",
            )
        table.add_section()
    return table
