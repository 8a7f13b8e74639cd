"""The decode loop: one loop for every policy (``ddtree.vocab.Policy``), propose -> verify ->
accept.

A step: the request's proposer (``ddtree.engine.propose``, chosen once from the policy) builds
the tree: ``draft`` (drafter forward over the new context and the block
``[root, MASK x (B-1)]``) -> ``topk`` -> ``build`` (best-first tree), or the root alone without
a drafter; then ``layout`` -> ``verify`` (one target forward over the M tree tokens) ->
``accept`` (the request's sampler, ``ddtree.engine.sample``, walks the tree by match with the
target's token at every node; greedy or sampled) -> ``commit`` (keep the accepted path's KV
entries; the proposer sees their hidden states). The step commits ``tau`` tokens: the
accepted draft nodes and the bonus token, which becomes the next root. The first token after
the prompt comes from the prefill's last logits.

Layout: the engine asks the target for what its verify takes (``Target.layout``: positions and
the ancestor-only additive mask of ``ddtree.tree.verify_layout``, filled into a ``LayoutBuffer``
reused across steps, in eager mode; the tree copied into preallocated static inputs in compiled
mode) and hands it to ``Target.verify``, so it is timed as the ``layout`` stage, apart from the
target forward.

Engine mode (``DecodeConfig.engine_mode``, see ``ddtree.models.static``): ``eager`` or
``compiled``; the loop is the same, the models run their forwards compiled at static shapes.
Compiling happens in ``set_engine_mode`` before the prefill and is reported as ``compile_s``,
never inside a step time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ddtree.engine.budget import budget_for
from ddtree.engine.propose import check_runnable, proposer_for
from ddtree.engine.sample import sampler_for
from ddtree.engine.stop import StopCondition
from ddtree.engine.timing import StageClock, StepTimings
from ddtree.models.base import Drafter, ModelInfo, Target
from ddtree.models.static import (
    EnginePlan,
    check_compile_scope,
    check_engine_mode,
    check_engine_support,
)
from ddtree.vocab import DEFAULT_POLICY, Policy, check_sampling_floors, get_policy

MAX_BUDGET = 8192
"""Largest budget N: the verify forward's width is M = N + 1 and its additive mask alone is
M x (S + M) floats (256 MiB at N = 8192, S = 0); past the tree's reachable nodes a budget only
costs (best-first over min(N, V) candidates per depth grows without end)."""


class ContextLengthError(ValueError):
    """The prompt plus the requested tokens do not fit the target's positions."""


@dataclass
class DecodeConfig:
    policy: str = DEFAULT_POLICY  # a name in ddtree.vocab.POLICIES
    block_size: int = 8  # B
    budget: int = 32  # N (ddtree only; chain uses B-1, ar 0)
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None: the target's
    engine_mode: str = "eager"  # "eager" | "compiled" (ddtree.models.static)
    buckets: tuple[int, ...] = ()  # compiled verify width buckets; (): the policy's own width
    compile_scope: str = "model"  # compiled: the target's whole forward, or each "layer"
    profile_stages: bool = True  # time every stage of a step (False: the step only, no syncs)
    # ``--budget auto``: each step verifies the best prefix of a tree of ``budget`` nodes for
    # this machine's verify cost and the request's recent acceptance (ddtree.engine.budget)
    auto_budget: bool = False
    # ``policy`` resolved once: every rule that follows from it (``ddtree.vocab.Policy``)
    rules: Policy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.rules = policy = get_policy(self.policy)
        check_runnable(policy)
        check_engine_mode(self.engine_mode)
        check_compile_scope(self.compile_scope)
        self.buckets = tuple(int(b) for b in self.buckets)
        if any(b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be >= 1, got {list(self.buckets)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not policy.min_budget <= self.budget <= MAX_BUDGET:
            raise ValueError(
                f"budget must be in {policy.min_budget}..{MAX_BUDGET} for policy {self.policy!r}, "
                f"got {self.budget}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:  # NaN fails too
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_sampling_floors(temperature=self.temperature, top_p=self.top_p)
        if self.auto_budget and not policy.uses_budget:
            raise ValueError(f"budget auto: policy {self.policy!r} has no budget to choose")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def tree_budget(self) -> int:
        """Non-root nodes of a step's tree: the policy's budget at this B and N (0 for ar,
        B - 1 for chain, N for ddtree)."""
        return self.rules.budget(self.block_size, self.budget)

    @property
    def budget_label(self) -> str:
        """The budget as progress lines and tables write it: "32", or "auto<=64"."""
        return f"auto<={self.tree_budget}" if self.auto_budget else str(self.tree_budget)

    def width_buckets(self) -> tuple[int, ...]:
        """Verify widths the compiled graphs are built for: ``buckets``, else the policy's
        width M = its budget + 1 (1 for ar, B for chain, N + 1 for ddtree)."""
        return self.buckets or (self.tree_budget + 1,)


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, after the prompt (EOS included if it stopped there)
    text: str | None  # decoded new tokens, when a tokenizer was given
    taus: list[int]  # tokens each step added to ``tokens`` (after truncation at the stop)
    steps: list[StepTimings] = field(default_factory=list)
    prefill_s: float = 0.0
    compile_s: float = 0.0  # warm-up compiles before the prefill (compiled mode), not in steps
    stop_reason: str = "max_new_tokens"  # "max_new_tokens" | "eos" | "stop_string"
    tree_nodes: list[int] = field(default_factory=list)  # non-root nodes each step verified

    @property
    def decode_s(self) -> float:
        return sum(s.step_s for s in self.steps)

    @property
    def mean_tau(self) -> float:
        return sum(self.taus) / len(self.taus) if self.taus else 0.0


def generate(
    target: Target,
    drafter: Drafter | None,
    prompt_ids: Sequence[int] | torch.Tensor,
    config: DecodeConfig,
    tokenizer=None,
    on_commit: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Decode one request. ``on_commit(tokens)`` is called with each step's new tokens (an
    exception raised there ends the request and propagates)."""
    policy = config.rules
    device = torch.device(target.device)
    proposer = proposer_for(policy, drafter, config.block_size, config.budget, device)
    prompt = prompt_tensor(prompt_ids)  # [T] int64
    max_len = check_context(target, int(prompt.numel()), config)
    eos = target.info.eos_token_ids if config.eos_token_ids is None else config.eos_token_ids
    stop_condition = StopCondition(
        config.max_new_tokens, frozenset(eos), config.stop_strings, tokenizer
    )
    sampler = sampler_for(config.temperature, config.top_k, config.top_p, config.seed, device)
    clock = StageClock.for_device(device, config.profile_stages)

    models = [target, drafter] if policy.needs_drafter else [target]
    described = [(f"{m.info.name} ({m.info.implementation})", m.engine_modes) for m in models]
    check_engine_support(config.engine_mode, described)
    plan = EnginePlan(
        config.engine_mode,
        config.width_buckets(),
        max_len,
        config.compile_scope,
        capture_layers=tuple(proposer.capture_layers),
    )
    compile_s = target.set_engine_mode(plan)  # resets the cache; EngineModeError if unsupported
    compile_s += proposer.set_engine_mode(plan)
    budget = budget_for(config, target, proposer)  # auto: measures the verify cost once

    clock.begin()
    out = target.prefill(prompt.to(device))
    root = sampler.first(out.logits[-1])
    prefill_s = clock.end(0).step_s
    proposer.observe(out.hidden)

    tokens = [root]
    result = GenerationResult(
        tokens=tokens, text=None, taus=[], prefill_s=prefill_s, compile_s=compile_s
    )
    if on_commit is not None:
        on_commit([root])
    stop = stop_condition.scan(tokens, 0)  # the prefill's token can stop the request too
    while stop is None:
        clock.begin()
        tree = budget.choose(proposer.propose(root, clock))  # stamps draft, topk, build
        layout = target.layout(tree)
        clock.mark("layout")
        out = target.verify(tree, layout)
        clock.mark("verify")
        accept = sampler.accept(tree, out.logits)
        clock.mark("accept")
        target.commit(accept.accepted)
        proposer.observe(out.hidden, accept.accepted)
        clock.mark("commit")
        new = tree.tokens[accept.accepted[1:]].tolist() + [accept.bonus_token]
        root = accept.bonus_token
        before = len(tokens)
        tokens.extend(new)
        stop = stop_condition.scan(tokens, before)
        tau = len(tokens) - before  # the step's tokens that are returned, after any stop
        result.steps.append(clock.end(tau))
        result.taus.append(tau)
        result.tree_nodes.append(tree.n_nodes - 1)
        budget.observe(tree, accept.tau, result.steps[-1].step_s)
        if on_commit is not None:
            on_commit(tokens[before:])
    result.stop_reason = stop
    if tokenizer is not None:
        result.text = tokenizer.decode(tokens)
    return result


def prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """One request's token ids as a ``[T]`` int64 tensor. Accepted: a flat sequence of ints, a
    ``[T]`` integer tensor, or one row ``[1, T]`` (what a tokenizer returns with
    ``return_tensors="pt"``). A batch (``[[a...], [b...]]``, ``[2, T]``) is refused, never
    flattened into one prompt: the engine decodes one request at a time."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt = prompt_ids
    else:
        try:
            prompt = torch.as_tensor(prompt_ids)
        except (ValueError, TypeError, RuntimeError):  # ragged rows, strings, None
            raise ValueError(
                "prompt_ids: expected one prompt, a flat sequence of int token ids"
            ) from None
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() == 0:
        raise ValueError("prompt_ids: expected a sequence of token ids, got one number")
    if prompt.dim() != 1:
        batch = prompt.shape[0] if prompt.dim() == 2 else None
        what = f"a batch of {batch} prompts" if batch else f"{prompt.dim()} dimensions"
        raise ValueError(
            f"prompt_ids: generate decodes one request, got {what} (shape "
            f"{list(prompt.shape)}); call it once per prompt (ddtree.engine.sweep decodes a "
            "prompt set)"
        )
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
        raise ValueError(f"prompt_ids: expected integer token ids, got {prompt.dtype}")
    return prompt.to(torch.int64)


def check_context(target: Target, prompt_len: int, config: DecodeConfig) -> int:
    """Positions a request may reach; refuses (``ContextLengthError``) what does not fit the
    target. ``generate`` calls it before any forward; a server calls it before queueing."""
    block = config.rules.block(config.block_size)
    return request_positions(target.info, prompt_len, config.max_new_tokens, block)


def request_positions(info: ModelInfo, prompt_len: int, max_new_tokens: int, block: int) -> int:
    """The positions rule of a request (the engine's and a replay recording's): the prompt,
    ``max_new_tokens`` and, since the last step verifies up to ``block`` tokens after the
    committed ones, a block more. ``ContextLengthError`` past the target's ``max_position``
    (0: unbounded)."""
    needed = prompt_len + max_new_tokens + block
    limit = info.max_position
    if limit and needed > limit:
        raise ContextLengthError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} + block "
            f"{block} needs {needed} positions; {info.name} has max_position {limit}"
        )
    return needed
