"""Our DeepSeek-V3 / Kimi-K2 style MLA + MoE target in plain PyTorch.

Conventions follow transformers' ``DeepseekV3ForCausalLM`` (5.x) exactly, so that a checkpoint
written for it loads with identity parameter names and gives the same logits:

- MLA: optional q LoRA (``q_a_proj -> q_a_layernorm -> q_b_proj``, or a plain ``q_proj``), a kv
  LoRA latent (``kv_a_proj_with_mqa`` gives ``[latent kv_lora_rank | rope key rope_dim]``, the
  latent is RMS-normed), ``kv_b_proj`` expands the latent into per-head nope keys and values.
- Decoupled RoPE on ``qk_rope_head_dim`` dims, interleaved pairs when ``rope_interleave``;
  YaRN scaling scales cos/sin by ``attention_factor`` and the softmax scale by
  ``mscale(factor, mscale_all_dim) ** 2``.
- MoE router: sigmoid scores, ``+ e_score_correction_bias`` for choosing only, groups ranked by
  the sum of their top-2 scores, ``topk_group`` groups kept, top-k experts, weights from the
  uncorrected scores, optionally normalised, times ``routed_scaling_factor``; shared experts
  always added; the first ``first_k_dense_replace`` layers are dense MLPs.

The KV cache holds, per layer and token, the normed kv latent and the rotated rope key in one
row ``[kv_lora_rank + rope_dim]`` (preallocated, grown geometrically). Attention is either
``naive`` (materialise per-head K/V from the latent) or ``absorbed`` (fold ``W_UK`` into the
query and ``W_UV`` after the attention: one query head group against the latent rows, which
serve as both keys and values). Both attend without a dense mask
(``ddtree.models.nn.attention``). ``ddtree.models.adapters.mla_moe.MlaMoeTarget`` adapts the
model to the ``Target`` protocol (its engine modes from the shared ``CachedTarget``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.loading.quant import QuantScheme, scheme_from_config
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
    yarn_mscale,
)

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")  # config.json model_type values
ARCHITECTURES = ("DeepseekV3ForCausalLM",)
ATTN_IMPLS = ("absorbed", "naive")
# Router group score: sum of the top-2 expert scores of each group (DeepSeek-V3 "noaux_tc").
GROUP_SCORE_TOPK = 2
# transformers' router adds this to the normalisation denominator.
ROUTER_NORM_EPS = 1e-20


@dataclass
class MlaMoeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_shared_experts: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool = True
    rope_scaling: dict = field(default_factory=dict)  # {} or the yarn parameters
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = ARCHITECTURES[0]
    quantization: QuantScheme | None = (
        None  # of the checkpoint's weights (ddtree.models.loading.quant)
    )
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers stored after the others
    # derived in __post_init__
    qk_head_dim: int = 0
    softmax_scale: float = 0.0
    rope_attention_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_experts_per_tok", "n_group", "topk_group"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config field {name}={getattr(self, name)}: expected >= 1")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"config field n_routed_experts={self.n_routed_experts} is not divisible by "
                f"n_group={self.n_group}"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(f"config field topk_group={self.topk_group} > n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if per_group < GROUP_SCORE_TOPK and self.n_group > 1:
            raise ConfigError(f"config: {per_group} experts per group, group scoring needs >= 2")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(
                f"config field num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                f"{self.topk_group * per_group} experts in topk_group={self.topk_group} groups"
            )
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        scale = self.qk_head_dim**-0.5
        self.rope_attention_factor = self.rope.attention_factor
        mscale_all_dim = self.rope_scaling.get("mscale_all_dim")
        if self.rope_scaling and mscale_all_dim:  # DeepSeek's YaRN softmax correction
            scale = scale * yarn_mscale(float(self.rope_scaling["factor"]), mscale_all_dim) ** 2
        self.softmax_scale = scale

    @property
    def rope(self) -> RopeSpec:
        """The decoupled RoPE on ``qk_rope_head_dim`` dims (YaRN when ``rope_scaling``)."""
        kind = "yarn" if self.rope_scaling else "default"
        return RopeSpec(self.qk_rope_head_dim, self.rope_theta, kind, dict(self.rope_scaling))

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> MlaMoeConfig:
        """Build from a Hugging Face DeepseekV3 / Kimi-K2 ``config.json`` dict."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: field model_type={model_type!r}, expected one of {SUPPORTED_MODEL_TYPES}"
            )
        expected_values = {
            "hidden_act": "silu",
            "attention_bias": False,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "pretraining_tp": 1,
        }
        for name, value in expected_values.items():
            if name in cfg and cfg[name] != value:
                raise ConfigError(
                    f"{source}: field {name}={cfg[name]!r} unsupported, expected {value!r}"
                )
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ConfigError(
                f"{source}: field num_key_value_heads={kv_heads} must equal num_attention_heads={heads}"
            )
        rope = RopeSpec.from_hf(cfg, int(cfg.get("qk_rope_head_dim") or 0), source)
        if rope.kind not in ("default", "yarn"):
            raise ConfigError(
                f"{source}: field rope_type={rope.kind!r}, expected 'default' or 'yarn'"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        try:
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads,
                n_shared_experts=cfg.get("n_shared_experts") or 0,
                n_routed_experts=cfg["n_routed_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                n_group=cfg.get("n_group") or 1,
                topk_group=cfg.get("topk_group") or 1,
                first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                kv_lora_rank=cfg["kv_lora_rank"],
                q_lora_rank=cfg.get("q_lora_rank"),
                qk_rope_head_dim=cfg["qk_rope_head_dim"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"],
                v_head_dim=cfg["v_head_dim"],
                max_position_embeddings=cfg["max_position_embeddings"],
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope.theta,
                rope_interleave=bool(cfg.get("rope_interleave", True)),
                rope_scaling=rope.params if rope.kind == "yarn" else {},
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
                architecture=(cfg.get("architectures") or ARCHITECTURES)[0],
                quantization=scheme_from_config(cfg, source),
            )
        except KeyError as err:
            raise ConfigError(f"{source}: missing field {err.args[0]}") from None


@dataclass(frozen=True)
class ModelShard:
    """The slice of the model one rank of a tensor/expert-parallel group holds.

    Attention heads and the dense and shared MLP intermediates are split across ranks (column
    split in, row split out); routed experts are split by intermediate (TP) and/or by expert
    (EP: ``first_expert .. first_expert + n_experts - 1``). Each sublayer then returns a
    partial sum of its output that ``reduce`` (an all-reduce over the group) completes: two
    reductions per decoder layer. ``lm_head`` False: this rank computes no logits.
    ``ModelShard.whole(config)`` is the single-process model.
    """

    heads: int
    dense_intermediate: int
    shared_intermediate: int
    first_expert: int
    n_experts: int
    expert_intermediate: int
    lm_head: bool = True
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def whole(cls, config: MlaMoeConfig) -> ModelShard:
        return cls(
            heads=config.num_attention_heads,
            dense_intermediate=config.intermediate_size,
            shared_intermediate=config.moe_intermediate_size * config.n_shared_experts,
            first_expert=0,
            n_experts=config.n_routed_experts,
            expert_intermediate=config.moe_intermediate_size,
        )


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class LatentCache:
    """Per layer, per token: ``[kv latent (kv_lora_rank) | rotated rope key (rope_dim)]``.

    ``rows[l, :length]`` are committed; a forward writes its M rows after them provisionally.
    Capacity doubles when needed (never a per-step copy of the whole cache). One tensor for
    every layer: a layer writes into it by its index (a write through a per-layer view would
    become a copy of the whole cache inside a compiled graph).
    """

    capacity_dim = 1

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def __init__(self, config: MlaMoeConfig, capacity: int, dtype: torch.dtype, device) -> None:
        self.n_layers = config.num_hidden_layers
        self.row_dim = config.kv_lora_rank + config.qk_rope_head_dim
        self.max_capacity = config.max_position_embeddings
        self.rows = torch.zeros(self.n_layers, capacity, self.row_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return int(self.rows.shape[1])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.rows,)

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def ensure(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_capacity = min(max(needed, 2 * self.capacity), max(needed, self.max_capacity))
        grown = self.rows.new_zeros(self.n_layers, new_capacity, self.row_dim)
        grown[:, : self.length] = self.rows[:, : self.length]
        self.rows = grown

    def compact(self, src: torch.Tensor, dst: torch.Tensor, new_len: int) -> None:
        """Move rows ``src`` [tau] to ``dst`` [tau] in every layer; keep ``new_len`` rows."""
        self.rows[:, dst] = self.rows[:, src]
        self.length = new_len


class Router(nn.Module):
    """Sigmoid router with correction bias and group limiting (parameters kept in float32)."""

    def __init__(self, config: MlaMoeConfig) -> None:
        super().__init__()
        self.config = config
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] -> (weights [M, k] float32, expert ids [M, k] int64)."""
        c = self.config
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [M, E]
        choice = scores + self.e_score_correction_bias
        if c.n_group > 1:
            grouped = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
            group_scores = grouped.topk(GROUP_SCORE_TOPK, dim=-1)[0].sum(dim=-1)  # [M, G]
            keep = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            expert_mask = group_mask.repeat_interleave(c.n_routed_experts // c.n_group, dim=1)
            choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTER_NORM_EPS)
        return weights * c.routed_scaling_factor, ids


class MoE(nn.Module):
    def __init__(self, config: MlaMoeConfig, shard: ModelShard | None = None) -> None:
        super().__init__()
        shard = shard or ModelShard.whole(config)
        self.gate = Router(config)
        self.experts = Experts(shard.n_experts, config.hidden_size, shard.expert_intermediate)
        self.shared_experts = GatedMLP(config.hidden_size, shard.shared_intermediate)
        self.first_expert = shard.first_expert
        self.all_experts = shard.n_experts == config.n_routed_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.all_experts:
            routed = self.experts(x, weights, ids)
        else:
            routed = self._local_experts(x, weights, ids)
        return routed + self.shared_experts(x)

    def _local_experts(self, x, weights, ids) -> torch.Tensor:
        """Expert parallel: the slots routed to this rank's experts, [M, H] (zero rows for
        tokens routed elsewhere; the other ranks' partial sums add the rest)."""
        k, n = ids.shape[1], self.experts.gate_up_proj.shape[0]
        local = ids.reshape(-1) - self.first_expert  # [M*k] index among this rank's experts
        slots = ((local >= 0) & (local < n)).nonzero().squeeze(1)  # [S]
        tokens = slots // k
        y = self.experts(x[tokens], weights.reshape(-1)[slots, None], local[slots, None])
        return torch.zeros_like(x).index_add_(0, tokens, y)


class Attention(nn.Module):
    """MLA over ``heads`` query heads (default all; a TP rank holds a slice, latent replicated)."""

    def __init__(
        self, config: MlaMoeConfig, attn_impl: str, heads: int | None = None, layer_idx: int = 0
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        self.attn_impl = attn_impl
        self.layer_idx = layer_idx  # its rows in the [n_layers, capacity, row] latent cache
        self.heads = c.num_attention_heads if heads is None else heads
        h, nh = c.hidden_size, self.heads
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, nh * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(nh * c.v_head_dim, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [M, H]
        rope: RopeTables,
        attn: AttentionInputs,
        caches: tuple[torch.Tensor, ...],  # (rows [n_layers, capacity, r + rope_dim],)
    ) -> torch.Tensor:
        c = self.config
        m, nh = x.shape[0], self.heads
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(m, nh, c.qk_head_dim).transpose(0, 1)  # [nh, M, dq]
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_rope = rope.apply(q_rope)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        new = torch.cat([self.kv_a_layernorm(latent), rope.apply(k_rope)], -1)
        # written into the whole cache tensor, not a per-layer view: a compiled graph updates
        # an input in place, but a write through a view of it copies the whole cache per layer
        (cache_rows,) = caches
        layer = torch.full_like(attn.write_slots, self.layer_idx)
        cache_rows.index_put_((layer, attn.write_slots), new)
        rows = cache_rows[self.layer_idx]  # [capacity, r + rope_dim]
        if self.attn_impl == "absorbed":
            out = self._absorbed(q_nope, q_rope, rows, attn)
        else:
            out = self._naive(q_nope, q_rope, rows, attn)
        return self.o_proj(out.transpose(0, 1).reshape(m, nh * c.v_head_dim))

    def _naive(self, q_nope, q_rope, rows, attn: AttentionInputs) -> torch.Tensor:
        """Materialise per-head keys and values from the latent rows the forward attends
        (the prefix ``0 .. P-1`` and the tail slots): [nh, M, dv]. The values are zero-padded to the key width (the fused
        kernels take one head size)."""
        c = self.config
        p = attn.prefix_len  # the prefix rows, then the tail's slots (anywhere in the cache)
        seen = torch.cat([rows[:p], rows[attn.tail_slots]])  # [P+T, r + rope_dim]
        t = attn.tail_slots.shape[0]
        attn = dataclasses.replace(attn, tail_slots=p + torch.arange(t, device=rows.device))
        latent, k_rope = seen.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(seen.shape[0], self.heads, -1).transpose(0, 1)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [nh, P+T, *]
        k = torch.cat([k_nope, k_rope.expand(self.heads, -1, -1)], -1)
        v = F.pad(v, (0, c.qk_head_dim - c.v_head_dim))
        q = torch.cat([q_nope, q_rope], -1)  # [nh, M, dq]
        out = grouped_attention(q, k, v, attn, c.softmax_scale)
        return out[..., : c.v_head_dim]

    def _absorbed(self, q_nope, q_rope, rows, attn: AttentionInputs) -> torch.Tensor:
        """Fold W_UK into the query, attend over the latent rows (one KV head, which is also
        the value), apply W_UV after: [nh, M, dv]."""
        c = self.config
        nh, m = q_nope.shape[:2]
        w = self.kv_b_proj.weight.view(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)  # [nh, dn|dv, r]
        q_cat = torch.cat([q_nope @ w_uk, q_rope], dim=-1)  # [nh, M, r + rope_dim]
        latent_rows = rows[None]  # [1, capacity, r + rope_dim]: key and value of one head
        out = grouped_attention(q_cat, latent_rows, latent_rows, attn, c.softmax_scale)
        return out[..., : c.kv_lora_rank] @ w_uv.transpose(1, 2)  # [nh, M, dv]


class DecoderLayer(nn.Module):
    def __init__(
        self, config: MlaMoeConfig, layer_idx: int, attn_impl: str, shard: ModelShard | None = None
    ) -> None:
        super().__init__()
        shard = shard or ModelShard.whole(config)
        self.self_attn = Attention(config, attn_impl, shard.heads, layer_idx)
        if layer_idx >= config.first_k_dense_replace:
            self.mlp = MoE(config, shard)
        else:
            self.mlp = GatedMLP(config.hidden_size, shard.dense_intermediate)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.reduce = shard.reduce or _no_reduce  # sums the ranks' partial sublayer outputs

    def forward(self, x, rope: RopeTables, attn: AttentionInputs, caches) -> torch.Tensor:
        x = x + self.reduce(self.self_attn(self.input_layernorm(x), rope, attn, caches))
        return x + self.reduce(self.mlp(self.post_attention_layernorm(x)))


class Backbone(nn.Module):
    """``model.*`` of the checkpoint: embedding, decoder layers, final norm."""

    def __init__(
        self, config: MlaMoeConfig, attn_impl: str, shard: ModelShard | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, attn_impl, shard) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = Rotary(config.rope, interleave=config.rope_interleave)


class MlaMoeModel(CausalLM):
    """The MLA+MoE causal LM. Parameter names equal ``DeepseekV3ForCausalLM``'s.

    ``shard``: this rank's slice in a tensor/expert-parallel group (None: the whole model).
    A shard without ``lm_head`` returns ``[M, 0]`` logits.
    """

    def __init__(
        self, config: MlaMoeConfig, attn_impl: str = "absorbed", shard: ModelShard | None = None
    ) -> None:
        super().__init__()
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={attn_impl!r}, expected one of {ATTN_IMPLS}")
        self.config = config
        self.attn_impl = attn_impl
        self.model = Backbone(config, attn_impl, shard)
        self.lm_head = None
        if shard is None or shard.lm_head:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight


def expected_shapes(
    config: MlaMoeConfig, attn_impl: str = "absorbed", shard: ModelShard | None = None
) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` a checkpoint must provide (a tied LM head is not needed)."""
    with torch.device("meta"):
        model = MlaMoeModel(config, attn_impl, shard)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    return expected


def build_model(
    config: MlaMoeConfig,
    attn_impl: str,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str | torch.device,
    shard: ModelShard | None = None,
) -> MlaMoeModel:
    """The model (or one rank's ``shard`` of it) from checked ``tensors``, in ``dtype`` on
    ``device``; the router stays in float32, as transformers keeps it."""
    with torch.device("meta"):
        model = MlaMoeModel(config, attn_impl, shard)
    model = model.to_empty(device=device)
    model.load_state_dict(tensors, strict=False, assign=False)
    if config.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.reset_inv_freq()
    model = model.to(dtype)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
    return model


def fuse_per_expert(tensors: dict[str, torch.Tensor], config: MlaMoeConfig) -> dict:
    """Published DeepSeek/Kimi checkpoints store experts one by one
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``); stack them into the fused layout.
    The ``num_nextn_predict_layers`` multi-token-prediction layers stored after the decoder
    layers are dropped; layers beyond those stay, for the check to name as unexpected."""
    n = config.num_hidden_layers
    mtp = range(n, n + config.num_nextn_predict_layers)
    out = {k: v for k, v in tensors.items() if _layer_index(k) not in mtp}
    for layer in range(config.first_k_dense_replace, n):
        fuse_experts(
            out, f"model.layers.{layer}.mlp.experts.", config.n_routed_experts, "checkpoint"
        )
    return out


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None
