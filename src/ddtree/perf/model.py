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

import json
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
    "int4-g32": 0.5 + 2.0 / 32,  # bf16 scale per group of 32
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
    "int8": "fp8",
    "int4-g32": "bf16",
    "int4-g128": "bf16",
    "fp4": "fp4",
    "mxfp4": "bf16",  # dequantised into BF16 MMA by the Hopper-class kernels (assumed)
}
COMPONENTS = ("attention", "routed_experts", "shared_experts", "dense_mlp", "lm_head", "kv_cache")


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
        return self.num_layers - self.first_k_dense if self.n_routed_experts else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attention_params_per_layer(self) -> int:
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
        d = self.head_dim
        return h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h

    def attention_params_per_shard(self, shards: int) -> float:
        """Attention parameters one of ``shards`` tensor-parallel GPUs holds: query and output
        projections split ``shards`` ways, GQA's K/V projections split at most ``num_kv_heads``
        ways (past that each GPU keeps a whole KV head: replicated). MLA splits evenly.
        Example (Llama 3.1 70B, 8 KV heads) at 16: q/o 1/16 each, k/v 1/8."""
        if self.attention == "mla":
            return self.attention_params_per_layer / shards
        d, h = self.head_dim, self.hidden_size
        q_o = 2 * h * d * self.num_heads
        k_v = 2 * h * d * self.num_kv_heads
        return q_o / shards + k_v / min(shards, self.num_kv_heads)

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
        layers: full layers read all of it, sliding-window ones at most the window.
        Example (gpt-oss-120b: 36 layers, 18 of them window 128) at 2048: 18 x 2048 + 18 x 128."""
        full = self.num_layers - self.sliding_layers
        return full * context + self.sliding_layers * np.minimum(context, self.sliding_window)

    def kv_bytes_per_token_layer(self) -> float:
        """KV-cache bytes one token adds to one layer (MLA: the shared latent + rope key)."""
        b = PRECISION_BYTES[self.precision["kv_cache"]]
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * b
        return 2 * self.num_kv_heads * self.head_dim * b

    def attention_flops_per_query_key(self) -> float:
        """FLOPs of one query attending to one key, all heads (MLA absorbed form)."""
        if self.attention == "mla":
            return 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 4.0 * self.num_heads * self.head_dim

    def bytes_per_param(self, component: str) -> float:
        return PRECISION_BYTES[self.precision[component]]

    def active_params(self) -> float:
        """Parameters read for one token (whole model, routed top-k only)."""
        return (
            self.num_layers * self.attention_params_per_layer
            + self.num_moe_layers * (self.top_k + self.n_shared_experts) * self.expert_params
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


def _precision_from_quant(cfg: dict[str, Any]) -> dict[str, str]:
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return dict(_FP8_ALL)
    if method == "mxfp4":  # gpt-oss: the routed experts only
        return {"routed_experts": "mxfp4"}
    if method in ("compressed-tensors", "compressed_tensors"):
        groups = q.get("config_groups") or {}
        for g in groups.values():
            w = g.get("weights") or {}
            if w.get("num_bits") == 4:
                gs = w.get("group_size") or 32
                prec = "int4-g32" if gs <= 32 else "int4-g128"
                ignore = " ".join(q.get("ignore") or [])
                out = {"routed_experts": prec}
                for comp, key in (("attention", "self_attn"), ("shared_experts", "shared_experts")):
                    if key not in ignore and ignore:
                        out[comp] = prec
                return out
    return {}


def shape_from_config(
    cfg: dict[str, Any], name: str = "config", where: str = "config"
) -> ModelShape:
    """Read a HF config dict (DeepSeek-V3 / Kimi-K2 / Qwen3 / Qwen3-MoE / Llama-like)."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        inner = dict(cfg["text_config"])
        inner.setdefault("quantization_config", cfg.get("quantization_config"))
        cfg = inner

    def need(key: str) -> Any:
        if key not in cfg:
            raise ModelError(f"{where}: config lacks field {key!r}")
        return cfg[key]

    layers, hidden = int(need("num_hidden_layers")), int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv = int(cfg.get("num_key_value_heads") or heads)
    mla = "kv_lora_rank" in cfg and cfg.get("kv_lora_rank")
    experts = int(
        cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    )
    if experts:
        first_dense = int(cfg.get("first_k_dense_replace", 0))
        mlp_only = cfg.get("mlp_only_layers") or []
        first_dense = max(first_dense, len(mlp_only))
    else:
        first_dense = layers
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    base = {"float32": "fp32", "float16": "fp16"}.get(dtype, "bf16")
    precision = {c: base for c in COMPONENTS if c != "kv_cache"}
    precision["kv_cache"] = base
    precision.update(_precision_from_quant(cfg))
    kw: dict[str, Any] = {}
    if mla:
        kw = dict(
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
        )
    else:
        kw = dict(head_dim=int(cfg.get("head_dim") or hidden // heads))
    layer_types = cfg.get("layer_types") or []
    if cfg.get("sliding_window") and "sliding_attention" in layer_types:
        kw.update(sliding_window=int(cfg["sliding_window"]),
                  sliding_layers=layer_types.count("sliding_attention"))  # fmt: skip
    # gpt-oss names the expert width intermediate_size (it has no dense MLP)
    moe_inter = cfg.get("moe_intermediate_size") or (
        cfg.get("intermediate_size") if cfg.get("num_local_experts") else 0
    )
    return ModelShape(
        name=name,
        num_layers=layers,
        first_k_dense=first_dense,
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        vocab_size=int(need("vocab_size")),
        attention="mla" if mla else "gqa",
        num_heads=heads,
        num_kv_heads=kv,
        moe_intermediate_size=int(moe_inter or 0) if experts else 0,
        n_routed_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        n_shared_experts=int(cfg.get("n_shared_experts") or 0) if experts else 0,
        precision=precision,
        source=f"config.json ({where})",
        max_positions=int(cfg.get("max_position_embeddings") or 0),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        **kw,
    )


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
        try:  # a regular file only, checked before it is opened (a FIFO would block)
            cfg = json.loads(read_input_bytes(path, "a config.json file").decode("utf-8"))
        except OSError as exc:
            raise ModelError(f"{where}: model.config {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ModelError(f"{where}: model.config {path}: not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise ModelError(f"{where}: model.config {path}: not JSON ({exc.msg})") from None
        except RecursionError:
            raise ModelError(f"{where}: model.config {path}: JSON nested too deeply") from None
        shape = shape_from_config(cfg, name=path.parent.name, where=str(path))
    prec = spec.get("precision") or {}
    if prec:
        if not isinstance(prec, dict) or not all(isinstance(v, str) for v in prec.values()):
            raise ModelError(f"{where}: model.precision must be a table of component = format")
        shape = replace(shape, precision={**shape.precision, **prec})
    return shape
