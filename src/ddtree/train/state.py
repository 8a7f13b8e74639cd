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
        meta_file.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


def checkpoint_step(out: Path) -> int | None:
    """The step of ``<out>/checkpoint``, None without a readable one."""
    try:
        state_file = Path(out) / CHECKPOINT_DIR / "state.json"
        return int(json.loads(state_file.read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# state.json's fields: name -> (types, what is expected)
STATE_FIELDS = {
    "step": ((int,), "an integer >= 0"),
    "optimizer_step": ((int,), "an integer >= 0"),
    "losses": ((list,), "a list of numbers"),
    "elapsed_s": ((int, float), "a number of seconds"),
    "config": ((dict,), "the run's config object"),
}
TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")


def check_checkpoint(out: Path) -> dict:
    """``<out>/checkpoint`` checked before a resume does anything (reads the corpus, trains
    a tokenizer, writes): ``state.json`` a JSON object with its fields, both tensor files
    readable safetensors (headers only). Returns state.json's dict; a
    :class:`~ddtree.models.loading.checkpoint.CheckpointError` names the file otherwise."""
    from safetensors import SafetensorError, safe_open

    from ddtree.models.loading.checkpoint import CheckpointError

    ckpt = Path(out) / CHECKPOINT_DIR
    meta_file = ckpt / "state.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{meta_file}: no checkpoint to resume from (no such file)")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{meta_file}: not JSON ({err}); expected a JSON object") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file}: expected a JSON object, got {type(meta).__name__}")
    for name, (types, what) in STATE_FIELDS.items():
        value = meta.get(name)
        if (
            not isinstance(value, types)
            or isinstance(value, bool)
            or (types == (int,) and value < 0)
        ):
            raise CheckpointError(f"{meta_file}: field {name}={value!r}: expected {what}")
    for name in TENSOR_FILES:
        file = ckpt / name
        if not file.is_file():
            raise CheckpointError(f"{file}: no such file; the checkpoint is incomplete")
        try:
            with safe_open(str(file), framework="pt", device="cpu"):
                pass
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None
    return meta


def load_checkpoint(
    out: Path, model: nn.Module, opt: torch.optim.AdamW, config: dict
) -> TrainState:
    """Restore ``model`` and ``opt`` from ``<out>/checkpoint``; the run's config must match,
    and every tensor the model's (names and shapes, the AdamW moments' too)."""
    from ddtree.models.loading.checkpoint import CheckpointError, match_state_dict

    ckpt = Path(out) / CHECKPOINT_DIR
    meta_file = ckpt / "state.json"
    meta = check_checkpoint(out)
    saved, now = _flatten(meta.get("config", {})), _flatten(config)
    differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    differ = [k for k in differ if k not in RESUMABLE_CHANGES]
    if differ:
        raise ValueError(
            f"{meta_file}: config fields {differ} differ from this run "
            f"(saved {[saved.get(k) for k in differ]}, now {[now.get(k) for k in differ]})"
        )
    weights = load_file(str(ckpt / "model.safetensors"))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    match_state_dict(expected, weights, str(ckpt / "model.safetensors"), "this run's model")
    moments = load_file(str(ckpt / "optimizer.safetensors"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    wanted = {f"{n}.{m}": shape for n, shape in shapes.items() for m in ("exp_avg", "exp_avg_sq")}
    # a parameter without gradients (a balanced router bias) has no moments: not required
    match_state_dict(
        {k: v for k, v in wanted.items() if k in moments},
        moments,
        str(ckpt / TENSOR_FILES[1]),
        "this run's model",
    )
    if any((f"{n}.exp_avg" in moments) != (f"{n}.exp_avg_sq" in moments) for n in shapes):
        raise CheckpointError(f"{ckpt / TENSOR_FILES[1]}: an exp_avg without its exp_avg_sq")
    model.load_state_dict(weights)
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
