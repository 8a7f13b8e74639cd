"""argparse types shared by the commands (stdlib only, so light commands stay light).

Each type rejects what the command cannot use with one line that argparse prefixes with the
argument's name: ``argument --budget: expected an integer in 1..8192, got '0'``. Floats must be
finite (``nan`` and ``inf`` parse as floats in Python; no command can use them).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit integer


def _bounds(low, high, low_open: bool = False) -> str:
    lo, hi = (f"{x:g}" if isinstance(x, float) else str(x) for x in (low, high))
    if high is None:
        return f"> {lo}" if low_open else f">= {lo}"
    return f"in ({lo}, {hi}]" if low_open else f"in {lo}..{hi}"


def int_in(low: int, high: int | None = None, what: str = "an integer") -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (``high`` None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {what} {_bounds(low, high)}, got {text!r}"
            ) from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what} {_bounds(low, high)}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


def float_in(
    low: float, high: float | None = None, low_open: bool = False, what: str = "a number"
) -> Callable[[str], float]:
    """An argparse type: a finite float >= ``low`` (> with ``low_open``), <= ``high``."""

    def parse(text: str) -> float:
        expected = f"expected a finite {what.removeprefix('a ')} {_bounds(low, high, low_open)}"
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
positive_float = float_in(0.0, low_open=True)
non_negative_float = float_in(0.0)
probability = float_in(0.0, 1.0, low_open=True, what="a probability")
seed = int_in(0, MAX_SEED, what="a seed")


def threads(text: str) -> int:
    """torch CPU threads: 0 (torch's default) up to this machine's CPU count."""
    return int_in(0, os.cpu_count() or 1, what="a thread count (0: torch's default)")(text)


def output_file(text: str) -> Path:
    """A file to write (records, traces): not an existing folder; parent folders are created."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; expected a file path to write")
    return path


def int_list_upto(high: int | None) -> Callable[[str], list[int]]:
    """An argparse type: "8,16,32" -> [8, 16, 32], a non-empty list of integers in 1..high."""
    expected = f"comma-separated integers, each {_bounds(1, high)}"

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not values or min(values) < 1 or (high is not None and max(values) > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return values

    parse.__name__ = "integer list"
    return parse


int_list = int_list_upto(None)
