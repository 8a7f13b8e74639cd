"""Verify layout: positions and masks for one target forward over a tree, and the gather
indices that compact the KV cache after acceptance."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.tree.types import DraftTree


@dataclass
class VerifyLayout:
    position_ids: torch.Tensor  # [M] int64, start + depth
    attn_mask: torch.Tensor  # [1, 1, M, start + M] additive float: 0 visible, finfo.min hidden
    parents: torch.Tensor  # [M] int64, the compact form for kernels that walk ancestors
    visibility: torch.Tensor  # [M, M] bool

    def ancestor_bits(self) -> torch.Tensor:
        """[M, ceil(M / 64)] int64 packed visibility (see ``pack_bits``), built on demand: the
        additive mask is what most forwards take."""
        return pack_bits(self.visibility)


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


def verify_layout(tree: DraftTree, start: int, dtype: torch.dtype = torch.float32) -> VerifyLayout:
    """Layout for verifying ``tree`` after a committed prefix of ``start`` tokens."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    m = tree.n_nodes
    device = tree.tokens.device
    mask = torch.zeros(1, 1, m, start + m, dtype=dtype, device=device)
    mask[0, 0, :, start:].masked_fill_(~tree.visibility, torch.finfo(dtype).min)
    return VerifyLayout(
        position_ids=start + tree.depth,
        attn_mask=mask,
        parents=tree.parents,
        visibility=tree.visibility,
    )


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
