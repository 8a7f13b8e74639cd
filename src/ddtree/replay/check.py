"""Exactness of replay against the engine: decode the trace's prompts with
``ddtree.engine.generate`` and replay every engine step at the engine's own root position.

A replayed step can differ only where float rounding differs between the engine's forwards
(the drafter over the committed context, the target's tree verify) and the recording's (the
greedy pass, the batched drafter), enough to reorder two of the drafter's candidates that
matter to the tree. Comparing each engine step at its own position counts such steps one by
one, instead of once per run from the first divergence on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ddtree.engine import DecodeConfig, generate
from ddtree.replay.simulate import PromptReplayer, budgets_by_policy
from ddtree.replay.trace import Trace


@dataclass
class RunCheck:
    prompt: int
    policy: str
    budget: int
    steps: int  # engine steps
    mismatched: list[int] = field(default_factory=list)  # engine step indices tau differs
    lossless: bool = True  # the engine's tokens equal the trace's greedy continuation
    walk_equal: bool = True  # the sweep's walk (trees shared across budgets) gives its taus


@dataclass
class ExactnessReport:
    runs: list[RunCheck]

    @property
    def steps(self) -> int:
        return sum(r.steps for r in self.runs)

    @property
    def mismatched_steps(self) -> int:
        return sum(len(r.mismatched) for r in self.runs)

    @property
    def mismatch_rate(self) -> float:
        return self.mismatched_steps / self.steps if self.steps else 0.0

    @property
    def lossless(self) -> bool:
        return all(r.lossless for r in self.runs)

    @property
    def walks_equal(self) -> bool:
        return all(r.walk_equal for r in self.runs)


def check_against_engine(
    trace: Trace,
    target,
    drafter,
    policies: Sequence[str] = ("chain", "ddtree"),
    budgets: Sequence[int] = (1, 4, 16, 64),
    prompts: Sequence[int] | None = None,
    on_run: Callable[[RunCheck], None] | None = None,
) -> ExactnessReport:
    """Decode prompts ``prompts`` (indices; None: all) of ``trace`` with the engine for every
    (policy, budget) point; compare each engine step's tau with the step replayed at its
    position and budget, and each run's taus with the sweep's walk (shared trees)."""
    header = trace.header
    if drafter.block_size != header.block_size:
        raise ValueError(
            f"the drafter's block_size {drafter.block_size} != the trace's {header.block_size}"
        )
    runs = []
    indices = range(len(header.prompts)) if prompts is None else prompts
    for policy, ns in budgets_by_policy(trace, policies, budgets).items():
        for i in indices:
            info = header.prompts[i]
            sequence = trace.sequence(i)
            replayer = PromptReplayer(trace, i, policy)
            walks = replayer.run(ns)
            for budget, walk in zip(ns, walks, strict=True):
                config = DecodeConfig(
                    policy,
                    block_size=header.block_size,
                    budget=budget,
                    max_new_tokens=header.max_new_tokens,
                    eos_token_ids=tuple(header.eos_token_ids),
                )
                out = generate(target, drafter, sequence[: info.prompt_tokens], config)
                run = RunCheck(i, policy, budget, len(out.taus))
                run.lossless = out.tokens == sequence[info.prompt_tokens :].tolist()
                run.walk_equal = walk.taus.tolist() == out.taus
                if run.lossless:
                    p = info.prompt_tokens
                    for s, tau in enumerate(out.taus):
                        if replayer.step(p, budget) != tau:
                            run.mismatched.append(s)
                        p += tau
                runs.append(run)
                if on_run is not None:
                    on_run(run)
    return ExactnessReport(runs)
