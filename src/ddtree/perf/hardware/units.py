"""Quantities with units, as written in scenario files: ``"8 TB/s"``, ``"14.5 ms"``, ``"303 tok/s"``.

A ``Quantity`` is a float in SI base units (seconds, bytes, FLOP, tokens, steps) and a
``Dim``: the exponent of each base unit. Decimal prefixes are SI (``T`` is 1e12, never
2**40); binary prefixes only where spelled (``GiB`` is 2**30 bytes, as nvidia-smi prints).

Worked example: ``parse_quantity("1.8 TB/s", BANDWIDTH)`` is ``1.8e12`` bytes per second;
``parse_quantity("3.3 ms/tok", STEP_TIME)`` is an error (per token, where per step is meant:
step time = per-token latency x tau).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

BASES = ("s", "B", "FLOP", "tok", "step")


class UnitError(ValueError):
    """A quantity that cannot be parsed, or has the wrong dimension."""


@dataclass(frozen=True)
class Dim:
    """Exponents of (s, B, FLOP, tok, step)."""

    s: int = 0
    B: int = 0
    FLOP: int = 0
    tok: int = 0
    step: int = 0

    def _vec(self) -> tuple[int, ...]:
        return (self.s, self.B, self.FLOP, self.tok, self.step)

    def __mul__(self, other: Dim) -> Dim:
        return Dim(*(a + b for a, b in zip(self._vec(), other._vec(), strict=True)))

    def __truediv__(self, other: Dim) -> Dim:
        return Dim(*(a - b for a, b in zip(self._vec(), other._vec(), strict=True)))

    def __str__(self) -> str:
        num = [
            b if e == 1 else f"{b}^{e}" for b, e in zip(BASES, self._vec(), strict=True) if e > 0
        ]
        den = [
            b if e == -1 else f"{b}^{-e}" for b, e in zip(BASES, self._vec(), strict=True) if e < 0
        ]
        text = "*".join(num) or "1"
        return text + ("/" + "/".join(den) if den else "")


NUMBER = Dim()
TIME = Dim(s=1)
BYTES = Dim(B=1)
FLOPS = Dim(FLOP=1)
TOKENS = Dim(tok=1)
BANDWIDTH = Dim(B=1, s=-1)
FLOP_RATE = Dim(FLOP=1, s=-1)
TOKEN_RATE = Dim(tok=1, s=-1)
STEP_TIME = Dim(s=1, step=-1)
TOKENS_PER_STEP = Dim(tok=1, step=-1)
PER_TOKEN_TIME = Dim(s=1, tok=-1)

# What each dimension is called in error messages, with an example the user can copy.
DIM_NAMES: dict[Dim, tuple[str, str]] = {
    NUMBER: ("a plain number", "0.7"),
    TIME: ("a time", "14.5 ms"),
    BYTES: ("a size in bytes", "96 GB"),
    FLOPS: ("an amount of FLOP", "2 TFLOP"),
    TOKENS: ("a token count", "2048 tok"),
    BANDWIDTH: ("a bandwidth", "8 TB/s"),
    FLOP_RATE: ("a FLOP rate", "2.25 PFLOP/s"),
    TOKEN_RATE: ("a token rate", "303 tok/s"),
    STEP_TIME: ("a time per step", "14.5 ms"),
    TOKENS_PER_STEP: ("tokens per step", "4.4"),
    PER_TOKEN_TIME: ("a time per token", "3.3 ms/tok"),
}

PREFIXES: dict[str, float] = {
    "": 1.0,
    "n": 1e-9,
    "u": 1e-6,
    "µ": 1e-6,
    "μ": 1e-6,
    "m": 1e-3,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
}

# unit symbol -> (factor, dim). FLOPS means FLOP/s (as in "989 TFLOPS"); OPS likewise.
UNITS: dict[str, tuple[float, Dim]] = {
    "s": (1.0, TIME),
    "sec": (1.0, TIME),
    "min": (60.0, TIME),
    "h": (3600.0, TIME),
    "B": (1.0, BYTES),
    "byte": (1.0, BYTES),
    "bytes": (1.0, BYTES),
    "bit": (0.125, BYTES),
    "FLOP": (1.0, FLOPS),
    "OP": (1.0, FLOPS),
    "FLOPS": (1.0, FLOP_RATE),
    "OPS": (1.0, FLOP_RATE),
    "tok": (1.0, TOKENS),
    "token": (1.0, TOKENS),
    "tokens": (1.0, TOKENS),
    "step": (1.0, Dim(step=1)),
    "steps": (1.0, Dim(step=1)),
}

_NUM = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(.*?)\s*$")


@dataclass(frozen=True)
class Quantity:
    value: float  # in SI base units
    dim: Dim

    def __str__(self) -> str:
        return format_quantity(self.value, self.dim)


def _unit_term(term: str, text: str) -> tuple[float, Dim]:
    if term in UNITS:
        return UNITS[term]
    for plen in (2, 1):
        prefix, base = term[:plen], term[plen:]
        if prefix in PREFIXES and base in UNITS and base not in ("min", "h"):
            factor, dim = UNITS[base]
            return PREFIXES[prefix] * factor, dim
    hint = ""
    if term.endswith("b") and term[:-1] in PREFIXES:
        hint = " (lower-case b is bits: write 'Gbit' for bits or 'GB' for bytes)"
    raise UnitError(f"unknown unit {term!r} in {text!r}{hint}")


def parse_unit(unit: str, text: str | None = None) -> tuple[float, Dim]:
    """``"TB/s"`` -> (1e12, B/s). Products with ``*`` or a space, one or more ``/``."""
    text = unit if text is None else text
    unit = unit.strip()
    if not unit:
        return 1.0, NUMBER
    factor, dim = 1.0, NUMBER
    parts = unit.split("/")
    for i, part in enumerate(parts):
        terms = [t for t in re.split(r"[*\s·]+", part.strip()) if t]
        if not terms:
            raise UnitError(f"malformed unit in {text!r}")
        for term in terms:
            f, d = _unit_term(term, text)
            if i == 0:
                factor, dim = factor * f, dim * d
            else:
                factor, dim = factor / f, dim / d
    return factor, dim


def parse(text: str | int | float) -> Quantity:
    """Parse ``"8 TB/s"`` or a bare number into a Quantity (no dimension check)."""
    if isinstance(text, bool):
        raise UnitError(f"expected a number or a quantity, got {text!r}")
    if isinstance(text, (int, float)):
        return Quantity(float(text), NUMBER)
    if not isinstance(text, str):
        raise UnitError(f"expected a number or a quantity string, got {type(text).__name__}")
    m = _NUM.match(text)
    if not m:
        raise UnitError(f"cannot read {text!r} as a number with a unit (like '8 TB/s')")
    unit = m.group(2)
    if unit == "%":
        return Quantity(float(m.group(1)) / 100.0, NUMBER)
    factor, dim = parse_unit(unit, text)
    return Quantity(float(m.group(1)) * factor, dim)


def _describe(dim: Dim) -> str:
    name, example = DIM_NAMES.get(dim, (f"a quantity in {dim}", ""))
    return f"{name} (like '{example}')" if example else name


def parse_quantity(text: str | int | float, expect: Dim, where: str) -> float:
    """Parse and check the dimension; returns the value in SI base units.

    A bare number is taken in base units only where ``expect`` is dimensionless or a count
    per step (tau); elsewhere a unit is required. ``STEP_TIME`` accepts a plain time
    (``"14.5 ms"``, implicitly per step) or ``"14.5 ms/step"``, and rejects per-token times.
    """
    try:
        q = parse(text)
    except UnitError as exc:
        raise UnitError(f"{where}: {exc}; expected {_describe(expect)}") from None
    dim = q.dim
    if expect in (STEP_TIME, TOKENS_PER_STEP) and dim == expect * Dim(step=1):
        dim = expect  # "14.5 ms" in a per-step field means per step
    if expect == TOKENS_PER_STEP and dim == NUMBER:
        dim = expect
    if dim != expect:
        if q.dim == NUMBER and isinstance(text, (int, float)):
            raise UnitError(
                f"{where}: got the bare number {text!r}; expected {_describe(expect)} "
                "with its unit written out"
            )
        extra = ""
        if expect == STEP_TIME and q.dim == PER_TOKEN_TIME:
            extra = (
                " — this is per token, the field wants per step "
                "(step time = per-token latency x tau)"
            )
        elif expect == TOKEN_RATE and q.dim == Dim(tok=1, s=-1, step=-1):
            extra = " — tokens/s has no 'per step'"
        raise UnitError(
            f"{where}: {text!r} is {_describe(q.dim)}; expected {_describe(expect)}{extra}"
        )
    if not math.isfinite(q.value):
        raise UnitError(f"{where}: {text!r} is not finite")
    return q.value


_SHOW_PREFIX = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, "")]
_SHOW_SMALL = [(1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n")]
_SHOW_UNIT = {
    TIME: "s",
    STEP_TIME: "s",
    BYTES: "B",
    BANDWIDTH: "B/s",
    FLOPS: "FLOP",
    FLOP_RATE: "FLOP/s",
    TOKEN_RATE: "tok/s",
    TOKENS: "tok",
    PER_TOKEN_TIME: "s/tok",
}


def format_quantity(value: float, dim: Dim, digits: int = 3) -> str:
    """8e12, BANDWIDTH -> '8 TB/s'; 0.0145, TIME -> '14.5 ms'."""
    if dim in (NUMBER, TOKENS_PER_STEP):
        return f"{value:.{digits}g}"
    unit = _SHOW_UNIT.get(dim, str(dim))
    if dim == TOKEN_RATE:
        return f"{value:.{digits}g} {unit}"
    a = abs(value)
    table = _SHOW_SMALL if dim in (TIME, STEP_TIME, PER_TOKEN_TIME) else _SHOW_PREFIX
    scale, prefix = table[-1]
    for s, p in table:
        if a >= s:
            scale, prefix = s, p
            break
    return f"{value / scale:.{digits}g} {prefix}{unit}"
