"""argparse types shared by the commands (stdlib only, so light commands stay light)."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    """ "8,16,32" -> [8, 16, 32]: a non-empty list of positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
