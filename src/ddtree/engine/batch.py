"""Several requests at once: continuous batching of DDTree (and chain, and AR) requests.

The step of ``ddtree.engine.loop`` for a batch of rows: every running row proposes its tree
(its own proposer and drafter state, chosen once per request as ``generate`` chooses them),
then **one target forward** verifies every row's tree at once (``ddtree.models.adapters.rows``: the
trees packed side by side, each row attending to its own region of the cache), then each
row accepts with its own sampler, commits, and checks its own stop conditions. A request
that joins is prefilled in the next step's forward (eager mode packs its prompt beside the
others' trees; compiled mode runs prompts in a forward of their own); a request that
finishes or is cancelled leaves between steps and frees its row for the next one waiting
(first come, first served: no request starves).

Each row is lossless on its own: its tree, acceptance and commit depend on its own tokens
alone, so a greedy row equals AR token for token (float32; in bfloat16 the rounding of a
forward depends on how many tokens it carries, so a row can differ from AR as a lone DDTree
request can) and a sampled row follows the target's distribution with its own generator.

Example::

    engine = BatchEngine(target, drafter, max_rows=4)
    results = engine.run([BatchRequest(ids, DecodeConfig(policy="ddtree")) for ids in prompts])
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ddtree.engine.budget import (
    AutoBudget,
    Calibration,
    VerifyCost,
    chain_tree,
    cost_widths,
    measure_verify_cost,
    next_build,
    node_probs,
)
from ddtree.engine.loop import DecodeConfig, GenerationResult, check_context, prompt_tensor
from ddtree.engine.propose import BlockTreeProposer, Proposer, proposer_for
from ddtree.engine.sample import sampler_for
from ddtree.engine.stop import StopCondition
from ddtree.engine.timing import StageClock, StepTimings
from ddtree.models.adapters.rows import RowsTarget, Segment
from ddtree.models.base import Drafter, Target
from ddtree.models.static import EnginePlan, check_engine_support
from ddtree.tree.types import DraftTree

DEFAULT_ROW_CAPACITY = 2048
"""Positions a row holds when the engine is not told (capped by the target's max_position)."""


@dataclass
class BatchRequest:
    """One request of a batch: its prompt, its own decode settings, an optional callback with
    each step's new tokens, and optionally a drafter state of its own (default: the engine's
    drafter, forked once per row)."""

    prompt_ids: Sequence[int] | torch.Tensor
    config: DecodeConfig
    on_commit: Callable[[list[int]], None] | None = None
    drafter: Drafter | None = None


@dataclass
class _Row:
    """A request holding a row: its proposer, sampler, stop rule and what it has made."""

    id: int
    slot: int
    request: BatchRequest
    prompt: torch.Tensor  # [T] int64
    proposer: Proposer
    sampler: object
    stop: StopCondition
    result: GenerationResult
    calibration: Calibration = field(default_factory=Calibration)  # --budget auto
    root: int | None = None  # None until its prompt is prefilled
    tree: DraftTree | None = None
    cancelled: bool = False


@dataclass
class BatchStep:
    """What one step did: the rows in its forward, and the requests it finished."""

    rows: int  # requests in the step's target forward
    finished: list[tuple[int, GenerationResult]] = field(default_factory=list)
    step_s: float = 0.0  # the step's wall seconds (every row's step)
    tokens: int = 0  # tokens the step gave its rows (a joining row's first token included)
    decoding: int = 0  # rows that verified a tree (the others joined: their prompt's prefill)
    stage_s: dict = field(default_factory=dict)  # the step's seconds by stage
    tree_tokens: int = 0  # tokens of the verified trees (root included), all rows


class BatchEngine:
    """Continuous batching over one target (see the module docstring).

    ``max_rows``: requests decoded together (C); ``row_capacity``: cache slots each holds
    (:func:`row_slots`; default the target's ``max_position``, at most
    ``DEFAULT_ROW_CAPACITY``, and a tree of ``width``). ``engine_mode`` and ``compile_scope`` hold for every request
    (a request's config must agree); compiled mode compiles one graph per packed width
    bucket, ``rows x width`` for rows 1, 2, 4, ... up to ``max_rows``, at construction.
    ``profile_stages``: stamp every stage of a step (CUDA syncs), else the step only."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        max_rows: int = 4,
        row_capacity: int | None = None,
        engine_mode: str = "eager",
        width: int = 1,
        compile_scope: str = "model",
        tokenizer=None,
        profile_stages: bool = True,
        auto_budget: bool = False,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        limit = target.info.max_position or DEFAULT_ROW_CAPACITY
        # a row's slots: its positions, and a whole tree past the last committed token
        capacity = (
            min(limit, DEFAULT_ROW_CAPACITY) + width if row_capacity is None else row_capacity
        )
        models = [target] if drafter is None else [target, drafter]
        described = [(f"{m.info.name} ({m.info.implementation})", m.engine_modes) for m in models]
        check_engine_support(engine_mode, described)
        self.rows_target = RowsTarget(target, max_rows, capacity)
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.max_rows, self.row_capacity, self.width = max_rows, capacity, width
        self.engine_mode, self.compile_scope = engine_mode, compile_scope
        self.device = torch.device(target.device)
        self.clock = StageClock.for_device(self.device, profile_stages)
        self.capture_layers = tuple(drafter.target_layer_ids) if drafter is not None else ()
        widths = tuple(sorted({r * width for r in _doublings(max_rows)}))
        plan = EnginePlan(engine_mode, widths, capacity, compile_scope, self.capture_layers)
        self.compile_s = self.rows_target.set_engine_mode(plan, self.capture_layers)
        self._drafters: dict[int, Drafter] = {}  # slot -> the engine drafter's fork
        self._ids = itertools.count()
        self.waiting: deque[tuple[int, BatchRequest]] = deque()
        self.running: dict[int, _Row] = {}  # request id -> its row
        self._dropped: list[tuple[int, GenerationResult]] = []  # cancelled while waiting
        self._free = list(range(max_rows - 1, -1, -1))
        # --budget auto: this machine's cost of a forward over W packed tokens, measured now
        self.auto: AutoBudget | None = None
        if auto_budget:
            cost = self._verify_cost(plan.widths if engine_mode != "eager" else ())
            self.auto = AutoBudget(cost, fixed_s=cost(max_rows))

    # --- requests -------------------------------------------------------------------------
    def submit(self, request: BatchRequest) -> int:
        """Queue a request; its id. Refuses now (ValueError, ``ContextLengthError``) what could
        never run: a prompt that is not one request, more positions than a row holds, another
        engine mode, a policy that needs a drafter the engine lacks."""
        config = request.config
        if config.engine_mode != self.engine_mode:
            raise ValueError(
                f"request engine_mode {config.engine_mode!r}: this batch engine runs "
                f"{self.engine_mode!r} for every request"
            )
        prompt = prompt_tensor(request.prompt_ids)
        check_context(self.target, int(prompt.numel()), config)
        needed = row_slots(int(prompt.numel()), config)
        if needed > self.row_capacity:
            raise ValueError(
                f"a prompt of {prompt.numel()} tokens + max_new_tokens {config.max_new_tokens} "
                f"+ a verify of {max(config.width_buckets())} tokens needs {needed} cache slots; "
                f"a row holds {self.row_capacity} (raise the row capacity)"
            )
        if config.auto_budget and self.auto is None:
            raise ValueError(
                "budget auto: this batch engine was built without a verify cost curve "
                "(BatchEngine(auto_budget=True))"
            )
        drafter = request.drafter or self.drafter
        if config.rules.needs_drafter:
            proposer_for(config.rules, drafter, config.block_size, config.budget, self.device)
            if tuple(drafter.target_layer_ids) != self.capture_layers:
                raise ValueError(
                    f"the request's drafter reads target layers {drafter.target_layer_ids}; "
                    f"the engine captures {list(self.capture_layers)}"
                )
        request_id = next(self._ids)
        self.waiting.append((request_id, request))
        return request_id

    def cancel(self, request_id: int) -> None:
        """Drop a request at the next step, waiting or running: that step returns its result
        so far (no tokens if it never ran), ``stop_reason`` "cancelled"."""
        if any(i == request_id for i, _ in self.waiting):
            self.waiting = deque((i, r) for i, r in self.waiting if i != request_id)
            never_ran = GenerationResult(tokens=[], text=None, taus=[], stop_reason="cancelled")
            self._dropped.append((request_id, never_ran))
        if request_id in self.running:
            self.running[request_id].cancelled = True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self._dropped

    def run(
        self,
        requests: Sequence[BatchRequest],
        on_step: Callable[[BatchStep], None] | None = None,
    ) -> list[GenerationResult]:
        """Decode ``requests`` (at most ``max_rows`` at a time, the next joining as one
        leaves); their results in order. ``on_step`` sees every step (its rows, seconds and
        tokens: what an aggregate tokens/s is made of)."""
        ids = [self.submit(r) for r in requests]
        done: dict[int, GenerationResult] = {}
        while not self.idle:
            step = self.step()
            if on_step is not None:
                on_step(step)
            done.update(step.finished)
        return [done[i] for i in ids]

    # --- the step -------------------------------------------------------------------------
    def step(self) -> BatchStep:
        """One forward for every running row (joining rows prefilled in it)."""
        finished = [self._leave(row, "cancelled") for row in self._cancelled()]
        finished += self._dropped
        self._dropped = []
        self._admit()
        rows = list(self.running.values())
        if not rows:
            return BatchStep(0, finished)
        clock = self.clock
        clock.begin()
        joining = [r for r in rows if r.root is None]
        verifying = [r for r in rows if r.root is not None]
        self._propose(verifying, clock)
        self._choose_budgets(joining, verifying)
        segments = [Segment.prompt(r.slot, r.prompt.to(self.device)) for r in joining]
        segments += [_tree_segment(r.slot, r.tree, self.device) for r in verifying]
        clock.mark("layout")
        outs = self._forward(segments)
        clock.mark("verify")
        prompt_outs, tree_outs = outs[: len(joining)], outs[len(joining) :]
        accepts = [
            r.sampler.accept(r.tree, o.logits) for r, o in zip(verifying, tree_outs, strict=True)
        ]
        clock.mark("accept")
        self.rows_target.commit([r.slot for r in verifying], [a.accepted for a in accepts])
        new_tokens: dict[int, list[int]] = {}
        for row, out in zip(joining, prompt_outs, strict=True):
            self.rows_target.commit_prompt(row.slot)
            row.root = row.sampler.first(out.logits[-1])
            row.proposer.observe(out.hidden)
            new_tokens[row.id] = [row.root]
        for row, out, acc in zip(verifying, tree_outs, accepts, strict=True):
            row.calibration.observe(float(node_probs(row.tree).sum()), acc.tau - 1)
            row.proposer.observe(out.hidden, acc.accepted)
            new_tokens[row.id] = row.tree.tokens[acc.accepted[1:]].tolist() + [acc.bonus_token]
            row.root = acc.bonus_token
        clock.mark("commit")
        timing = clock.end(0)
        if self.auto is not None:
            self.auto.observe_step(timing.step_s, sum(int(s.tokens.shape[0]) for s in segments))
        made = 0
        for row in rows:
            result, joined = row.result, row in joining
            before = len(result.tokens)
            result.tokens.extend(new_tokens[row.id])
            stop = row.stop.scan(result.tokens, before)
            tau = len(result.tokens) - before
            made += tau
            if joined:
                result.prefill_s = timing.step_s
            else:
                result.steps.append(StepTimings(timing.step_s, dict(timing.stage_s), tau))
                result.taus.append(tau)
                result.tree_nodes.append(row.tree.n_nodes - 1)
            if row.request.on_commit is not None:
                row.request.on_commit(result.tokens[before:])
            if stop is not None:
                finished.append(self._leave(row, stop))
        trees = sum(r.tree.n_nodes for r in verifying)
        return BatchStep(
            len(rows), finished, timing.step_s, made, len(verifying), dict(timing.stage_s), trees
        )

    def abort(self) -> list[int]:
        """Drop every request, running or waiting, without results (a step failed under
        them); their ids. The rows are free for the next requests."""
        ids = [*self.running, *(i for i, _ in self.waiting)]
        for row in list(self.running.values()):
            del self.running[row.id]
            self.rows_target.release(row.slot)
            self._free.append(row.slot)
        self.waiting.clear()
        self._dropped = []
        return ids

    def _propose(self, rows: list[_Row], clock: StageClock) -> None:
        """Every row's tree. The rows whose drafters are forks of one draft in one
        forward (``DFlashDrafter.propose_many``), then each builds its tree; the others
        propose alone. Stamps draft, topk, build."""
        drafting = [
            r for r in rows
            if isinstance(r.proposer, BlockTreeProposer)
            and hasattr(r.proposer.drafter, "propose_many")
        ]  # fmt: skip
        together = [
            r for r in drafting if r.proposer.drafter.batches_with(drafting[0].proposer.drafter)
        ]
        if len(together) > 1:
            drafters = [r.proposer.drafter for r in together]
            contexts = [r.proposer.pending_context() for r in together]
            logits = type(drafters[0]).propose_many(drafters, contexts, [r.root for r in together])
            clock.mark("draft")
            for row, lg in zip(together, logits, strict=True):
                row.tree = row.proposer.tree(row.root, lg, clock)
        else:
            together = []
        for row in rows:
            if row not in together:
                row.tree = row.proposer.propose(row.root, clock)

    def _choose_budgets(self, joining: list[_Row], verifying: list[_Row]) -> None:
        """``--budget auto`` rows: each tree cut to the prefix the step's best share of
        verify tokens gives it (``ddtree.engine.budget.allocate``), the other rows' tokens
        counted as they are."""
        auto = [r for r in verifying if r.request.config.auto_budget]
        if not auto:
            return
        fixed = sum(r.tree.n_nodes for r in verifying if not r.request.config.auto_budget)
        if self.engine_mode == "eager":  # joining prompts share the forward
            fixed += sum(int(r.prompt.numel()) for r in joining)
        trees = self.auto.choose([r.tree for r in auto], [r.calibration for r in auto], fixed)
        for row, tree in zip(auto, trees, strict=True):
            row.tree = tree
            row.proposer.budget = next_build(tree.n_nodes - 1, row.request.config.tree_budget)

    def _verify_cost(self, buckets: tuple[int, ...]) -> VerifyCost:
        """Time a forward over W tokens spread over every row (all free now), at W = 1, 2,
        4, ... up to every row's widest tree (compiled: at its packed width buckets)."""
        rows, device = self.rows_target, self.device

        def forward(total: int) -> None:
            share = -(-total // self.max_rows)
            segments, left = [], total
            for slot in range(self.max_rows):
                m = min(share, left)
                if m:
                    tree = chain_tree(m, device)
                    segments.append(Segment(slot, tree.tokens, tree.depth, tree.visibility))
                left -= m
            rows.forward(segments)
            for slot in range(self.max_rows):
                rows.release(slot)

        widths = buckets or tuple(cost_widths(self.max_rows * self.width))
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        curve = measure_verify_cost(forward, widths, sync=sync)
        return VerifyCost(curve.tokens, curve.seconds, tuple(buckets))

    def _forward(self, segments: list[Segment]):
        """Eager: one forward. Compiled: the trees through the compiled graphs, prompts (no
        width bucket holds them) in an eager forward of their own first."""
        prompts = [s for s in segments if s.is_prompt]
        if self.engine_mode == "eager" or not prompts or len(prompts) == len(segments):
            return self.rows_target.forward(segments)
        trees = segments[len(prompts) :]
        return self.rows_target.forward(prompts) + self.rows_target.forward(trees)

    # --- rows joining and leaving ---------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and self._free:
            request_id, request = self.waiting.popleft()
            slot = self._free.pop()
            self.running[request_id] = self._start(request_id, slot, request)

    def _start(self, request_id: int, slot: int, request: BatchRequest) -> _Row:
        config = request.config
        drafter = request.drafter
        if drafter is None and config.rules.needs_drafter:
            drafter = self._drafters.get(slot)
            if drafter is None:
                drafter = self.drafter if not self._drafters else self.drafter.fork()
                self._drafters[slot] = drafter
        proposer = proposer_for(
            config.rules, drafter, config.block_size, config.budget, self.device
        )
        prompt = prompt_tensor(request.prompt_ids)
        plan = EnginePlan(
            self.engine_mode,
            config.width_buckets(),
            check_context(self.target, int(prompt.numel()), config),
            self.compile_scope,
            capture_layers=self.capture_layers,
        )
        compile_s = proposer.set_engine_mode(plan)  # resets the row's drafter state
        eos = (
            self.target.info.eos_token_ids if config.eos_token_ids is None else config.eos_token_ids
        )
        stop = StopCondition(
            config.max_new_tokens, frozenset(eos), config.stop_strings, self.tokenizer
        )
        sampler = sampler_for(
            config.temperature, config.top_k, config.top_p, config.seed, self.device
        )
        result = GenerationResult(tokens=[], text=None, taus=[], compile_s=compile_s)
        return _Row(request_id, slot, request, prompt, proposer, sampler, stop, result)

    def _cancelled(self) -> list[_Row]:
        return [r for r in self.running.values() if r.cancelled]

    def _leave(self, row: _Row, reason: str) -> tuple[int, GenerationResult]:
        del self.running[row.id]
        self.rows_target.release(row.slot)
        self._free.append(row.slot)
        row.result.stop_reason = reason
        if self.tokenizer is not None:
            row.result.text = self.tokenizer.decode(row.result.tokens)
        return row.id, row.result


def row_slots(prompt_len: int, config: DecodeConfig) -> int:
    """Cache slots a request's row needs: every token it may commit (the prompt and
    ``max_new_tokens``) and a whole verify tree written after them. Example: a prompt of 10,
    64 new tokens, DDTree N = 32 (33 tree tokens) -> 107."""
    return prompt_len + config.max_new_tokens + max(config.width_buckets())


def _tree_segment(slot: int, tree: DraftTree, device: torch.device) -> Segment:
    return Segment(slot, tree.tokens.to(device), tree.depth.to(device), tree.visibility.to(device))


def _doublings(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``, and ``n``. Example: 6 -> [1, 2, 4, 6]."""
    out = [1]
    while out[-1] * 2 < n:
        out.append(out[-1] * 2)
    return sorted({*out, n})
