"""Our Qwen3 (dense and MoE) and Llama-3 decoders in plain PyTorch, with a static KV cache: the
targets every published DFlash drafter serves (Qwen3-4B/8B, Llama-3.1-8B, Qwen3-Coder-30B-A3B)
in both engine modes.

Conventions follow transformers' ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` and
``Qwen3MoeForCausalLM`` (5.x) exactly, so a checkpoint written for them loads with identity
parameter names and gives the same logits:

- grouped-query attention (``num_key_value_heads``), rotate-half RoPE (default, ``linear``,
  Llama-3.1's ``llama3`` or ``yarn`` scaling), ``attention_bias`` on q/k/v/o;
- Qwen3: RMSNorm of every query and key head (``q_norm``/``k_norm``) before RoPE;
- Qwen3-MoE: a softmax router over ``num_experts`` (float32), the top ``num_experts_per_tok``
  renormalised when ``norm_topk_prob``, SiLU experts; a layer is sparse when ``(i + 1) %
  decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``;
- tied or untied embeddings (``tie_word_embeddings``).

The KV cache holds, per layer, keys and values ``[kv_heads, capacity, head_dim]`` (one
tensor each, heads first so attention reads each head's keys contiguously), preallocated and
grown geometrically; attention is ``ddtree.models.nn.attention.grouped_attention`` (no dense mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.base import ModelInfo
from ddtree.models.nn.attention import AttentionInputs, grouped_attention
from ddtree.models.nn.causal_lm import CausalLM
from ddtree.models.nn.layers import (
    ConfigError,
    Experts,
    GatedMLP,
    RMSNorm,
    RopeSpec,
    RopeTables,
    Rotary,
    fuse_experts,
)


@dataclass(frozen=True)
class Family:
    """What tells the architectures apart (one entry per ``model_type``)."""

    qk_norm: bool  # RMSNorm per query/key head before RoPE (Qwen3)
    moe: bool  # routed-expert layers (Qwen3-MoE)
    default_head_dim: int | None  # None: hidden_size // num_attention_heads


FAMILIES: dict[str, Family] = {
    "llama": Family(qk_norm=False, moe=False, default_head_dim=None),
    "qwen3": Family(qk_norm=True, moe=False, default_head_dim=128),
    "qwen3_moe": Family(qk_norm=True, moe=True, default_head_dim=128),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope: RopeSpec
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = ""
    family: Family = field(init=False)

    def __post_init__(self) -> None:
        self.family = FAMILIES[self.model_type]
        self.architecture = self.architecture or ARCHITECTURES[self.model_type]
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.family.moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"config: num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"1..num_experts={self.num_experts}"
            )

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts (transformers' rule)."""
        return (
            self.family.moe
            and self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> DecoderConfig:
        """From a Hugging Face Llama / Qwen3 / Qwen3-MoE ``config.json`` dict."""
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(
                f"{source}: field model_type={model_type!r}, expected one of {', '.join(FAMILIES)}"
            )
        family = FAMILIES[model_type]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: field hidden_act={cfg['hidden_act']!r}, expected 'silu'")
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
            raise ConfigError(
                f"{source}: sliding-window attention layers (use_sliding_window / layer_types) "
                f"are not supported by the decoder; use impl 'hf'"
            )
        if cfg.get("pretraining_tp", 1) != 1:
            raise ConfigError(f"{source}: field pretraining_tp={cfg['pretraining_tp']}, expected 1")
        if cfg.get("quantization_config"):
            raise ConfigError(
                f"{source}: field quantization_config is set; only unquantised weights load"
            )
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            n_layers = int(cfg["num_hidden_layers"])
            head_dim = cfg.get("head_dim") or family.default_head_dim or hidden // heads
            layer_types = cfg.get("layer_types")
            if layer_types is not None and len(layer_types) != n_layers:
                raise ConfigError(
                    f"{source}: field layer_types has {len(layer_types)} entries, expected "
                    f"num_hidden_layers={n_layers}"
                )
            eos = cfg.get("eos_token_id")
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=n_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(cfg["max_position_embeddings"]),
                rope=RopeSpec.from_hf(cfg, int(head_dim), source),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
                num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
                eos_token_ids=()
                if eos is None
                else tuple(eos)
                if isinstance(eos, list)
                else (int(eos),),
                architecture=(cfg.get("architectures") or [ARCHITECTURES[model_type]])[0],
            )
        except KeyError as err:
            raise ConfigError(f"{source}: missing field {err.args[0]}") from None
        except (TypeError, ValueError) as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"{source}: a field has the wrong type: {err}") from None


class KVCache:
    """Per layer keys and values ``[kv_heads, capacity, head_dim]``; rows ``:length`` are
    committed, a forward writes its M rows after them provisionally. Capacity doubles when
    needed (up to ``max_position_embeddings``; never a per-step copy)."""

    capacity_dim = 1

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def __init__(self, config: DecoderConfig, capacity: int, dtype: torch.dtype, device) -> None:
        c = config
        self.shape = (c.num_key_value_heads, capacity, c.head_dim)
        self.max_capacity = c.max_position_embeddings
        self.n_layers = c.num_hidden_layers
        self.k = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(self.n_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.length = 0

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[1])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(k_0, v_0, k_1, v_1, ...): layer i reads entries 2i and 2i + 1."""
        return tuple(t for pair in zip(self.k, self.v, strict=True) for t in pair)

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def ensure(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        size = min(max(needed, 2 * self.capacity), max(needed, self.max_capacity))
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                grown = old.new_zeros(old.shape[0], size, old.shape[2])
                grown[:, : self.length] = old[:, : self.length]
                buffers[i] = grown

    def compact(self, src: torch.Tensor, dst: torch.Tensor, new_len: int) -> None:
        """Move rows ``src`` [tau] to ``dst`` [tau] in every layer; keep ``new_len`` rows."""
        for t in self.tensors():
            t[:, dst] = t[:, src]
        self.length = new_len


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q_out, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv_out, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv_out, bias=c.attention_bias)
        self.o_proj = nn.Linear(q_out, c.hidden_size, bias=c.attention_bias)
        if c.family.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.qk_norm = c.family.qk_norm
        self.scale = c.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [M, H]
        rope: RopeTables,
        attn: AttentionInputs,
        caches: tuple[torch.Tensor, torch.Tensor],  # this layer's keys, values [kvh, cap, D]
    ) -> torch.Tensor:
        m = x.shape[0]
        q = self.q_proj(x).view(m, self.heads, self.head_dim)
        k = self.k_proj(x).view(m, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(m, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope.apply(q.transpose(0, 1))  # [nh, M, D]
        k = rope.apply(k.transpose(0, 1))  # [kvh, M, D]
        k_cache, v_cache = caches
        k_cache.index_copy_(1, attn.write_slots, k)
        v_cache.index_copy_(1, attn.write_slots, v.transpose(0, 1))
        out = grouped_attention(q, k_cache, v_cache, attn, self.scale)  # [nh, M, D]
        return self.o_proj(out.transpose(0, 1).reshape(m, -1))


class SoftmaxRouter(nn.Module):
    """Qwen3-MoE's router: softmax over all experts in float32, the top k, renormalised when
    ``norm_topk_prob``; weights in the model dtype (as transformers)."""

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size))
        self.top_k, self.normalize = c.num_experts_per_tok, c.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] -> (weights [M, k] in x's dtype, expert ids [M, k] int64)."""
        logits = F.linear(x, self.weight)  # [M, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class SparseMoe(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.gate = SoftmaxRouter(c)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids)


class DecoderLayer(nn.Module):
    def __init__(self, c: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(c, layer_idx)
        if c.sparse(layer_idx):
            self.mlp = SparseMoe(c)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, rope: RopeTables, attn: AttentionInputs, caches) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, attn, caches)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """``model.*`` of the checkpoint: embedding, decoder layers, final norm."""

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.rotary_emb = Rotary(c.rope)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DecoderModel(CausalLM):
    """The Llama / Qwen3 / Qwen3-MoE causal LM. Parameter names equal transformers'."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def layer_caches(self, caches: tuple[torch.Tensor, ...], layer: int) -> tuple:
        """(keys, values) of decoder layer ``layer`` (``KVCache.tensors`` order): a layer
        never sees another's, so every layer runs the same code (one compiled graph)."""
        return caches[2 * layer : 2 * layer + 2]


def expected_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` a checkpoint must provide (a tied LM head is not needed)."""
    with torch.device("meta"):
        model = DecoderModel(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    return expected


def build_model(
    config: DecoderConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device
) -> DecoderModel:
    """The model from checked ``tensors``, in ``dtype`` on ``device`` (allocated once, in
    ``dtype``: a real-size checkpoint is never held in float32 on the way)."""
    with torch.device("meta"):
        model = DecoderModel(config).to(dtype)
    model = model.to_empty(device=device)
    model.load_state_dict(tensors, strict=False, assign=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.reset_inv_freq()
    return model


def fuse_checkpoint_experts(tensors: dict[str, torch.Tensor], config: DecoderConfig, source: str):
    """Per-expert tensors of a published Qwen3-MoE checkpoint, fused layer by layer."""
    for layer in range(config.num_hidden_layers):
        if config.sparse(layer):
            fuse_experts(tensors, f"model.layers.{layer}.mlp.experts.", config.num_experts, source)
    return tensors


def model_info(config: DecoderConfig, model: nn.Module, name: str, dtype: torch.dtype) -> ModelInfo:
    return ModelInfo(
        name=name,
        architecture=config.architecture,
        implementation="decoder",
        n_params=sum(p.numel() for p in model.parameters()),
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        dtype=str(dtype).removeprefix("torch."),
        max_position=config.max_position_embeddings,
        eos_token_ids=config.eos_token_ids,
    )
