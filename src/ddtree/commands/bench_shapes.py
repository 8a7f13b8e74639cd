"""`ddtree bench shapes`: what target would make DDTree pay on this machine: the step costs of target shapes with the
bundled drafter, and the speedup over AR each would give at a given acceptance length.

The targets have the bundled target's widths (hidden 256, vocabulary 2048: its tokenizer and
its DFlash drafter, which reads target layers 1 and 3, fit every one of them) at other depths,
MoE or dense, with random weights: speed does not depend on the weights, acceptance does, so
tau is an input (the bundled pair's measured tau). For each shape and engine mode the engine
decodes the demo prompts with AR and with DDTree (block 8, budget N; the tree is always full,
whatever gets accepted) in one sweep, and from the measured step times:

    speedup vs AR at tau   = tau * step_ar / step_ddtree                     (derived)
    tau for 2x             = 2 * step_ddtree / step_ar                       (derived)

Run: ``ddtree bench shapes --shapes 4:moe,16:moe,16:dense --tau 3.01``. The bundled shape is
``4:moe`` (1 dense layer, then MoE); ``L:dense`` has no MoE layer.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddtree.commands._args import output_file, positive_int, threads
from ddtree.commands._decode import DEMO_DIR, TextCodec, demo_prompts, set_threads
from ddtree.commands.bench_engine import add_engine_modes_argument

if TYPE_CHECKING:
    from ddtree.models.mla_moe import MlaMoeTarget

INIT_STD = 0.02  # random weights: N(0, 0.02), norms 1 (speed only)


@dataclass(frozen=True)
class Shape:
    layers: int
    dense: bool  # True: no MoE layer; False: the bundled layout (first layer dense)

    @staticmethod
    def parse(text: str) -> Shape:
        """ "16:moe" or "16:dense"."""
        layers, _, kind = text.partition(":")
        if not layers.isdigit() or int(layers) < 4 or kind not in ("moe", "dense"):
            raise argparse.ArgumentTypeError(
                f"shape {text!r}: expected LAYERS:moe or LAYERS:dense with LAYERS >= 4 (the "
                f"drafter reads target layers 1 and 3)"
            )
        return Shape(int(layers), kind == "dense")

    @property
    def name(self) -> str:
        return f"{self.layers}:{'dense' if self.dense else 'moe'}"

    def target(self, seed: int = 0) -> MlaMoeTarget:
        import torch

        from ddtree.models.mla_moe import MlaMoeConfig, MlaMoeModel, MlaMoeTarget

        base = json.loads((DEMO_DIR / "target" / "config.json").read_text())
        cfg = {**base, "num_hidden_layers": self.layers}
        if self.dense:
            cfg["first_k_dense_replace"] = self.layers
        torch.manual_seed(seed)
        model = MlaMoeModel(MlaMoeConfig.from_hf(cfg, source=f"shape {self.name}"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.fill_(1.0) if "norm" in name else p.normal_(0, INIT_STD)
        return MlaMoeTarget(model, name=f"random-{self.name}", capacity=512)


@dataclass
class ShapeCost:
    """Mean step costs of one shape in one engine mode, from one sweep (milliseconds)."""

    shape: str
    params: int
    mode: str
    step_ar_ms: float
    step_ddtree_ms: float
    verify_ar_ms: float  # T1
    verify_ddtree_ms: float  # T(M)
    draft_ms: float
    compile_s: float

    def speedup(self, tau: float) -> float:
        return tau * self.step_ar_ms / self.step_ddtree_ms

    @property
    def tau_for_2x(self) -> float:
        return 2 * self.step_ddtree_ms / self.step_ar_ms


def measure(shape: Shape, modes: list[str], budget: int, prompts, max_new_tokens: int):
    from ddtree.engine import DecodeConfig
    from ddtree.engine.sweep import sweep
    from ddtree.models import load_drafter

    target = shape.target()
    drafter = load_drafter(DEMO_DIR / "drafter", target)
    configs = [
        DecodeConfig(policy, budget=budget, max_new_tokens=max_new_tokens, engine_mode=mode)
        for mode in modes
        for policy in ("ar", "ddtree")
    ]
    points = sweep(target, drafter, prompts, configs)
    out = []
    for ar, dd in zip(points[::2], points[1::2], strict=True):
        if dd.identical_to_ar is False:
            raise RuntimeError(f"{shape.name} {ar.config.engine_mode}: DDTree output != AR")
        s_ar, s_dd = ar.summary, dd.summary
        out.append(
            ShapeCost(
                shape=shape.name,
                params=target.info.n_params,
                mode=ar.config.engine_mode,
                step_ar_ms=s_ar["step_s_mean"] * 1e3,
                step_ddtree_ms=s_dd["step_s_mean"] * 1e3,
                verify_ar_ms=s_ar["stage_s_mean"]["verify"] * 1e3,
                verify_ddtree_ms=s_dd["stage_s_mean"]["verify"] * 1e3,
                draft_ms=s_dd["stage_s_mean"]["draft"] * 1e3,
                compile_s=s_ar["compile_s"] + s_dd["compile_s"],
            )
        )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        type=shape_list,
        default="4:moe,16:moe,16:dense",
        help="target shapes LAYERS:moe|dense, comma-separated (default: %(default)s)",
    )
    add_engine_modes_argument(p, default="eager,compiled")
    p.add_argument("--budget", type=positive_int, default=8, help="DDTree budget N")
    p.add_argument(
        "--tau",
        type=positive_float_list,
        default="3.01",
        help="acceptance lengths to project the speedup at (default: the bundled pair's at "
        "N=8 on the demo prompts, measurements/cpu/engine_modes.jsonl)",
    )
    p.add_argument("--n-prompts", type=positive_int, default=4)
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--threads", type=threads, default=1)
    p.add_argument("--json", type=output_file, help="also write the rows as JSON")


def shape_list(text: str) -> list[Shape]:
    return [Shape.parse(s) for s in text.split(",") if s]


def positive_float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or not all(v > 0 and v == v and v != float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    set_threads(args)
    codec = TextCodec(DEMO_DIR / "target")
    prompts = [codec.encode(t) for t in demo_prompts()[: args.n_prompts]]
    rows = []
    print(
        "| shape | params | mode | AR step ms | T1 ms | T(M) ms | T(M)/T1 | draft ms | DDTree "
        "step ms | " + " | ".join(f"vs AR at tau {t}" for t in args.tau) + " | tau for 2x |"
    )
    for shape in args.shapes:
        for c in measure(shape, args.engine_modes, args.budget, prompts, args.max_new_tokens):
            rows.append(c)
            print(
                f"| {c.shape} | {c.params / 1e6:.1f}M | {c.mode} | {c.step_ar_ms:.2f} | "
                f"{c.verify_ar_ms:.2f} | {c.verify_ddtree_ms:.2f} | "
                f"{c.verify_ddtree_ms / c.verify_ar_ms:.2f} | {c.draft_ms:.2f} | "
                f"{c.step_ddtree_ms:.2f} | "
                + " | ".join(f"{c.speedup(t):.2f}x" for t in args.tau)
                + f" | {c.tau_for_2x:.1f} |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps([c.__dict__ for c in rows], indent=1))
    return 0
