"""Which implementation of the host tree core runs, chosen once per process, and the entry
points that run it (``build_tree``, ``accept_greedy``, ``accept_sampled``; ``verify_layout``
in ``layout.py`` fills its mask through it too, and so sits above it).

Backends (a registry: ``BACKENDS``, which imports its implementations; they never import it):

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

import torch

from ddtree.tree.accept import accept_greedy_torch, sample_token
from ddtree.tree.build import build_tree_python
from ddtree.tree.mask import fill_layout_torch
from ddtree.tree.types import AcceptResult, BackendUnavailable, DraftTree, TreeBackend

ENV_VAR = "DDTREE_TREE_BACKEND"


def _python() -> TreeBackend:
    return TreeBackend("python", build_tree_python, fill_layout_torch, accept_greedy_torch)


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


def build_tree(
    root_token: int,
    topk_logprobs: torch.Tensor,  # [L, K] float, sorted descending per depth
    topk_tokens: torch.Tensor,  # [L, K] int64
    budget: int,
) -> DraftTree:
    """Best-first (heap) builder on the host. Returns at most ``budget + 1`` nodes, root first,
    as CPU tensors. Runs the active backend (``backend()``): the compiled core, or
    ``build_tree_python`` where it is not built; both give the same tree, bit for bit."""
    return active_backend().build_tree(root_token, topk_logprobs, topk_tokens, budget)


def accept_greedy(tree: DraftTree, target_tokens: torch.Tensor) -> AcceptResult:
    """``target_tokens`` [M] int64: the target's token after each node (argmax for greedy).
    Runs the active backend (``backend()``)."""
    return active_backend().accept_greedy(tree, target_tokens)


def accept_sampled(
    tree: DraftTree,
    target_logits: torch.Tensor,  # [M, V]
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Draw the target's token at every node, then walk by match (lossless) on the active
    backend."""
    if target_logits.dim() != 2 or target_logits.shape[0] != tree.n_nodes:
        raise ValueError(
            f"target_logits must be [{tree.n_nodes}, V], got {tuple(target_logits.shape)}"
        )
    drawn = sample_token(target_logits, temperature, top_k, top_p, generator)
    return accept_greedy(tree, drawn)
