"""Glue shared by ``demo``, ``generate`` and ``bench engine``: model/decode arguments, loading a
target + drafter + tokenizer, and the side-by-side summary table."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from ddtree.commands._args import (
    AUTO,
    add_alias,
    add_dtype_argument,
    add_threads_argument,
    device,
    int_list,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    seed,
    set_threads,
)
from ddtree.commands._args import (
    budget as budget_arg,
)
from ddtree.files import read_input_bytes
from ddtree.utf8 import check_text, decode_text
from ddtree.vocab import (
    AUTO_MAX_BUDGET,
    DEFAULT_POLICY,
    POLICIES,
    SAMPLING_FLOORS,
    Drafting,
    EngineMode,
    get_policy,
    policies_help,
)

# the most a prompt, messages or prompts file (or stdin) may hold: far more text than any
# context; a larger one (or /dev/zero, refused before as not a regular file) is not read on
PROMPT_FILE_LIMIT = 64 << 20
DEMO_DIR = Path(str(files("ddtree") / "assets" / "demo"))
# ddtree.models.TARGET_IMPLS' names (not imported here: it imports torch; a test keeps them equal)
TARGET_IMPL_CHOICES = ("auto", "mla_moe", "decoder", "hf")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    where = " (default: the bundled demo pair)"
    target = p.add_argument(
        "--target", help=f"target checkpoint directory{where} (also --model, as vLLM)"
    )
    add_alias(p, target, "--model")
    p.add_argument("--drafter", help=f"DFlash drafter directory (z-lab format){where}")
    p.add_argument(
        "--impl",
        default="auto",
        choices=TARGET_IMPL_CHOICES,
        help="target implementation (auto: ours for DeepSeek-V3 / Kimi-K2 (mla_moe) and "
        "Qwen3 / Qwen3-MoE / Llama (decoder), transformers (hf) for the rest) "
        "(default: %(default)s)",
    )
    add_dtype_argument(p, "float32", "weights and activations")
    p.add_argument(
        "--device",
        type=device(),
        default="cpu",
        help="torch device, e.g. cpu, cuda or cuda:1 (default: %(default)s)",
    )
    add_threads_argument(p)
    tp = p.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="split the MLA+MoE target over N processes (spawned here, or the ranks torchrun "
        "started); rank 0 runs the drafter and the tree (also --tensor-parallel-size, as "
        "vLLM) (default: %(default)s)",
    )
    add_alias(p, tp, "--tensor-parallel-size")
    p.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="with --tp: split the routed experts into N groups of whole experts (N divides "
        "--tp); 1 splits every expert's intermediate instead (default: %(default)s)",
    )


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """``--policy`` and ``--engine-mode`` of a command that decodes with one configuration."""
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        choices=tuple(POLICIES),
        help=f"{policies_help()} (default: %(default)s)",
    )
    p.add_argument(
        "--engine-mode",
        default="eager",
        choices=[m.value for m in EngineMode],
        help="eager, or compiled (torch.compile at static shapes: compiles first, then faster "
        "steps; MLA+MoE targets) (default: %(default)s)",
    )


def temperature(text: str) -> float:
    """An argparse type: 0 (greedy) or a finite temperature above its float32 floor."""
    value = non_negative_float(text)
    floor = SAMPLING_FLOORS["temperature"]
    if floor.refuses(value):
        raise argparse.ArgumentTypeError(
            f"expected 0 (greedy) or a finite number >= {floor.least:g}, got {text!r} ({floor.why})"
        )
    return value


def top_p(text: str) -> float:
    """An argparse type: a probability in (0, 1] that float32 holds (its floor)."""
    value = probability(text)
    floor = SAMPLING_FLOORS["top_p"]
    if floor.refuses(value):
        raise argparse.ArgumentTypeError(
            f"expected a finite probability in {floor.least:g}..1, got {text!r} ({floor.why})"
        )
    return value


@dataclass(frozen=True)
class DecodeFlag:
    """One decode flag and the ``DecodeConfig`` field it sets: ``add_decode_arguments`` adds
    the flag, ``decode_config`` fills the field, both from :data:`DECODE_FLAGS`, so a field and
    its flag cannot drift (tests/commands/test_decode_flags.py holds the defaults to the
    config's)."""

    flag: str
    field: str | None  # the DecodeConfig field; None: a load option (the drafter's vocabulary)
    type: Callable[[str], object]
    default: object  # MAX_NEW_TOKENS: the command's own
    help: str
    metavar: str | None = None
    to_config: Callable[[object], object] = lambda value: value

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


MAX_NEW_TOKENS = object()  # DecodeFlag.default: each command passes its own
BUDGET_DEFAULT = 32

DECODE_FLAGS = (
    DecodeFlag("--block", "block_size", positive_int, 8, "block size B (drafter slots)"),
    DecodeFlag(
        "--budget",
        "budget",
        budget_arg,
        BUDGET_DEFAULT,
        "DDTree budget N, non-root nodes, or 'auto': each step verifies the best prefix "
        f"of a {AUTO_MAX_BUDGET}-node tree for this machine's measured verify cost, the load "
        "and each request's recent acceptance (default: %(default)s)",
    ),
    DecodeFlag("--temperature", "temperature", temperature, 0.0, "0: greedy"),
    DecodeFlag("--top-k", "top_k", non_negative_int, 0, "sampling top-k (0: off)"),
    DecodeFlag("--top-p", "top_p", top_p, 1.0, "sampling top-p (1: off)"),
    DecodeFlag("--seed", "seed", seed, 0, "sampling seed"),
    DecodeFlag(
        "--max-new-tokens", "max_new_tokens", positive_int, MAX_NEW_TOKENS, "tokens per prompt"
    ),
    DecodeFlag(
        "--draft-vocab",
        None,
        positive_int,
        None,
        "the drafter proposes over the K most frequent tokens only (its LM head computes K "
        "rows: a cheaper draft; the target still verifies the full vocabulary, so the output is "
        "unchanged); the counts come from draft_vocab.json beside the drafter "
        "(default: the full vocabulary)",
        metavar="K",
    ),
    DecodeFlag(
        "--buckets",
        "buckets",
        int_list,
        [],
        "compiled mode: verify width buckets, e.g. 1,16,64 (default: each policy's width "
        "M, nothing padded; the widest also sets the prefill chunk)",
        to_config=tuple,
    ),
)


def add_decode_arguments(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    for f in DECODE_FLAGS:
        default = max_new_tokens if f.default is MAX_NEW_TOKENS else f.default
        extra = {"metavar": f.metavar} if f.metavar else {}
        p.add_argument(f.flag, type=f.type, default=default, help=f.help, **extra)


def policy_list(replay: bool = False) -> Callable[[str], list[str]]:
    """An argparse type: "chain,ddtree" -> ["chain", "ddtree"], a non-empty list of known
    policies (``replay``: those a trace replays, which draft every depth from one block)."""
    known = [n for n, p in POLICIES.items() if not replay or p.drafting is Drafting.BLOCK]

    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        if not names or any(n not in known for n in names):
            why = " (those a trace replays)" if replay else ""
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(known)}{why}, got {text!r}"
            )
        return list(dict.fromkeys(names))

    parse.__name__ = "policy list"
    return parse


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


def decode_config(args: argparse.Namespace, policy: str, budget: int | None = None, **extra):
    """A ``DecodeConfig`` from the arguments ``add_decode_arguments`` added (``budget``: this
    one instead of ``--budget``; ``auto`` where the policy uses no budget: the default)."""
    from ddtree.engine import DecodeConfig

    fields = {f.field: f.to_config(getattr(args, f.dest)) for f in DECODE_FLAGS if f.field}
    n = fields["budget"] if budget is None else budget
    auto = n == AUTO and get_policy(policy).uses_budget
    fields["budget"] = (AUTO_MAX_BUDGET if auto else BUDGET_DEFAULT) if n == AUTO else n
    return DecodeConfig(policy=policy, auto_budget=auto, **fields, **extra)


class TextCodec:
    """Text <-> token ids with the target's tokenizer (``tokenizer.json``, checked by
    ``ddtree.models.loading.tokenizer.load_tokenizer``: no more ids than ``vocab_size``)."""

    def __init__(self, path: Path, vocab_size: int | None = None) -> None:
        from ddtree.models.loading.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(path, vocab_size)

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


def model_paths(args: argparse.Namespace, need_drafter: bool) -> tuple[Path, Path | None]:
    """The target and drafter folders the arguments name: the bundled pair by default, and no
    drafter by default for a target of the user's."""
    target_path = Path(args.target) if args.target else DEMO_DIR / "target"
    drafter_path = Path(args.drafter) if args.drafter else None
    if drafter_path is None and not args.target:
        drafter_path = DEMO_DIR / "drafter"
    if need_drafter and drafter_path is None:
        raise ValueError("--drafter DIR is required by this policy (or use --policy ar)")
    return target_path, drafter_path


def load_models(
    args: argparse.Namespace,
    need_drafter: bool,
    engine_modes: tuple[str, ...] = ("eager",),
    draft_vocab: int | None = None,
) -> LoadedModels:
    """Target, drafter and tokenizer from the model arguments; ``engine_modes`` the run will
    use are refused first, from the checkpoints' config.json alone, when one cannot run them.
    ``draft_vocab``: ``--draft-vocab`` K (``ddtree.models.load_drafter``)."""
    import torch

    from ddtree.models import DRAFTER_ENGINE_MODES, load_drafter, load_target, target_engine_modes
    from ddtree.models.static import check_engine_support

    set_threads(args)
    target_path, drafter_path = model_paths(args, need_drafter)
    described = f"{target_path.name} (impl {args.impl}, tp {args.tp})"
    models = [(described, target_engine_modes(target_path, args.impl, args.tp))]
    if need_drafter:
        models.append((f"drafter {drafter_path.name}", DRAFTER_ENGINE_MODES))
    for mode in engine_modes:
        check_engine_support(mode, models)
    # the tokenizer first: its files and its size against the config's vocabulary, before
    # any weights are read
    from ddtree.models.loading.checkpoint import read_config
    from ddtree.models.loading.tokenizer import config_vocab_size

    codec = TextCodec(target_path, config_vocab_size(read_config(target_path)))
    dtype = getattr(torch, args.dtype)
    target = load_target(
        target_path, impl=args.impl, dtype=dtype, device=args.device, tp=args.tp, ep=args.ep
    )
    drafter = None
    if need_drafter:
        drafter = load_drafter(
            drafter_path, target, dtype=dtype, device=args.device, draft_vocab=draft_vocab
        )
    stored = checkpoint_dtype(target_path)
    if stored and stored != args.dtype:  # never a silent cast: say which way it went
        from ddtree.commands._output import note

        # after the loads, so a checkpoint that fails to load gets its error line alone
        note(
            f"note: {target_path.name} stores {stored} weights; they run as {args.dtype} (--dtype)"
        )
    return LoadedModels(target, drafter, codec, target_path, drafter_path)


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype a checkpoint's config.json says its weights are stored in (``dtype``, or
    the older ``torch_dtype``), or None when it does not say."""
    from ddtree.models.loading.checkpoint import read_config

    config = read_config(path)
    stored = config.get("dtype") or config.get("torch_dtype")
    return str(stored).removeprefix("torch.") if stored else None


def demo_prompts(path: Path | None = None) -> list[str]:
    """Held-out prompts (JSON list of strings), by default the demo pair's."""
    what = f"--prompts {path}" if path else str(DEMO_DIR / "prompts.json")
    path = path or DEMO_DIR / "prompts.json"
    try:  # a regular file only, checked before it is opened (a FIFO would block forever)
        data = read_input_bytes(path, "a regular JSON file", PROMPT_FILE_LIMIT)
    except FileNotFoundError:
        raise ValueError(f"{what}: prompts file not found") from None
    except OSError as e:
        raise ValueError(f"{what}: {e.strerror or e}") from None
    try:
        prompts = json.loads(decode_text(data, what))
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: not JSON ({e})") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"{what}: expected a JSON list of non-empty strings")
    return [check_text(p, f"{what}: prompt {i}") for i, p in enumerate(prompts)]


def _key(config) -> tuple:
    return (config.engine_mode, config.policy, config.budget, config.auto_budget)


def summary_tables(points, title: str):
    """Two rich tables, one row per sweep point: the headline figures, and the stage
    breakdown in ms per step (split so each fits an 80-column terminal)."""
    from rich import box
    from rich.table import Table

    from ddtree.engine.sweep import speedups
    from ddtree.vocab import STEP_STAGES

    ratio = speedups(points)
    batched = any(p.concurrency > 1 for p in points)
    caption = "vs AR, same as AR: against AR in the same engine mode" + (
        " and at the same C; tok/s: all C rows'; vs C=1: the same config one at a time"
        if batched
        else ""
    )
    head = Table(title=title, caption=caption)
    columns = ["mode", "policy", "B", "N", "mean tau", "tok/s", "vs AR", "same as AR", "step ms"]
    if batched:
        columns[2:2] = ["C"]
        columns.append("vs C=1")
    for col in columns:
        head.add_column(col, justify="left" if col in ("mode", "policy") else "right")
    alone = {_key(p.config): p for p in points if p.concurrency == 1}
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
        policy = c.rules
        block = str(c.block_size) if policy.needs_drafter else "-"
        budget = str(policy.budget(c.block_size, c.budget))
        if c.auto_budget:
            budget = f"auto<={budget}"
        row = [
            c.engine_mode,
            c.policy,
            block,
            budget,
            f"{s['mean_tau']:.2f}",
            f"{s['tokens_per_s']:.1f}",
            f"{ratio[i]:.2f}x" if ratio[i] else "-",
            same,
            f"{s['step_s_mean'] * 1e3:.2f}",
        ]
        if batched:
            row[2:2] = [str(p.concurrency)]
            one = alone.get(_key(c))
            row.append(f"{s['tokens_per_s'] / one.summary['tokens_per_s']:.2f}x" if one else "-")
        head.add_row(*row)
        stage_ms = [f"{s['stage_s_mean'][k] * 1e3:.2f}" for k in STEP_STAGES]
        stages.add_row(
            c.engine_mode, c.policy, budget, *stage_ms, f"{s['overhead_fraction'] * 100:.0f}%"
        )
    return head, stages


# T(M)/T1 under which a verify of M tokens counts as nearly free (the weights dominate)
MEMORY_BOUND_VERIFY_RATIO = 1.3


def regime_lines(points) -> list[str]:
    """What a sweep says about the regime, per engine mode with AR and DDTree points: the
    speedup as tau over the step ratio, the verify's cost over one token's, and the tau that
    2x would need (every figure from the points; nothing assumed)."""

    lines = []
    for mode in dict.fromkeys(p.config.engine_mode for p in points):
        here = [p for p in points if p.config.engine_mode == mode and p.concurrency == 1]
        ar = next((p for p in here if not p.config.rules.needs_drafter), None)
        trees = [p for p in here if p.config.policy == "ddtree"]
        if ar is None or not trees:
            continue
        best = max(trees, key=lambda p: p.summary["tokens_per_s"])
        a, d = ar.summary, best.summary
        ratio = d["step_s_mean"] / a["step_s_mean"]
        verify = d["stage_s_mean"]["verify"] / a["stage_s_mean"]["verify"]
        draft = d["stage_s_mean"]["draft"] / a["stage_s_mean"]["verify"]
        width = best.config.tree_budget
        bound = verify < MEMORY_BOUND_VERIFY_RATIO
        regime = (
            "memory-bound: a wide verify is nearly free"
            if bound
            else ("compute/dispatch-bound: the verify grows with its width")
        )
        lines.append(
            f"{mode}: DDTree N={best.config.budget} is {d['tokens_per_s'] / a['tokens_per_s']:.2f}x "
            f"AR = tau {d['mean_tau']:.2f} / a step {ratio:.2f}x AR's (verify of {width + 1} "
            f"tokens {verify:.2f}x one token's, drafter {draft:.2f}x): {regime}; 2x AR would "
            f"need tau >= {2 * ratio:.1f}"
        )
    if lines:
        lines.append(
            "Real-size targets are memory-bound on hardware with matrix units (GPUs, AMX "
            "CPUs), where a verify of 8-64 tokens costs about one token's: `ddtree bench shapes "
            "--preset qwen3-1.7b` measures how far that holds on this machine (README: Where "
            "DDTree pays)."
        )
    return lines
