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
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.base import ModelInfo
from ddtree.models.layers import (
    GatedMLP,
    RMSNorm,
    RopeSpec,
    RopeTables,
    check_finite,
    rope_tables,
)
from ddtree.models.static import (
    ENGINE_MODES,
    CompiledForward,
    EnginePlan,
    KeyPositions,
    cache_input,
    kv_bucket,
    mark_key_dim,
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
        from ddtree.models.compat import drafter_target_layer_ids

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
    rotate-half pairs), from the shared rotary code (``ddtree.models.layers``)."""
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


class DFlashDrafter:
    """The ``Drafter`` protocol over :class:`DFlashModel` for one request, with an incremental
    context cache: per layer the keys/values of every committed token seen so far (``seen``
    of them, at slots = positions ``0..seen-1``) in one preallocated buffer grown
    geometrically from ``capacity``. A propose writes the new context rows and then the
    block's rows right after them, and attends over the buffer's first rows; the block's rows
    are overwritten by the next propose. ``check_finite``: NaN/inf drafter logits raise
    :class:`NonFiniteLogitsError`. Engine modes as the target's (``ddtree.models.static``):
    compiled mode pads the new context to ``B`` rows (a longer first context is appended
    eagerly first) and masks the padded keys.

    ``draft_tokens`` [K] int64 (ascending vocabulary ids; None: the full vocabulary): a reduced
    draft vocabulary (``ddtree.models.draft_vocab``): :meth:`propose` computes the LM head over
    those K rows only and returns logits [B-1, K], column j standing for id
    ``draft_tokens[j]``. :meth:`propose_at` and :meth:`block_logits` (recording, training)
    keep the full head."""

    engine_modes = ENGINE_MODES
    plain_linears: tuple[str, ...] = ()  # as the target's (ddtree.models.linear)

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def __init__(
        self,
        model: DFlashModel,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        name="dflash",
        capacity: int = 256,
        check_finite: bool = True,
        draft_tokens: torch.Tensor | None = None,
    ):
        self.model = model.eval()
        self.config = model.config
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.block_size = self.config.block_size
        self.check_finite = check_finite
        # the Drafter protocol indexes hidden states as transformers does (0 = embeddings)
        self.target_layer_ids = [i + 1 for i in self.config.target_layer_ids]
        c = self.config
        self.info = ModelInfo(
            name=name,
            architecture=ARCHITECTURE,
            implementation="dflash",
            n_params=sum(p.numel() for p in model.parameters()),
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            dtype=str(self.dtype).removeprefix("torch."),
            max_position=c.max_position_embeddings,
        )
        kv_heads, head_dim = c.num_key_value_heads, c.head_dim
        shape = (c.num_hidden_layers, max(int(capacity), 1), kv_heads, head_dim)
        self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [L, C, kvh, D]
        self._v = torch.zeros_like(self._k)
        self._key_positions = KeyPositions(max(int(capacity), c.block_size), self.device)
        self._block = torch.full(
            (1, c.block_size), c.mask_token_id, dtype=torch.int64, device=self.device
        )  # [1, B]: [root, MASK x (B-1)], the root refilled each step
        self._context = torch.zeros(1, c.block_size, c.context_features, device=self.device)
        self._context = self._context.to(self.dtype)  # [1, B, F]: compiled mode's padded rows
        self._seen_t = torch.zeros((), dtype=torch.int64, device=self.device)
        self._block_start = torch.zeros((), dtype=torch.int64, device=self.device)
        self.engine = EnginePlan()
        self._runner: EagerDraftStep | CompiledDraftStep = EagerDraftStep(self)
        self._graphs: CompiledDraftStep | None = None  # kept across plans: compiles once
        self.seen = 0  # committed tokens whose context keys/values are cached
        self.draft_tokens: torch.Tensor | None = None  # [K] int64, None: the full vocabulary
        self.draft_head: nn.Module = lm_head  # what propose's logits come from
        if draft_tokens is not None:
            self.restrict_vocab(draft_tokens)

    def restrict_vocab(self, draft_tokens: torch.Tensor | None) -> None:
        """Propose over ``draft_tokens`` [K] int64 (distinct vocabulary ids, ascending) only,
        or over the full vocabulary again (None): the LM head's K rows are copied once here
        (``draft_vocab.head_rows``). Proposes run eager until the next ``set_engine_mode``,
        which compiles a compiled mode's graph again, for the new head."""
        import dataclasses

        from ddtree.models.draft_vocab import head_rows

        vocab = self.config.vocab_size
        if draft_tokens is None:
            self.draft_tokens, self.draft_head = None, self.lm_head
        else:
            ids = draft_tokens.to(self.device, torch.int64)  # [K]
            assert ids.dim() == 1, ids.shape
            if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
                raise ValueError(f"draft_tokens must be non-empty ids in 0..{vocab - 1}")
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                raise ValueError("draft_tokens must be distinct ids in ascending order")
            self.draft_tokens, self.draft_head = ids, head_rows(self.lm_head, ids)
        k = 0 if self.draft_tokens is None else int(self.draft_tokens.shape[0])
        self.info = dataclasses.replace(self.info, draft_vocab=k)
        self.engine, self._runner, self._graphs = EnginePlan(), EagerDraftStep(self), None
        self.reset()

    def reset(self) -> None:
        self.seen = 0

    def fork(self) -> DFlashDrafter:
        """A drafter for another request decoded beside this one (``ddtree.engine.batch``):
        the same modules, weights and draft vocabulary (its head rows shared, not copied), a
        context cache of its own."""
        twin = DFlashDrafter(
            self.model,
            self.embed_tokens,
            self.lm_head,
            name=self.info.name,
            capacity=int(self._k.shape[1]),
            check_finite=self.check_finite,
        )
        twin.info = self.info
        twin.draft_tokens, twin.draft_head = self.draft_tokens, self.draft_head
        return twin

    @torch.inference_mode()
    def set_engine_mode(self, plan: EnginePlan) -> float:
        """Eager or compiled proposes for the next requests: picks the step runner of
        ``plan.mode`` once (the target's widths do not matter: a propose always has B block
        rows and at most B new context rows). Compiled mode compiles its one graph the first
        time; returns the seconds that took."""
        self.engine = plan
        self.reset()
        if plan.mode == "eager":
            self._runner = EagerDraftStep(self)
            return 0.0
        self._ensure(kv_bucket(plan.max_len + 2 * self.block_size))
        compile_s = 0.0
        if self._graphs is None:
            self._graphs = CompiledDraftStep(self)
            compile_s = self._graphs.warm_up()
            self.reset()
        self._runner = self._graphs
        return compile_s

    @torch.inference_mode()
    def propose(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        """The ``Drafter`` protocol's: logits [B-1, K] over ``draft_tokens`` (K = V and
        column = id without a draft vocabulary)."""
        self._check_propose(context_hidden, root_token)
        logits = self._step(context_hidden.to(self.device, self.dtype), int(root_token))
        self._check_logits(logits, root_token)
        return logits

    def _check_propose(self, context_hidden: torch.Tensor, root_token: int) -> None:
        assert context_hidden.dim() == 2, context_hidden.shape  # [T_new, F]
        c, t_new = self.config, int(context_hidden.shape[0])
        if context_hidden.shape[1] != c.context_features:
            raise ValueError(
                f"context_hidden has {context_hidden.shape[1]} features; the drafter expects "
                f"{c.context_features} ({len(c.target_layer_ids)} target layers x {c.hidden_size})"
            )
        if not self.seen and not t_new:
            raise ValueError(
                "propose() needs context: the first call must carry the prompt's hidden states"
            )
        if not 0 <= int(root_token) < c.vocab_size:
            raise ValueError(
                f"root_token={root_token} outside the vocabulary 0..{c.vocab_size - 1}"
            )

    def _check_logits(self, logits: torch.Tensor, root_token: int) -> None:
        if self.check_finite:
            check_finite(
                logits,
                lambda: (
                    f"drafter {self.info.name}: NaN/inf logits for the block after {self.seen} "
                    f"context tokens (root {root_token}); stopping instead of drafting garbage"
                ),
            )

    def batches_with(self, other) -> bool:
        """Whether ``other`` can propose in one forward with this drafter (:meth:`propose_many`):
        a drafter of the same modules and draft vocabulary (a :meth:`fork`) in the same engine
        mode. The joint forward runs eagerly in either mode (its widths vary with the rows;
        reading the weights once for every row is what it is for); each drafter's cache stays
        what its own compiled proposes read."""
        return (
            isinstance(other, DFlashDrafter)
            and other.model is self.model
            and other.draft_head is self.draft_head
            and self.engine.mode == other.engine.mode
        )

    @staticmethod
    @torch.inference_mode()
    def propose_many(
        drafters: list[DFlashDrafter],
        contexts: list[torch.Tensor],  # per drafter [T_new, F]: as propose's context_hidden
        roots: list[int],
    ) -> list[torch.Tensor]:
        """``d.propose(context, root)`` of every drafter (forks of one: :meth:`batches_with`)
        in one forward: the new context rows of all appended to each one's cache by one
        projection, then the R blocks against their own contexts, padded to the longest and
        masked (``DFlashModel.block_hidden``'s batched form), then one head over the R
        blocks. Per drafter, logits [B-1, K]."""
        first = drafters[0]
        model, c, b, device = first.model, first.config, first.block_size, first.device
        for d, ctx, root in zip(drafters, contexts, roots, strict=True):
            d._check_propose(ctx, root)
        new = [int(x.shape[0]) for x in contexts]
        if sum(new):  # the new context rows of every drafter, projected together
            rows = torch.cat(contexts).to(device, first.dtype)[None]  # [1, sum T, F]
            slots = torch.cat(
                [
                    d.seen + torch.arange(t, device=device)
                    for d, t in zip(drafters, new, strict=True)
                ]
            )
            kv = model.context_kv(model.context(rows), slots[None])  # per layer [1, kvh, sum T, D]
            at = 0
            for d, t in zip(drafters, new, strict=True):
                d._ensure(d.seen + t + b)
                for layer, (k, v) in enumerate(kv):
                    d._k[layer, d.seen : d.seen + t] = k[0, :, at : at + t].transpose(0, 1)
                    d._v[layer, d.seen : d.seen + t] = v[0, :, at : at + t].transpose(0, 1)
                d.seen += t
                at += t
        ends = torch.tensor([d.seen for d in drafters], device=device)  # [R]: each root's slot
        longest = int(ends.max())
        r = len(drafters)
        contexts_kv = []
        for layer in range(c.num_hidden_layers):
            k = first._k.new_zeros(r, longest, *first._k.shape[2:])  # [R, C, kvh, D]
            v = torch.zeros_like(k)
            for i, d in enumerate(drafters):
                k[i, : d.seen] = d._k[layer, : d.seen]
                v[i, : d.seen] = d._v[layer, : d.seen]
            contexts_kv.append((k.transpose(1, 2), v.transpose(1, 2)))  # [R, kvh, C, D]
        block_positions = ends[:, None] + torch.arange(b, device=device)  # [R, B]
        context_positions = torch.arange(longest, device=device).expand(r, longest)
        keys = torch.cat([context_positions, block_positions], 1)  # [R, C + B]
        visible = torch.cat(
            [context_positions < ends[:, None], torch.ones(r, b, dtype=torch.bool, device=device)],
            1,
        )[:, None, None].expand(r, 1, b, longest + b)  # [R, 1, B, C + B]
        ids = torch.full((r, b), c.mask_token_id, dtype=torch.int64, device=device)
        ids[:, 0] = torch.tensor(roots, device=device)
        emb = first.embed_tokens(ids).to(first.dtype) * c.input_embedding_scale
        hidden = model.block_hidden(emb, block_positions, contexts_kv, keys, visible)
        logits = model.logits(hidden[:, 1:], first.draft_head)  # [R, B-1, K]
        out = list(logits.unbind(0))
        for d, lg, root in zip(drafters, out, roots, strict=True):
            d._check_logits(lg, root)
        return out

    @torch.inference_mode()
    def propose_at(
        self,
        context_hidden: torch.Tensor,  # [C, F] target hidden states of tokens 0..C-1
        root_tokens: torch.Tensor,  # [R] int64
        root_positions: torch.Tensor,  # [R] int64, each in 1..C
    ) -> torch.Tensor:
        """Many blocks in one forward, independent of this drafter's cache: block r is
        ``[root_tokens[r], MASK x (B-1)]`` at positions ``p..p+B-1`` (``p = root_positions[r]``)
        and sees the context ``0..p-1`` and its own block, as :meth:`propose` drafts it after
        committing tokens ``0..p-1``. Returns logits [R, B-1, V].

        The R blocks are one row of ``R * B`` queries against the context followed by every
        block, under a block-structured mask (example, B = 2, roots at 1 and 2: the queries
        at 1, 2 see context 0 and keys 1, 2; the queries at 2, 3 see context 0, 1 and keys
        2, 3), so a recorder drafts every position of a sequence in a few forwards."""
        c, b = self.config, self.config.block_size
        roots = root_positions.to(self.device, torch.int64)  # [R]
        r = int(roots.shape[0])
        ctx_len = int(roots.max()) if r else 0
        if r == 0 or int(roots.min()) < 1 or ctx_len > context_hidden.shape[0]:
            raise ValueError(
                f"root_positions must be non-empty and in 1..{context_hidden.shape[0]} (the "
                f"context rows), got {root_positions.tolist()[:8]}"
            )
        if not bool(((root_tokens >= 0) & (root_tokens < c.vocab_size)).all()):
            raise ValueError(f"root_tokens outside the vocabulary 0..{c.vocab_size - 1}")
        ctx_positions = torch.arange(ctx_len, device=self.device)[None]  # [1, C]
        feats = self.model.context(context_hidden[:ctx_len].to(self.device, self.dtype)[None])
        ids = torch.full((r, b), c.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = root_tokens.to(self.device)
        positions = (roots[:, None] + torch.arange(b, device=self.device)).view(1, r * b)
        emb = self.embed_tokens(ids.view(1, r * b)).to(self.dtype) * c.input_embedding_scale
        block_of = torch.arange(r, device=self.device).repeat_interleave(b)  # [R*B]
        sees_context = ctx_positions[0][None, :] < roots.repeat_interleave(b)[:, None]
        own_block = block_of[:, None] == block_of[None, :]  # [R*B, R*B]
        visible = torch.cat([sees_context, own_block], 1)[None, None]  # [1, 1, R*B, C+R*B]
        kv = self.model.context_kv(feats, ctx_positions)
        keys = torch.cat([ctx_positions, positions], 1)  # [1, C + R*B]
        hidden = self.model.block_hidden(emb, positions, kv, keys, visible)
        logits = self.model.logits(hidden.view(r, b, -1)[:, 1:], self.lm_head)  # [R, B-1, V]
        if self.check_finite:
            check_finite(
                logits, lambda: f"drafter {self.info.name}: NaN/inf logits in a batch of {r} blocks"
            )
        return logits

    def _step(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        """One propose through the runner the engine mode picked (one input pipeline and one
        forward, :func:`_draft_step`, for both)."""
        return self._runner.step(context_hidden, root_token)

    def run_forward(
        self,
        forward,
        context: torch.Tensor,  # [1, T, F] new context rows
        end: int,  # seen + the real new rows: the root's slot
        keys: int,  # slots attended over
        root_token: int,
        masked: bool,  # keys past the block hidden (padded inputs)
    ) -> torch.Tensor:
        """Fill the step's inputs, call ``forward`` (:func:`_draft_step`, eager or compiled)
        and count the new rows as seen. Returns logits [B-1, K] (K = V without a draft
        vocabulary)."""
        self._seen_t.fill_(self.seen)
        self._block_start.fill_(end)
        self._block[0, 0] = root_token
        key_positions = self._key_positions(keys)
        if masked:
            key_positions = mark_key_dim(key_positions)
        logits = forward(
            self.model,
            self.embed_tokens,
            self.draft_head,
            context,
            self._seen_t,
            self._block,
            self._block_start,
            key_positions,
            self._k,
            self._v,
            masked=masked,
        )
        self.seen = end
        return logits

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def _ensure(self, needed: int) -> None:
        """Grow the cache buffers (geometrically) to at least ``needed`` slots."""
        have = self._k.shape[1]
        if needed <= have:
            return
        size = max(needed, 2 * have)
        for name in ("_k", "_v"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], size, *old.shape[2:])
            grown[:, : self.seen] = old[:, : self.seen]
            setattr(self, name, grown)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        target,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> DFlashDrafter:
        """Load a z-lab-format directory (config.json + safetensors) for ``target``, whose
        embedding and LM head it shares. ``dtype``/``device`` None: the target's. Its config is
        not checked against the target here: ``ddtree.models.load_drafter`` checks it first
        (``ddtree.models.compat.check_drafter_compat``, once per load)."""
        from ddtree.models.checkpoint import load_safetensors, match_state_dict, read_config
        from ddtree.models.linear import prepare_linears

        path = Path(path)
        raw = read_config(path)
        config = DFlashConfig.from_dict(raw, str(path / "config.json"))
        dtype = dtype or target.dtype
        device = device or target.device
        with torch.device("meta"):
            model = DFlashModel(config)
        tensors = load_safetensors(path)
        # published drafters may carry the target's embedding/head copies: not ours to load
        tensors = {
            k: v for k, v in tensors.items() if not k.startswith(("embed_tokens.", "lm_head."))
        }
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        match_state_dict(expected, tensors, str(path))
        model = model.to_empty(device=device)
        model.load_state_dict(tensors)
        drafter = cls(model.to(dtype), target.embed_tokens, target.lm_head, name=path.name)
        prepare_linears(drafter)
        return drafter

    def block_logits(self, context_hidden, block_ids, **positions) -> torch.Tensor:
        """:meth:`DFlashModel.block_logits` with this drafter's shared embedding and LM head:
        context_hidden [R, C, F], block_ids [R, B] -> [R, B-1, V]."""
        return self.model.block_logits(
            context_hidden.to(self.device, self.dtype),
            block_ids.to(self.device),
            self.embed_tokens,
            self.lm_head,
            **positions,
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Write a z-lab format directory: config.json + model.safetensors (the drafter's own
        tensors; no embedding or LM head)."""
        from ddtree.models.checkpoint import save_safetensors

        save_safetensors(path, self.model.state_dict(), self.config.to_dict())


class EagerDraftStep:
    """Eager proposes of a :class:`DFlashDrafter`: the new context rows and the keys at their
    exact counts."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter

    def step(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        d = self.drafter
        end = d.seen + int(context_hidden.shape[0])
        keys = end + d.block_size
        d._ensure(keys)
        return d.run_forward(_draft_step, context_hidden[None], end, keys, root_token, False)


class CompiledDraftStep:
    """Compiled proposes of a :class:`DFlashDrafter`: one graph of static shapes. It only
    pads: the new context to B rows (a longer one, the prompt, appended eagerly first), the
    keys to a whole bucket, hiding what is padded."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.forward = CompiledForward(_draft_step, drafter.device)

    def warm_up(self) -> float:
        """Compile the graph; returns the seconds that took."""
        d = self.drafter
        return self.forward.warm_up(lambda: self.step(d._context[0, :1], 0))

    def step(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        d, b = self.drafter, self.drafter.block_size
        if context_hidden.shape[0] > b:
            head = context_hidden[:-b]
            d._ensure(d.seen + head.shape[0])
            d._seen_t.fill_(d.seen)
            _append_context(d.model, head[None], d._seen_t, d._k, d._v)
            d.seen += int(head.shape[0])
            context_hidden = context_hidden[-b:]
        t_new = int(context_hidden.shape[0])
        end = d.seen + t_new
        keys = kv_bucket(end + b)
        d._ensure(keys)
        d._context[0, :t_new] = context_hidden
        d._context[0, t_new:] = 0
        cache_input(d._k, capacity_dim=1)
        cache_input(d._v, capacity_dim=1)
        return d.run_forward(self.forward, d._context, end, keys, root_token, True)


def _append_context(
    model: DFlashModel,
    context_hidden: torch.Tensor,  # [1, T, F] target hidden states of the new context rows
    start: torch.Tensor,  # [] int64: their first slot (= position)
    k_cache: torch.Tensor,  # [L, capacity, kv_heads, D]
    v_cache: torch.Tensor,
) -> None:
    """Write the context keys/values of T rows at slots ``start .. start+T-1``."""
    slots = start + torch.arange(context_hidden.shape[1], device=context_hidden.device)
    for layer, (k, v) in enumerate(model.context_kv(model.context(context_hidden), slots[None])):
        CacheView(k_cache, v_cache, layer, slots, 0).store(k, v)


def _draft_step(
    model: DFlashModel,
    embed_tokens: nn.Module,
    lm_head: nn.Module,
    context_hidden: torch.Tensor,  # [1, T, F] new context rows (compiled: padded to B)
    context_start: torch.Tensor,  # [] int64: slot of the first new context row (= seen)
    block_ids: torch.Tensor,  # [1, B] int64: [root, MASK x (B-1)]
    block_start: torch.Tensor,  # [] int64: the root's slot and position (seen + real rows)
    key_positions: torch.Tensor,  # [K] int64: 0..K-1, the slots attended over
    k_cache: torch.Tensor,  # [L, capacity, kv_heads, D]
    v_cache: torch.Tensor,
    masked: bool,
) -> torch.Tensor:
    """One propose, eager or compiled: append the context rows, write the block's rows right
    after the real ones (over any padding), attend over slots ``0..K-1`` (``masked``: keys
    past the block hidden). Slot = position, so windowed/causal masks read the slots.
    Returns logits [B-1, V], or [B-1, K] when ``lm_head`` is a draft vocabulary's head."""
    _append_context(model, context_hidden, context_start, k_cache, v_cache)
    b = block_ids.shape[1]
    block_positions = (block_start + torch.arange(b, device=block_ids.device))[None]  # [1, B]
    emb = embed_tokens(block_ids).to(k_cache.dtype) * model.config.input_embedding_scale
    n_keys = key_positions.shape[0]
    views = [
        CacheView(k_cache, v_cache, layer, block_positions[0], n_keys)
        for layer in range(k_cache.shape[0])
    ]
    valid = (key_positions < block_start + b)[None, None, None] if masked else None  # [1,1,1,K]
    hidden = model.block_hidden(emb, block_positions, views, key_positions[None], valid)
    return model.logits(hidden[0, 1:], lm_head)  # [B-1, the head's rows]
