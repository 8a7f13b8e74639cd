"""Measured acceptance for the estimator: tau at a (policy, block size, budget) from
``acceptance`` records (``ddtree replay tau``), with its bootstrap interval as the range.

A scenario case takes it with ``tau = { records = "runs/acc.jsonl" }`` (optionally
``trace = "trace:..."`` when the file holds several traces); ``ddtree tune`` takes every
budget a file holds. The value is labelled measured, with the trace's fingerprint.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddtree.perf.scenario import Range, ScenarioError, Value
from ddtree.records import Acceptance, Policy, RecordError, read_records


@dataclass(frozen=True)
class MeasuredTau:
    policy: Policy
    block_size: int
    budget: int
    mean: float
    low: float  # bootstrap interval over prompts
    high: float
    interval: float  # its central mass
    trace: str  # the trace's fingerprint
    target: str
    drafter: str
    prompts: int
    steps: int
    source: str  # the records file

    @property
    def value(self) -> Value:
        """A triangular range (low, mean, high), or the mean when the interval is a point."""
        if self.high > self.low:
            return Range(self.low, self.high, self.mean)
        return self.mean

    @property
    def label(self) -> str:
        return (
            f"measured: replayed greedy acceptance, {self.trace} ({self.prompts} prompts, "
            f"{self.steps} steps; target {self.target}, drafter {self.drafter}); range = "
            f"{self.interval:.0%} bootstrap interval over prompts, mode = mean; {self.source}"
        )


def from_record(r: Acceptance, source: str) -> MeasuredTau:
    return MeasuredTau(
        policy=Policy(r.policy),
        block_size=r.block_size,
        budget=r.budget,
        mean=r.mean_tau,
        low=min(r.tau_low, r.mean_tau),
        high=max(r.tau_high, r.mean_tau),
        interval=r.interval,
        trace=r.trace,
        target=str(r.target.get("name", "?")),
        drafter=str(r.drafter.get("name", "?")),
        prompts=r.prompts,
        steps=r.steps,
        source=source,
    )


def read_acceptance(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[MeasuredTau]:
    """Every acceptance record of the files (or folders); an error when there is none."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out = []
    for path in paths:
        try:
            records = read_records(path, kind="acceptance")
        except RecordError as exc:
            raise ScenarioError(str(exc)) from None
        out.extend(from_record(r, str(path)) for r in records)
    if not out:
        raise ScenarioError(
            f"{', '.join(map(str, paths))}: no acceptance records (write them with "
            "`ddtree replay tau TRACE --records FILE`)"
        )
    return out


def choose_trace(
    measured: Sequence[MeasuredTau], trace: str | None, where: str
) -> list[MeasuredTau]:
    """The records of one trace: ``trace`` when given, else the only one there is."""
    traces = sorted({m.trace for m in measured})
    if trace is not None:
        if trace not in traces:
            raise ScenarioError(f"{where}: trace {trace!r} not in the records; they hold {traces}")
        return [m for m in measured if m.trace == trace]
    if len(traces) > 1:
        raise ScenarioError(
            f"{where}: the records hold {len(traces)} traces {traces}; choose one with "
            'trace = "..." (or --trace)'
        )
    return list(measured)


def find_tau(
    measured: Sequence[MeasuredTau], policy: Policy, block_size: int, budget: int, where: str
) -> MeasuredTau:
    """The record at exactly this configuration (the last one when repeated)."""
    hits = [
        m
        for m in measured
        if (m.policy, m.block_size, m.budget) == (Policy(policy), block_size, budget)
    ]
    if not hits:
        have = sorted({(str(m.policy), m.block_size, m.budget) for m in measured})
        raise ScenarioError(
            f"{where}: no acceptance record for {policy} at block {block_size}, budget {budget}; "
            f"the records hold (policy, block, budget) {have}"
        )
    return hits[-1]


def tau_from_records(
    spec: dict, policy: Policy, block_size: int, budget: int, base_dir: Path, where: str
) -> MeasuredTau:
    """A scenario's ``tau = { records = "...", trace = "..." }`` at the case's configuration."""
    extra = set(spec) - {"records", "trace"}
    if extra or "records" not in spec:
        raise ScenarioError(
            f'{where}: a measured tau is {{ records = "acc.jsonl" }} with an optional '
            f'trace = "trace:..."; got fields {sorted(spec)}'
        )
    path = Path(str(spec["records"]))
    if not path.is_absolute():
        path = base_dir / path
    measured = choose_trace(read_acceptance(path), spec.get("trace"), where)
    return find_tau(measured, policy, block_size, budget, where)
