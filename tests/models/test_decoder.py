"""Golden reference: our Qwen3 / Qwen3-MoE / Llama decoder against transformers' own models, in
float32 within 1e-5: prefill (logits and every hidden state), one-token decode, tree verify
against each node's path, commit; checkpoints as transformers saves them and as published
(per-expert tensors, sharded with an index); config errors named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tests.trees import hf_logits, make_tree, path_of

from ddtree.models.adapters.decoder import DecoderTarget
from ddtree.models.base import Target
from ddtree.models.loading.checkpoint import CheckpointError
from ddtree.models.nn.decoder import DecoderConfig, DecoderModel
from ddtree.models.nn.layers import ConfigError

transformers = pytest.importorskip("transformers")

TOL = 1e-5
COMMON = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.1,
)
CONFIGS = {
    # grouped-query attention 4:2, QK-norm, tied embeddings (Qwen3-0.6B..4B are tied)
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True
    ),
    # Llama-3.1's rope scaling (short original context so every band is exercised), biases
    "llama": lambda: transformers.LlamaConfig(
        **COMMON,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    # routed experts with norm_topk_prob, one dense layer between sparse ones
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
}
CLASSES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]
TREE_TOKENS = [12, 40, 7, 55, 40, 19, 3]
TREE_PARENTS = [-1, 0, 0, 1, 1, 3, 2]


def make_hf(kind: str):
    torch.manual_seed(0)
    cfg = CONFIGS[kind]()
    cfg._attn_implementation = "eager"
    return getattr(transformers, CLASSES[kind])(cfg).eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_model(request):
    return request.param, make_hf(request.param)


def ours(hf, capacity: int = 8) -> DecoderTarget:
    config = DecoderConfig.from_hf(hf.config.to_dict())
    model = DecoderModel(config)
    model.load_state_dict(hf.state_dict())
    model.model.rotary_emb.reset_inv_freq()
    return DecoderTarget(model, capacity=capacity)  # small: exercises cache growth


def test_is_a_target(hf_model):
    assert isinstance(ours(hf_model[1]), Target)


def test_prefill_logits_and_every_hidden_state_match_hf(hf_model):
    _, hf = hf_model
    target = ours(hf)
    layers = list(range(hf.config.num_hidden_layers + 1))
    target.set_capture_layers(layers)
    out = target.prefill(torch.tensor(PROMPT))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT]), output_hidden_states=True)
    assert out.logits.shape == (len(PROMPT), hf.config.vocab_size)
    assert (out.logits - ref.logits[0]).abs().max() <= TOL
    ref_hidden = torch.cat([ref.hidden_states[i][0] for i in layers], -1)
    assert (out.hidden - ref_hidden).abs().max() <= TOL


def test_sequential_decode_matches_hf(hf_model):
    _, hf = hf_model
    target = ours(hf)
    target.prefill(torch.tensor(PROMPT[:4]))
    ref = hf_logits(hf, PROMPT)
    for pos in range(4, len(PROMPT)):
        out = target.verify(make_tree([PROMPT[pos]], [-1]))
        target.commit(torch.tensor([0]))
        assert (out.logits[0] - ref[pos]).abs().max() <= TOL, pos
    assert target.cache.capacity >= len(PROMPT) > 8


def test_tree_verify_matches_each_nodes_path(hf_model):
    _, hf = hf_model
    target = ours(hf)
    target.prefill(torch.tensor(PROMPT))
    out = target.verify(make_tree(TREE_TOKENS, TREE_PARENTS))
    for i in range(len(TREE_TOKENS)):
        path_tokens = [TREE_TOKENS[j] for j in path_of(TREE_PARENTS, i)]
        ref = hf_logits(hf, PROMPT + path_tokens)[-1]
        assert (out.logits[i] - ref).abs().max() <= TOL, i
    assert target.seq_len == len(PROMPT)  # verify entries are provisional


def test_commit_then_decode_equals_decoding_the_accepted_path(hf_model):
    _, hf = hf_model
    accepted = [0, 1, 3, 5]  # a root-to-leaf path of the tree
    path_tokens = [TREE_TOKENS[j] for j in accepted]
    target = ours(hf)
    target.prefill(torch.tensor(PROMPT))
    target.verify(make_tree(TREE_TOKENS, TREE_PARENTS))
    target.commit(torch.tensor(accepted))
    assert target.seq_len == len(PROMPT) + len(accepted)
    got = target.prefill(torch.tensor([22, 8])).logits
    ref = hf_logits(hf, PROMPT + path_tokens + [22, 8])[-2:]
    assert (got - ref).abs().max() <= TOL
    direct = ours(hf)
    direct.prefill(torch.tensor(PROMPT + path_tokens + [22, 8]))
    n = direct.seq_len
    for mine, theirs in zip(target.cache.tensors(), direct.cache.tensors(), strict=True):
        assert (mine[:, :n] - theirs[:, :n]).abs().max() <= TOL


def save_published(hf, path, shards: int) -> None:
    """The checkpoint as published models ship it: experts one by one, ``shards`` files and a
    ``model.safetensors.index.json``; a tied LM head not stored."""
    from tests.engine.helpers import per_expert

    path.mkdir()
    state = per_expert({k: v.contiguous() for k, v in hf.state_dict().items()})
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: state[n] for n in part}, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(hf.config.to_json_string())


@pytest.mark.parametrize("layout", ["save_pretrained", "published-sharded"])
def test_checkpoint_directories_load_as_saved_and_as_published(hf_model, tmp_path, layout):
    kind, hf = hf_model
    path = tmp_path / kind
    if layout == "save_pretrained":
        hf.save_pretrained(path)
    else:
        save_published(hf, path, shards=3)
    target = DecoderTarget.from_pretrained(path)
    assert target.info.implementation == "decoder"
    assert target.info.architecture == CLASSES[kind] and target.info.name == kind
    assert target.info.n_params == sum(p.numel() for p in hf.parameters())
    out = target.prefill(torch.tensor(PROMPT)).logits
    assert (out - hf_logits(hf, PROMPT)).abs().max() <= TOL


def test_a_missing_expert_tensor_is_named(tmp_path):
    hf = make_hf("qwen3_moe")
    save_published(hf, tmp_path / "ckpt", shards=1)
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    from safetensors.torch import load_file

    (file,) = set(index["weight_map"].values())
    state = load_file(str(tmp_path / "ckpt" / file))
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    state.pop(gone)
    index["weight_map"].pop(gone)
    save_file(state, str(tmp_path / "ckpt" / file))
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"ckpt: missing tensors .*experts\.5\.up_proj"):
        DecoderTarget.from_pretrained(tmp_path / "ckpt")


def base_config(**changes) -> dict:
    cfg = transformers.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16).to_dict()
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "mistral"}, "model_type='mistral', expected one of llama, qwen3"),
        ({"use_sliding_window": True}, "sliding-window attention .* use impl 'hf'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu', expected 'silu'"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type='longrope'"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
            "llama3 rope field low_freq_factor is missing",
        ),
        ({"layer_types": ["full_attention"] * 2}, "layer_types has 2 entries, expected"),
        ({"vocab_size": None}, "missing field vocab_size|wrong type"),
    ],
)
def test_config_errors_name_the_file_and_field(changes, message):
    cfg = base_config(**changes)
    if cfg.get("vocab_size") is None:
        cfg.pop("vocab_size")
    with pytest.raises(ConfigError, match=f"x/config.json: .*{message}|{message}"):
        DecoderConfig.from_hf(cfg, source="x/config.json")


def test_sparse_layer_rule_matches_transformers():
    hf = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **dict(COMMON, num_hidden_layers=6),
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        )
    )
    config = DecoderConfig.from_hf(hf.config.to_dict())
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [config.sparse(i) for i in range(6)] == theirs == [0, 1, 0, 0, 0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["model", "layer"])
def test_compiled_forwards_equal_eager_across_prefix_chunks(hf_model, scope):
    """The compiled graphs (without a prefix, then with one once the context passes the first
    64-key chunk), whole or per layer, give the eager logits, hidden states and cache rows."""
    from ddtree.models.static import EnginePlan

    _, hf = hf_model
    eager, compiled = ours(hf, capacity=16), ours(hf, capacity=16)
    for target in (eager, compiled):
        target.set_capture_layers([1, 3])
    compiled.set_engine_mode(EnginePlan("compiled", (1, 8), max_len=110, compile_scope=scope))
    prompt = torch.arange(40) % 101  # prefilled in chunks of 8, all before the first 64 keys
    results = []
    for target in (eager, compiled):
        outs = [target.prefill(prompt)]
        for step in range(40):
            tree = make_tree([(7 * step) % 101, 3, 9], [-1, 0, 0]) if step % 2 else None
            tree = tree or make_tree([(5 * step) % 101], [-1])
            outs.append(target.verify(tree, target.layout(tree)))
            target.commit(torch.tensor([0, 2] if tree.n_nodes == 3 else [0]))
        results.append(outs)
    for a, b in zip(*results, strict=True):
        assert (a.logits - b.logits).abs().max() <= TOL
        assert (a.hidden - b.hidden).abs().max() <= TOL
    n = eager.seq_len
    assert n == compiled.seq_len == 40 + 20 * 2 + 20
    for mine, theirs in zip(eager.cache.tensors(), compiled.cache.tensors(), strict=True):
        assert (mine[:, :n] - theirs[:, :n]).abs().max() <= TOL
