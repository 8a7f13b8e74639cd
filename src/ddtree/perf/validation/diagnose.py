"""Where did the tokens/s go? Attribute the ratio of two engine runs to tau and to each
timed stage, and within a stage to context length where the runs' contexts differ.

Terms (measured, from ``engine_run`` records A and B):

    tokens/s = tau / step_s      (pooled over steps: sum(tau) / sum(step_s))
    tps_B / tps_A = (tau_B / tau_A) x (step_A / step_B)
    step_B / step_A = 1 + sum over stages s of (stage_B[s] - stage_A[s]) / step_A

so each stage's *share* ``(stage_B[s] - stage_A[s]) / step_A`` adds up to the step-time
change. When the steps carry their context length (``points[i].context_len``), each stage's
difference is split further by one least-squares fit over both runs' steps,
``stage_s = a + b * context + c * [step of B]``: context length accounts for
``b * (mean context B - mean context A)``, the rest (``c``) is what changed at equal context.
With an intercept and a per-run indicator the fitted means equal the runs' means, so the two
parts add up to the difference exactly. The seed's regression hunt is the use: "32 tok/s at
5k context vs the expected 138".

Worked example: A: tau 4.0, step 20 ms (verify 12, draft 5, other 3); B: tau 3.0, step 30 ms
(verify 21, draft 5, other 4). tps 200 -> 100: ratio 0.5 = tau 0.75 x step 0.667; step ratio
1.5 = 1 + verify 0.45 + draft 0 + other 0.05.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree.perf.inputs.consistency import mismatch_warning
from ddtree.records import EngineRun
from ddtree.vocab import STEP_STAGES, Stage

CONTEXT_KEY = "context_len"  # per-step key of engine_run points: the root's position


class DiagnoseError(ValueError):
    """Records that cannot be compared; the message names the file and what is missing."""


@dataclass
class RunView:
    """One engine run as diagnose sees it."""

    label: str  # "A" / "B"
    source: str  # file (and record) it came from
    policy: str
    block_size: int
    budget: int
    mean_tau: float
    step_s: float  # mean seconds per step
    stage_s: dict[Stage, float]  # mean seconds per step by stage
    steps: int
    mean_context: float | None  # mean context length over steps, when the points carry it

    @property
    def tokens_per_s(self) -> float:
        return self.mean_tau / self.step_s


@dataclass
class StageShare:
    stage: Stage
    a_s: float  # mean seconds per step in A
    b_s: float  # ... in B
    share: float  # (b_s - a_s) / step_A: its part of step_B / step_A - 1
    context_s: float | None  # part of b_s - a_s from context length (None: not separable)
    other_s: float | None  # the rest, at equal context
    context_slope_s: float | None  # seconds per extra context token (the fit's b)


@dataclass
class Diagnosis:
    a: RunView
    b: RunView
    tokens_per_s_ratio: float  # tps_B / tps_A
    tau_ratio: float  # tau_B / tau_A
    step_ratio: float  # step_A / step_B: the step-time factor of the tokens/s ratio
    stages: list[StageShare]
    context_note: str  # why the context split is absent, or ""


def run_view(record: EngineRun, label: str, source: str) -> RunView:
    points = record.points
    contexts = [p.get(CONTEXT_KEY) for p in points]
    have = bool(points) and all(isinstance(c, (int, float)) for c in contexts)
    return RunView(
        label=label,
        source=source,
        policy=record.policy,
        block_size=record.block_size,
        budget=record.budget,
        mean_tau=record.mean_tau,
        step_s=record.step_s_mean,
        stage_s={s: float(record.stage_s_mean.get(s, 0.0)) for s in STEP_STAGES},
        steps=record.steps,
        mean_context=float(np.mean(contexts)) if have else None,
    )


def _context_split(a: EngineRun, b: EngineRun, stage: Stage) -> tuple[float, float, float]:
    """(context part, other part, slope) of stage B - stage A from one fit over all steps."""
    rows = [(p[CONTEXT_KEY], 0.0, p["stage_s"].get(stage, 0.0)) for p in a.points]
    rows += [(p[CONTEXT_KEY], 1.0, p["stage_s"].get(stage, 0.0)) for p in b.points]
    data = np.asarray(rows, dtype=np.float64)  # [steps, 3]: context, is_b, seconds
    design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    (_, slope, shift), *_ = np.linalg.lstsq(design, data[:, 2], rcond=None)
    gap = data[data[:, 1] == 1, 0].mean() - data[data[:, 1] == 0, 0].mean()
    return float(slope * gap), float(shift), float(slope)


def _separable(a: EngineRun, b: EngineRun) -> str:
    """ "" when context length can be separated from the rest, else why not."""
    for run, label in ((a, "A"), (b, "B")):
        if not run.points or not all(CONTEXT_KEY in p for p in run.points):
            return f"run {label}'s steps do not carry {CONTEXT_KEY}: no split by context length"
        if not all(isinstance(p.get("stage_s"), dict) for p in run.points):
            return f"run {label}'s steps do not carry stage_s: no split by context length"
    within = [
        np.ptp([p[CONTEXT_KEY] for p in run.points]) > 0 for run in (a, b) if len(run.points) > 1
    ]
    if not any(within):
        return "context length does not vary within either run: its effect is not identifiable"
    return ""


def diagnose(a: EngineRun, b: EngineRun, source_a: str = "A", source_b: str = "B") -> Diagnosis:
    """Attribute tokens/s of run B relative to run A (see the module docstring)."""
    va, vb = run_view(a, "A", source_a), run_view(b, "B", source_b)
    note = _separable(a, b)
    stages = []
    for stage in STEP_STAGES:
        delta = vb.stage_s[stage] - va.stage_s[stage]
        context = other = slope = None
        if not note:
            context, other, slope = _context_split(a, b, stage)
        stages.append(
            StageShare(
                stage,
                va.stage_s[stage],
                vb.stage_s[stage],
                delta / va.step_s,
                context,
                other,
                slope,
            )
        )
    return Diagnosis(
        a=va,
        b=vb,
        tokens_per_s_ratio=vb.tokens_per_s / va.tokens_per_s,
        tau_ratio=vb.mean_tau / va.mean_tau,
        step_ratio=va.step_s / vb.step_s,
        stages=stages,
        context_note=note,
    )


def _key(r: EngineRun) -> tuple:
    return (r.policy, r.block_size, r.budget)


def pair_runs(
    runs_a: Sequence[EngineRun], runs_b: Sequence[EngineRun], where_a: str, where_b: str
) -> list[tuple[EngineRun, EngineRun]]:
    """Pairs to compare: records of equal (policy, block size, budget), in A's order (the
    last record of a configuration in each file); one record each: those two, whatever their
    configurations."""
    if not runs_a or not runs_b:
        empty = where_a if not runs_a else where_b
        raise DiagnoseError(
            f"{empty}: no engine_run records (write them with `ddtree bench engine`)"
        )
    if len(runs_a) == 1 and len(runs_b) == 1:
        return [(runs_a[0], runs_b[0])]
    last_b = {_key(r): r for r in runs_b}
    pairs = [
        (r, last_b[_key(r)]) for r in {_key(r): r for r in runs_a}.values() if _key(r) in last_b
    ]
    if not pairs:
        have_a = sorted({_key(r) for r in runs_a})
        have_b = sorted({_key(r) for r in runs_b})
        raise DiagnoseError(
            f"no (policy, block size, budget) in both files: {where_a} has {have_a}, "
            f"{where_b} has {have_b}; pick one record each with --policy/--budget"
        )
    return pairs


def pair_warning(a: EngineRun, b: EngineRun) -> str | None:
    """One line when A and B differ in workload or setup beyond what a diagnosis compares
    (prompts, max new tokens, threads, device, dtype, hardware, target, drafter)."""
    return mismatch_warning(
        "A and B", [("A", a), ("B", b)],
        "the ratio includes what that changes (ignore this if it is the comparison you meant)",
    )  # fmt: skip


def select(runs: Sequence[EngineRun], policy: str | None, budget: int | None) -> list[EngineRun]:
    return [
        r
        for r in runs
        if (policy is None or r.policy == policy) and (budget is None or r.budget == budget)
    ]


def to_json(d: Diagnosis) -> dict:
    """A JSON-ready dict (stages by name; every figure measured or derived from measured)."""

    def view(v: RunView) -> dict:
        return {
            "source": v.source,
            "policy": v.policy,
            "block_size": v.block_size,
            "budget": v.budget,
            "tokens_per_s": v.tokens_per_s,
            "mean_tau": v.mean_tau,
            "step_s": v.step_s,
            "steps": v.steps,
            "mean_context": v.mean_context,
            "stage_s": {str(k): x for k, x in v.stage_s.items()},
        }

    return {
        "a": view(d.a),
        "b": view(d.b),
        "tokens_per_s_ratio": d.tokens_per_s_ratio,
        "tau_ratio": d.tau_ratio,
        "step_ratio": d.step_ratio,
        "stages": [
            {
                "stage": str(s.stage),
                "a_s": s.a_s,
                "b_s": s.b_s,
                "share_of_step_a": s.share,
                "context_s": s.context_s,
                "other_s": s.other_s,
                "context_slope_s_per_token": s.context_slope_s,
            }
            for s in d.stages
        ],
        "context_note": d.context_note,
    }
