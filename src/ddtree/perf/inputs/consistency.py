"""Do the records a command combines describe the same workload and setup? ``ddtree tune``
calibrates on engine runs and replays tau from a trace, ``ddtree diagnose`` divides one run
by another, ``ddtree estimate --records`` fits a profile to runs: each says in one line what
differs among its records (prompts, max new tokens, threads, device, dtype, hardware,
target, drafter), so a difference the user did not mean is not read as the model's error.

What a command compares on purpose (policy, block size, budget, engine mode, TP, sampling)
is not checked. A setting a record does not carry (``threads`` before engine_run records
stored it) is not compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ddtree.records import Acceptance, BenchBandwidth, EngineRun, Record


@dataclass(frozen=True)
class PromptSet:
    """A run's prompts as the records know them: their lengths in tokens."""

    lengths: tuple[int, ...]

    def __str__(self) -> str:
        return f"{len(self.lengths)} prompts, {sum(self.lengths)} tok"

    def detailed(self) -> str:
        """For two sets of equal count and total: the lengths themselves."""
        shown = ", ".join(map(str, self.lengths[:8]))
        return f"{self} ({shown}{', ...' if len(self.lengths) > 8 else ''})"


def _prompts(lengths: Sequence[int]) -> PromptSet | None:
    return PromptSet(tuple(lengths)) if lengths else None


def _name(model: dict | None) -> str | None:
    return None if not model else str(model.get("name", "")) or None


# setting -> what each record kind says of it (None: the record does not say)
SETTINGS: dict[str, dict[type, Callable[[Record], object]]] = {
    "prompts": {
        EngineRun: lambda r: _prompts(r.prompt_lengths),
        Acceptance: lambda r: _prompts(r.prompt_lengths),
    },
    "max new tokens": {
        EngineRun: lambda r: r.max_new_tokens or None,
        Acceptance: lambda r: r.max_new_tokens,
    },
    "threads": {EngineRun: lambda r: r.threads, BenchBandwidth: lambda r: r.threads},
    "device": {EngineRun: lambda r: r.device, BenchBandwidth: lambda r: r.device},
    "dtype": {EngineRun: lambda r: r.dtype},
    "hardware": {EngineRun: lambda r: r.hardware.label, BenchBandwidth: lambda r: r.hardware.label},
    "target": {EngineRun: lambda r: _name(r.target), Acceptance: lambda r: _name(r.target)},
    "drafter": {EngineRun: lambda r: _name(r.drafter), Acceptance: lambda r: _name(r.drafter)},
}


@dataclass(frozen=True)
class Difference:
    setting: str
    values: dict[str, list[str]]  # value -> the records that hold it ("A", "engine_run", ...)

    def describe(self) -> str:
        parts = []
        for value, who in self.values.items():
            kinds = {w: who.count(w) for w in dict.fromkeys(who)}
            held = ", ".join(f"{n} {w}" if n > 1 else w for w, n in kinds.items())
            parts.append(f"{value} ({held})")
        return f"{self.setting} {' vs '.join(parts)}"


def differences(records: Sequence[tuple[str, Record]]) -> list[Difference]:
    """The settings on which the (label, record) pairs disagree, in ``SETTINGS`` order; a
    record that does not say a setting is left out of that one."""
    out = []
    for setting, getters in SETTINGS.items():
        held: dict[object, list[str]] = {}
        for label, record in records:
            get = getters.get(type(record))
            value = None if get is None else get(record)
            if value is not None:
                held.setdefault(value, []).append(label)
        if len(held) > 1:
            shown = {v: str(v) for v in held}
            if len(set(shown.values())) < len(shown):  # equal in brief: say more
                shown = {v: getattr(v, "detailed", lambda v=v: repr(v))() for v in held}
            out.append(Difference(setting, {shown[v]: who for v, who in held.items()}))
    return out


def mismatch_warning(what: str, records: Sequence[tuple[str, Record]], why: str) -> str | None:
    """One line naming what differs among ``records`` (None when nothing does): "``what``
    differ in threads 1 (bench_bandwidth) vs 2 (6 engine_run); ...: ``why``"."""
    found = differences(records)
    if not found:
        return None
    return f"{what} differ in {'; '.join(d.describe() for d in found)}: {why}"
