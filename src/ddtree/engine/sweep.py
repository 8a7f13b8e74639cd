"""Run several decode configurations over one prompt set and summarise them side by side.

Used by ``ddtree demo`` and ``ddtree bench engine``: the same prompts, the same models, one
run, so the ratios between configurations (speedup over AR, overhead share) are measured
under the same machine load. The configurations take turns on every prompt (prompt-major),
so that load drifting on a shared machine during the run hits every configuration alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from ddtree.engine.loop import DecodeConfig, GenerationResult, generate
from ddtree.engine.runrecord import summarize
from ddtree.models.base import Drafter, Target
from ddtree.vocab import AR


@dataclass
class SweepPoint:
    config: DecodeConfig
    results: list[GenerationResult]  # one per prompt, in prompt order
    summary: dict  # ``summarize(results)``: mean_tau, tokens_per_s, stage_s_mean, ...
    # greedy output equals the AR run's in the same engine mode; None without AR / sampled
    identical_to_ar: bool | None
    concurrency: int = 1  # requests decoded together (C); tokens_per_s is then all rows'


def sweep_rounds(
    target: Target,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    configs: Sequence[DecodeConfig],
    tokenizer=None,
    on_result: Callable[[DecodeConfig, int, GenerationResult], None] | None = None,
    warmup_tokens: int = 8,
    on_warmup: Callable[[DecodeConfig], None] | None = None,
) -> Iterator[list[SweepPoint]]:
    """Decode every prompt under every config, the configs taking turns on each prompt; after
    each prompt (a round: every config decoded it), yield the points over the prompts so far.
    A caller that stops early (an interrupt) keeps the last round's points: every config over
    the same prompts, so their ratios stay comparable.

    ``on_result(config, prompt_index, result)`` is called after each generation, for a
    round's last generation only once the caller holds that round (progress bars; a synthetic oracle drafter learns its reference from the AR result, which comes
    first on each prompt when AR is listed first). A short untimed warm-up per config first
    (``on_warmup(config)`` before each); in compiled mode it compiles the config's graphs, and
    ``summary["compile_s"]`` says how long that took (never part of a step)."""
    if not prompts:
        raise ValueError("no prompts to decode")
    compile_s = []  # generate ignores the drafter under a policy that needs none (ar)
    for config in configs:
        if on_warmup is not None:
            on_warmup(config)
        warm = replace(config, max_new_tokens=min(warmup_tokens, config.max_new_tokens))
        compile_s.append(generate(target, drafter, prompts[0], warm, tokenizer).compile_s)
    results: list[list[GenerationResult]] = [[] for _ in configs]
    last = len(configs) - 1
    for i, prompt in enumerate(prompts):
        for k, (config, out) in enumerate(zip(configs, results, strict=True)):
            out.append(generate(target, drafter, prompt, config, tokenizer))
            if k == last:  # yielded before it is announced: a progress line that counts
                yield _points(configs, results, compile_s)  # the round means it is kept
            if on_result is not None:
                on_result(config, i, out[-1])


def sweep(
    target: Target,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    configs: Sequence[DecodeConfig],
    tokenizer=None,
    on_result: Callable[[DecodeConfig, int, GenerationResult], None] | None = None,
    warmup_tokens: int = 8,
    on_warmup: Callable[[DecodeConfig], None] | None = None,
) -> list[SweepPoint]:
    """``sweep_rounds`` to the end: the points over every prompt."""
    rounds = sweep_rounds(
        target, drafter, prompts, configs, tokenizer, on_result, warmup_tokens, on_warmup
    )
    return deque(rounds, maxlen=1)[0]


def sweep_batched(
    target: Target,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    configs: Sequence[DecodeConfig],
    concurrency: Sequence[int],
    tokenizer=None,
    on_result: Callable[[DecodeConfig, int, GenerationResult], None] | None = None,
    on_warmup: Callable[[DecodeConfig], None] | None = None,
    drafter_for: Callable[[DecodeConfig, int], Drafter | None] | None = None,
) -> Iterator[list[SweepPoint]]:
    """Every config at every concurrency C (``ddtree.engine.batch``: C requests decoded
    together, the next prompt joining as one finishes); after each (C, config), yield the
    points so far. A point's figures are its steady state (:func:`steady_state`): tokens/s
    over all C rows, a batched step's mean and stages, tau per row. An untimed warm-up per
    (C, config) first (compiles, in compiled mode). ``drafter_for(config, i)``: prompt i's
    own drafter state (a synthetic oracle that must follow its prompt), or None for a fork of
    the engine's drafter."""
    from ddtree.engine.batch import BatchEngine, BatchRequest, row_slots

    if not prompts:
        raise ValueError("no prompts to decode")
    points: list[SweepPoint] = []
    for c in concurrency:
        for config in configs:
            if on_warmup is not None:
                on_warmup(config)
            engine = BatchEngine(
                target, drafter if config.rules.needs_drafter else None, max_rows=c,
                row_capacity=max(row_slots(len(p), config) for p in prompts),
                engine_mode=config.engine_mode, width=max(config.width_buckets()),
                compile_scope=config.compile_scope, tokenizer=tokenizer,
                profile_stages=config.profile_stages, auto_budget=config.auto_budget,
            )  # fmt: skip
            warm = replace(config, max_new_tokens=min(8, config.max_new_tokens))
            compile_s = engine.compile_s
            compile_s += sum(
                r.compile_s for r in engine.run([BatchRequest(prompts[0], warm)] * min(c, 2))
            )
            steps = []
            own = drafter_for or (lambda config, i: None)  # a request's own drafter state
            requests = [
                BatchRequest(p, config, drafter=own(config, i)) for i, p in enumerate(prompts)
            ]
            results = engine.run(requests, steps.append)
            if on_result is not None:
                for i, result in enumerate(results):
                    on_result(config, i, result)
            summary = summarize(results)
            summary.update(steady_state(steps, c))
            summary["compile_s"] = compile_s
            points.append(SweepPoint(config, results, summary, None, c))
            _compare_with_ar(points)
            yield list(points)


def steady_state(steps: Sequence, rows: int) -> dict:
    """The figures of a batched run at ``rows`` requests (``BatchStep``s): over the steps
    where all ``rows`` rows decode and none joins (every decode step when there are none:
    fewer prompts than rows), so that tokens/s = rows x tau / step holds as the estimator
    reads a record at concurrency ``rows``. Example: steps of 4, 4, 3 decoding rows at C = 4
    -> the first two."""
    decoding = [s for s in steps if s.decoding]
    steady = [s for s in decoding if s.decoding == s.rows == rows] or decoding
    wall_s = sum(s.step_s for s in steady)
    tokens = sum(s.tokens for s in steady)
    n_rows = sum(s.decoding for s in steady)
    stages = steady[0].stage_s.keys()
    return {
        "tokens_per_s": tokens / wall_s,
        "step_s_mean": wall_s / len(steady),
        "mean_tau": tokens / n_rows,
        "rows_mean": n_rows / len(steady),
        "tree_nodes_mean": sum(s.tree_tokens for s in steady) / n_rows - 1,  # per row
        "stage_s_mean": {k: sum(s.stage_s[k] for s in steady) / len(steady) for k in stages},
        "steps": len(steady),
    }


def _points(configs, results, compile_s) -> list[SweepPoint]:
    points = []
    for config, out, warm_s in zip(configs, results, compile_s, strict=True):
        summary = summarize(out)
        summary["compile_s"] = warm_s + sum(r.compile_s for r in out)
        points.append(SweepPoint(config, list(out), summary, None))
    _compare_with_ar(points)
    return points


def _compare_with_ar(points: list[SweepPoint]) -> None:
    """Greedy points get ``identical_to_ar`` from an AR point with the same stop settings and
    engine mode."""
    for point in points:
        c = point.config
        if not c.greedy:
            continue
        for ar in points:
            a = ar.config
            comparable = (a.max_new_tokens, a.stop_strings, a.eos_token_ids, a.engine_mode) == (
                c.max_new_tokens,
                c.stop_strings,
                c.eos_token_ids,
                c.engine_mode,
            ) and ar.concurrency == point.concurrency
            if a.rules is AR and a.greedy and comparable:
                point.identical_to_ar = all(
                    r.tokens == b.tokens for r, b in zip(point.results, ar.results, strict=True)
                )
                break


def speedups(points: Sequence[SweepPoint]) -> dict[int, float | None]:
    """tokens/s of each point over the first AR point's in the same engine mode and at the
    same concurrency (a speedup vs AR is on the same hardware, engine mode and load);
    index -> ratio, None without."""
    base: dict[tuple[str, int], float] = {}
    for p in points:
        if p.config.rules is AR:
            base.setdefault((p.config.engine_mode, p.concurrency), p.summary["tokens_per_s"])
    return {
        i: (p.summary["tokens_per_s"] / base[key])
        if (key := (p.config.engine_mode, p.concurrency)) in base
        else None
        for i, p in enumerate(points)
    }
