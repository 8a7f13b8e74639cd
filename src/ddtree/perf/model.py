"""Model shapes for the cost model: from a Hugging Face ``config.json`` or a built-in preset.

Only what moves bytes or FLOPs per decode step matters: per-layer attention weights and KV
bytes per token, routed / shared expert and dense-MLP weights, the LM head, each at its own
weight precision (bytes per parameter including quantisation scales).

Worked example (Kimi K2-Thinking): a routed expert is 3 x 7168 x 2048 = 44.04 M params; INT4
group-32 with a BF16 scale per group is 0.5 + 2/32 = 0.5625 B/param, so 24.8 MB per expert.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

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

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

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
_REF_D = "REFERENCE.md D (aiconfigurator model_configs)"


_QWEN3_SOURCE = (
    "Qwen/Qwen3 config.json figures (from memory of the published configs; not re-verified here)"
)


def _qwen3(name, layers, hidden, inter, heads, kv, vocab=151936, source=_QWEN3_SOURCE, **moe):
    return ModelShape(
        name=name,
        num_layers=layers,
        first_k_dense=0 if moe else layers,
        hidden_size=hidden,
        intermediate_size=inter,
        vocab_size=vocab,
        attention="gqa",
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=128,
        source=source,
        **moe,
    )


PRESETS: dict[str, ModelShape] = {
    "kimi-k2": _mla("kimi-k2", 61, 1, 64, 384, 163840, _FP8_ALL, _REF_D + ", Kimi-K2-Instruct"),
    "kimi-k2-thinking": _mla(
        "kimi-k2-thinking",
        61,
        1,
        64,
        384,
        163840,
        {"routed_experts": "int4-g32"},
        _REF_D + ", Kimi-K2.5 shapes; INT4 W4A16 group 32 on routed experts only (vLLM #32437)",
    ),
    "deepseek-v3": _mla("deepseek-v3", 61, 3, 128, 256, 129280, _FP8_ALL, _REF_D),
    "llama-3.1-8b": _qwen3(
        "llama-3.1-8b", 32, 4096, 14336, 32, 8, vocab=128256,
        source="meta-llama/Llama-3.1-8B config.json figures (32 layers, hidden 4096, MLP 14336, "
        "32 heads, 8 KV heads, vocab 128256; from memory of the published config)",
    ),
    "qwen3-0.6b": _qwen3("qwen3-0.6b", 28, 1024, 3072, 16, 8),
    "qwen3-1.7b": _qwen3("qwen3-1.7b", 28, 2048, 6144, 16, 8),
    "qwen3-4b": _qwen3("qwen3-4b", 36, 2560, 9728, 32, 8),
    "qwen3-8b": _qwen3("qwen3-8b", 36, 4096, 12288, 32, 8),
    "qwen3-32b": _qwen3("qwen3-32b", 64, 5120, 25600, 64, 8),
    "qwen3-30b-a3b": _qwen3(
        "qwen3-30b-a3b", 48, 2048, 6144, 32, 4,
        moe_intermediate_size=768, n_routed_experts=128, top_k=8,
    ),
    "qwen3-235b-a22b": _qwen3(
        "qwen3-235b-a22b", 94, 4096, 12288, 64, 4,
        moe_intermediate_size=1536, n_routed_experts=128, top_k=8,
    ),
}  # fmt: skip


def _precision_from_quant(cfg: dict[str, Any]) -> dict[str, str]:
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return dict(_FP8_ALL)
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
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
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
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
        n_routed_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        n_shared_experts=int(cfg.get("n_shared_experts") or 0) if experts else 0,
        precision=precision,
        source=f"config.json ({where})",
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
    if "preset" in spec:
        key = str(spec["preset"]).lower()
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
        if not path.is_file():
            raise ModelError(f"{where}: model.config: no such file {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(f"{where}: model.config {path}: not JSON ({exc.msg})") from None
        shape = shape_from_config(cfg, name=path.parent.name, where=str(path))
    prec = spec.get("precision") or {}
    if prec:
        if not isinstance(prec, dict):
            raise ModelError(f"{where}: model.precision must be a table of component = format")
        shape = replace(
            shape, precision={**shape.precision, **{k: str(v) for k, v in prec.items()}}
        )
    return shape
