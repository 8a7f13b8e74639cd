"""Tiny targets and a scripted drafter for engine tests."""

from __future__ import annotations

import torch

from ddtree.models.adapters.mla_moe import MlaMoeTarget
from ddtree.models.base import ModelInfo
from ddtree.models.nn.mla_moe import MlaMoeConfig, MlaMoeModel

TINY = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=512,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
)


def tiny_mla_target(seed: int = 0, scale: float = 0.3, **overrides) -> MlaMoeTarget:
    """A random MLA+MoE target. ``scale`` sets how peaked its next-token distributions are."""
    config = MlaMoeConfig.from_hf(dict(TINY, **overrides), source="tiny")
    torch.manual_seed(seed)
    model = MlaMoeModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif "e_score_correction_bias" in name:
                p.normal_(0, 0.1)
            else:
                p.normal_(0, scale / p.shape[-1] ** 0.5 * 4 if p.dim() > 1 else 0.02)
    return MlaMoeTarget(model, capacity=64)


def per_expert(state: dict) -> dict:
    """A fused MLA+MoE state_dict with the routed experts stored one by one, as published
    DeepSeek/Kimi checkpoints do (``mlp.experts.{e}.{gate,up,down}_proj.weight``)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e, w in enumerate(tensor):
                out[f"{base}{e}.down_proj.weight"] = w
        else:
            out[name] = tensor
    return out


class ScriptedDrafter:
    """Implements the Drafter protocol from a known continuation ``script`` (prompt + greedy
    output): at each position the true token is ranked first with probability ``hit``, else
    second or third or not at all, so trees have to branch to recover it."""

    engine_modes = ("eager", "compiled")  # nothing to compile: the same in both
    draft_tokens = None  # proposes over the full vocabulary

    def __init__(self, script: list[int], vocab_size: int, block_size: int, hit=0.6, seed=0):
        self.script, self.vocab_size, self.block_size = script, vocab_size, block_size
        self.hit, self.seed = hit, seed
        self.target_layer_ids = [1]
        self.info = ModelInfo("scripted", "Scripted", "test", 0, 0, 0, vocab_size, "float32")
        self.reset()

    def reset(self) -> None:
        self.seen = 0
        self.rng = torch.Generator().manual_seed(self.seed)

    def set_engine_mode(self, plan) -> float:
        self.reset()
        return 0.0

    def propose(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        self.seen += int(context_hidden.shape[0])
        logits = torch.randn(self.block_size - 1, self.vocab_size, generator=self.rng)  # [B-1, V]
        for i in range(self.block_size - 1):
            pos = self.seen + 1 + i  # the block's root sits at position `seen`
            if pos >= len(self.script):
                continue
            u = float(torch.rand((), generator=self.rng))
            rank = 0 if u < self.hit else 1 if u < self.hit + 0.2 else 2 if u < 0.95 else None
            if rank is None:
                continue
            others = [t for t in range(self.vocab_size) if t != self.script[pos]]
            pick = torch.randperm(len(others), generator=self.rng)[:rank].tolist()
            for r, j in enumerate(pick):  # decoys ranked above the true token
                logits[i, others[j]] = 20.0 - r
            logits[i, self.script[pos]] = 20.0 - rank
        return logits


def tiny_hf_target(kind: str, seed: int = 0, dtype=None, **overrides):
    """A random transformers model (Qwen3, Llama or DeepseekV3) behind ``HFTarget``;
    ``overrides`` change the Qwen3/Llama config (vocab_size, hidden_size, ...)."""
    import transformers

    from ddtree.models.adapters.hf import HFTarget

    common = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.5,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    configs = {
        "qwen3": lambda: transformers.Qwen3Config(
            **common, num_key_value_heads=2, head_dim=head_dim
        ),
        "llama": lambda: transformers.LlamaConfig(**common, num_key_value_heads=2),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=head_dim,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=common["hidden_size"],
            norm_topk_prob=True,
        ),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            **{k: v for k, v in TINY.items() if k not in ("architectures", "model_type")},
            initializer_range=0.5,
        ),
    }
    classes = {
        "qwen3": transformers.Qwen3ForCausalLM,
        "llama": transformers.LlamaForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
    }
    torch.manual_seed(seed)
    cfg = configs[kind]()
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"  # its grouped_mm takes no float64
    model = classes[kind](cfg).eval()
    return HFTarget(model if dtype is None else model.to(dtype), name=f"tiny-{kind}")


def decoder_from_hf(model, capacity: int = 64):
    """Our ``DecoderTarget`` with the weights of a transformers Qwen3 / Qwen3-MoE / Llama
    model, in its dtype."""
    from ddtree.models.adapters.decoder import DecoderTarget
    from ddtree.models.nn.decoder import DecoderConfig, DecoderModel

    config = DecoderConfig.from_hf(model.config.to_dict(), source="transformers model")
    ours = DecoderModel(config)
    ours.load_state_dict(model.state_dict())
    ours.model.rotary_emb.reset_inv_freq()
    dtype = next(model.parameters()).dtype
    return DecoderTarget(ours.to(dtype), name=f"decoder-{config.model_type}", capacity=capacity)


def random_dflash_drafter(
    target,
    block: int,
    seed: int = 0,
    layers: int = 1,
    target_layer_ids=(0, 1),
    mask_token_id=None,
    output_multiplier: float = 1.0,
):
    """A random DFlash drafter on ``target``'s embedding and LM head, in the target's dtype.
    The weights depend on ``seed`` (and the shapes) only, not on ``block``. A small
    ``output_multiplier`` flattens its distributions (wide trees, close scores)."""
    from ddtree.models.adapters.dflash import DFlashDrafter
    from ddtree.models.nn.dflash import DFlashConfig, DFlashModel

    info = target.info
    raw = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": info.hidden_size,
        "intermediate_size": info.hidden_size * 3 // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": info.hidden_size // 4,
        "vocab_size": info.vocab_size,
        "rope_theta": 10000.0,
        "block_size": block,
        "dflash_config": {
            "mask_token_id": info.vocab_size - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": list(target_layer_ids),
            "output_multiplier": output_multiplier,
        },
    }
    torch.manual_seed(seed)
    model = DFlashModel(DFlashConfig.from_dict(raw)).to(getattr(torch, info.dtype))
    return DFlashDrafter(model, target.embed_tokens, target.lm_head)


def transformers_greedy(model, prompts: torch.Tensor, max_new_tokens: int, eos_token_ids=()):
    """transformers' own greedy ``generate`` of prompts [P, T] int64 (one batch, equal
    lengths, no padding): per prompt the new tokens, ending at the first EOS if one came."""
    import transformers

    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_token_ids) or None,
        pad_token_id=0,
        bos_token_id=None,
    )
    # these settings alone: generate fills unset ones (eos_token_id=None) from the model's own
    # generation_config, and random configs carry an EOS id (Llama's 2)
    saved, model.generation_config = model.generation_config, config
    try:
        with torch.inference_mode():
            # an explicit mask: without one, transformers masks every prompt token equal to pad
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts))
    finally:
        model.generation_config = saved
    out = out[:, prompts.shape[1] :].tolist()
    eos = set(eos_token_ids)
    cut = [next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in out]
    return [row[:n] for row, n in zip(out, cut, strict=True)]
