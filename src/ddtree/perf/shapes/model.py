"""Model shapes for the cost model: from a Hugging Face ``config.json`` or a built-in preset.

Only what moves bytes or FLOPs per decode step matters: per-layer attention weights and KV
bytes per token, routed / shared expert and dense-MLP weights, the LM head, each at its own
weight precision (bytes per parameter including quantisation scales).

Worked example (Kimi K2-Thinking): a routed expert is 3 x 7168 x 2048 = 44.04 M params; INT4
group-32 with a BF16 scale per group is 0.5 + 2/32 = 0.5625 B/param, so 24.8 MB per expert.

Presets are the published ``config.json`` shapes; ``source`` says where each was read (the
copies in ai-dynamo/aiconfigurator ``model_configs/`` where it has them).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ddtree.files import read_input_bytes

# bytes per parameter, scales included
PRECISION_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "fp8-block128": 1.0 + 4.0 / (128 * 128),  # float32 scale per 128x128 block
    "int8": 1.0,
    "int4": 0.5,  # per-output-channel scale (GPTQ/AWQ group_size -1): negligible
    "int4-g32": 0.5 + 2.0 / 32,  # bf16 scale per group of 32
    "int4-g64": 0.5 + 2.0 / 64,
    "int4-g128": 0.5 + 2.0 / 128,
    "fp4": 0.5 + 1.0 / 16,  # nvfp4: fp8 scale per 16
    "mxfp4": 0.5 + 1.0 / 32,  # OCP MX: an 8-bit (e8m0) scale per block of 32 (gpt-oss experts)
}
# the tensor-core precision a weight format computes in (weight-only int4 runs BF16 MMA)
COMPUTE_PRECISION = {
    "fp32": "bf16",
    "bf16": "bf16",
    "fp16": "bf16",
    "fp8": "fp8",
    "fp8-block128": "fp8",
    "int8": "bf16",  # weight-only: dequantised, as int4
    "int4": "bf16",
    "int4-g32": "bf16",
    "int4-g64": "bf16",
    "int4-g128": "bf16",
    "fp4": "fp4",
    "mxfp4": "bf16",  # dequantised into BF16 MMA by the Hopper-class kernels (assumed)
}
COMPONENTS = ("attention", "routed_experts", "shared_experts", "dense_mlp", "lm_head", "kv_cache")


@dataclass(frozen=True)
class SoftmaxLayers:
    """Softmax-attention layers of one shape: how many, their head dim and KV heads, how many
    K/V projections they keep (1 where the keys are the values), and the most keys they read
    (their window; None: the whole context)."""

    layers: int
    head_dim: int
    kv_heads: int
    kv_projections: int
    window: int | None

    def keys(self, context):
        """Cached keys one query of these layers reads at ``context``: the context, or at most
        the window."""
        return context if self.window is None else np.minimum(context, self.window)


class ModelError(ValueError):
    """A model config or preset the estimator cannot use."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    first_k_dense: int  # leading layers with a dense MLP (the rest are MoE)
    hidden_size: int
    intermediate_size: int  # dense MLP
    vocab_size: int
    attention: str  # "mla" | "gqa"
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128  # gqa
    q_lora_rank: int = 0  # mla (0: no q compression)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    precision: dict[str, str] = field(default_factory=dict)  # component -> PRECISION_BYTES key
    source: str = ""
    max_positions: int = 0  # max_position_embeddings (0: not known)
    sliding_window: int = 0  # keys a sliding-window layer attends to (0: none)
    sliding_layers: int = 0  # how many layers attend through that window
    mtp_layers: int = 0  # num_nextn_predict_layers: multi-token-prediction layers shipped
    moe_layers: int = -1  # layers with routed experts (-1: num_layers - first_k_dense)
    attn_output_gate: bool = False  # q_proj also yields a per-head output gate (Qwen3-Next)
    # linear-attention (Gated DeltaNet) layers: a fixed recurrent state per request, no KV cache
    linear_layers: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # Gemma 4: the full-attention layers' own shape (0: the sliding layers' head_dim and KV
    # heads), their keys doubling as values (one K projection; the cache keeps K and V, as a
    # paged layout does: assumed), and a dense MLP beside the MoE block in every layer
    global_head_dim: int = 0
    global_kv_heads: int = 0
    global_k_eq_v: bool = False
    dense_mlp_beside_moe: bool = False

    def __post_init__(self) -> None:
        full = {c: "bf16" for c in COMPONENTS}
        full.update(self.precision)
        for comp, prec in full.items():
            if comp not in COMPONENTS:
                raise ModelError(f"model {self.name}: unknown component {comp!r} in precision")
            if prec not in PRECISION_BYTES:
                raise ModelError(
                    f"model {self.name}: precision.{comp} = {prec!r}; "
                    f"expected one of {', '.join(PRECISION_BYTES)}"
                )
        object.__setattr__(self, "precision", full)

    # ---- derived sizes (params are counts, bytes are per layer / per token) ----
    @property
    def num_moe_layers(self) -> int:
        if not self.n_routed_experts:
            return 0
        return self.moe_layers if self.moe_layers >= 0 else self.num_layers - self.first_k_dense

    @property
    def attention_layers(self) -> int:
        """Softmax-attention layers (full or sliding): the ones with a KV cache."""
        return self.num_layers - self.linear_layers

    @property
    def shared_expert_intermediate_size(self) -> int:
        """Width of one MoE layer's shared experts together (Qwen2-MoE's field of that name)."""
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def shared_expert_params(self) -> int:
        return self.n_shared_experts * self.expert_params

    @property
    def linear_attention_params_per_layer(self) -> int:
        """Gated DeltaNet projections: q/k/v/z and the b/a gates in, the conv, out.
        Example (Qwen3-Next-80B: hidden 2048, 16 key heads x 128, 32 value heads x 128, conv 4):
        2048 x (2x16x128 + 2x32x128 + 2x32) + (2x16x128 + 32x128) x 4 + 32x128 x 2048."""
        if not self.linear_layers:
            return 0
        h = self.hidden_size
        k = self.linear_num_key_heads * self.linear_key_head_dim
        v = self.linear_num_value_heads * self.linear_value_head_dim
        inp = h * (2 * k + 2 * v + 2 * self.linear_num_value_heads)
        return inp + (2 * k + v) * self.linear_conv_kernel + v * h

    def state_bytes_per_request_layer(self) -> float:
        """Recurrent state one request keeps in one linear-attention layer, at the KV-cache
        precision: the delta-rule state (value heads x key dim x value dim) and the conv window
        ((kernel - 1) x conv channels). Read and written once per forward, whatever the context."""
        if not self.linear_layers:
            return 0.0
        b = PRECISION_BYTES[self.precision["kv_cache"]]
        nv = self.linear_num_value_heads
        ssm = nv * self.linear_key_head_dim * self.linear_value_head_dim
        channels = 2 * self.linear_num_key_heads * self.linear_key_head_dim
        conv = (self.linear_conv_kernel - 1) * (channels + nv * self.linear_value_head_dim)
        return (ssm + conv) * b

    def linear_flops_per_token_layer(self) -> float:
        """Delta-rule FLOPs per token and linear layer beyond the projections: decay, rank-1
        update and read-out of the value heads' dk x dv state (about 6 x nv x dk x dv)."""
        nv, dk, dv = (
            self.linear_num_value_heads,
            self.linear_key_head_dim,
            self.linear_value_head_dim,
        )
        return 6.0 * nv * dk * dv if self.linear_layers else 0.0

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense MLP (Gemma 4: every layer, beside its MoE block)."""
        return (
            self.num_layers if self.dense_mlp_beside_moe else self.num_layers - self.num_moe_layers
        )

    def softmax_kinds(self) -> tuple[SoftmaxLayers, ...]:
        """The softmax-attention layers by shape: sliding (or chunked) layers read at most their
        window, full layers all of the context, in the full layers' own shape where the config
        gives one (Gemma 4's global_head_dim / num_global_key_value_heads). Example (Gemma 4
        26B-A4B): 25 sliding layers (head dim 256, 8 KV heads, window 1024) and 5 full ones
        (head dim 512, 2 KV heads, K = V)."""
        return self._softmax_kinds

    @functools.cached_property
    def _softmax_kinds(self) -> tuple[SoftmaxLayers, ...]:
        # once per shape (frozen): a corpus fit asks for it ~100,000 times
        full = self.attention_layers - self.sliding_layers
        return tuple(k for k in (
            SoftmaxLayers(self.sliding_layers, self.head_dim, self.num_kv_heads, 2,
                          self.sliding_window),
            SoftmaxLayers(full, self.global_head_dim or self.head_dim,
                          self.global_kv_heads or self.num_kv_heads,
                          1 if self.global_k_eq_v else 2, None),
        ) if k.layers)  # fmt: skip

    @property
    def attention_params_per_layer(self) -> float:
        """Attention parameters per layer, averaged over the layers where linear-attention
        layers mix with softmax ones (so ``num_layers x`` this is the model's attention)."""
        soft = self.softmax_attention_params_per_layer
        if not self.linear_layers:
            return soft
        lin = self.linear_attention_params_per_layer
        return (self.attention_layers * soft + self.linear_layers * lin) / self.num_layers

    def _gqa_params(self, kind: SoftmaxLayers, shards: int = 1) -> float:
        """One GQA layer's attention parameters on one of ``shards`` GPUs: q (with its output
        gate) and o split ``shards`` ways, K/V split at most ``kv_heads`` ways."""
        h, d = self.hidden_size, kind.head_dim
        q_o = (3 if self.attn_output_gate else 2) * h * d * self.num_heads
        k_v = kind.kv_projections * h * d * kind.kv_heads
        return q_o / shards + k_v / min(shards, kind.kv_heads)

    @property
    def softmax_attention_params_per_layer(self) -> float:
        h = self.hidden_size
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (
                h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk
                if self.q_lora_rank
                else h * self.num_heads * qk
            )
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * (
                self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            )
            o = self.num_heads * self.v_head_dim * h
            return q + kv + o
        return self._softmax_gqa_params(1)

    def _softmax_gqa_params(self, shards: int) -> float:
        """GQA attention parameters per softmax layer on one of ``shards`` GPUs, averaged over
        the softmax kinds (a model of linear layers only: what one would hold)."""
        kinds = self.softmax_kinds() or (
            SoftmaxLayers(1, self.head_dim, self.num_kv_heads, 2, None),
        )
        return sum(k.layers * self._gqa_params(k, shards) for k in kinds) / sum(
            k.layers for k in kinds
        )

    def attention_params_per_shard(self, shards: int) -> float:
        """Attention parameters one of ``shards`` tensor-parallel GPUs holds: query and output
        projections split ``shards`` ways, GQA's K/V projections split at most ``num_kv_heads``
        ways (past that each GPU keeps a whole KV head: replicated). MLA splits evenly.
        Example (Llama 3.1 70B, 8 KV heads) at 16: q/o 1/16 each, k/v 1/8."""
        if self.attention == "mla":
            soft = self.softmax_attention_params_per_layer / shards
        else:
            soft = self._softmax_gqa_params(shards)
        if not self.linear_layers:
            return soft
        lin = self.linear_attention_params_per_layer / shards  # split by heads
        return (self.attention_layers * soft + self.linear_layers * lin) / self.num_layers

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def kv_tokens_read(self, context):
        """Cached tokens the attention layers read for one query at ``context``, summed over
        layers: full layers read all of it, sliding-window (and chunked) ones at most the window;
        linear-attention layers read no KV (their state: ``state_bytes_per_request_layer``).
        Example (gpt-oss-120b: 36 layers, 18 of them window 128) at 2048: 18 x 2048 + 18 x 128."""
        return sum(k.layers * k.keys(context) for k in self.softmax_kinds())

    def kv_bytes_per_token_layer(self) -> float:
        """KV-cache bytes one token adds to one layer (MLA: the shared latent + rope key; a
        model with full layers of their own shape: a sliding layer's, see ``kv_bytes_read``)."""
        b = PRECISION_BYTES[self.precision["kv_cache"]]
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * b
        return 2 * self.num_kv_heads * self.head_dim * b

    def _kv_per_token(self, kind: SoftmaxLayers, tp: int) -> float:
        """KV bytes one token adds to one layer of ``kind`` on one of ``tp`` GPUs: GQA's KV
        heads split at most their count ways (whole heads replicated past it), MLA's latent
        replicated."""
        if self.attention == "mla":
            return self.kv_bytes_per_token_layer()
        b = PRECISION_BYTES[self.precision["kv_cache"]]
        return 2 * kind.kv_heads * kind.head_dim * b / min(tp, kind.kv_heads)

    def kv_bytes_read(self, context, tp: int = 1):
        """KV-cache bytes one request's query reads over every layer at ``context``, on one of
        ``tp`` GPUs: each softmax kind's layers x the keys it reads x its bytes per token.
        Example (Llama 3.1 8B, bf16, one GPU) at 2048: 32 x 2048 x 2 x 8 x 128 x 2 B = 268 MB."""
        return sum(k.layers * k.keys(context) * self._kv_per_token(k, tp)
                   for k in self.softmax_kinds())  # fmt: skip

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """KV-cache bytes one token adds over every layer, on one of ``tp`` GPUs."""
        return sum(k.layers * self._kv_per_token(k, tp) for k in self.softmax_kinds())

    def attention_flops_per_query_key(self) -> float:
        """FLOPs of one query attending to one key, all heads (MLA absorbed form; a model
        with full layers of their own shape: a sliding layer's, see ``score_flops``)."""
        if self.attention == "mla":
            return 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 4.0 * self.num_heads * self.head_dim

    def score_flops(self, context, width: int):
        """Attention-score FLOPs of one query token over every layer: the keys each softmax
        kind reads (context or window, + the ``width`` new keys) x its FLOPs per query-key."""
        if self.attention == "mla":
            return (self.kv_tokens_read(context) + self.attention_layers * width) * (
                self.attention_flops_per_query_key())  # fmt: skip
        return sum(k.layers * (k.keys(context) + width) * 4.0 * self.num_heads * k.head_dim
                   for k in self.softmax_kinds())  # fmt: skip

    def total_params(self) -> float:
        """Every parameter: all experts, the input embedding and the LM head (untied)."""
        return (
            self.num_layers * self.attention_params_per_layer
            + self.num_moe_layers * (self.n_routed_experts * self.expert_params
                                     + self.shared_expert_params)
            + self.num_dense_layers * self.dense_mlp_params
            + 2 * self.lm_head_params
        )  # fmt: skip

    def bytes_per_param(self, component: str) -> float:
        return PRECISION_BYTES[self.precision[component]]

    def active_params(self) -> float:
        """Parameters read for one token (whole model, routed top-k only)."""
        return (
            self.num_layers * self.attention_params_per_layer
            + self.num_moe_layers * (self.top_k * self.expert_params + self.shared_expert_params)
            + self.num_dense_layers * self.dense_mlp_params
            + self.lm_head_params
        )


def _mla(name, layers, dense, heads, experts, vocab, precision, source, **kw) -> ModelShape:
    return ModelShape(
        name=name,
        num_layers=layers,
        first_k_dense=dense,
        hidden_size=7168,
        intermediate_size=18432,
        vocab_size=vocab,
        attention="mla",
        num_heads=heads,
        num_kv_heads=heads,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        moe_intermediate_size=2048,
        n_routed_experts=experts,
        top_k=8,
        n_shared_experts=1,
        precision=precision,
        source=source,
        **kw,
    )


_FP8_ALL = {
    c: "fp8-block128" for c in ("attention", "routed_experts", "shared_experts", "dense_mlp")
}
_AIC = "ai-dynamo/aiconfigurator model_configs/{}_config.json (the published config.json)"


def _gqa(name, layers, hidden, inter, heads, kv, vocab, source, **kw) -> ModelShape:
    """A GQA decoder (Llama, Qwen3, GLM-4.5, gpt-oss); MoE when ``n_routed_experts`` is given."""
    kw.setdefault("head_dim", 128)
    return ModelShape(
        name=name,
        num_layers=layers,
        first_k_dense=kw.pop("first_k_dense", 0 if kw.get("n_routed_experts") else layers),
        hidden_size=hidden,
        intermediate_size=inter,
        vocab_size=vocab,
        attention="gqa",
        num_heads=heads,
        num_kv_heads=kv,
        source=source,
        **kw,
    )


_QWEN3_UNVERIFIED = (
    "Qwen/Qwen3 config.json figures (from memory of the published config; not re-verified)"
)
_LLAMA2 = (
    "meta-llama/Llama-2-{} config.json figures as recalled (not re-verified); the parameter count "
    "agrees with the q4_0 / f16 file sizes in XiongjieDai/GPU-Benchmarks-on-LLM-Inference"
)
_GLM = (
    "zai-org/{} config.json as recalled: 92 layers (first 3 dense), hidden 5120, 96 heads x 128, "
    "8 KV heads, MLP 12288, 160 routed experts x 1536 top-8 + 1 shared, vocab 151552, 1 MTP "
    "layer; 160 experts top-8, 1 shared and 96 x 128 heads seen in a glm4_moe preset in the code "
    "index; the rest not re-verified"
)
_GPT_OSS = dict(
    hidden=2880, inter=2880, heads=64, kv=8, vocab=201088, head_dim=64,
    moe_intermediate_size=2880, top_k=4, sliding_window=128, max_positions=131072,
    precision={"routed_experts": "mxfp4"},
)  # fmt: skip

PRESETS: dict[str, ModelShape] = {
    "kimi-k2": _mla("kimi-k2", 61, 1, 64, 384, 163840, _FP8_ALL,
                    _AIC.format("moonshotai--Kimi-K2-Instruct"), max_positions=131072),
    "kimi-k2-thinking": _mla(
        "kimi-k2-thinking", 61, 1, 64, 384, 163840, {"routed_experts": "int4-g32"},
        _AIC.format("moonshotai--Kimi-K2.5")
        + ": K2-Thinking shapes; INT4 W4A16 group 32 on routed experts only (vLLM #32437)",
        max_positions=262144,
    ),
    "deepseek-v3": _mla("deepseek-v3", 61, 3, 128, 256, 129280, _FP8_ALL,
                        _AIC.format("deepseek-ai--DeepSeek-V3"), max_positions=163840,
                        mtp_layers=1),
    "llama-2-7b": _gqa("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, _LLAMA2.format("7b-hf"),
                       max_positions=4096),
    "llama-2-70b": _gqa("llama-2-70b", 80, 8192, 28672, 64, 8, 32000,
                        _LLAMA2.format("70b-hf"), max_positions=4096),
    "llama-3.1-8b": _gqa("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128256,
                         _AIC.format("meta-llama--Meta-Llama-3.1-8B"), max_positions=131072),
    "llama-3.1-70b": _gqa("llama-3.1-70b", 80, 8192, 28672, 64, 8, 128256,
                          _AIC.format("meta-llama--Meta-Llama-3.1-70B"), max_positions=131072),
    "llama-3.3-70b": _gqa(
        "llama-3.3-70b", 80, 8192, 28672, 64, 8, 128256,
        _AIC.format("meta-llama--Meta-Llama-3.1-70B") + ": Llama 3.3 70B keeps the 3.1 70B "
        "shapes (assumed)", max_positions=131072,
    ),
    "qwen3-0.6b": _gqa("qwen3-0.6b", 28, 1024, 3072, 16, 8, 151936,
                       _AIC.format("Qwen--Qwen3-0.6B"), max_positions=40960),
    "qwen3-1.7b": _gqa("qwen3-1.7b", 28, 2048, 6144, 16, 8, 151936,
                       _AIC.format("Qwen--Qwen3-1.7B"), max_positions=40960),
    "qwen3-4b": _gqa("qwen3-4b", 36, 2560, 9728, 32, 8, 151936, _QWEN3_UNVERIFIED,
                     max_positions=40960),
    "qwen3-8b": _gqa("qwen3-8b", 36, 4096, 12288, 32, 8, 151936,
                     _AIC.format("Qwen--Qwen3-8B"), max_positions=40960),
    "qwen3-32b": _gqa("qwen3-32b", 64, 5120, 25600, 64, 8, 151936,
                      _AIC.format("Qwen--Qwen3-32B"), max_positions=40960),
    "qwen3-30b-a3b": _gqa(
        "qwen3-30b-a3b", 48, 2048, 6144, 32, 4, 151936, _AIC.format("Qwen--Qwen3-30B-A3B"),
        moe_intermediate_size=768, n_routed_experts=128, top_k=8, max_positions=40960,
    ),
    "qwen3-235b-a22b": _gqa(
        "qwen3-235b-a22b", 94, 4096, 12288, 64, 4, 151936,
        _AIC.format("Qwen--Qwen3-235B-A22B"),
        moe_intermediate_size=1536, n_routed_experts=128, top_k=8, max_positions=40960,
    ),
    "gpt-oss-20b": _gqa("gpt-oss-20b", 24, source=_AIC.format("openai--gpt-oss-20b"),
                        n_routed_experts=32, sliding_layers=12, **_GPT_OSS),
    "gpt-oss-120b": _gqa("gpt-oss-120b", 36, source=_AIC.format("openai--gpt-oss-120b"),
                         n_routed_experts=128, sliding_layers=18, **_GPT_OSS),
    "glm-4.5": _gqa(
        "glm-4.5", 92, 5120, 12288, 96, 8, 151552, _GLM.format("GLM-4.5"), first_k_dense=3,
        moe_intermediate_size=1536, n_routed_experts=160, top_k=8, n_shared_experts=1,
        max_positions=131072, mtp_layers=1,
    ),
    "glm-4.6": _gqa(
        "glm-4.6", 92, 5120, 12288, 96, 8, 151552,
        _GLM.format("GLM-4.6") + "; GLM-4.6 keeps the 4.5 shapes with max_position 202752",
        first_k_dense=3, moe_intermediate_size=1536, n_routed_experts=160, top_k=8,
        n_shared_experts=1, max_positions=202752, mtp_layers=1,
    ),
}  # fmt: skip


# ---- reading a Hugging Face config.json ---------------------------------------------------

_LINEAR = ("attention", "routed_experts", "shared_experts", "dense_mlp")
# model types whose config.json fields this reader knows; the rest are read only when they
# carry none of the fields in _UNKNOWN_RISK (a plain Llama-like decoder)
KNOWN_MODEL_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next",
    "deepseek_v2", "deepseek_v3", "kimi_k2", "gpt_oss", "glm4_moe", "gemma3", "gemma3_text",
    "llama4", "llama4_text", "minimax_m2", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
    "qwen3_5_moe_text", "glm4_moe_lite", "gemma4", "gemma4_text",
)  # fmt: skip
# Qwen3.5 / 3.6 (model_type qwen3_5[_moe], text_config qwen3_5[_moe]_text): Qwen3-Next's
# hybrid decoder (Gated DeltaNet layers, every full_attention_interval-th layer gated full
# attention, a shared expert beside the routed ones) under a vision-language wrapper; its
# DeltaNet projections are split four ways (qkv, z, b, a) where Qwen3-Next fuses two, the
# same weights in all
_QWEN3_NEXT_LIKE = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_UNKNOWN_RISK = re.compile(
    r"expert|moe|lora_rank|linear_|sliding|layer_types|window|chunk|mamba|ssm|conv_|nextn|mtp"
    r"|global_|interleave|hybrid|attn_type|block_types|kv_shared|sparse"
)
# the fields this reader reads the same way whatever the model type
_GENERIC_FIELDS = {
    "layer_types", "sliding_window", "use_sliding_window", "max_window_layers",
    "n_routed_experts", "num_experts", "num_local_experts", "num_experts_per_tok",
    "moe_intermediate_size", "n_shared_experts", "shared_expert_intermediate_size",
    "first_k_dense_replace", "moe_layer_freq", "mlp_only_layers", "decoder_sparse_step",
    "q_lora_rank", "kv_lora_rank", "num_nextn_predict_layers", "output_router_logits",
    "router_aux_loss_coef", "norm_topk_prob", "topk_method", "n_group", "topk_group",
}  # fmt: skip
# defaults of the transformers config class that published configs rely on (the field is
# absent from the file): Gemma3TextConfig
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262208, "max_position_embeddings": 131072,
                    "sliding_window_pattern": 6},
}  # fmt: skip
_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")


def _classify_module(name: str) -> str | None:
    """Which cost component a quantisation ``ignore`` / ``exclude_modules`` entry names (None:
    one the cost model does not price: routers, embeddings, norms, vision, MTP). A regex
    (``re:``) is read by the module names it spells out."""
    n = name.removeprefix("re:").lower()
    if "lm_head" in n:
        return "lm_head"
    if re.search(r"embed|vision|visual|vit\b|mm_projector|multi_modal|audio|norm|\bmtp\b|nextn", n):
        return None
    if re.search(r"(mlp|moe|block_sparse_moe|feed_forward)\.(gate|router)\b|\brouter\b", n) or (
        re.search(r"\.gate$|e_score_correction_bias|shared_expert_gate", n)
    ):
        return None
    if "shared_expert" in n:
        return "shared_experts"
    if "expert" in n:
        return "routed_experts"
    if re.search(r"attn|attention|[qkvo]_proj|qkv|kv_a|kv_b|q_a|q_b|in_proj|out_proj|conv1d", n):
        return "attention"
    if re.search(r"mlp|gate_proj|up_proj|down_proj|feed_forward|ffn", n):
        return "dense_mlp"
    return None if n in ("gate", "router") else ""


def _excluded(entries, where: str, field: str) -> dict[str, str]:
    """Components a list of left-unquantised modules covers: ``all`` when no layer index
    restricts an entry, else ``some`` (counted as quantised, noted in the source)."""
    out: dict[str, str] = {}
    if entries is None:
        return out
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ModelError(f"{where}: quantization_config.{field}: expected a list of module names")
    for e in entries:
        comp = _classify_module(e)
        if comp == "":
            raise ModelError(
                f"{where}: quantization_config.{field} entry {e!r}: cannot tell which component "
                "(attention, experts, shared experts, dense MLP, lm_head, router) it names"
            )
        if comp is None:
            continue
        whole = not re.search(r"layers\.\d+\.", e)
        out[comp] = "all" if whole or out.get(comp) == "all" else "some"
    return out


def _int4(bits, group, where: str, field: str) -> str:
    if bits == 8:
        return "int8"
    if bits != 4:
        raise ModelError(f"{where}: {field}: {bits}-bit weights; expected 4 or 8")
    if group in (-1, None, 0):
        return "int4"
    if group in (32, 64, 128):
        return f"int4-g{group}"
    raise ModelError(f"{where}: {field}: int4 group size {group}; expected 32, 64, 128 or -1")


def _ct_scheme(w: dict, where: str, gname: str) -> str:
    """compressed-tensors weight scheme -> precision key."""
    bits, kind = w.get("num_bits"), str(w.get("type", "int")).lower()
    strategy, gs = str(w.get("strategy", "")).lower(), w.get("group_size")
    field = f"quantization_config.config_groups.{gname}.weights"
    if kind == "float" and bits == 8:
        block = w.get("block_structure")
        if strategy == "block":
            if list(block or []) != [128, 128]:
                raise ModelError(f"{where}: {field}.block_structure = {block}; expected [128, 128]")
            return "fp8-block128"
        return "fp8"
    if kind == "float" and bits == 4:
        if gs != 16:
            raise ModelError(f"{where}: {field}: fp4 group size {gs}; expected 16 (NVFP4)")
        return "fp4"
    if kind == "int":
        return _int4(bits, gs if strategy == "group" else -1, where, field)
    raise ModelError(f"{where}: {field}: {kind} {bits}-bit weights; expected int4/int8/fp8/fp4")


def _ct_targets(targets, where: str, gname: str) -> set[str]:
    comps: set[str] = set()
    for t in targets or ["Linear"]:
        if t == "Linear":
            comps.update(_LINEAR)
            continue
        comp = _classify_module(t)
        if not comp:
            raise ModelError(
                f"{where}: quantization_config.config_groups.{gname}.targets entry {t!r}: "
                "expected 'Linear' or a module name of one component"
            )
        comps.add(comp)
    return comps


def _precision_from_quant(cfg: dict[str, Any], where: str = "config") -> tuple[dict, list[str]]:
    """Per-component weight (and KV) precision from ``quantization_config``; the notes say what
    was read. Unquantised components keep the checkpoint dtype."""
    q = cfg.get("quantization_config")
    if not q:
        return {}, []
    if not isinstance(q, dict):
        raise ModelError(f"{where}: quantization_config must be a table")
    method = str(q.get("quant_method", "")).lower().replace("_", "-")
    out: dict[str, str] = {}
    skip_field = "modules_to_not_convert"
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is None:
            prec = "fp8"
        elif list(block) == [128, 128]:
            prec = "fp8-block128"
        else:
            raise ModelError(f"{where}: quantization_config.weight_block_size = {block}; "
                             "expected [128, 128] or none (per-tensor)")  # fmt: skip
        out = dict.fromkeys(_LINEAR, prec)
    elif method == "mxfp4":  # gpt-oss: the routed experts only
        out = {"routed_experts": "mxfp4"}
    elif method in ("awq", "gptq"):
        if q.get("dynamic"):
            raise ModelError(f"{where}: quantization_config.dynamic (per-module GPTQ overrides) "
                             "is not read; expected none")  # fmt: skip
        bits = q.get("bits", q.get("w_bit"))
        prec = _int4(bits, q.get("group_size", q.get("q_group_size")), where,
                     f"quantization_config ({method})")  # fmt: skip
        out = dict.fromkeys(_LINEAR, prec)
        if q.get("lm_head"):
            out["lm_head"] = prec
    elif method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        if not groups:
            raise ModelError(f"{where}: quantization_config.config_groups: none; expected one")
        for gname, g in groups.items():
            prec = _ct_scheme(g.get("weights") or {}, where, gname)
            for comp in _ct_targets(g.get("targets"), where, gname):
                out[comp] = prec
        kv = q.get("kv_cache_scheme")
        if kv:
            if kv.get("type") == "float" and kv.get("num_bits") == 8:
                out["kv_cache"] = "fp8"
            else:
                raise ModelError(f"{where}: quantization_config.kv_cache_scheme {kv}; "
                                 "expected fp8 or none")  # fmt: skip
        skip_field = "ignore"
    elif method == "modelopt":
        algo = str(q.get("quant_algo", "")).upper()
        prec = {"NVFP4": "fp4", "FP8": "fp8"}.get(algo)
        if prec is None:
            raise ModelError(f"{where}: quantization_config.quant_algo = {algo!r} (modelopt); "
                             "expected NVFP4 or FP8")  # fmt: skip
        out = dict.fromkeys(_LINEAR, prec)
        kv = q.get("kv_cache_quant_algo")
        if kv:
            if str(kv).upper() != "FP8":
                raise ModelError(f"{where}: quantization_config.kv_cache_quant_algo = {kv!r}; "
                                 "expected FP8 or none")  # fmt: skip
            out["kv_cache"] = "fp8"
        skip_field = "exclude_modules"
    elif method == "bitsandbytes":
        raise ModelError(
            f"{where}: quantization_config.quant_method = 'bitsandbytes': its NF4/int8 weights "
            "dequantise per matmul in kernels none of the estimator's serving stacks run; "
            "give [model.precision] by hand if you mean to price it"
        )
    else:
        raise ModelError(
            f"{where}: quantization_config.quant_method = {method!r}; expected one of fp8, "
            "mxfp4, awq, gptq, compressed-tensors, modelopt"
        )
    notes = [f"quantization {method}"]
    for comp, how in _excluded(q.get(skip_field), where, skip_field).items():
        if how == "all":
            out.pop(comp, None)
            notes.append(f"{comp} left unquantised ({skip_field})")
        else:
            notes.append(f"{comp} unquantised in some layers only (counted quantised)")
    return out, notes


def _refuse_gemma4_fields(cfg: dict[str, Any], where: str) -> None:
    """Gemma 4 fields that change what a decode step reads in ways ModelShape has no term for
    (the small sizes' per-layer input embeddings, KV shared across layers, a double-wide MLP):
    refused, each named, when set."""
    for key, why in (
        ("hidden_size_per_layer_input", "per-layer input embeddings (an extra embedding read "
         "per layer)"),
        ("num_kv_shared_layers", "layers reusing an earlier layer's KV cache"),
        ("use_double_wide_mlp", "a double-wide MLP in some layers"),
    ):  # fmt: skip
        if cfg.get(key):
            raise ModelError(f"{where}: {key} = {cfg[key]!r} ({why}) is not priced; "
                             "expected 0 / false, as Gemma 4 26B-A4B publishes")  # fmt: skip


def _count(layers: int, pred) -> int:
    return sum(1 for i in range(layers) if pred(i))


def shape_from_config(
    cfg: dict[str, Any], name: str = "config", where: str = "config"
) -> ModelShape:
    """Read a HF config dict: Llama 3/4, Mistral/Mixtral, Qwen2/2-MoE/3/3-MoE/3-Next/3.5,
    DeepSeek-V2/V3/R1, Kimi K2, gpt-oss, GLM-4.5 (glm4_moe), GLM-4.7-Flash (glm4_moe_lite:
    DeepSeek-style MLA and experts), Gemma 3/4, MiniMax-M2. A field
    that changes the cost and is not understood is a ModelError naming it."""
    outer = cfg
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = dict(cfg["text_config"])
        if outer.get("quantization_config") and not cfg.get("quantization_config"):
            cfg["quantization_config"] = outer["quantization_config"]
        for k in ("torch_dtype", "dtype"):
            if k in outer and k not in cfg:
                cfg[k] = outer[k]
    mtype = str(cfg.get("model_type") or outer.get("model_type") or "")
    notes: list[str] = []
    if mtype not in KNOWN_MODEL_TYPES:
        risky = sorted(
            k for k in cfg
            if _UNKNOWN_RISK.search(k) and k not in _GENERIC_FIELDS and cfg[k] not in (None, False)
        )  # fmt: skip
        if risky:
            raise ModelError(
                f"{where}: model_type {mtype or '(none)'!r} is not one this reader knows "
                f"({', '.join(KNOWN_MODEL_TYPES)}) and its field(s) {', '.join(risky)} change "
                "what a decode step reads; expected a known model_type"
            )
    defaults = _CLASS_DEFAULTS.get(mtype, {})
    used_defaults = sorted(k for k in defaults if k not in cfg)
    if used_defaults:
        notes.append(f"{mtype} class defaults for " + ", ".join(
            f"{k}={defaults[k]}" for k in used_defaults))  # fmt: skip

    def get(key: str, default: Any = None) -> Any:
        v = cfg.get(key)
        return defaults.get(key, default) if v is None else v

    def need(key: str) -> Any:
        v = get(key)
        if v is None:
            raise ModelError(f"{where}: config lacks field {key!r}")
        return v

    layers, hidden = int(need("num_hidden_layers")), int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv = int(get("num_key_value_heads") or heads)
    mla = bool(get("kv_lora_rank"))

    # ---- experts: how many, how wide, which layers -------------------------------------
    gemma4 = mtype.startswith("gemma4")
    if gemma4:
        _refuse_gemma4_fields(cfg, where)
    experts = int(get("n_routed_experts") or get("num_experts") or get("num_local_experts") or 0)
    if gemma4 and not get("enable_moe_block"):
        experts = 0  # Gemma 4's dense sizes: no MoE block, whatever num_experts says
    top_k = int(
        get("num_experts_per_tok") or get("experts_per_token") or get("top_k_experts") or 0
    ) if experts else 0  # fmt: skip
    if experts and not top_k:
        raise ModelError(f"{where}: {experts} experts but no num_experts_per_tok")
    dense_inter = int(get("intermediate_size") or 0)
    moe_inter = int(get("moe_intermediate_size") or 0)
    shared = int(get("n_shared_experts") or 0)
    if mtype.startswith("llama4"):  # experts and the one shared expert: intermediate_size
        moe_inter, dense_inter, shared = dense_inter, int(get("intermediate_size_mlp") or 0), 1
    elif mtype in ("gpt_oss", "mixtral", "minimax_m2") or (experts and not moe_inter):
        moe_inter, dense_inter = dense_inter, 0  # the expert width is intermediate_size
    if mtype == "minimax_m2" and int(get("shared_intermediate_size") or 0):
        raise ModelError(f"{where}: shared_intermediate_size > 0 (a MiniMax shared expert) is "
                         "not read; expected 0 as MiniMax-M2 publishes")  # fmt: skip
    sei = int(get("shared_expert_intermediate_size") or 0)
    if experts and sei:
        if sei % moe_inter:
            raise ModelError(f"{where}: shared_expert_intermediate_size {sei} is not a multiple "
                             f"of moe_intermediate_size {moe_inter}")  # fmt: skip
        shared = sei // moe_inter
    if experts:
        if mtype.startswith("llama4"):
            step = int(get("interleave_moe_layer_step") or 1)
            explicit = get("moe_layers")
            moe_set = set(explicit) if explicit else set(range(step - 1, layers, step))
        elif mtype in ("qwen2_moe", "qwen3_moe", *_QWEN3_NEXT_LIKE):
            only, step = set(get("mlp_only_layers") or []), int(get("decoder_sparse_step") or 1)
            moe_set = {i for i in range(layers) if i not in only and (i + 1) % step == 0}
        else:  # DeepSeek / Kimi / GLM: first_k_dense_replace, moe_layer_freq
            first, freq = int(get("first_k_dense_replace") or 0), int(get("moe_layer_freq") or 1)
            moe_set = {i for i in range(layers) if i >= first and i % freq == 0}
        n_moe = len(moe_set)
        first_dense = next((i for i in range(layers) if i in moe_set), layers)
        if n_moe < layers and not dense_inter:
            raise ModelError(f"{where}: {layers - n_moe} dense layers but no dense MLP width "
                             "(intermediate_size)")  # fmt: skip
    else:
        n_moe, first_dense = 0, layers

    # ---- attention: which layers are full, sliding / chunked, linear ---------------------
    window, sliding, linear = 0, 0, 0
    types = get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ModelError(f"{where}: layer_types: expected a list of {layers} layer kinds")
        bad = sorted({t for t in types if t not in _LAYER_TYPES})
        if bad:
            raise ModelError(f"{where}: layer_types value(s) {', '.join(map(repr, bad))}; "
                             f"expected {', '.join(_LAYER_TYPES)}")  # fmt: skip
        sliding = sum(t in ("sliding_attention", "chunked_attention") for t in types)
        linear = types.count("linear_attention")
        if sliding:
            window = int(get("sliding_window") or get("attention_chunk_size") or 0)
            if not window:
                raise ModelError(f"{where}: layer_types has sliding layers but no sliding_window")
    elif mtype in _QWEN3_NEXT_LIKE:
        interval = int(need("full_attention_interval"))
        linear = _count(layers, lambda i: (i + 1) % interval != 0)
    elif mtype == "gemma3_text" or mtype == "gemma3":
        pattern = int(need("sliding_window_pattern"))
        window = int(need("sliding_window"))
        sliding = _count(layers, lambda i: (i + 1) % pattern != 0)
    elif mtype.startswith("llama4") and get("attention_chunk_size"):
        window = int(get("attention_chunk_size"))
        rope = get("no_rope_layers")
        if rope:  # 1: a RoPE layer, which attends within its chunk; 0: a global NoPE layer
            sliding = sum(1 for r in rope[:layers] if r)
        else:  # Llama4TextConfig: every 4th layer is NoPE (global)
            sliding = _count(layers, lambda i: (i + 1) % 4 != 0)
            notes.append("no_rope_layers absent: Llama4TextConfig's every-4th-layer NoPE")
    elif get("sliding_window"):
        if mtype in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
            if get("use_sliding_window"):
                first_swa = int(get("max_window_layers") or 0)
                window, sliding = int(get("sliding_window")), max(layers - first_swa, 0)
        elif mtype in ("mistral", "mixtral", ""):
            window, sliding = int(get("sliding_window")), layers
        elif mtype not in ("llama",):
            raise ModelError(f"{where}: sliding_window set for model_type {mtype!r} without "
                             "layer_types: cannot tell which layers slide")  # fmt: skip
    if get("attn_type_list") is not None and any(int(t) != 1 for t in get("attn_type_list")):
        raise ModelError(f"{where}: attn_type_list has non-softmax (lightning) layers; "
                         "expected all 1 (full attention) as MiniMax-M2 publishes")  # fmt: skip
    if window and window >= int(get("max_position_embeddings") or 0) > 0:
        window, sliding = 0, 0  # a window as long as the context slides nothing
    lin_kw: dict[str, Any] = {}
    if linear:
        lin_kw = dict(
            linear_layers=linear,
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel=int(need("linear_conv_kernel_dim")),
        )

    # ---- precision -----------------------------------------------------------------------
    dtype = str(get("torch_dtype") or get("dtype") or "bfloat16").removeprefix("torch.")
    base = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype)
    if base is None:
        raise ModelError(f"{where}: torch_dtype = {dtype!r}; expected bfloat16, float16, float32")
    precision = dict.fromkeys(COMPONENTS, base)
    qprec, qnotes = _precision_from_quant(cfg, where)
    precision.update(qprec)
    notes += qnotes

    kw: dict[str, Any] = {}
    if mla:
        kw = dict(
            q_lora_rank=int(get("q_lora_rank") or 0),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
        )
    else:
        kw = dict(head_dim=int(get("head_dim") or hidden // heads))
    if mtype in _QWEN3_NEXT_LIKE and get("attn_output_gate", True):  # the configs' default
        kw["attn_output_gate"] = True
    if gemma4:  # the full layers' own shape; a dense MLP beside the MoE block
        kw.update(
            global_head_dim=int(get("global_head_dim") or 0),
            global_kv_heads=int(get("num_global_key_value_heads") or 0),
            global_k_eq_v=bool(get("attention_k_eq_v")),
            dense_mlp_beside_moe=bool(experts and dense_inter),
        )
    mtp = int(get("num_nextn_predict_layers") or get("mtp_num_hidden_layers") or 0)
    if mtype == "minimax_m2" and get("use_mtp"):
        mtp = int(get("num_mtp_modules") or 0) * int(get("mtp_transformer_layers") or 1)
    source = f"config.json ({where})" + (": " + "; ".join(notes) if notes else "")
    return ModelShape(
        name=name,
        num_layers=layers,
        first_k_dense=first_dense,
        hidden_size=hidden,
        intermediate_size=dense_inter,
        vocab_size=int(need("vocab_size")),
        attention="mla" if mla else "gqa",
        num_heads=heads,
        num_kv_heads=kv,
        moe_intermediate_size=moe_inter if experts else 0,
        n_routed_experts=experts,
        top_k=top_k,
        n_shared_experts=shared if experts else 0,
        precision=precision,
        source=source,
        max_positions=int(get("max_position_embeddings") or 0),
        sliding_window=window,
        sliding_layers=sliding,
        mtp_layers=mtp,
        moe_layers=n_moe if experts else -1,
        **lin_kw,
        **kw,
    )


def read_config(path: Path, where: str | None = None) -> dict[str, Any]:
    """A config.json, with modelopt's ``hf_quant_config.json`` beside it folded in as its
    ``quantization_config`` (NVIDIA's NVFP4 / FP8 checkpoints ship their scheme there)."""
    where = where or str(path)
    try:  # a regular file only, checked before it is opened (a FIFO would block)
        cfg = json.loads(read_input_bytes(path, "a config.json file").decode("utf-8"))
    except OSError as exc:
        raise ModelError(f"{where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ModelError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{where}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise ModelError(f"{where}: JSON nested too deeply") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{where}: expected a JSON object")
    for side in (path.parent / "hf_quant_config.json",
                 path.with_name(path.name.removesuffix(".json") + ".hf_quant_config.json")):  # fmt: skip
        if side.is_file() and side != path and not cfg.get("quantization_config"):
            hq = json.loads(side.read_text(encoding="utf-8"))
            q = hq.get("quantization") if isinstance(hq, dict) else None
            if not isinstance(q, dict):
                raise ModelError(f"{side}: expected a 'quantization' table (modelopt)")
            cfg = {**cfg, "quantization_config": {"quant_method": "modelopt", **q}}
    return cfg


CONFIGS = Path(__file__).parents[1] / "data" / "configs"
# presets read from the published config.json shipped beside this module (one source of truth)
_CONFIG_PRESETS = {
    "llama-4-scout": ("meta-llama--Llama-4-Scout-17B-16E-Instruct.json", ""),
    "llama-4-maverick": ("meta-llama--Llama-4-Maverick-17B-128E-Instruct.json", ""),
    "qwen3-next-80b-a3b": ("Qwen--Qwen3-Next-80B-A3B-Thinking.json",
                           "; the Instruct model publishes the same shapes (assumed)"),
    "deepseek-r1": ("deepseek-ai--DeepSeek-R1.json", ""),
    "qwen3.5-35b-a3b": ("Qwen--Qwen3.5-35B-A3B.json", ""),
    "qwen3.5-397b-a17b": ("Qwen--Qwen3.5-397B-A17B.json", ""),
    "glm-4.7-flash": ("zai-org--GLM-4.7-Flash.json", ""),
    "gemma-4-26b-a4b": ("google--gemma-4-26B-A4B.json", ""),
    "mixtral-8x7b": ("mistralai--Mixtral-8x7B-v0.1.json", ""),
    "minimax-m2": ("MiniMaxAI--MiniMax-M2.5.json",
                   "; MiniMax-M2.5, read as MiniMax-M2 (the same minimax_m2 shapes, 230B / 10B "
                   "active, assumed)"),
}  # fmt: skip


def _config_preset(key: str, file: str, note: str) -> ModelShape:
    path = CONFIGS / file
    shape = shape_from_config(
        read_config(path), name=key, where=f"src/ddtree/perf/data/configs/{file}"
    )
    return replace(shape, source=shape.source + note)


PRESETS.update({k: _config_preset(k, f, n) for k, (f, n) in _CONFIG_PRESETS.items()})


def load_model(spec: dict[str, Any], where: str, base_dir: Path | None = None) -> ModelShape:
    """``[model]`` table: ``preset = "kimi-k2-thinking"`` or ``config = "path/config.json"``,
    optional ``[model.precision]`` overrides per component."""
    if not isinstance(spec, dict):
        raise ModelError(f"{where}: [model] must be a table")
    unknown = sorted(set(spec) - {"preset", "config", "precision"})
    if unknown:
        raise ModelError(
            f"{where}: model: unknown field(s) {', '.join(unknown)}; "
            "expected some of config, precision, preset"
        )
    if ("preset" in spec) == ("config" in spec):
        raise ModelError(
            f"{where}: model needs exactly one of 'preset' ({', '.join(PRESETS)}) or "
            "'config' (path to a Hugging Face config.json)"
        )
    for name in ("preset", "config"):
        if name in spec and not isinstance(spec[name], str):
            raise ModelError(f"{where}: model.{name}: expected a string, got {spec[name]!r:.60}")
    if "preset" in spec:
        key = spec["preset"].lower()
        if key not in PRESETS:
            raise ModelError(
                f"{where}: model.preset = {spec['preset']!r}; expected one of {', '.join(PRESETS)}"
            )
        shape = PRESETS[key]
    else:
        path = Path(spec["config"])
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ModelError(f"{where}: model.config: no such file {path}")
        cfg = read_config(path, f"{where}: model.config {path}")
        shape = shape_from_config(cfg, name=path.parent.name, where=str(path))
    prec = spec.get("precision") or {}
    if prec:
        if not isinstance(prec, dict) or not all(isinstance(v, str) for v in prec.values()):
            raise ModelError(f"{where}: model.precision must be a table of component = format")
        shape = replace(shape, precision={**shape.precision, **prec})
    return shape
