"""Step costs at the shapes users run (``ddtree bench shapes --preset NAME``): a random-weight
target of a published shape (``ddtree.models.presets``), its DFlash drafter's shape under the
synthetic oracle (``ddtree.models.oracle``, which sets the acceptance), decoding AR, chain and
DDTree at several budgets, eager and compiled, in one sweep.

What a step must read (its memory roofline, DESIGN.md's vocabulary):

    target bytes(M) = every weight of the target once (routed experts: the expected distinct
                      experts M tokens touch, E (1 - (1 - k/E)^M) per layer, uniform routing)
                      + the M embedding rows + the KV cache of the S committed tokens
    drafter bytes   = the drafter's weights + the LM head it computes (the target's again, or
                      its K rows with a draft vocabulary) + its context keys and values
    step bytes      = target bytes(1) for AR; drafter bytes + target bytes(M) otherwise
    roofline fraction = step bytes / measured read bandwidth / measured step time

S is each run's mean context over its steps. Everything here is measured, except the expected
experts touched (derived, formula above).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddtree.engine.loop import DecodeConfig, GenerationResult
from ddtree.models.nn.linear import weight_tensors

EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")


def experts_touched(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` tokens touch, each routed to ``top_k`` of
    ``n_experts`` uniformly: E (1 - (1 - k/E)^M). Example: E = 128, k = 8, M = 1 -> 8;
    M = 33 -> 112.8."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def weight_bytes(model: torch.nn.Module, tokens: int, top_k: int = 0) -> float:
    """Bytes of weights one forward of ``tokens`` rows reads (module docstring). A tied LM
    head is read as the head; an untied embedding only as its ``tokens`` rows."""
    head = getattr(model, "lm_head", None)
    tied = head is not None and head.weight is model.model.embed_tokens.weight
    total = 0.0
    for name, p in weight_tensors(model):
        size = p.numel() * p.element_size()
        if name == "model.embed_tokens.weight" and not tied:
            size = tokens * p.shape[-1] * p.element_size()
        elif name.endswith(EXPERT_PARAMS):
            size = size / p.shape[0] * experts_touched(p.shape[0], top_k, tokens)
        total += size
    return total


def kv_bytes(cache_tensors, capacity_dim: int, context: float) -> float:
    """Bytes the keys/values of ``context`` committed rows take in cache tensors whose
    dimension ``capacity_dim`` is the row (slot) index."""
    per_row = sum(t.numel() / t.shape[capacity_dim] * t.element_size() for t in cache_tensors)
    return per_row * context


def mean_context(results: list[GenerationResult], prompt_lens: list[int]) -> float:
    """The mean committed tokens at the start of a step, over every step of ``results``."""
    contexts = []
    for r, n in zip(results, prompt_lens, strict=True):
        for s in r.steps:
            contexts.append(n)
            n += s.tau
    return sum(contexts) / max(len(contexts), 1)


@dataclass
class ShapeRow:
    """One (engine mode, policy, budget) of the sweep, with its roofline."""

    mode: str
    policy: str
    budget: int
    width: int  # M
    summary: dict  # engine_run summary (mean_tau, tokens_per_s, step_s_mean, stage_s_mean...)
    identical_to_ar: bool | None
    step_bytes: float
    bytes_parts: dict = field(default_factory=dict)  # target/drafter weights and KV
    roofline_fraction: float = 0.0
    vs_ar: float = 0.0  # tokens/s over AR's in the same engine mode and at the same C
    concurrency: int = 1  # requests decoded together (C): tokens/s is all rows'
    auto: bool = False  # --budget auto: ``budget`` is the mean of the trees it verified

    @property
    def budget_label(self) -> str:
        """ "32", or "auto (12)" for a run that chose each step's tree (12 nodes on average)."""
        return f"auto ({self.budget})" if self.auto else str(self.budget)


def step_bytes(
    config: DecodeConfig,
    target,
    drafter,
    context: float,
    top_k: int,
    rows: int = 1,
    width: int | None = None,
) -> tuple[float, dict]:
    """(step bytes, their parts) of a config at mean context ``context`` (module docstring).
    ``drafter``: the oracle; its ``base`` (the DFlash drafter whose forward it runs) is what
    reads memory. ``rows`` requests decoded together (``--concurrency``): the weights once
    for all their tokens (``rows x M`` rows touch the experts), every row's KV. ``width``:
    the verify's tokens M (None: the config's tree + 1; a ``--budget auto`` run: its mean)."""
    width = config.tree_budget + 1 if width is None else width
    cache = target.cache
    parts = {
        "target_weights": weight_bytes(target.model, width * rows, top_k),
        "target_kv": rows * kv_bytes(cache.tensors(), cache.capacity_dim, context),
    }
    base = getattr(drafter, "base", None)
    if config.rules.needs_drafter and base is not None:
        own = sum(p.numel() * p.element_size() for _, p in weight_tensors(base.model))
        head = sum(p.numel() * p.element_size() for _, p in weight_tensors(base.draft_head))
        parts["drafter_weights"] = float(own + head)
        parts["drafter_kv"] = rows * kv_bytes((base._k, base._v), 1, context)
    return sum(parts.values()), parts


def oracle_feeder(oracle, prompts: list[list[int]]) -> Callable:
    """A sweep ``on_result`` hook: after the AR run on a prompt, the oracle follows that
    run's tokens for the other policies on the same prompt (same engine mode)."""

    def on_result(config: DecodeConfig, i: int, result: GenerationResult) -> None:
        if not config.rules.needs_drafter:
            oracle.expect(list(prompts[i]) + result.tokens)

    return on_result


@dataclass
class OracleRows:
    """The batched sweep's oracles (``sweep_batched``): ``on_result`` keeps each prompt's AR
    continuation; ``drafter_for`` gives a request a fork of the oracle that follows its own
    prompt's (a batch decodes several prompts at once, each needs its own reference)."""

    oracle: object  # OracleDrafter
    prompts: list[list[int]]
    references: dict[int, list[int]] = field(default_factory=dict)

    def on_result(self, config: DecodeConfig, i: int, result: GenerationResult) -> None:
        if not config.rules.needs_drafter:
            self.references[i] = list(self.prompts[i]) + result.tokens

    def drafter_for(self, config: DecodeConfig, i: int):
        if not config.rules.needs_drafter:
            return None
        twin = self.oracle.fork()
        twin.expect(self.references.get(i, []))
        return twin
