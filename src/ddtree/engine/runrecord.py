"""Turn decode results into one ``engine_run`` measurement record (``ddtree.records``)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ddtree.engine.loop import DecodeConfig, GenerationResult
from ddtree.provenance import this_hardware, this_process
from ddtree.records import EngineRun
from ddtree.tree import backend as tree_backend
from ddtree.vocab import MODEL_STAGES, STEP_STAGES, EngineMode


def model_config(info, path: str | Path | None) -> dict[str, Any]:
    """ModelInfo fields plus ``config_json`` (the HF config.json) when the folder has one."""
    out = dataclasses.asdict(info)
    out["eos_token_ids"] = list(out["eos_token_ids"])
    if path is not None and (Path(path) / "config.json").is_file():
        out["config_json"] = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    return out


def summarize(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """Headline figures over every step of every result (the engine_run summary fields)."""
    steps = [s for r in results for s in r.steps]
    if not steps:
        raise ValueError("no decode steps to summarise (max_new_tokens 1 decodes none)")
    step_s = sorted(s.step_s for s in steps)
    total_s = sum(step_s)
    taus = [s.tau for s in steps]
    stage_s_mean = {k: sum(s.stage_s[k] for s in steps) / len(steps) for k in STEP_STAGES}
    model_s = sum(stage_s_mean[k] for k in MODEL_STAGES)
    step_s_mean = total_s / len(steps)
    return {
        "mean_tau": sum(taus) / len(taus),
        "tokens_per_s": sum(taus) / total_s,
        "step_s_mean": step_s_mean,
        "step_s_p50": statistics.median(step_s),
        "step_s_p90": step_s[min(len(step_s) - 1, int(0.9 * len(step_s)))],
        "stage_s_mean": stage_s_mean,
        "overhead_fraction": (step_s_mean - model_s) / step_s_mean,
        "steps": len(steps),
        "new_tokens": sum(len(r.tokens) for r in results),
        "prefill_s_mean": sum(r.prefill_s for r in results) / len(results),
        "prompts": len(results),
    }


def step_points(
    results: Sequence[GenerationResult], prompt_lens: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """One point per step. With the prompt lengths, each carries ``context_len``: the tokens
    in the target's cache when the step starts (the root's position: prompt + committed)."""
    points = []
    for i, r in enumerate(results):
        context = prompt_lens[i] if len(prompt_lens) == len(results) else None
        for s in r.steps:
            point = {"tau": s.tau, "step_s": s.step_s, "stage_s": dict(s.stage_s)}
            if context is not None:
                point["context_len"] = context
                context += s.tau
            points.append(point)
    return points


def engine_run_record(
    results: Sequence[GenerationResult],
    config: DecodeConfig,
    target_info,
    target_path: str | Path | None,
    drafter_info=None,
    drafter_path: str | Path | None = None,
    device: str = "cpu",
    prompt_lens: Sequence[int] = (),
    extra: dict[str, Any] | None = None,
    compile_s: float | None = None,
    concurrency: int = 1,
    summary: dict[str, Any] | None = None,
) -> EngineRun:
    """The engine's record builder. ``extra`` keys go to the record's config as they are.
    ``compile_s``: compile time spent outside ``results`` (a sweep's warm-up request); default
    the results' own. ``threads`` is torch's CPU thread count as the record is made (the
    runs that feed one calibration or one diagnosis should agree on it). ``concurrency``:
    requests decoded together; its ``summary`` (``ddtree.engine.sweep.sweep_batched``) holds
    the aggregate tokens/s and the batched step's mean, which ``summarize`` of the rows'
    results cannot tell."""
    figures = summarize(results)
    if summary is not None:
        figures.update({k: v for k, v in summary.items() if k in figures})
    budget = verified_budget(config, results, summary)
    policy = config.rules
    compiled = config.engine_mode != EngineMode.EAGER
    return EngineRun(
        hardware=this_hardware(),
        provenance=this_process("ddtree.engine"),
        policy=config.policy,
        block_size=policy.block(config.block_size),
        budget=budget,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        seed=config.seed,
        max_new_tokens=config.max_new_tokens,
        target=model_config(target_info, target_path),
        drafter=None if drafter_info is None else model_config(drafter_info, drafter_path),
        dtype=target_info.dtype,
        device=device,
        engine_mode=config.engine_mode,
        width_buckets=list(config.width_buckets()) if compiled else [],
        compile_s=sum(r.compile_s for r in results) if compile_s is None else compile_s,
        tree_backend=tree_backend(),
        tp=getattr(target_info, "tp", 1),
        concurrency=concurrency,
        threads=torch.get_num_threads(),
        prompt_set={"count": len(results), "lengths": list(prompt_lens)},
        config_extra=dict(extra or {}),
        points=step_points(results, prompt_lens),
        **figures,
    )


def verified_budget(config, results: Sequence[GenerationResult], summary: dict | None) -> int:
    """The budget a run's record states: the config's, or for ``--budget auto`` the mean
    nodes of the trees it verified (not the largest it built them from)."""
    if not config.auto_budget:
        return config.rules.budget(config.block_size, config.budget)
    return max(1, round(_mean_tree_nodes(results, summary)))


def _mean_tree_nodes(results: Sequence[GenerationResult], summary: dict | None) -> float:
    """Non-root nodes of the trees a ``--budget auto`` run verified, per step: the batch's
    steady state when it says, else the results' own (``GenerationResult.tree_nodes``)."""
    if summary is not None and "tree_nodes_mean" in summary:
        return summary["tree_nodes_mean"]
    nodes = [n for r in results for n in r.tree_nodes]
    return sum(nodes) / len(nodes) if nodes else 0.0
