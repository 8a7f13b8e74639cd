"""The decode loop: one loop for every proposal policy (see ``ddtree.engine.policies``).

A step: ``draft`` (drafter forward over the new context and the block ``[root, MASK x (B-1)]``)
-> ``topk`` -> ``build`` (best-first tree) -> ``layout`` -> ``verify`` (one target forward over
the M tree tokens) -> ``accept`` (walk the tree by match with the target's token at every
node; greedy or sampled) -> ``commit`` (keep the accepted path's KV entries). The step
commits ``tau`` tokens: the accepted draft nodes and the bonus token, which becomes the next
root. The first token after the prompt comes from the prefill's last logits.

Layout: the engine asks the target for what its verify takes (``Target.layout``: positions and
the ancestor-only additive mask of ``ddtree.tree.verify_layout``, filled into a ``LayoutBuffer``
reused across steps, in eager mode; the tree copied into preallocated static inputs in compiled
mode) and hands it to ``Target.verify``, so it is
timed as the ``layout`` stage, apart from the target forward.

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

from ddtree import tree as tree_core
from ddtree.engine.policies import Policy, get_policy, root_tree
from ddtree.engine.stop import StopCondition
from ddtree.engine.timing import StageClock, StepTimings
from ddtree.models.base import Drafter, Target
from ddtree.models.static import EnginePlan, check_engine_mode

MAX_BUDGET = 8192
"""Largest budget N: the verify forward's width is M = N + 1 and its additive mask alone is
M x (S + M) floats (256 MiB at N = 8192, S = 0); past the tree's reachable nodes a budget only
costs (best-first over min(N, V) candidates per depth grows without end)."""


class ContextLengthError(ValueError):
    """The prompt plus the requested tokens do not fit the target's positions."""


@dataclass
class DecodeConfig:
    policy: str = "ddtree"
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

    def __post_init__(self) -> None:
        policy = get_policy(self.policy)
        check_engine_mode(self.engine_mode)
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def width_buckets(self) -> tuple[int, ...]:
        """Verify widths the compiled graphs are built for: ``buckets``, else the policy's
        width M (1 for ar, B for chain, N + 1 for ddtree)."""
        policy = get_policy(self.policy)
        return self.buckets or (policy.budget(self.block_size, self.budget) + 1,)


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, after the prompt (EOS included if it stopped there)
    text: str | None  # decoded new tokens, when a tokenizer was given
    taus: list[int]  # tokens each step added to ``tokens`` (after truncation at the stop)
    steps: list[StepTimings] = field(default_factory=list)
    prefill_s: float = 0.0
    compile_s: float = 0.0  # warm-up compiles before the prefill (compiled mode), not in steps
    stop_reason: str = "max_new_tokens"  # "max_new_tokens" | "eos" | "stop_string"

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
    """Decode one request. ``on_commit(tokens)`` is called with each step's new tokens."""
    policy = get_policy(config.policy)
    if policy.needs_drafter and drafter is None:
        raise ValueError(f"policy {policy.name!r} needs a drafter")
    prompt = torch.as_tensor(prompt_ids, dtype=torch.int64).flatten()  # [T] int64
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    block = config.block_size if policy.needs_drafter else 1
    if policy.needs_drafter and drafter.block_size != config.block_size:
        raise ValueError(
            f"block_size {config.block_size} != the drafter's block_size {drafter.block_size}"
        )
    max_len = _check_context(target, int(prompt.numel()), config.max_new_tokens, block)
    eos = target.info.eos_token_ids if config.eos_token_ids is None else config.eos_token_ids
    stop_condition = StopCondition(
        config.max_new_tokens, frozenset(eos), config.stop_strings, tokenizer
    )
    device = _device_of(target)
    generator = None
    if not config.greedy:
        generator = torch.Generator(device=device).manual_seed(config.seed)
    clock = StageClock.for_device(device)

    use_drafter = policy.needs_drafter  # (checked above: then there is a drafter)
    target.set_capture_layers(list(drafter.target_layer_ids) if use_drafter else [])
    plan = EnginePlan(config.engine_mode, config.width_buckets(), max_len)
    compile_s = target.set_engine_mode(plan)  # resets the cache; EngineModeError if unsupported
    if use_drafter:
        compile_s += drafter.set_engine_mode(plan)

    clock.begin()
    out = target.prefill(prompt.to(device))
    root = _choose(out.logits[-1], config, generator)
    prefill_s = clock.end(0).step_s
    context_hidden = out.hidden  # [T, F] hidden of tokens committed, not yet seen by drafter

    tokens = [root]
    result = GenerationResult(
        tokens=tokens, text=None, taus=[], prefill_s=prefill_s, compile_s=compile_s
    )
    if on_commit is not None:
        on_commit([root])
    stop = stop_condition.scan(tokens, 0)  # the prefill's token can stop the request too
    budget = policy.budget(config.block_size, config.budget)
    while stop is None:
        clock.begin()
        tree = _propose(policy, drafter, context_hidden, root, budget, config, clock, device)
        layout = target.layout(tree)
        clock.mark("layout")
        out = target.verify(tree, layout)
        clock.mark("verify")
        accept = _accept(tree, out.logits, config, generator)
        clock.mark("accept")
        target.commit(accept.accepted)
        if policy.needs_drafter:
            context_hidden = out.hidden.index_select(0, accept.accepted.to(out.hidden.device))
        clock.mark("commit")
        new = tree.tokens[accept.accepted[1:]].tolist() + [accept.bonus_token]
        root = accept.bonus_token
        before = len(tokens)
        tokens.extend(new)
        stop = stop_condition.scan(tokens, before)
        tau = len(tokens) - before  # the step's tokens that are returned, after any stop
        result.steps.append(clock.end(tau))
        result.taus.append(tau)
        if on_commit is not None:
            on_commit(tokens[before:])
    result.stop_reason = stop
    if tokenizer is not None:
        result.text = tokenizer.decode(tokens)
    return result


def _propose(
    policy: Policy,
    drafter: Drafter | None,
    context_hidden: torch.Tensor | None,
    root: int,
    budget: int,
    config: DecodeConfig,
    clock: StageClock,
    device: torch.device,
):
    if not policy.needs_drafter:
        return root_tree(root, device)
    logits = drafter.propose(context_hidden, root)  # [B-1, V]
    clock.mark("draft")
    k = policy.candidates(budget, int(logits.shape[-1]))
    top = tree_core.topk_logprobs(logits, k)  # logprobs, tokens: [B-1, K] each
    clock.mark("topk")
    tree = tree_core.build_tree(root, top.logprobs, top.tokens, budget)
    clock.mark("build")
    return tree


def _accept(tree, logits: torch.Tensor, config: DecodeConfig, generator):
    # logits [M, V]: the target's next-token logits at every tree node
    if config.greedy:
        return tree_core.accept_greedy(tree, logits.argmax(dim=-1).to(tree.tokens.device))
    return tree_core.accept_sampled(
        tree, logits, config.temperature, config.top_k, config.top_p, generator
    )


def _choose(logits: torch.Tensor, config: DecodeConfig, generator) -> int:
    # logits [V]: the target's next-token logits after the last committed token
    if config.greedy:
        return int(logits.argmax())
    return int(
        tree_core.sample_token(logits, config.temperature, config.top_k, config.top_p, generator)
    )


def _check_context(target: Target, prompt_len: int, max_new_tokens: int, block: int) -> int:
    """Positions the request may reach; refuses what does not fit the target."""
    limit = target.info.max_position
    # the last step verifies up to B tokens after the committed ones
    needed = prompt_len + max_new_tokens + block
    if limit and needed > limit:
        raise ContextLengthError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} + block {block} "
            f"needs {needed} positions; {target.info.name} has max_position {limit}"
        )
    return needed


def _device_of(target: Target) -> torch.device:
    device = getattr(target, "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")
