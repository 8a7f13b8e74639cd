"""Glue shared by ``demo``, ``generate`` and ``bench engine``: model/decode arguments, loading a
target + drafter + tokenizer, and the side-by-side summary table."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from ddtree.commands._args import (
    int_list,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    seed,
    threads,
)
from ddtree.records import EngineMode

DEMO_DIR = Path(str(files("ddtree") / "assets" / "demo"))
DTYPES = ("float32", "bfloat16", "float16")


def add_model_arguments(p: argparse.ArgumentParser, default_demo: bool) -> None:
    where = " (default: the bundled demo pair)" if default_demo else ""
    p.add_argument("--target", help=f"target checkpoint directory{where}")
    p.add_argument("--drafter", help=f"DFlash drafter directory (z-lab format){where}")
    p.add_argument(
        "--impl",
        default="auto",
        choices=("auto", "mla_moe", "hf"),
        help="target implementation (auto: ours for DeepSeek-V3/Kimi configs)",
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    p.add_argument(
        "--threads",
        type=threads,
        default=0,
        help="torch CPU threads, 0 for torch's default (default: %(default)s)",
    )
    p.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="split the MLA+MoE target over N processes (spawned here, or the ranks torchrun "
        "started); rank 0 runs the drafter and the tree (default: %(default)s)",
    )
    p.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="with --tp: split the routed experts into N groups of whole experts (N divides "
        "--tp); 1 splits every expert's intermediate instead (default: %(default)s)",
    )


def add_decode_arguments(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--block", type=positive_int, default=8, help="block size B (drafter slots)")
    p.add_argument(
        "--budget",
        type=positive_int,
        default=32,
        help="DDTree budget N, non-root nodes (default: %(default)s)",
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="sampling top-k (0: off)")
    p.add_argument("--top-p", type=probability, default=1.0, help="sampling top-p (1: off)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens)
    p.add_argument(
        "--buckets",
        type=int_list,
        default=[],
        help="compiled mode: verify width buckets, e.g. 1,16,64 (default: each policy's width "
        "M, nothing padded; the widest also sets the prefill chunk)",
    )


def engine_modes(text: str) -> list[str]:
    """ "eager,compiled" -> ["eager", "compiled"] (argparse type)."""
    modes = [m for m in text.split(",") if m]
    known = [mode.value for mode in EngineMode]
    bad = [m for m in modes if m not in known]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"engine modes {text!r}: expected a comma-separated subset of {','.join(known)}"
        )
    return modes


def check_engine_modes(models: LoadedModels, modes: list[str]) -> None:
    """Refuse, before decoding anything, an engine mode the loaded models cannot run."""
    for model in (models.target, models.drafter):
        bad = [m for m in modes if model is not None and m not in model.engine_modes]
        if bad:
            raise SystemExit(
                f"error: engine mode {bad[0]!r} is not available for {model.info.name} "
                f"(implementation {model.info.implementation}, runs: "
                f"{', '.join(model.engine_modes)}); compiled mode runs the MLA+MoE target "
                f"(DeepSeek-V3 / Kimi-K2 configs) and the DFlash drafter"
            )


def decode_config(args: argparse.Namespace, policy: str, budget: int | None = None, **extra):
    """A ``DecodeConfig`` from the arguments ``add_decode_arguments`` added."""
    from ddtree.engine import DecodeConfig

    return DecodeConfig(
        policy=policy,
        block_size=args.block,
        budget=args.budget if budget is None else budget,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        buckets=tuple(args.buckets),
        **extra,
    )


class TextCodec:
    """Text <-> token ids with the target's tokenizer (``tokenizer.json``)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no tokenizer.json next to the target's config.json")
        self.tokenizer = Tokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class LoadedModels:
    target: object  # Target
    drafter: object | None  # Drafter
    codec: TextCodec
    target_path: Path
    drafter_path: Path | None


def set_threads(args: argparse.Namespace) -> int:
    """Apply ``--threads`` (0 keeps torch's default); returns the thread count in use."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.get_num_threads()


def load_models(args: argparse.Namespace, need_drafter: bool, default_demo: bool) -> LoadedModels:
    import torch

    from ddtree.models import load_drafter, load_target

    set_threads(args)
    target_path = Path(args.target) if args.target else None
    drafter_path = Path(args.drafter) if args.drafter else None
    if default_demo:
        target_path = target_path or DEMO_DIR / "target"
        drafter_path = drafter_path or (DEMO_DIR / "drafter" if not args.target else None)
    if target_path is None:
        raise SystemExit("error: --target DIR is required")
    if need_drafter and drafter_path is None:
        raise SystemExit("error: this policy needs --drafter DIR (or use --policy ar)")
    dtype = getattr(torch, args.dtype)
    target = load_target(
        target_path, impl=args.impl, dtype=dtype, device=args.device, tp=args.tp, ep=args.ep
    )
    drafter = None
    if need_drafter:
        drafter = load_drafter(drafter_path, target, dtype=dtype, device=args.device)
    return LoadedModels(target, drafter, TextCodec(target_path), target_path, drafter_path)


def demo_prompts(path: Path | None = None) -> list[str]:
    """Held-out prompts (JSON list of strings), by default the demo pair's."""
    path = path or DEMO_DIR / "prompts.json"
    try:
        prompts = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path}: prompts file not found") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {path}: not JSON ({e})") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
        raise SystemExit(f"error: {path}: expected a JSON list of non-empty strings")
    return prompts


def summary_tables(points, title: str):
    """Two rich tables, one row per sweep point: the headline figures, and the stage
    breakdown in ms per step (split so each fits an 80-column terminal)."""
    from rich import box
    from rich.table import Table

    from ddtree.engine.sweep import speedups
    from ddtree.records import STEP_STAGES

    ratio = speedups(points)
    head = Table(title=title, caption="vs AR, same as AR: against AR in the same engine mode")
    for col in ("mode", "policy", "B", "N", "mean tau", "tok/s", "vs AR", "same as AR", "step ms"):
        head.add_column(col, justify="left" if col in ("mode", "policy") else "right")
    stages = Table(
        title="ms per step by stage (ovhd: share of the step outside draft and verify forwards)",
        box=box.SIMPLE_HEAD,
        padding=(0, 0, 0, 1),
    )
    for col in ("mode", "policy", "N", *STEP_STAGES, "ovhd"):
        stages.add_column(col, justify="left" if col in ("mode", "policy") else "right")
    for i, p in enumerate(points):
        s, c = p.summary, p.config
        same = {None: "-", True: "yes", False: "NO"}[p.identical_to_ar]
        block = "-" if c.policy == "ar" else str(c.block_size)
        budget = {"ar": "0", "chain": str(c.block_size - 1)}.get(c.policy, str(c.budget))
        head.add_row(
            c.engine_mode,
            c.policy,
            block,
            budget,
            f"{s['mean_tau']:.2f}",
            f"{s['tokens_per_s']:.1f}",
            f"{ratio[i]:.2f}x" if ratio[i] else "-",
            same,
            f"{s['step_s_mean'] * 1e3:.2f}",
        )
        stage_ms = [f"{s['stage_s_mean'][k] * 1e3:.2f}" for k in STEP_STAGES]
        stages.add_row(
            c.engine_mode, c.policy, budget, *stage_ms, f"{s['overhead_fraction'] * 100:.0f}%"
        )
    return head, stages
