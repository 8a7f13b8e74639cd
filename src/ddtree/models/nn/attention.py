"""Verify attention without a dense ``[M, S + M]`` mask.

A verify forward's M new rows (the tree, or a prompt chunk) attend to the committed prefix and
to their own tree ancestors. The prefix needs no mask at all; only the keys near the new rows
do. So attention is split in two and merged exactly by log-sum-exp, as split-KV decoding does:

- **prefix**: keys ``0 .. P-1``, every one visible to every row: a maskless attention kernel
  (flash attention on CPU and CUDA), returning its output and the log-sum-exp of each row;
- **tail**: ``T`` keys at slots ``P .. P+T-1``, which hold the rest of the prefix
  (``P .. S-1``) and the M new rows (``S .. S+M-1``, written into the cache first), under a
  small additive ``[M, T]`` mask built from the tree's ``[M, M]`` visibility;
- **merge**: ``out = out_p * exp(lse_p - lse) + out_t * exp(lse_t - lse)`` with
  ``lse = logaddexp(lse_p, lse_t)``: the softmax over all keys, never materialised.

Eager mode passes ``P = S`` and ``T = M`` (the tail is exactly the tree). Compiled mode keeps
shapes static: ``P`` is ``S`` rounded down to a multiple of ``chunk`` (the graph's one dynamic
dimension, so it changes once per ``chunk`` tokens) and ``T = chunk + Mb``; tail keys past the
new rows are hidden. ``P = 0`` (a short prefix) skips the prefix part.

Worked example (compiled, chunk 4): S = 6 committed, a tree of Mb = 2 rows. P = 4; the tail
is slots 4..9: slots 4, 5 are prefix (visible to both rows), 6, 7 the tree (per visibility),
8, 9 hidden.

Grouped-query attention (:func:`grouped_attention`) never repeats the cache per query head:
for the prefix the query heads of each KV head are folded into the query length, so every key
is read once per KV head; for the tail they are a batch against keys broadcast over it, so
the ``[M, T]`` mask is not repeated either. Multi-head latent attention is the case of one KV
head whose latent rows are both key and value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddtree.models.static import packed_rows_mask, static_attention_mask

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def attention_lse_math(
    q: torch.Tensor,  # [B, H, L, D]
    k: torch.Tensor,  # [B, H, K, D]
    v: torch.Tensor,  # [B, H, K, Dv]
    mask: torch.Tensor | None,  # [L, K] additive, or None
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention: (out [B, H, L, Dv] in q's dtype, lse [B, H, L] float32). Scores are
    materialised in float32: for small tails, devices without a fused kernel, and tests."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [B, H, L, K]
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ v.float()
    return out.to(q.dtype), lse


def _cpu_flash(q, k, v, mask, scale):
    if mask is not None:
        mask = mask.to(q.dtype)  # the kernel takes an additive mask in the query dtype
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )


def _cuda_attention(q, k, v, mask, scale):
    """Flash attention (half types, no mask) for the prefix; the small masked tail, and float32,
    by the reference math."""
    if mask is None and q.dtype in (torch.float16, torch.bfloat16):
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale
        )
        return out[0], out[1]
    return attention_lse_math(q, k, v, mask, scale)


# device type -> attention with log-sum-exp; chosen by the query's device, once per call site
ATTENTION_BACKENDS: dict[str, AttentionFn] = {"cpu": _cpu_flash, "cuda": _cuda_attention}


def attention_lse(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax attention on q's device: see :data:`ATTENTION_BACKENDS`."""
    return ATTENTION_BACKENDS.get(q.device.type, attention_lse_math)(q, k, v, mask, scale)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets from each set's output
    [..., L, Dv] and log-sum-exp [..., L] (float32): ``out_a + w_b (out_b - out_a)`` with
    ``w_b = sigmoid(lse_b - lse_a)`` (the share of the probability mass in set b)."""
    w_b = torch.sigmoid(lse_b - lse_a)[..., None].to(out_a.dtype)
    return torch.lerp(out_a, out_b, w_b)


@dataclass
class AttentionInputs:
    """What every layer of one forward attends with (see the module docstring)."""

    prefix_keys: torch.Tensor  # [P] int64: keys 0..P-1 need no mask (P: the graph's dynamic dim)
    tail_slots: torch.Tensor  # [T] int64: cache slots P .. P+T-1
    tail_mask: torch.Tensor  # [M, T] additive in the model dtype
    write_slots: torch.Tensor  # [M] int64: where the new rows' keys/values go, S .. S+M-1

    @property
    def prefix_len(self) -> int:
        """P, read off a tensor's shape: symbolic inside a compiled graph (a plain int would
        specialise the graph on every prefix length)."""
        return self.prefix_keys.shape[0]

    @classmethod
    def build(
        cls,
        start: torch.Tensor,  # [] int64: committed prefix S
        visibility: torch.Tensor,  # [M, M] bool: ancestor-or-self among the new rows
        prefix_keys: torch.Tensor,  # [P] int64 (0 .. P-1), P <= S
        tail_len: int,  # T >= S - P + M
        dtype: torch.dtype,
    ) -> AttentionInputs:
        """Host (eager: P = S, T = M) and in-graph (compiled) alike: no host sync."""
        device = visibility.device
        tail_slots = prefix_keys.shape[0] + torch.arange(tail_len, device=device)
        return cls(
            prefix_keys=prefix_keys,
            tail_slots=tail_slots,
            tail_mask=static_attention_mask(start, visibility, tail_slots, dtype),
            write_slots=start + torch.arange(visibility.shape[0], device=device),
        )

    @classmethod
    def packed(
        cls,
        row_lo: torch.Tensor,  # [W] int64: first cache slot of each new row's request
        row_new: torch.Tensor,  # [W] int64: that request's first new slot (lo + its S)
        node: torch.Tensor,  # [W] int64: the new row's index in its request's tree
        visibility: torch.Tensor,  # [W, Mx] bool: its row of that tree's visibility
        keys: torch.Tensor,  # [T] int64: the cache slots attended over (any order)
        dtype: torch.dtype,
    ) -> AttentionInputs:
        """Several requests in one forward (``ddtree.engine.batch``): no maskless prefix
        (P = 0); every key is a tail key under :func:`packed_rows_mask`, so a request sees
        only its own region of the cache. Row ``q`` is written at ``row_new + node``."""
        return cls(
            prefix_keys=keys[:0],
            tail_slots=keys,
            tail_mask=packed_rows_mask(row_lo, row_new, visibility, keys, dtype),
            write_slots=row_new + node,
        )


def grouped_attention(
    q: torch.Tensor,  # [nh, M, D] rotated queries, heads first
    k_cache: torch.Tensor,  # [kvh, capacity, D] one layer's keys (new rows already written)
    v_cache: torch.Tensor,  # [kvh, capacity, Dv]
    inputs: AttentionInputs,
    scale: float,
    attention: AttentionFn = attention_lse,
) -> torch.Tensor:
    """Grouped-query verify attention: [nh, M, Dv]. Query head ``j * G + g`` reads KV head
    ``j`` (transformers' ``repeat_kv`` order).

    - prefix: the group folded into the query length (``[1, kvh, G * M, D]``: row ``g * M + i``
      is head ``j * G + g`` at new row ``i``), so each KV head's keys are read once;
    - tail: the group as the batch (``[G, kvh, M, D]``) against the tail keys broadcast over it
      (stride 0), so one ``[M, T]`` mask serves every head without being repeated.
    """
    nh, m, d = q.shape
    kvh = k_cache.shape[0]
    g = nh // kvh
    slots = inputs.tail_slots
    k_tail = k_cache[None, :, slots].expand(g, -1, -1, -1)  # [G, kvh, T, D]
    v_tail = v_cache[None, :, slots].expand(g, -1, -1, -1)
    q_tail = q.view(kvh, g, m, d).transpose(0, 1)  # [G, kvh, M, D]
    out_t, lse_t = attention(q_tail, k_tail, v_tail, inputs.tail_mask[None, None], scale)
    out_t, lse_t = out_t.transpose(0, 1), lse_t.transpose(0, 1)  # [kvh, G, M, Dv], [kvh, G, M]
    p = inputs.prefix_len
    if p == 0:
        return out_t.reshape(nh, m, -1)
    prefix = (k_cache[None, :, :p], v_cache[None, :, :p])  # [1, kvh, P, D]
    out_p, lse_p = attention(q.reshape(1, kvh, g * m, d), *prefix, None, scale)
    out = merge_attention(out_p.view(kvh, g, m, -1), lse_p.view(kvh, g, m), out_t, lse_t)
    return out.reshape(nh, m, -1)
