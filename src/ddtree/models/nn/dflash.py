"""The DFlash block drafter (our implementation of the architecture; z-lab checkpoint format).

Architecture (one forward proposes a whole block):

- Context: target hidden states of ``target_layer_ids`` (decoder-layer indices, HF
  ``hidden_states[id + 1]``) concatenated per token, projected by ``fc`` and normalised by
  ``hidden_norm``: one context feature ``[H]`` per committed token, shared by every layer.
- Block: ``[root, MASK x (B-1)]`` embedded with the target's embedding (times
  ``input_embedding_scale``), run through Qwen3-style layers (q/k RMSNorm per head, RoPE with
  ``rotate_half``, GQA, SiLU MLP). In every layer the same ``k_proj``/``v_proj`` apply to the
  context features and to the block; the block attends to all context and to the whole block
  (not causal).
- Output: the final norm, then the target's LM head (times ``output_multiplier``, optional
  tanh soft-capping) at the B-1 mask positions.

Positions: context token t sits at its absolute position ``t`` (``0..C-1``); the block's
root sits right after the context (``C..C+B-1``), as in the reference. Worked example: 5
committed tokens in the context, B = 4: context at 0..4, root at 5, masks at 6, 7, 8, whose
logits predict the tokens at positions 6, 7, 8.

Attention is non-causal and unwindowed unless config.json has ``sliding_attention`` layers
(``use_sliding_window`` + ``sliding_window``) or ``is_causal``: then, as the reference does,
a query at position q sees a key at position k when ``q - k < W`` (and ``k - q < W`` when
non-causal) and, when causal, ``k <= q``; ``is_causal`` absent means causal exactly in the
sliding layers. Because a layer's context keys/values depend only on the context features, the
decoding drafter caches them and appends the newly committed tokens each step; the block's
own keys/values are recomputed every step and never kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.nn.layers import (
    GatedMLP,
    RMSNorm,
    RopeSpec,
    RopeTables,
    rope_tables,
)

ARCHITECTURE = "DFlashDraftModel"
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# Qwen3Config's defaults for the sliding-window fields (transformers 5.x).
QWEN3_SLIDING_WINDOW, QWEN3_MAX_WINDOW_LAYERS = 4096, 28
# ... and for absent head_dim / rope_theta: what the reference (a Qwen3Config) builds with.
QWEN3_HEAD_DIM, QWEN3_ROPE_THETA = 128, 10000.0


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int  # B
    mask_token_id: int
    target_layer_ids: list[int]  # decoder-layer indices of the target (HF hidden_states id - 1)
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] = ()  # per layer; () means all full_attention
    sliding_window: int | None = None  # W of the sliding_attention layers
    is_causal: bool | None = None  # None: causal exactly in the sliding_attention layers

    def __post_init__(self) -> None:
        self.layer_types = tuple(self.layer_types) or (FULL_ATTENTION,) * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, expected "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if bad:
            raise ValueError(f"layer_types {bad}: expected {FULL_ATTENTION} or {SLIDING_ATTENTION}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def rope(self) -> RopeSpec:
        """Default RoPE over ``head_dim`` at ``rope_theta`` (the only kind a drafter uses)."""
        return RopeSpec(self.head_dim, self.rope_theta)

    @property
    def context_features(self) -> int:
        """F: width of the concatenated target hidden states."""
        return len(self.target_layer_ids) * self.hidden_size

    def layer_attention(self, layer: int) -> tuple[int | None, bool]:
        """(sliding window or None, causal) of drafter layer ``layer``."""
        sliding = self.layer_types[layer] == SLIDING_ATTENTION
        causal = sliding if self.is_causal is None else bool(self.is_causal)
        return (self.sliding_window if sliding else None), causal

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> DFlashConfig:
        from ddtree.models.loading.compat import drafter_target_layer_ids

        def need(name: str):
            if cfg.get(name) is None:
                raise ValueError(f"{source}: missing field {name!r} (a DFlash drafter config)")
            return cfg[name]

        dflash = cfg.get("dflash_config") or {}
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: field hidden_act={cfg['hidden_act']!r}, expected 'silu'")
        n_layers = int(need("num_hidden_layers"))
        # as Qwen3Config: sliding_window only counts with use_sliding_window; layer_types
        # default to sliding from layer max_window_layers on
        window = cfg.get("sliding_window", QWEN3_SLIDING_WINDOW)
        window = int(window) if cfg.get("use_sliding_window") and window is not None else None
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            first = cfg.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
            layer_types = [
                SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION
                for i in range(n_layers)
            ]
        bad = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if bad or len(layer_types) != n_layers:
            raise ValueError(
                f"{source}: field layer_types={layer_types}: expected {n_layers} entries of "
                f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{source}: rope type {rope_type!r}: only default RoPE is supported")
        rope_theta = cfg.get("rope_theta") or rope.get("rope_theta") or QWEN3_ROPE_THETA
        mask_token_id = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if mask_token_id is None:
            raise ValueError(f"{source}: missing field dflash_config.mask_token_id")
        layer_ids = drafter_target_layer_ids(cfg)
        if not layer_ids:
            raise ValueError(f"{source}: missing field dflash_config.target_layer_ids")
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        softcap = dflash.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or QWEN3_HEAD_DIM),
            vocab_size=int(need("vocab_size")),
            block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
            mask_token_id=int(mask_token_id),
            target_layer_ids=layer_ids,
            num_target_layers=int(cfg.get("num_target_layers") or max(layer_ids) + 1),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            attention_bias=bool(cfg.get("attention_bias", False)),
            input_embedding_scale=float(
                dflash.get("input_embedding_scale", cfg.get("input_embedding_scale", 1.0))
            ),
            output_multiplier=float(
                dflash.get("output_multiplier", cfg.get("output_multiplier", 1.0))
            ),
            final_logit_softcapping=None if softcap is None else float(softcap),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
            layer_types=tuple(layer_types),
            sliding_window=window,
            is_causal=None if cfg.get("is_causal") is None else bool(cfg["is_causal"]),
        )

    def to_dict(self) -> dict:
        """A z-lab-format ``config.json`` (Qwen3 fields + DFlash fields)."""
        dflash: dict = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        for name, default in (
            ("input_embedding_scale", 1.0),
            ("output_multiplier", 1.0),
            ("final_logit_softcapping", None),
        ):
            if getattr(self, name) != default:
                dflash[name] = getattr(self, name)
        out = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
        }
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out


def rotary_tables(c: DFlashConfig, positions: torch.Tensor, dtype) -> RopeTables:
    """positions [R, T] -> the rotary tables of x [R, heads, T, D] (cos/sin [R, 1, T, D/2];
    rotate-half pairs), from the shared rotary code (``ddtree.models.nn.layers``)."""
    return rope_tables(c.rope.inv_freq(positions.device), positions[:, None], dtype)


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.c = c
        q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q_out, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv_out, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv_out, bias=c.attention_bias)
        self.o_proj = nn.Linear(q_out, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, T, H] -> k, v [R, kv_heads, T, D] (k normalised and rotated)."""
        r, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(r, t, -1, self.c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(r, t, -1, self.c.head_dim).transpose(1, 2)
        return rope.apply(k), v

    def forward(self, x, rope: RopeTables, context, mask=None) -> torch.Tensor:
        """x [R, B, H] block; ``context`` either (ctx_k, ctx_v) [R, kv_heads, C, D], to which
        the block's keys/values are concatenated (batched forwards), or a :class:`CacheView`,
        into which they are written at its slots before attending over its first ``n_keys``
        rows (decoding). mask [R, 1, B, keys] bool (True: visible) or None: all visible."""
        r, b, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(r, b, -1, self.c.head_dim)).transpose(1, 2)
        q = rope.apply(q)  # [R, heads, B, D]
        k, v = self.keys_values(x, rope)
        if isinstance(context, CacheView):
            k, v = context.write(k, v)
        else:
            k, v = torch.cat([context[0], k], 2), torch.cat([context[1], v], 2)
        groups = self.c.num_attention_heads // self.c.num_key_value_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.c.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(r, b, -1))


@dataclass
class CacheView:
    """One layer of the decode cache as the block attends to it: the block's keys/values go
    to ``slots``, then the first ``n_keys`` slots (context, block, masked padding) are read."""

    k: torch.Tensor  # [n_layers, capacity, kv_heads, D] the whole cache (slot-major)
    v: torch.Tensor  # [n_layers, capacity, kv_heads, D]
    layer: int
    slots: torch.Tensor  # [T] int64
    n_keys: int

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [1, kv_heads, T, D] at ``slots``, into the whole cache tensor, not into a
        per-layer view: a compiled graph updates an input in place, but a write through a view
        of it copies the whole cache."""
        layer = torch.full_like(self.slots, self.layer)
        self.k.index_put_((layer, self.slots), k[0].transpose(0, 1))
        self.v.index_put_((layer, self.slots), v[0].transpose(0, 1))

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`store`, then this layer's first ``n_keys`` keys/values [1, kv_heads, K, D]."""
        self.store(k, v)
        return (
            self.k[self.layer, : self.n_keys].transpose(0, 1)[None],
            self.v[self.layer, : self.n_keys].transpose(0, 1)[None],
        )


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, rope: RopeTables, context, mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_mask(
    block_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None, causal: bool
) -> torch.Tensor | None:
    """Which keys each block query sees: bool [R, 1, B, K], or None when it sees them all.

    block_positions [R, B], key_positions [R, K] (context then block). Causal: ``k <= q``;
    window W: ``q - k < W``, and ``k - q < W`` too when not causal (the reference's rule).
    Example, W = 3, non-causal, context 0..4, block 5..6: the query at 5 sees keys 3..6.
    """
    if window is None and not causal:
        return None
    q, k = block_positions[:, :, None], key_positions[:, None, :]  # [R, B, 1], [R, 1, K]
    visible = torch.ones(q.shape[0], q.shape[1], k.shape[2], dtype=torch.bool, device=q.device)
    if causal:
        visible &= k <= q
    if window is not None:
        visible &= q - k < window
        if not causal:
            visible &= k - q < window
    return visible[:, None]


def _both(mask: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    return mask if visible is None else mask & visible


class DFlashModel(nn.Module):
    """The drafter's own weights (parameter names as in z-lab checkpoints)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(c.context_features, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def context(self, context_hidden: torch.Tensor) -> torch.Tensor:
        """[R, C, F] target hidden states -> [R, C, H] context features."""
        return self.hidden_norm(self.fc(context_hidden))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        """Per layer (k, v) [R, kv_heads, C, D] of context features [R, C, H] at [R, C]."""
        tables = rotary_tables(self.config, positions, features.dtype)
        return [layer.self_attn.keys_values(features, tables) for layer in self.layers]

    def block_hidden(
        self, block_emb, block_positions, contexts, key_positions=None, visible=None
    ) -> torch.Tensor:
        """block_emb [R, B, H] at block_positions [R, B], attending per layer to ``contexts``
        (``Attention.forward``'s context: (k, v) [R, kv_heads, C, D], to which the block's are
        appended, or a ``CacheView``) -> final-normed hidden [R, B, H]. ``key_positions``
        [R, keys], the position of every key (default: context 0..C-1, then the block), only
        matter for windowed or causal layers (the keys are already rotated). ``visible``
        [R or 1, 1, B, keys] bool (None: all) hides more keys on top of the window/causal
        rules (many blocks in one row; padded keys of a compiled propose)."""
        c = self.config
        tables = rotary_tables(c, block_positions, block_emb.dtype)
        kinds = [c.layer_attention(i) for i in range(len(contexts))]
        if key_positions is None and any(kind != (None, False) for kind in kinds):
            r, ctx_len = block_positions.shape[0], contexts[0][0].shape[2]
            context_positions = torch.arange(ctx_len, device=block_positions.device)
            key_positions = torch.cat([context_positions.expand(r, ctx_len), block_positions], 1)
        masks: dict[tuple, torch.Tensor | None] = {}
        x = block_emb
        for layer, context, kind in zip(self.layers, contexts, kinds, strict=True):
            if kind not in masks:
                masks[kind] = (
                    visible
                    if kind == (None, False)
                    else _both(attention_mask(block_positions, key_positions, *kind), visible)
                )
            x = layer(x, tables, context, masks[kind])
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        out = lm_head(hidden) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    def block_logits(
        self,
        context_hidden: torch.Tensor,  # [R, C, F] target hidden states of the context tokens
        block_ids: torch.Tensor,  # [R, B] int64: [root, MASK x (B-1)] (or any block tokens)
        embed_tokens: nn.Module,  # the target's embedding
        lm_head: nn.Module,  # the target's LM head
        context_positions: torch.Tensor | None = None,  # [R, C] int64; default 0..C-1
        block_positions: torch.Tensor | None = None,  # [R, B] int64; default C..C+B-1
    ) -> torch.Tensor:
        """Batched forward for training and tests: R independent blocks in one forward.

        - ``context_hidden`` [R, C, F]: target features of each row's context (the
          ``target_layer_ids`` hidden states concatenated, ``F = len(ids) * H``): the tokens
          *before* the root, whose hidden states the target has already produced.
        - ``block_ids`` [R, B] int64: ``[root, MASK x (B-1)]`` (or any block tokens).
        - ``embed_tokens``/``lm_head``: the target's (shared, not part of this model).
        - Positions (the reference's convention): context token j at ``j`` (``0..C-1``),
          block slot i at ``C + i``. ``context_positions`` [R, C] / ``block_positions`` [R, B]
          override them (e.g. a row whose context is a prefix of a longer sequence).

        Returns logits [R, B-1, V] for block slots 1..B-1, which predict the tokens at
        positions ``C+1..C+B-1``. Differentiable (gradients flow to this model only if the
        caller freezes the shared modules)."""
        r, ctx_len, _ = context_hidden.shape
        b = block_ids.shape[1]
        device = context_hidden.device
        if context_positions is None:
            context_positions = torch.arange(ctx_len, device=device).expand(r, ctx_len)
        if block_positions is None:
            block_positions = torch.arange(ctx_len, ctx_len + b, device=device).expand(r, b)
        feats = self.context(context_hidden)
        emb = embed_tokens(block_ids) * self.config.input_embedding_scale
        hidden = self.block_hidden(
            emb.to(feats.dtype),
            block_positions,
            self.context_kv(feats, context_positions),
            torch.cat([context_positions.expand(r, ctx_len), block_positions], 1),
        )
        return self.logits(hidden[:, 1:], lm_head)
