"""Which implementation of the host tree core runs, chosen once per process.

Backends (a registry: ``BACKENDS``):

- ``native``: the compiled extension ``ddtree.tree._native`` (C++, built by the package's own
  install; ``ddtree.tree.native`` wraps it);
- ``python``: the Python heap builder and the torch layout / accept code, the reference the
  native one is tested against bit for bit, and the fallback.

``DDTREE_TREE_BACKEND=native|python`` forces one; otherwise ``native`` when the extension
loads, else ``python`` with a one-line notice on the ``ddtree`` logger. ``backend()`` names the
one in use, so every result can record it. Both take tensors on any device: ``native`` works
on host (CPU) tensors and hands other devices to the torch code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddtree.tree.types import AcceptResult, DraftTree

ENV_VAR = "DDTREE_TREE_BACKEND"


@dataclass(frozen=True)
class TreeBackend:
    name: str
    # (root_token, topk_logprobs [L, K], topk_tokens [L, K], budget) -> DraftTree on the CPU
    build_tree: Callable[[int, torch.Tensor, torch.Tensor, int], DraftTree]
    # (visibility [M, M] bool, depth [M] int64, start, mask [rows, cols] float,
    #  positions [rows] int64) -> None; fills mask and positions in place (layout.py)
    fill_layout: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor], None]
    # (tree, target_tokens [M] int64) -> AcceptResult
    accept_greedy: Callable[[DraftTree, torch.Tensor], AcceptResult]


class BackendUnavailable(ImportError):
    """The requested backend cannot be loaded here (the message says why)."""


def _python() -> TreeBackend:
    from ddtree.tree import accept, build, layout

    return TreeBackend(
        "python", build.build_tree_python, layout.fill_layout_torch, accept.accept_greedy_torch
    )


def _native() -> TreeBackend:
    from ddtree.tree import native  # raises BackendUnavailable with the reason

    return TreeBackend("native", native.build_tree, native.fill_layout, native.accept_greedy)


BACKENDS: dict[str, Callable[[], TreeBackend]] = {"native": _native, "python": _python}

_active: TreeBackend | None = None


def load_backend(name: str) -> TreeBackend:
    """The backend ``name``; BackendUnavailable if it cannot load here."""
    if name not in BACKENDS:
        raise ValueError(f"unknown tree backend {name!r}: expected one of {sorted(BACKENDS)}")
    return BACKENDS[name]()


def active_backend() -> TreeBackend:
    """The backend in use, chosen on first call (see the module docstring)."""
    global _active
    if _active is None:
        _active = _choose()
    return _active


def backend() -> str:
    """Name of the tree backend in use: ``"native"`` or ``"python"``."""
    return active_backend().name


def _choose() -> TreeBackend:
    forced = os.environ.get(ENV_VAR, "").strip()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {sorted(BACKENDS)}")
        return load_backend(forced)
    try:
        return load_backend("native")
    except BackendUnavailable as err:
        logging.getLogger("ddtree").warning(
            "ddtree: compiled tree core unavailable (%s); using the Python tree builder", err
        )
        return load_backend("python")
