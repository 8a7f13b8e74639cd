"""The verify layout's additive mask and positions in torch: the Python backend's fill (the
native backend's ``fill_layout`` is the same in C++; ``layout.verify_layout`` calls whichever
backend is active)."""

from __future__ import annotations

import torch


def check_layout_shapes(visibility, depth, start: int, mask, positions) -> None:
    """Both fills' contract: visibility [M, M], depth [M], mask [.., M, start + M],
    positions [M]."""
    m = visibility.shape[0]
    rows, cols = mask.shape[-2:]
    if visibility.shape != (m, m) or depth.shape != (m,) or positions.shape != (m,):
        raise ValueError(
            f"fill_layout: visibility {tuple(visibility.shape)}, depth {tuple(depth.shape)}, "
            f"positions {tuple(positions.shape)} do not fit M = {m}"
        )
    if start < 0 or (rows, cols) != (m, start + m):
        raise ValueError(f"fill_layout: mask [{rows}, {cols}] is not [{m}, {start} + {m}]")


def fill_layout_torch(
    visibility: torch.Tensor,  # [M, M] bool
    depth: torch.Tensor,  # [M] int64
    start: int,
    mask: torch.Tensor,  # [.., M, start + M] float; written
    positions: torch.Tensor,  # [M] int64; written
) -> None:
    """Additive mask (0 visible, finfo.min hidden) and positions, in torch (any device): row
    i sees the committed prefix and its ancestors-or-self. Example M = 2 (root, child),
    start 1 (h = hidden)::

        row 0: 0 | 0 h      position start + 0 = 1
        row 1: 0 | 0 0      position start + 1 = 2
    """
    check_layout_shapes(visibility, depth, start, mask, positions)
    mask.fill_(torch.finfo(mask.dtype).min)
    mask[..., :start] = 0
    mask[..., start:].masked_fill_(visibility, 0)
    positions.copy_(start + depth)
