"""A rich progress bar for training loops (steps, loss, tokens/s)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def train_progress(disable: bool = False) -> Progress:
    """On stderr: stdout holds the command's result line."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=disable,
        console=Console(stderr=True),
    )


def log_interval(bar: Progress, text: str) -> None:
    """A plain line per log interval when output is not a terminal (a log file), where the
    live bar does not render."""
    if not bar.console.is_terminal:
        bar.console.print(text, highlight=False)
