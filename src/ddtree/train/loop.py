"""The training-step skeleton both recipes share: AdamW with weight decay on the matrices,
the warm-up + cosine schedule, clipped steps, interval logging on the progress bar, and the
checkpoints a stopped run resumes from exactly. A recipe brings its loss (and what its bar
shows); the loop does the rest."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.progress import Progress

from ddtree.signals import deferred
from ddtree.train.progress import log_interval
from ddtree.train.state import TrainState, lr_at, save_checkpoint


def adamw(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    decays: Callable[[str], bool] | None = None,
) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) with ``weight_decay`` on the matrices (of the names ``decays``
    accepts, default all), none on the rest (vectors, norms)."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and (decays is None or decays(name)) else rest).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


class NonFiniteTraining(ValueError):
    """The loss or the weights went NaN/inf (a learning rate too large, most often): the run
    stops there, and the broken weights are neither checkpointed nor exported."""


def _stop_if_not_finite(name, what, step, cfg, saved) -> None:
    kept = f"the checkpoint of step {saved} is kept" if saved else "nothing was saved"
    raise NonFiniteTraining(
        f"{name} step {step}: {what} (--lr {cfg.lr:g}); training stopped and {kept}: "
        "try a smaller --lr"
    )


def _not_finite(model: torch.nn.Module) -> str | None:
    """The first parameter holding NaN/inf, or None. A pass over every weight, so it runs
    before a checkpoint only: a broken update shows in the next step's loss anyway."""
    return next((n for n, w in model.named_parameters() if not w.isfinite().all()), None)


def train_steps(
    name: str,
    model: torch.nn.Module,
    opt: torch.optim.AdamW,
    cfg,  # steps, lr, warmup_steps, grad_clip, log_every, save_every
    state: TrainState,
    checkpoint: tuple[Path, dict],  # (output folder, the run config saved with it)
    bar: Progress,
    step_loss: Callable[[int], tuple[torch.Tensor, float]],
    describe: Callable[[TrainState, float], str],
    stop_at: int | None = None,
    after_step: Callable[[], None] | None = None,
) -> None:
    """Run steps ``state.step .. min(cfg.steps, stop_at)``, updating ``state`` in place.

    ``step_loss(step)`` -> (loss to minimise, a metric averaged over each log interval);
    ``describe(state, mean metric)`` -> the bar's rate column and the log line's tail;
    ``after_step()`` runs after each optimizer step. A checkpoint is written every
    ``save_every`` steps, at the end and at ``stop_at``, and when the run is interrupted
    (Ctrl-C, or SIGTERM under ``ddtree.signals``): then of the last finished step, before the
    interrupt goes on. An update (optimizer step, ``after_step``, the step count) is never
    cut in half: the interrupt waits for it (``ddtree.signals.deferred``). A loss or weights
    that are not finite stop the run with ``NonFiniteTraining`` (one line naming the step and
    ``--lr``), saving nothing of that step or after it."""
    out, run_config = checkpoint
    interval: list[tuple[float, float]] = []
    t0 = time.perf_counter() - state.elapsed_s
    saved = state.step  # the step the checkpoint on disk holds (a resumed run starts there)
    task = bar.add_task(name, total=cfg.steps, completed=state.step, loss="-", rate="")
    try:
        while state.step < min(cfg.steps, stop_at or cfg.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(state.step, cfg.steps, cfg.lr, cfg.warmup_steps)
            loss, metric = step_loss(state.step)
            if not torch.isfinite(loss.detach()).all():
                what = f"the loss is {float(loss.detach())}"
                _stop_if_not_finite(name, what, state.step + 1, cfg, saved)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            with deferred():
                opt.step()
                if after_step is not None:
                    after_step()
                interval.append((float(loss.detach()), metric))
                state.step += 1
            if state.step % cfg.log_every == 0 or state.step == cfg.steps:
                state.losses.append(sum(x for x, _ in interval) / len(interval))
                state.elapsed_s = time.perf_counter() - t0
                text = describe(state, sum(m for _, m in interval) / len(interval))
                interval.clear()
                bar.update(task, loss=f"{state.losses[-1]:.3f}", rate=text)
                log_interval(
                    bar,
                    f"{name} step {state.step}/{cfg.steps} loss {state.losses[-1]:.3f} {text} "
                    f"{state.elapsed_s:.0f} s",
                )
            if state.step % cfg.save_every == 0 or state.step in (cfg.steps, stop_at):
                bad = _not_finite(model)  # weights broken by this step's update: not saved
                if bad is not None:
                    _stop_if_not_finite(name, f"{bad} is not finite", state.step, cfg, saved)
                state.elapsed_s = time.perf_counter() - t0
                save_checkpoint(out, model, opt, state, run_config)
                saved = state.step
            bar.update(task, completed=state.step)
    except KeyboardInterrupt:
        if state.step > saved and _not_finite(model) is None:
            state.elapsed_s = time.perf_counter() - t0
            save_checkpoint(out, model, opt, state, run_config)
        raise
