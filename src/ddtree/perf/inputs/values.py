"""Inputs of the estimator that may be uncertain (``Range``, ``Value``) and the error a bad
scenario raises: the leaf that the scenario reader and the acceptance reader share."""

from __future__ import annotations

from dataclasses import dataclass


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names file and field."""


@dataclass(frozen=True)
class Range:
    """An uncertain input: uniform on [low, high], or triangular with a mode."""

    low: float
    high: float
    mode: float | None = None

    @property
    def mid(self) -> float:
        return self.mode if self.mode is not None else 0.5 * (self.low + self.high)


Value = float | Range


# ---- the type of a field the schema (``inputs/schema.py``) leaves open, naming the field ------

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "a list", dict: "a table"}  # fmt: skip


def type_name(raw: object) -> str:
    """What a TOML value is, in words: ``a table``, ``a list``, ``a string``, ..."""
    return _TYPE_NAMES.get(type(raw), f"a {type(raw).__name__}")


def text(raw: object, where: str) -> str:
    """A field that must be a string (a name, a note, a source)."""
    if not isinstance(raw, str):
        raise ScenarioError(f"{where}: expected a string, got {type_name(raw)} ({raw!r:.60})")
    return raw


def flag(raw: object, where: str) -> bool:
    """A field that must be true or false."""
    if not isinstance(raw, bool):
        raise ScenarioError(f"{where}: expected true or false, got {type_name(raw)} ({raw!r:.60})")
    return raw


def one_of(raw: object, choices, where: str, what: str = "one of") -> str:
    """A name that must be a string and one of ``choices`` (a policy, an engine, a link)."""
    if not isinstance(raw, str) or raw not in choices:
        raise ScenarioError(f"{where}: {raw!r:.60}; expected {what} {', '.join(choices)}")
    return raw
