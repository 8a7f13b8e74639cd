"""Resumable training state without pickles: weights and AdamW moments in safetensors, the
rest (step, hyper-parameters, loss history) in JSON.

Layout of ``<out>/checkpoint/``: ``model.safetensors`` (float32 trainable weights and
buffers), ``optimizer.safetensors`` (``<param name>.exp_avg`` / ``.exp_avg_sq``),
``state.json`` (``step``, ``optimizer_step``, ``losses``, ``config``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ddtree.files import replace_atomically, write_safetensors
from ddtree.signals import deferred

CHECKPOINT_DIR = "checkpoint"
# config fields a resumed run may change: train longer (the cosine schedule stretches), log
# or checkpoint at another interval
RESUMABLE_CHANGES = frozenset({"train.steps", "train.save_every", "train.log_every"})


@dataclass
class TrainState:
    step: int = 0
    losses: list[float] = field(default_factory=list)  # mean loss of each logged interval
    elapsed_s: float = 0.0


def save_checkpoint(
    out: Path, model: nn.Module, opt: torch.optim.AdamW, state: TrainState, config: dict
) -> None:
    """Write ``<out>/checkpoint``: each file to a temporary one, then the three renamed into
    place together (``state.json`` last) in a section a signal waits for; a save that fails
    (a full disk) leaves the previous checkpoint as it was and says so."""
    ckpt = Path(out) / CHECKPOINT_DIR
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    moments: dict[str, torch.Tensor] = {}
    opt_step = 0
    for group in opt.param_groups:
        for p in group["params"]:
            s = opt.state.get(p)
            if not s:
                continue
            moments[f"{names[id(p)]}.exp_avg"] = s["exp_avg"].contiguous()
            moments[f"{names[id(p)]}.exp_avg_sq"] = s["exp_avg_sq"].contiguous()
            opt_step = int(s["step"])
    meta = {
        "step": state.step,
        "optimizer_step": opt_step,
        "losses": state.losses,
        "elapsed_s": state.elapsed_s,
        "config": config,
    }
    with (
        deferred(),
        replace_atomically(ckpt / "state.json") as meta_file,
        replace_atomically(ckpt / "optimizer.safetensors") as optimizer_file,
        replace_atomically(ckpt / "model.safetensors") as model_file,
    ):  # renamed in reverse: model, optimizer, then state.json
        write_safetensors(tensors, model_file)
        write_safetensors(moments, optimizer_file)
        meta_file.write_text(json.dumps(meta, indent=1) + "\n")


def checkpoint_step(out: Path) -> int | None:
    """The step of ``<out>/checkpoint``, None without a readable one."""
    try:
        return int(json.loads((Path(out) / CHECKPOINT_DIR / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_checkpoint(
    out: Path, model: nn.Module, opt: torch.optim.AdamW, config: dict
) -> TrainState:
    """Restore ``model`` and ``opt`` from ``<out>/checkpoint``; the run's config must match."""
    ckpt = Path(out) / CHECKPOINT_DIR
    meta_file = ckpt / "state.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file}: no checkpoint to resume from")
    meta = json.loads(meta_file.read_text())
    saved, now = _flatten(meta.get("config", {})), _flatten(config)
    differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    differ = [k for k in differ if k not in RESUMABLE_CHANGES]
    if differ:
        raise ValueError(
            f"{meta_file}: config fields {differ} differ from this run "
            f"(saved {[saved.get(k) for k in differ]}, now {[now.get(k) for k in differ]})"
        )
    model.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    moments = load_file(str(ckpt / "optimizer.safetensors"))
    for name, p in model.named_parameters():
        if f"{name}.exp_avg" in moments:
            opt.state[p] = {
                "step": torch.tensor(float(meta["optimizer_step"])),
                "exp_avg": moments[f"{name}.exp_avg"],
                "exp_avg_sq": moments[f"{name}.exp_avg_sq"],
            }
    return TrainState(step=meta["step"], losses=meta["losses"], elapsed_s=meta["elapsed_s"])


def lr_at(step: int, steps: int, lr: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to ``final_frac * lr``."""
    import math

    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def _flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
