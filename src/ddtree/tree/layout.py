"""Verify layout: positions and masks for one target forward over a tree, and the gather
indices that compact the KV cache after acceptance."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree.backends import active_backend
from ddtree.tree.types import DraftTree, TreeBackend


@dataclass
class VerifyLayout:
    """What a forward that takes a dense additive mask needs (the transformers wrapper; our
    own targets attend without one, ``ddtree.models.nn.attention``)."""

    position_ids: torch.Tensor  # [M] int64, start + depth
    attn_mask: torch.Tensor  # [1, 1, M, start + M] additive float: 0 visible, finfo.min hidden
    visibility: torch.Tensor  # [M, M] bool


def pack_bits(visibility: torch.Tensor) -> torch.Tensor:
    """[M, M] bool -> [M, ceil(M/64)] int64 words, bit (j % 64) of word (j // 64) = row[j].

    Example: a row [True, False, True] packs to the word 0b101 = 5. Bytes are packed little
    endian and reinterpreted as int64 words (bit 63 lands in the sign bit).
    """
    lead, m = visibility.shape[:-1], visibility.shape[-1]
    words = (m + 63) // 64
    padded = torch.zeros(lead + (words * 64,), dtype=torch.uint8, device=visibility.device)
    padded[..., :m] = visibility
    byte_weights = torch.tensor(
        [1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=visibility.device
    )
    packed = (padded.view(lead + (words * 8, 8)) * byte_weights).sum(-1, dtype=torch.uint8)
    return packed.view(torch.int64)


class LayoutBuffer:
    """Storage for verify layouts, allocated once and refilled every step: no per-step
    allocation of the [M, S + M] mask (at N = 1024 and S = 128 that is 4.7 MB of float32).

    Holds up to ``rows`` tree nodes against ``cols`` key columns (committed prefix + tree).
    A layout filled into the buffer is a view of it: valid until the next fill.
    """

    def __init__(
        self, rows: int, cols: int, dtype: torch.dtype = torch.float32, device="cpu"
    ) -> None:
        if rows < 1 or cols < rows:
            raise ValueError(f"LayoutBuffer needs 1 <= rows <= cols, got rows={rows} cols={cols}")
        if not dtype.is_floating_point:
            raise ValueError(f"LayoutBuffer dtype must be an additive float type, got {dtype}")
        self.rows, self.cols, self.dtype = rows, cols, dtype
        self.mask = torch.empty(rows * cols, dtype=dtype, device=device)  # [rows * cols] flat
        self.positions = torch.empty(rows, dtype=torch.int64, device=device)  # [rows]

    def views(
        self, m: int, start: int, dtype: torch.dtype | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask [1, 1, M, start + M] contiguous, positions [M]) views for a tree of M nodes
        after ``start`` committed tokens."""
        if dtype is not None and dtype != self.dtype:
            raise ValueError(f"verify_layout dtype {dtype} != the LayoutBuffer's {self.dtype}")
        if m > self.rows or start + m > self.cols:
            raise ValueError(
                f"verify_layout: a tree of {m} nodes after {start} tokens needs a LayoutBuffer "
                f"of at least {m} rows x {start + m} cols, this one is {self.rows} x {self.cols}"
            )
        return self.mask[: m * (start + m)].view(1, 1, m, start + m), self.positions[:m]


def verify_layout(
    tree: DraftTree,
    start: int,
    dtype: torch.dtype | None = None,
    *,
    out: LayoutBuffer | None = None,
    backend: TreeBackend | None = None,
) -> VerifyLayout:
    """Layout for verifying ``tree`` after a committed prefix of ``start`` tokens.

    ``dtype``: the mask's float type (default float32, or the buffer's). ``out``: fill a
    ``LayoutBuffer`` instead of allocating. ``backend``: the tree backend that fills it
    (default: the active one; benchmarks compare).
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    m = tree.n_nodes
    if out is not None:
        mask, positions = out.views(m, start, dtype)
    else:
        device = tree.tokens.device
        mask = torch.empty(1, 1, m, start + m, dtype=dtype or torch.float32, device=device)
        positions = torch.empty(m, dtype=torch.int64, device=device)
    (backend or active_backend()).fill_layout(tree.visibility, tree.depth, start, mask, positions)
    return VerifyLayout(positions, mask, tree.visibility)


@dataclass
class CompactionPlan:
    src: torch.Tensor  # [tau] int64, cache positions of the accepted entries (start + node index)
    dst: torch.Tensor  # [tau] int64, where they go: start .. start + tau - 1
    new_len: int  # committed length after compaction: start + tau


def compaction_indices(accepted: torch.Tensor, start: int) -> CompactionPlan:
    """Gather plan that moves accepted node entries of a KV cache to ``start .. start+tau-1``.

    Example: start 10, accepted nodes [0, 2, 5] -> src [10, 12, 15], dst [10, 11, 12],
    new_len 13. ``cache[dst] = cache[src]`` is safe as one gather (``index_select`` first).
    """
    if accepted.dim() != 1 or accepted.numel() == 0:
        raise ValueError(f"accepted must be a non-empty [tau] tensor, got {tuple(accepted.shape)}")
    tau = accepted.shape[0]
    accepted = accepted.to(torch.int64)
    return CompactionPlan(
        src=start + accepted,
        dst=start + torch.arange(tau, dtype=torch.int64, device=accepted.device),
        new_len=start + tau,
    )
