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
