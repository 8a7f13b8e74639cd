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
query and ``W_UV`` after the attention: a few matmuls against the latent rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.models.base import ModelInfo, NonFiniteLogitsError, TargetOutput
from ddtree.models.static import (
    ENGINE_MODES,
    EagerLayouts,
    EnginePlan,
    KeyPositions,
    StaticLayout,
    StaticTree,
    cache_input,
    compile_forward,
    kv_bucket,
    mark_key_dim,
    pick_bucket,
    replay,
    static_attention_mask,
    timed,
)
from ddtree.tree.layout import VerifyLayout, compaction_indices
from ddtree.tree.types import DraftTree

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ATTN_IMPLS = ("absorbed", "naive")
# Router group score: sum of the top-2 expert scores of each group (DeepSeek-V3 "noaux_tc").
GROUP_SCORE_TOPK = 2
# transformers' router adds this to the normalisation denominator.
ROUTER_NORM_EPS = 1e-20


class ConfigError(ValueError):
    """A config.json field the MLA+MoE model does not support."""


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction (the formula of transformers' ``yarn_get_mscale``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


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
    architecture: str = "DeepseekV3ForCausalLM"
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
        if self.rope_scaling:
            factor = float(self.rope_scaling["factor"])
            mscale = self.rope_scaling.get("mscale")
            mscale_all_dim = self.rope_scaling.get("mscale_all_dim")
            attention_factor = self.rope_scaling.get("attention_factor")
            if attention_factor is None:
                if mscale and mscale_all_dim:
                    attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(
                        factor, mscale_all_dim
                    )
                else:
                    attention_factor = _yarn_mscale(factor)
            self.rope_attention_factor = float(attention_factor)
            if mscale_all_dim:
                scale = scale * _yarn_mscale(factor, mscale_all_dim) ** 2
        self.softmax_scale = scale

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
        if cfg.get("quantization_config"):
            raise ConfigError(
                f"{source}: field quantization_config is set; only unquantised weights load"
            )
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ConfigError(
                f"{source}: field num_key_value_heads={kv_heads} must equal num_attention_heads={heads}"
            )
        rope_theta, rope_scaling = _rope_from_hf(cfg, source)
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
                rope_theta=rope_theta,
                rope_interleave=bool(cfg.get("rope_interleave", True)),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                architecture=(cfg.get("architectures") or ["DeepseekV3ForCausalLM"])[0],
            )
        except KeyError as err:
            raise ConfigError(f"{source}: missing field {err.args[0]}") from None


def _rope_from_hf(cfg: dict, source: str) -> tuple[float, dict]:
    """(rope_theta, yarn parameters or {}) from ``rope_parameters`` (transformers 5) or the
    legacy ``rope_theta`` + ``rope_scaling`` fields of published checkpoints."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"{source}: missing field rope_theta (or rope_parameters.rope_theta)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), {}
    if rope_type != "yarn":
        raise ConfigError(f"{source}: field rope_type={rope_type!r}, expected 'default' or 'yarn'")
    for name in ("factor", "original_max_position_embeddings"):
        if params.get(name) is None:
            raise ConfigError(f"{source}: yarn rope field {name} is missing")
    return float(theta), params


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


def rope_inv_freq(config: MlaMoeConfig) -> torch.Tensor:
    """[rope_dim // 2] float32 inverse frequencies (plain, or YaRN-blended as transformers)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not config.rope_scaling:
        return 1.0 / pos_freqs
    p = config.rope_scaling
    factor = float(p["factor"])
    beta_fast = p.get("beta_fast") or 32  # YaRN paper defaults
    beta_slow = p.get("beta_slow") or 1
    original = p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions; ``apply`` rotates ``[..., M, rope_dim]`` tensors."""

    def __init__(self, config: MlaMoeConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.attention_factor = config.rope_attention_factor
        self.interleave = config.rope_interleave

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = position_ids[:, None].float() * self.inv_freq[None, :]  # [M, rope_dim/2]
        cos = (freqs.cos() * self.attention_factor).to(dtype)
        sin = (freqs.sin() * self.attention_factor).to(dtype)
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., M, rope_dim]; cos, sin [M, rope_dim/2]. Interleaved pairs (x0, x1), (x2, x3)
        are rotated and written de-interleaved (as transformers), else rotate-half."""
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LatentCache:
    """Per layer, per token: ``[kv latent (kv_lora_rank) | rotated rope key (rope_dim)]``.

    ``rows[l, :length]`` are committed; a forward writes its M rows after them provisionally.
    Capacity doubles when needed (never a per-step copy of the whole cache).
    """

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


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


class Experts(nn.Module):
    """Routed experts as fused 3D parameters (transformers' layout). ``n_experts`` and
    ``intermediate`` default to the config's (a parallel rank holds fewer or narrower ones)."""

    def __init__(
        self, config: MlaMoeConfig, n_experts: int | None = None, intermediate: int | None = None
    ) -> None:
        super().__init__()
        e = config.n_routed_experts if n_experts is None else n_experts
        i = config.moe_intermediate_size if intermediate is None else intermediate
        h = config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(e, h, i))  # [E, H, I]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [M, H]; weights, ids [M, k] -> [M, H]. Eager: tokens sorted by expert, a loop over
        the touched experts (data-dependent shapes); inside a compiled graph: a fixed-shape
        dispatch (:meth:`forward_static`)."""
        if torch.compiler.is_compiling():
            return self.forward_static(x, weights, ids)
        k = ids.shape[1]
        flat_ids = ids.reshape(-1)  # [M*k]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // k  # [M*k] token index of each sorted slot
        slot_weight = weights.reshape(-1)[order].to(x.dtype)
        out = torch.zeros_like(x)
        begin = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[begin : begin + count]
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, y * slot_weight[begin : begin + count, None])
            begin += count
        return out

    def forward_static(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Fixed-shape token-to-expert dispatch (no host sync, no data-dependent shapes), chosen
        by the static width: fewer token-expert pairs than experts (e.g. M = 1) gathers the
        chosen experts' weights per pair ([M*k, 2I, H]), reading only those; otherwise every
        expert runs on every token and a [M, E] combine matrix (the routing weight, 0 where
        not chosen) sums them, as a verify of M >= E/k tokens touches nearly all experts."""
        m, k = ids.shape
        n_experts = self.gate_up_proj.shape[0]
        w = weights.to(x.dtype)  # [M, k]
        if m * k < n_experts:
            flat = ids.reshape(-1)  # [M*k]
            xs = x.repeat_interleave(k, 0)[:, :, None]  # [M*k, H, 1]
            gate, up = torch.bmm(self.gate_up_proj[flat], xs)[..., 0].chunk(2, dim=-1)
            y = torch.bmm(self.down_proj[flat], (F.silu(gate) * up)[:, :, None])[..., 0]
            return (y.view(m, k, -1) * w[..., None]).sum(1)
        combine = torch.zeros(m, n_experts, dtype=x.dtype, device=x.device)
        combine = combine.scatter_add(1, ids, w)  # [M, E]
        gate, up = torch.einsum("mh,eih->emi", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("emi,ehi->emh", F.silu(gate) * up, self.down_proj)  # [E, M, H]
        return torch.einsum("emh,me->mh", y, combine)


class MoE(nn.Module):
    def __init__(self, config: MlaMoeConfig, shard: ModelShard | None = None) -> None:
        super().__init__()
        shard = shard or ModelShard.whole(config)
        self.gate = Router(config)
        self.experts = Experts(config, shard.n_experts, shard.expert_intermediate)
        self.shared_experts = MLP(config.hidden_size, shard.shared_intermediate)
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
        rope: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,  # [M, K] additive over cache slots 0..K-1
        cache_rows: torch.Tensor,  # [n_layers, capacity, r + rope_dim] the whole latent cache
        slots: torch.Tensor,  # [M] int64: where the new rows go (provisionally)
    ) -> torch.Tensor:
        c = self.config
        m, nh = x.shape[0], self.heads
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(m, nh, c.qk_head_dim).transpose(0, 1)  # [nh, M, dq]
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_rope = rope.apply(q_rope, *cos_sin)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        new = torch.cat([self.kv_a_layernorm(latent), rope.apply(k_rope, *cos_sin)], -1)
        # written into the whole cache tensor, not a per-layer view: a compiled graph updates
        # an input in place, but a write through a view of it copies the whole cache per layer
        layer = torch.full_like(slots, self.layer_idx)
        cache_rows.index_put_((layer, slots), new)
        rows = cache_rows[self.layer_idx, : mask.shape[-1]]  # [K, r + rope_dim]
        if self.attn_impl == "absorbed":
            out = self._absorbed(q_nope, q_rope, rows, mask)
        else:
            out = self._naive(q_nope, q_rope, rows, mask)
        return self.o_proj(out.transpose(0, 1).reshape(m, nh * c.v_head_dim))

    def _softmax(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = scores * self.config.softmax_scale + mask
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(mask.dtype)

    def _naive(self, q_nope, q_rope, rows, mask) -> torch.Tensor:
        """Materialise per-head keys and values from the latent: [nh, M, dv]."""
        c = self.config
        s = rows.shape[0]
        latent, k_rope = rows.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(s, self.heads, -1).transpose(0, 1)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [nh, S, *]
        scores = q_nope @ k_nope.transpose(1, 2) + q_rope @ k_rope.T  # [nh, M, S]
        return self._softmax(scores, mask) @ v

    def _absorbed(self, q_nope, q_rope, rows, mask) -> torch.Tensor:
        """Fold W_UK into the query, attend over latent rows, apply W_UV after: [nh, M, dv]."""
        c = self.config
        nh, m = q_nope.shape[:2]
        w = self.kv_b_proj.weight.view(nh, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)  # [nh, dn|dv, r]
        q_cat = torch.cat([q_nope @ w_uk, q_rope], dim=-1)  # [nh, M, r + rope_dim]
        scores = (q_cat.reshape(nh * m, -1) @ rows.T).view(nh, m, -1)  # [nh, M, S]
        probs = self._softmax(scores, mask)
        out_latent = (probs.reshape(nh * m, -1) @ rows[:, : c.kv_lora_rank]).view(nh, m, -1)
        return out_latent @ w_uv.transpose(1, 2)  # [nh, M, dv]


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
            self.mlp = MLP(config.hidden_size, shard.dense_intermediate)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.reduce = shard.reduce or _no_reduce  # sums the ranks' partial sublayer outputs

    def forward(self, x, rope, cos_sin, mask, cache_rows, slots) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, cos_sin, mask, cache_rows, slots)
        x = x + self.reduce(attn)
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
        self.rotary_emb = RotaryEmbedding(config)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [M, V]
    hidden: torch.Tensor | None  # [M, n_capture * H] or None


class MlaMoeModel(nn.Module):
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

    def forward(
        self,
        input_ids: torch.Tensor,  # [M] int64
        position_ids: torch.Tensor,  # [M] int64
        cache_slots: torch.Tensor,  # [M] int64: cache rows the new tokens are written to
        attn_mask: torch.Tensor,  # [M, K] additive float over cache rows 0..K-1
        cache_rows: torch.Tensor,  # [n_layers, capacity, r + rope_dim] (LatentCache.rows)
        capture_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Writes the M new rows at ``cache_slots`` (provisionally: the caller owns the length),
        then attends over rows ``0..K-1`` under ``attn_mask``. Eager and compiled modes both
        run this; they differ only in the shapes they pass (see ``ddtree.models.static``)."""
        m = input_ids.shape[0]
        assert input_ids.dim() == 1 and position_ids.shape == (m,) and cache_slots.shape == (m,), (
            input_ids.shape,
            position_ids.shape,
            cache_slots.shape,
        )
        assert attn_mask.dim() == 2 and attn_mask.shape[0] == m, (attn_mask.shape, m)
        x = self.model.embed_tokens(input_ids)  # [M, H]
        cos_sin = self.model.rotary_emb.cos_sin(position_ids, x.dtype)
        mask = attn_mask.to(x.dtype)
        captured = {0: x} if 0 in capture_layers else {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, self.model.rotary_emb, cos_sin, mask, cache_rows, cache_slots)
            if i + 1 in capture_layers:
                captured[i + 1] = x
        x = self.model.norm(x)
        n = len(self.model.layers)
        if n in capture_layers:  # transformers' last hidden_states entry is after the final norm
            captured[n] = x
        logits = self.lm_head(x) if self.lm_head is not None else x[:, :0]
        hidden = torch.cat([captured[i] for i in capture_layers], -1) if capture_layers else None
        return ForwardOutput(logits=logits, hidden=hidden)


def causal_mask(start: int, m: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """[1, 1, M, start+M] additive: prefix visible, new tokens causal among themselves."""
    mask = torch.zeros(1, 1, m, start + m, dtype=dtype, device=device)
    future = torch.ones(m, m, dtype=torch.bool, device=device).triu(1)
    mask[0, 0, :, start:].masked_fill_(future, torch.finfo(dtype).min)
    return mask


class MlaMoeTarget:
    """The ``Target`` protocol over :class:`MlaMoeModel` with a latent KV cache (batch of 1)."""

    engine_modes = ENGINE_MODES

    @torch.inference_mode(False)  # buffers a compiled graph reads: see static.py
    def __init__(
        self,
        model: MlaMoeModel,
        name: str = "mla_moe",
        capacity: int = 256,
        check_finite: bool = True,
    ) -> None:
        self.model = model.eval()
        self.config = model.config
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.check_finite = check_finite
        self.capture_layers: tuple[int, ...] = ()
        capacity = min(capacity, self.config.max_position_embeddings)
        self.cache = LatentCache(self.config, capacity, self.dtype, self.device)
        self._pending = 0  # M of the last verify, awaiting commit
        # engine mode (ddtree.models.static): the compiled forward and its static inputs
        self.engine = EnginePlan()
        self._layouts = EagerLayouts(self.dtype, self.device)
        self._compiled = None
        self._static: dict[int, StaticTree] = {}  # width bucket -> its preallocated inputs
        self._warm: set[tuple[int, tuple[int, ...]]] = set()  # (width, capture layers) compiled
        self._start = torch.zeros((), dtype=torch.int64, device=self.device)
        self._key_positions = KeyPositions(capacity, self.device)
        c = self.config
        n_params = sum(p.numel() for p in model.parameters())
        self.info = ModelInfo(
            name=name,
            architecture=c.architecture,
            implementation="mla_moe",
            n_params=n_params,
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            dtype=str(self.dtype).removeprefix("torch."),
            max_position=c.max_position_embeddings,
            eos_token_ids=c.eos_token_ids,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attn_impl: str = "absorbed",
        capacity: int = 4096,
        check_finite: bool = True,
    ) -> MlaMoeTarget:
        from ddtree.models.checkpoint import load_safetensors, match_state_dict, read_config

        path = Path(path)
        config = MlaMoeConfig.from_hf(read_config(path), source=str(path / "config.json"))
        tensors = _fuse_per_expert(load_safetensors(path), config)
        match_state_dict(expected_shapes(config, attn_impl), tensors, str(path))
        model = build_model(config, attn_impl, tensors, dtype, device)
        return cls(model, name=path.name, capacity=capacity, check_finite=check_finite)

    # --- protocol -------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.cache.length

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    def set_capture_layers(self, layer_ids: list[int]) -> None:
        n = self.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i <= n]
        if bad:
            raise ValueError(f"capture layer ids {bad} outside 0..{n} (HF hidden_states indexing)")
        self.capture_layers = tuple(layer_ids)

    def reset(self) -> None:
        self.cache.length = 0
        self._pending = 0

    @torch.inference_mode()
    def set_engine_mode(self, plan: EnginePlan) -> float:
        """Run the next requests eagerly or compiled (``ddtree.models.static``). Compiled mode
        compiles (warms up) each width bucket not compiled yet for the current capture layers
        and reserves the cache for ``plan.max_len``; returns the seconds that took (0 when
        nothing new compiled). Resets the cache."""
        self.engine = plan
        self.reset()
        if plan.mode == "eager":
            self._layouts.reserve(plan)
            return 0.0
        if self._compiled is None:
            self._compiled = compile_forward(_verify_static, self.device)
        self.cache.ensure(kv_bucket(plan.max_len + plan.widths[-1]))
        compile_s = 0.0
        for width in plan.widths:
            static = self._static.setdefault(width, StaticTree(width, self.device))
            if (width, self.capture_layers) not in self._warm:
                compile_s += timed(lambda s=static: self._run_static(s, s.width, 0, warm_up=True))
                self._warm.add((width, self.capture_layers))
        self.reset()
        return compile_s

    @torch.inference_mode()
    def layout(self, tree: DraftTree) -> VerifyLayout | StaticLayout:
        """What :meth:`verify` takes for ``tree`` (the engine times it as the layout stage):
        eager, ``verify_layout`` into a buffer reused across steps; compiled, the tree copied
        into its width bucket's preallocated inputs."""
        if self.engine.mode == "compiled":
            static = self._static[pick_bucket(tree.n_nodes, self.engine.widths)]
            return StaticLayout(static, static.fill(tree.tokens, tree.depth, tree.visibility))
        return self._layouts.fill(tree, self.seq_len)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        """Append T prompt tokens. Compiled mode runs them through the widest bucket's graph
        in causal chunks (each chunk a chain tree, committed whole)."""
        assert input_ids.dim() == 1, input_ids.shape  # [T] int64
        t, start = int(input_ids.shape[0]), self.seq_len
        self._check_positions(start + t, f"prompt of {t} tokens after {start} cached")
        self._pending = 0
        input_ids = input_ids.to(self.device)
        if self.engine.mode == "eager":
            mask = causal_mask(start, t, self.dtype, self.device)[0, 0]
            slots = torch.arange(start, start + t, device=self.device)
            out = self._forward(input_ids, slots, mask, slots)
            self.cache.length += t
            return out
        static = self._static[self.engine.widths[-1]]
        outs = []
        for chunk in input_ids.split(static.width):
            c = int(chunk.shape[0])
            chain = torch.ones(c, c, dtype=torch.bool, device=self.device).tril()
            static.fill(chunk, torch.arange(c, device=self.device), chain)
            out = self._run_static(static, c, self.seq_len)
            # copied: the next chunk replays the same graph (under CUDA graphs, into the same
            # output memory)
            hidden = None if out.hidden is None else out.hidden.clone()
            outs.append(TargetOutput(logits=out.logits.clone(), hidden=hidden))
            self.cache.length += c
        hidden = None if outs[0].hidden is None else torch.cat([o.hidden for o in outs])
        return TargetOutput(logits=torch.cat([o.logits for o in outs]), hidden=hidden)

    @torch.inference_mode()
    def verify(
        self, tree: DraftTree, layout: VerifyLayout | StaticLayout | None = None
    ) -> TargetOutput:
        m, start = tree.n_nodes, self.seq_len
        self._check_positions(
            start + int(tree.depth.max()) + 1, f"tree of depth {int(tree.depth.max())}"
        )
        if layout is None:
            layout = self.layout(tree)
        if self.engine.mode == "compiled":
            if not isinstance(layout, StaticLayout):
                raise TypeError("compiled mode: pass target.layout(tree) (a StaticLayout)")
            out = self._run_static(layout.static, layout.rows, start)
        else:
            mask = layout.attn_mask  # [1, 1, M, S+M]
            assert mask.shape == (1, 1, m, start + m), (mask.shape, m, start)
            slots = torch.arange(start, start + m, device=self.device)
            out = self._forward(
                tree.tokens.to(self.device),
                layout.position_ids.to(self.device),
                mask[0, 0].to(self.device),
                slots=slots,
            )
        self._pending = m
        return out

    @torch.inference_mode()
    def commit(self, accepted: torch.Tensor) -> None:
        assert accepted.dim() == 1, accepted.shape  # [tau] int64
        tau = int(accepted.shape[0])
        if self._pending == 0:
            raise RuntimeError("commit() without a preceding verify()")
        if tau < 1 or int(accepted[0]) != 0 or int(accepted.max()) >= self._pending:
            raise ValueError(
                f"accepted {accepted.tolist()}: expected root 0 first, ids < {self._pending}"
            )
        plan = compaction_indices(accepted.to(self.device), self.seq_len)
        self.cache.compact(plan.src, plan.dst, plan.new_len)
        self._pending = 0

    # --- internals ------------------------------------------------------------------------
    def _check_positions(self, needed: int, what: str) -> None:
        limit = self.config.max_position_embeddings
        if needed > limit:
            raise ValueError(f"{what} needs {needed} positions > max_position_embeddings={limit}")

    def _forward(self, ids, positions, mask, slots) -> TargetOutput:
        """Eager forward of M tokens at exact shapes: mask [M, S+M], slots [M]."""
        self.cache.ensure(int(mask.shape[-1]))
        out = self.model(ids, positions, slots, mask, self.cache.rows, self.capture_layers)
        return self._checked(out.logits, out.hidden, positions)

    def _run_static(
        self, static: StaticTree, rows: int, start: int, warm_up: bool = False
    ) -> TargetOutput:
        """Compiled forward of one width bucket after ``start`` committed rows; the first
        ``rows`` outputs are real, the padded ones are dropped here."""
        keys = kv_bucket(start + static.width)
        self.cache.ensure(keys)
        cache_input(self.cache.rows, capacity_dim=1)
        self._start.fill_(start)
        logits, hidden = replay(
            self._compiled,
            self.model,
            static.tokens,
            static.depth,
            self._start,
            static.visibility,
            mark_key_dim(self._key_positions(keys)),
            self.cache.rows,
            self.capture_layers,
            warm_up=warm_up,
        )
        hidden = None if hidden is None else hidden[:rows]
        return self._checked(logits[:rows], hidden, start + static.depth[:rows])

    def _checked(self, logits, hidden, positions) -> TargetOutput:
        # NaN/inf propagate into the sum (one cheap reduction instead of an elementwise test;
        # finite float32 logits cannot sum past float32's range at any real vocabulary size)
        if self.check_finite and not torch.isfinite(logits.sum(dtype=torch.float32)):
            raise NonFiniteLogitsError(
                f"{self.info.name}: NaN/inf in logits at positions "
                f"{int(positions.min())}..{int(positions.max())}"
            )
        return TargetOutput(logits=logits, hidden=hidden)


def _verify_static(
    model: MlaMoeModel,
    tokens: torch.Tensor,  # [Mb] int64
    depth: torch.Tensor,  # [Mb] int64
    start: torch.Tensor,  # [] int64: committed rows S
    visibility: torch.Tensor,  # [Mb, Mb] bool
    key_positions: torch.Tensor,  # [K] int64, 0..K-1 (K dynamic)
    cache_rows: torch.Tensor,  # [n_layers, capacity, r + rope_dim]
    capture_layers: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The compiled verify/prefill graph: positions, cache slots and the [Mb, K] mask are
    derived inside the graph from (S, depth, visibility), then the shared model forward."""
    slots = start + torch.arange(tokens.shape[0], device=tokens.device)
    mask = static_attention_mask(start, visibility, key_positions, cache_rows.dtype)
    out = model(tokens, start + depth, slots, mask, cache_rows, capture_layers)
    return out.logits, out.hidden


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
    model.model.rotary_emb.inv_freq = rope_inv_freq(config).to(device)
    model = model.to(dtype)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
    return model


def _fuse_per_expert(tensors: dict[str, torch.Tensor], config: MlaMoeConfig) -> dict:
    """Published DeepSeek/Kimi checkpoints store experts one by one
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``); stack them into the fused layout.
    Multi-token-prediction layers (index >= num_hidden_layers) are dropped."""
    n = config.num_hidden_layers
    out = {
        k: v
        for k, v in tensors.items()
        if not (
            k.startswith(f"model.layers.{n}.")
            or _layer_index(k) is not None
            and _layer_index(k) >= n
        )
    }
    for layer in range(config.first_k_dense_replace, n):
        prefix = f"model.layers.{layer}.mlp.experts."
        if prefix + "0.gate_proj.weight" not in out:
            continue
        gate_up, down = [], []
        for e in range(config.n_routed_experts):
            names = [f"{prefix}{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
            missing = [x for x in names if x not in out]
            if missing:
                raise KeyError(f"checkpoint: missing tensors {missing}")
            g, u, d = (out.pop(x) for x in names)
            gate_up.append(torch.cat([g, u], 0))
            down.append(d)
        out[prefix + "gate_up_proj"] = torch.stack(gate_up)
        out[prefix + "down_proj"] = torch.stack(down)
    return out


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None
