"""The config.json readers against real published configs (tests/perf/data/configs and the
preset configs shipped in src/ddtree/perf/data/configs; README beside each says where from)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.perf.shapes.model import CONFIGS, PRESETS, ModelError, read_config, shape_from_config

DATA = Path(__file__).parent / "data" / "configs"


def load(name: str):
    path = DATA / name if (DATA / name).is_file() else CONFIGS / name
    return shape_from_config(read_config(path), name=name, where=str(path))


def cfg(name: str) -> dict:
    path = DATA / name if (DATA / name).is_file() else CONFIGS / name
    return json.loads(path.read_text())


def with_emb(m):  # active parameters with the input embedding, as most model cards count
    return m.active_params() + m.lm_head_params


def test_llama_3_1_8b():
    m = load("meta-llama--Meta-Llama-3.1-8B.json")
    assert (m.num_layers, m.num_kv_heads, m.num_moe_layers, m.sliding_layers) == (32, 8, 0, 0)
    assert m.total_params() == pytest.approx(8.03e9, rel=0.02)  # card: 8.03B
    assert set(m.precision.values()) == {"bf16"}


def test_llama_4_scout_and_maverick():
    s = load("meta-llama--Llama-4-Scout-17B-16E-Instruct.json")
    assert (s.num_moe_layers, s.n_routed_experts, s.top_k, s.n_shared_experts) == (48, 16, 1, 1)
    assert s.moe_intermediate_size == 8192 and s.intermediate_size == 16384
    # chunked attention (8192) on the RoPE layers, every 4th layer global (NoPE)
    assert (s.sliding_window, s.sliding_layers) == (8192, 36)
    assert with_emb(s) == pytest.approx(17e9, rel=0.02)  # card: 17B active, 109B total
    assert s.total_params() == pytest.approx(109e9, rel=0.02)  # (the card counts vision too)
    m = load("meta-llama--Llama-4-Maverick-17B-128E-Instruct.json")
    assert (m.num_moe_layers, m.num_dense_layers, m.n_routed_experts) == (24, 24, 128)
    assert with_emb(m) == pytest.approx(17e9, rel=0.02)  # card: 17B active, 400B total
    assert m.total_params() == pytest.approx(400e9, rel=0.02)
    assert PRESETS["llama-4-scout"].total_params() == s.total_params()


def test_qwen2_moe_shared_expert():
    m = load("Qwen--Qwen2-57B-A14B.json")
    assert (m.num_moe_layers, m.n_routed_experts, m.top_k) == (28, 64, 8)
    assert m.shared_expert_intermediate_size == 20480 and m.n_shared_experts == 8
    assert m.total_params() == pytest.approx(57.4e9, rel=0.02)  # card: 57B total, 14B active
    assert with_emb(m) == pytest.approx(14e9, rel=0.05)  # "A14B" is a rounded figure


def test_qwen3_dense_and_moe():
    d = load("Qwen--Qwen3-8B.json")
    assert (d.num_layers, d.head_dim, d.num_moe_layers) == (36, 128, 0)
    assert d.total_params() == pytest.approx(8.2e9, rel=0.02)  # card: 8.2B
    m = load("Qwen--Qwen3-30B-A3B.json")
    assert (m.num_moe_layers, m.n_routed_experts, m.top_k, m.n_shared_experts) == (48, 128, 8, 0)
    assert m.total_params() == pytest.approx(30.5e9, rel=0.02)  # card: 30.5B total
    assert with_emb(m) == pytest.approx(3.3e9, rel=0.02)  # card: 3.3B active
    c = cfg("Qwen--Qwen3-30B-A3B.json")
    c2 = {**c, "mlp_only_layers": [0, 1], "decoder_sparse_step": 2}
    s = shape_from_config(c2)  # MoE on odd layers not in mlp_only_layers
    assert s.num_moe_layers == 23 and s.num_dense_layers == 25  # odd layers but 1


def test_qwen3_next_linear_attention():
    m = load("Qwen--Qwen3-Next-80B-A3B-Thinking.json")
    assert (m.linear_layers, m.attention_layers, m.sliding_layers) == (36, 12, 0)
    assert (m.n_routed_experts, m.top_k, m.n_shared_experts) == (512, 10, 1)
    assert m.total_params() == pytest.approx(80e9, rel=0.02)  # card: 80B total, 3B active
    assert 2.9e9 < m.active_params() - m.lm_head_params < 3.4e9  # "A3B", rounded
    # only the 12 full-attention layers read KV; the linear ones a fixed state
    assert m.kv_tokens_read(4096) == 12 * 4096
    state = 32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)
    assert m.state_bytes_per_request_layer() == state * 2
    with pytest.raises(ModelError, match="layer_types value.*'mamba'"):
        shape_from_config({**cfg("Qwen--Qwen3-Next-80B-A3B-Thinking.json"),
                           "layer_types": ["mamba"] * 48})  # fmt: skip


def test_qwen3_5_hybrid_dense_and_moe():
    # Qwen3.5: Qwen3-Next's hybrid decoder (3 Gated DeltaNet layers, then 1 gated full-attention
    # layer) inside a vision-language wrapper, its text model in text_config
    for name, total, active, (linear, full), experts in (
        ("Qwen--Qwen3.5-35B-A3B.json", 35e9, 3e9, (30, 10), (256, 8, 1)),
        ("Qwen--Qwen3.5-397B-A17B.json", 397e9, 17e9, (45, 15), (512, 10, 1)),
        ("Qwen--Qwen3.5-27B.json", 27e9, 27e9, (48, 16), (0, 0, 0)),
    ):
        m = load(name)
        assert (m.linear_layers, m.attention_layers) == (linear, full), name
        assert (m.n_routed_experts, m.top_k, m.n_shared_experts) == experts, name
        assert m.attn_output_gate and m.mtp_layers == 1 and m.vocab_size == 248320
        # the names count the vision tower too (~0.4B), and round
        assert m.total_params() == pytest.approx(total, rel=0.03), name
        assert m.active_params() == pytest.approx(active, rel=0.1), name
        assert m.kv_tokens_read(4096) == full * 4096  # only the full layers keep a KV cache
    assert PRESETS["qwen3.5-397b-a17b"].total_params() == load(
        "Qwen--Qwen3.5-397B-A17B.json").total_params()  # fmt: skip
    text = cfg("Qwen--Qwen3.5-35B-A3B.json")["text_config"]
    no_types = {k: v for k, v in text.items() if k != "layer_types"}
    assert shape_from_config(no_types).linear_layers == 30  # full_attention_interval 4


def test_deepseek_v3_r1_and_kimi_k2():
    for name in ("deepseek-ai--DeepSeek-V3.json", "deepseek-ai--DeepSeek-R1.json"):
        m = load(name)
        assert m.attention == "mla" and (m.num_moe_layers, m.first_k_dense) == (58, 3)
        assert m.mtp_layers == 1 and m.precision["routed_experts"] == "fp8-block128"
        assert m.precision["lm_head"] == "bf16"
        assert m.total_params() == pytest.approx(671e9, rel=0.02)  # card: 671B, 37B active
        assert with_emb(m) == pytest.approx(37e9, rel=0.02)
    assert PRESETS["deepseek-r1"].active_params() == PRESETS["deepseek-v3"].active_params()
    k = load("moonshotai--Kimi-K2-Instruct.json")
    assert (k.num_moe_layers, k.n_routed_experts, k.num_heads) == (60, 384, 64)
    assert k.total_params() == pytest.approx(1.04e12, rel=0.02)  # card: 1T total, 32B active
    assert with_emb(k) == pytest.approx(32.6e9, rel=0.02)
    assert k.active_params() == PRESETS["kimi-k2"].active_params()


def test_gpt_oss_120b():
    m = load("openai--gpt-oss-120b.json")
    assert (m.sliding_layers, m.sliding_window, m.num_moe_layers) == (18, 128, 36)
    assert m.precision["routed_experts"] == "mxfp4" and m.precision["attention"] == "bf16"
    assert m.active_params() == pytest.approx(5.13e9, rel=0.02)  # card: 5.1B active, 117B
    assert m.total_params() == pytest.approx(117e9, rel=0.02)


def test_glm4_moe():
    m = load("zai-org--GLM-4.7-FP8.trimmed.json")
    assert (m.first_k_dense, m.num_moe_layers, m.n_shared_experts) == (3, 89, 1)
    assert m.total_params() == pytest.approx(355e9, rel=0.02)  # GLM-4.5/4.7: 355B, 32B active
    assert with_emb(m) == pytest.approx(32e9, rel=0.05)  # "32B", rounded


def test_glm_4_7_flash_mla():
    # glm4_moe_lite: DeepSeek-style MLA (but 192 + 64 query / key dims, 256 value dims) and
    # DeepSeek-style experts after one dense layer
    m = load("zai-org--GLM-4.7-Flash.json")
    assert m.attention == "mla" and (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim) == (
        512, 192, 256)  # fmt: skip
    assert (m.first_k_dense, m.num_moe_layers, m.n_routed_experts, m.top_k) == (1, 46, 64, 4)
    assert m.n_shared_experts == 1 and m.mtp_layers == 1
    assert m.kv_bytes_per_token_layer() == (512 + 64) * 2  # the latent and the rope key, bf16
    assert m.total_params() == pytest.approx(30e9, rel=0.02)  # "30B-A3B"
    assert m.active_params() - m.lm_head_params == pytest.approx(3e9, rel=0.1)
    assert PRESETS["glm-4.7-flash"].active_params() == m.active_params()


def test_mixtral_8x7b():
    m = load("mistralai--Mixtral-8x7B-v0.1.json")
    assert (m.num_moe_layers, m.top_k, m.sliding_layers, m.num_dense_layers) == (32, 2, 0, 0)
    assert m.total_params() == pytest.approx(46.7e9, rel=0.02)  # card: 46.7B, 12.9B active
    assert with_emb(m) == pytest.approx(12.9e9, rel=0.02)
    s = shape_from_config({**cfg("mistralai--Mixtral-8x7B-v0.1.json"), "sliding_window": 4096})
    assert (s.sliding_layers, s.sliding_window) == (32, 4096)


def test_minimax_m2():
    m = load("MiniMaxAI--MiniMax-M2.5.json")
    assert (m.num_moe_layers, m.n_routed_experts, m.top_k, m.n_shared_experts) == (62, 256, 8, 0)
    assert m.sliding_layers == 0 and m.linear_layers == 0 and m.mtp_layers == 3
    assert m.precision["routed_experts"] == "fp8-block128" and m.precision["lm_head"] == "bf16"
    assert m.total_params() == pytest.approx(230e9, rel=0.02)  # card: 230B, 10B active
    assert with_emb(m) == pytest.approx(10e9, rel=0.1)  # "10B", rounded


def test_modelopt_nvfp4_reads_hf_quant_config():
    m = load("nvidia--Qwen3-235B-A22B-NVFP4.json")
    assert m.precision["routed_experts"] == "fp4" and m.precision["attention"] == "fp4"
    assert m.precision["lm_head"] == "bf16" and m.precision["kv_cache"] == "fp8"
    assert "lm_head left unquantised" in m.source


def test_gemma_4_full_layers_of_their_own_shape_and_a_dense_mlp_beside_the_experts():
    m = load("google--gemma-4-26B-A4B.json")
    sliding, full = m.softmax_kinds()
    assert (sliding.layers, sliding.head_dim, sliding.kv_heads, sliding.window) == (
        25,
        256,
        8,
        1024,
    )
    assert (full.layers, full.head_dim, full.kv_heads, full.kv_projections) == (5, 512, 2, 1)
    assert (m.num_moe_layers, m.n_routed_experts, m.top_k) == (30, 128, 8)  # top_k_experts
    assert m.num_dense_layers == 30 and m.intermediate_size == 2112  # beside every MoE block
    # card: 25.2B total (the embedding tied: total_params counts the LM head twice), 3.8B active
    assert m.total_params() - m.lm_head_params == pytest.approx(25.2e9, rel=0.01)
    assert m.active_params() == pytest.approx(3.8e9, rel=0.01)
    assert PRESETS["gemma-4-26b-a4b"].kv_bytes_read(8192) == m.kv_bytes_read(8192)
    # KV: the sliding layers at most their window, the full ones the context in their shape
    per_sliding, per_full = 2 * 8 * 256 * 2, 2 * 2 * 512 * 2  # bytes/token/layer, bf16
    assert m.kv_bytes_read(8192) == 25 * 1024 * per_sliding + 5 * 8192 * per_full
    # TP 8: the 8 sliding KV heads split, the 2 full ones replicated 4x
    assert m.kv_bytes_read(8192, 8) == 25 * 1024 * per_sliding / 8 + 5 * 8192 * per_full / 2
    assert m.score_flops(8192, 1) == 4.0 * 16 * (25 * 1025 * 256 + 5 * 8193 * 512)
    text = cfg("google--gemma-4-26B-A4B.json")["text_config"]
    dense = shape_from_config({**text, "enable_moe_block": False})
    assert dense.n_routed_experts == 0 and dense.num_dense_layers == 30
    for key, value in (("hidden_size_per_layer_input", 256), ("num_kv_shared_layers", 10),
                       ("use_double_wide_mlp", True)):  # fmt: skip
        with pytest.raises(ModelError, match=f"{key} = {value!r}"):
            shape_from_config({**text, key: value}, where="g.json")


def test_one_shape_models_price_their_kv_as_before():
    # kv_bytes_read / kv_bytes_per_token / score_flops over the softmax kinds equal the
    # one-shape products for a model whose full and sliding layers share a shape
    m = PRESETS["gpt-oss-120b"]  # 18 sliding (window 128) + 18 full layers
    per = m.kv_bytes_per_token_layer()
    assert m.kv_bytes_read(2048) == m.kv_tokens_read(2048) * per
    assert m.kv_bytes_per_token(8) == m.attention_layers * per / min(8, m.num_kv_heads)
    keys = m.kv_tokens_read(2048) + m.attention_layers * 4
    assert m.score_flops(2048, 4) == keys * m.attention_flops_per_query_key()


# ---- readers exercised on published configs edited in one field, and small configs ----


def test_gemma3_text_config_and_pattern():
    # the field set of gemma-3 text_config (layer count, window, head_dim), no layer_types
    text = {"model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376,
            "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16,
            "head_dim": 128, "sliding_window": 1024}  # fmt: skip
    m = shape_from_config({"model_type": "gemma3", "text_config": text,
                           "torch_dtype": "bfloat16"})  # fmt: skip
    assert (m.sliding_layers, m.sliding_window, m.vocab_size) == (52, 1024, 262208)
    assert "class defaults" in m.source
    t = shape_from_config({**text, "layer_types": ["sliding_attention", "full_attention"] * 31})
    assert t.sliding_layers == 31


@pytest.mark.parametrize(
    "quant,expect",
    [({"quant_method": "fp8"}, {"attention": "fp8", "lm_head": "bf16"}),
     ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "modules_to_not_convert": ["self_attn", "shared_expert", "mlp.gate"]},
      {"routed_experts": "int4-g128", "attention": "bf16", "shared_experts": "bf16"}),
     ({"quant_method": "gptq", "bits": 4, "group_size": 64}, {"dense_mlp": "int4-g64"}),
     ({"quant_method": "compressed-tensors", "format": "pack-quantized",
       "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
           "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}},
       "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.gate$"]},
      {"routed_experts": "int4-g32", "attention": "bf16", "shared_experts": "bf16"}),
     ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
       "config_groups": {"g": {"targets": ["Linear"], "weights": {
           "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}},
       "ignore": ["lm_head"]}, {"routed_experts": "fp4", "attention": "fp4"}),
     ({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]},
      {"attention": "fp8", "lm_head": "bf16"})],
)  # fmt: skip
def test_quantization_schemes(quant, expect):
    c = {**cfg("Qwen--Qwen3-30B-A3B.json"), "quantization_config": quant}
    m = shape_from_config(c)
    for comp, prec in expect.items():
        assert m.precision[comp] == prec, comp


@pytest.mark.parametrize(
    "quant,match",
    [({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
     ({"quant_method": "hqq"}, "quant_method = 'hqq'"),
     ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
     ({"quant_method": "awq", "bits": 3, "group_size": 128}, "3-bit"),
     ({"quant_method": "awq", "bits": 4, "group_size": 128,
       "modules_to_not_convert": ["frobnicator"]}, "frobnicator")],
)  # fmt: skip
def test_unreadable_quantization_is_an_error(quant, match):
    c = {**cfg("Qwen--Qwen3-8B.json"), "quantization_config": quant}
    with pytest.raises(ModelError, match=match):
        shape_from_config(c, where="x/config.json")


def test_unknown_model_type_with_unknown_fields_is_refused():
    c = {**cfg("Qwen--Qwen3-8B.json"), "model_type": "zamba9", "mamba_d_state": 64}
    with pytest.raises(ModelError, match=r"x.json: model_type 'zamba9'.*mamba_d_state"):
        shape_from_config(c, where="x.json")
    plain = {**cfg("Qwen--Qwen3-8B.json"), "model_type": "olmo2"}  # a plain decoder: read
    assert shape_from_config(plain).num_layers == 36


def test_linear_attention_costs_a_state_not_a_kv_cache():
    from ddtree.perf.cost.step import (
        Drafter,
        Forward,
        Point,
        attention,
        default_params,
        kv_commit,
        params_at,
    )
    from ddtree.perf.hardware.catalog import load_catalog
    from ddtree.vocab import Stage

    m = PRESETS["qwen3-next-80b-a3b"]
    pt = Point(hardware=load_catalog()["b300"], tp=1, concurrency=1, context_tokens=2048,
               block_size=8, budget=8, engine="eager",
               drafter=Drafter(params=1e9, layers=1, kv_bytes_per_token=1))  # fmt: skip
    params = params_at(default_params())
    short, long = (attention(m, pt, params, Forward(Stage.VERIFY, 8, c)) for c in (1024, 2048))
    kv = 12 * 1024 * m.kv_bytes_per_token_layer()  # only the 12 full layers grow with context
    assert long.hbm_bytes - short.hbm_bytes == pytest.approx(kv)
    state = 36 * m.state_bytes_per_request_layer() * 2
    weights = m.num_layers * m.attention_params_per_shard(1) * 2
    assert short.hbm_bytes == pytest.approx(
        weights + 12 * 1024 * m.kv_bytes_per_token_layer() + state
    )
    commit = kv_commit(m, pt, params, 3.0)
    assert commit.hbm_bytes == pytest.approx(3 * 12 * m.kv_bytes_per_token_layer() * 2 + state)
