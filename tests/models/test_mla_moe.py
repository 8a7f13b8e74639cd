"""Golden reference: our MLA+MoE model against transformers' DeepseekV3ForCausalLM."""

from __future__ import annotations

import pytest
import torch
from tests.trees import hf_logits, make_tree, path_of

from ddtree.errors import NonFiniteLogitsError
from ddtree.models.adapters.mla_moe import MlaMoeTarget
from ddtree.models.base import Target
from ddtree.models.nn.mla_moe import ConfigError, LatentCache, MlaMoeConfig, MlaMoeModel

transformers = pytest.importorskip("transformers")

TOL = 1e-4

BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=128,
    initializer_range=0.1,
    first_k_dense_replace=1,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
CONFIGS = {
    # Kimi-K2 shape: one group, one dense layer first, q LoRA.
    "kimi": dict(
        BASE,
        q_lora_rank=24,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
    ),
    # DeepSeek-V3 shape: grouped routing, correction bias, YaRN, and no q LoRA.
    "deepseek": dict(
        BASE,
        q_lora_rank=None,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
        rope_scaling=dict(
            type="yarn",
            factor=4.0,
            original_max_position_embeddings=32,
            mscale=1.0,
            mscale_all_dim=0.8,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
}


def make_hf(kind: str):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**CONFIGS[kind])
    cfg._attn_implementation = "eager"
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers[cfg.first_k_dense_replace :]:
            # zero after random init: make group/expert choice depend on it
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_model(request):
    return request.param, make_hf(request.param)


def ours(hf, attn_impl: str = "absorbed") -> MlaMoeTarget:
    config = MlaMoeConfig.from_hf(hf.config.to_dict())
    model = MlaMoeModel(config, attn_impl)
    model.load_state_dict(hf.state_dict())
    return MlaMoeTarget(model, capacity=8)  # small: exercises cache growth


PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]
TREE_TOKENS = [12, 40, 7, 55, 40, 19, 3]
TREE_PARENTS = [-1, 0, 0, 1, 1, 3, 2]


@pytest.mark.parametrize("attn_impl", ["absorbed", "naive"])
def test_prefill_logits_and_hidden_match_hf(hf_model, attn_impl):
    _, hf = hf_model
    target = ours(hf, attn_impl)
    # 0 = embeddings, i = output of layer i-1, the last one after the final norm
    layers = list(range(hf.config.num_hidden_layers + 1))
    target.set_capture_layers(layers)
    out = target.prefill(torch.tensor(PROMPT))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT]), output_hidden_states=True)
    assert out.logits.shape == (len(PROMPT), hf.config.vocab_size)
    assert (out.logits - ref.logits[0]).abs().max() <= TOL
    ref_hidden = torch.cat([ref.hidden_states[i][0] for i in layers], -1)
    assert (out.hidden - ref_hidden).abs().max() <= TOL
    assert target.seq_len == len(PROMPT)


@pytest.mark.parametrize("attn_impl", ["absorbed", "naive"])
def test_sequential_decode_matches_hf(hf_model, attn_impl):
    _, hf = hf_model
    target = ours(hf, attn_impl)
    target.prefill(torch.tensor(PROMPT[:4]))
    ref = hf_logits(hf, PROMPT)
    for pos in range(4, len(PROMPT)):
        out = target.prefill(torch.tensor([PROMPT[pos]]))
        assert (out.logits[0] - ref[pos]).abs().max() <= TOL, pos
    assert target.cache.capacity >= len(PROMPT) > 8


@pytest.mark.parametrize("attn_impl", ["absorbed", "naive"])
def test_tree_verify_matches_each_nodes_path(hf_model, attn_impl):
    _, hf = hf_model
    target = ours(hf, attn_impl)
    target.prefill(torch.tensor(PROMPT))
    out = target.verify(make_tree(TREE_TOKENS, TREE_PARENTS))
    assert out.logits.shape == (len(TREE_TOKENS), hf.config.vocab_size)
    for i in range(len(TREE_TOKENS)):
        path_tokens = [TREE_TOKENS[j] for j in path_of(TREE_PARENTS, i)]
        ref = hf_logits(hf, PROMPT + path_tokens)[-1]
        assert (out.logits[i] - ref).abs().max() <= TOL, i
    assert target.seq_len == len(PROMPT)  # verify entries are provisional


def test_absorbed_equals_naive_on_tree_verify(hf_model):
    _, hf = hf_model
    outs = []
    for impl in ("absorbed", "naive"):
        target = ours(hf, impl)
        target.set_capture_layers([1, hf.config.num_hidden_layers])
        target.prefill(torch.tensor(PROMPT))
        outs.append(target.verify(make_tree(TREE_TOKENS, TREE_PARENTS)))
    assert (outs[0].logits - outs[1].logits).abs().max() <= TOL
    assert (outs[0].hidden - outs[1].hidden).abs().max() <= TOL


def test_commit_then_decode_equals_decoding_the_accepted_path(hf_model):
    _, hf = hf_model
    accepted = [0, 1, 3, 5]  # a root-to-leaf path of the tree
    path_tokens = [TREE_TOKENS[j] for j in accepted]
    next_tokens = [22, 8]
    target = ours(hf)
    target.prefill(torch.tensor(PROMPT))
    target.verify(make_tree(TREE_TOKENS, TREE_PARENTS))
    target.commit(torch.tensor(accepted))
    assert target.seq_len == len(PROMPT) + len(accepted)
    got = target.prefill(torch.tensor(next_tokens)).logits

    direct = ours(hf)
    direct.prefill(torch.tensor(PROMPT + path_tokens))
    n = direct.seq_len
    assert torch.allclose(target.cache.rows[:, :n], direct.cache.rows[:, :n], atol=TOL)
    ref = hf_logits(hf, PROMPT + path_tokens + next_tokens)[-len(next_tokens) :]
    assert (got - ref).abs().max() <= TOL
    # a second step: verify again from the new position and commit only the root
    target.verify(make_tree([4, 9], [-1, 0]))
    target.commit(torch.tensor([0]))
    after = target.prefill(torch.tensor([30])).logits[0]
    ref = hf_logits(hf, PROMPT + path_tokens + next_tokens + [4, 30])[-1]
    assert (after - ref).abs().max() <= TOL


def test_commit_rejects_bad_input(hf_model):
    _, hf = hf_model
    target = ours(hf)
    target.prefill(torch.tensor(PROMPT))
    with pytest.raises(RuntimeError, match="without a preceding verify"):
        target.commit(torch.tensor([0]))
    target.verify(make_tree(TREE_TOKENS, TREE_PARENTS))
    with pytest.raises(ValueError, match="root 0 first"):
        target.commit(torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="root 0 first"):
        target.commit(torch.tensor([0, 99]))


def test_target_protocol_and_shared_modules(hf_model):
    _, hf = hf_model
    target = ours(hf)
    assert isinstance(target, Target)
    assert target.embed_tokens.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr() or (
        torch.equal(target.embed_tokens.weight, hf.model.embed_tokens.weight)
    )
    assert torch.equal(target.lm_head.weight, hf.lm_head.weight)
    assert target.info.implementation == "mla_moe"
    assert target.info.num_layers == hf.config.num_hidden_layers
    target.prefill(torch.tensor(PROMPT))
    target.reset()
    assert target.seq_len == 0
    out = target.prefill(torch.tensor(PROMPT[:3]))
    assert (out.logits - hf_logits(hf, PROMPT[:3])).abs().max() <= TOL
    with pytest.raises(ValueError, match="outside 0..3"):
        target.set_capture_layers([4])


def test_prompt_longer_than_context_is_refused(hf_model):
    _, hf = hf_model
    target = ours(hf)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        target.prefill(torch.zeros(129, dtype=torch.long))


def test_nan_logits_raise(hf_model):
    _, hf = hf_model
    target = ours(hf)
    with torch.no_grad():
        target.lm_head.weight[3, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="NaN/inf in logits"):
        target.prefill(torch.tensor(PROMPT[:2]))


def test_yarn_softmax_scale_includes_mscale():
    config = MlaMoeConfig.from_hf(transformers.DeepseekV3Config(**CONFIGS["deepseek"]).to_dict())
    # mscale(s, m) = 0.1 * m * ln(s) + 1 (YaRN); the softmax scale uses mscale_all_dim = 0.8,
    # cos/sin carry mscale(4, 1.0) / mscale(4, 0.8)
    log4 = torch.log(torch.tensor(4.0)).item()
    assert config.softmax_scale == pytest.approx(16**-0.5 * (0.08 * log4 + 1) ** 2)
    assert config.rope_attention_factor == pytest.approx((0.1 * log4 + 1) / (0.08 * log4 + 1))
    plain = MlaMoeConfig.from_hf(transformers.DeepseekV3Config(**CONFIGS["kimi"]).to_dict())
    assert plain.softmax_scale == pytest.approx(16**-0.5)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("model_type", "llama", "model_type"),
        ("hidden_act", "gelu", "hidden_act"),
        ("num_key_value_heads", 2, "num_key_value_heads"),
        ("n_group", 3, "n_group"),
        (
            "rope_parameters",
            {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
            "rope_type",
        ),
    ],
)
def test_unsupported_config_fields_are_named(field, value, match):
    cfg = transformers.DeepseekV3Config(**CONFIGS["kimi"]).to_dict()
    cfg[field] = value
    with pytest.raises(ConfigError, match=match):
        MlaMoeConfig.from_hf(cfg)


def test_missing_field_is_named():
    cfg = transformers.DeepseekV3Config(**CONFIGS["kimi"]).to_dict()
    del cfg["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        MlaMoeConfig.from_hf(cfg)


def test_legacy_rope_scaling_fields_match_rope_parameters():
    cfg = transformers.DeepseekV3Config(**CONFIGS["deepseek"]).to_dict()
    legacy = dict(cfg)
    params = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = params.pop("rope_theta")
    legacy["rope_scaling"] = params
    assert MlaMoeConfig.from_hf(legacy) == MlaMoeConfig.from_hf(cfg)


def test_cache_growth_keeps_committed_rows():
    config = MlaMoeConfig.from_hf(transformers.DeepseekV3Config(**CONFIGS["kimi"]).to_dict())
    cache = LatentCache(config, 4, torch.float32, "cpu")
    cache.rows.normal_()
    cache.length = 3
    before = cache.rows[:, :3].clone()
    cache.ensure(5)
    assert cache.capacity == 8
    assert torch.equal(cache.rows[:, :3], before)
