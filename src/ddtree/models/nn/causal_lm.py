"""The module shape our cached causal LMs share (:class:`CausalLM`: embedding, decoder layers,
final norm, LM head) and their cache protocol (:class:`ModelCache`);
:mod:`ddtree.models.adapters.target` adapts them to the ``Target`` protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ddtree.models.base import TargetOutput
from ddtree.models.nn.attention import AttentionInputs


class ModelCache(Protocol):
    """Preallocated per-layer cache tensors of one request."""

    length: int  # committed rows
    capacity_dim: int  # the dimension that grows

    def tensors(self) -> tuple[torch.Tensor, ...]: ...
    def ensure(self, needed: int) -> None: ...
    def compact(self, src: torch.Tensor, dst: torch.Tensor, new_len: int) -> None: ...


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head (``model.embed_tokens``,
    ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``: transformers' names).
    A layer is ``layer(x [M, H], rope, attn, layer_caches) -> [M, H]``, given what
    :meth:`layer_caches` picks from the cache tensors for it. ``lm_head`` None (a
    tensor-parallel rank without the head): [M, 0] logits."""

    model: nn.Module
    lm_head: nn.Module | None

    def layer_caches(self, caches: tuple[torch.Tensor, ...], layer: int) -> tuple:
        """The cache tensors decoder layer ``layer`` reads and writes (default: all of them)."""
        return caches

    def forward(
        self,
        input_ids: torch.Tensor,  # [M] int64
        position_ids: torch.Tensor,  # [M] int64
        attn: AttentionInputs,
        caches: tuple[torch.Tensor, ...],
        capture_layers: tuple[int, ...] = (),
        layers=None,  # the decoder layers to call (default ``model.layers``; compiled copies)
    ) -> TargetOutput:
        m = input_ids.shape[0]
        assert input_ids.dim() == 1 and position_ids.shape == (m,), (
            input_ids.shape,
            position_ids.shape,
        )
        x = self.model.embed_tokens(input_ids)  # [M, H]
        rope = self.model.rotary_emb.tables(position_ids, x.dtype)
        captured = {0: x} if 0 in capture_layers else {}
        for i, layer in enumerate(self.model.layers if layers is None else layers):
            x = layer(x, rope, attn, self.layer_caches(caches, i))
            if i + 1 in capture_layers:
                captured[i + 1] = x
        x = self.model.norm(x)
        n = len(self.model.layers)
        if n in capture_layers:  # transformers' last hidden_states entry is after the final norm
            captured[n] = x
        logits = self.lm_head(x) if self.lm_head is not None else x[:, :0]
        hidden = torch.cat([captured[i] for i in capture_layers], -1) if capture_layers else None
        return TargetOutput(logits=logits, hidden=hidden)
