"""HFTarget: tree verify over a DynamicCache equals plain full-sequence forwards of each path."""

from __future__ import annotations

import pytest
import torch
from tests.tiny import TINY_DEEPSEEK_V3, TINY_LLAMA, TINY_QWEN3, TINY_VOCAB
from tests.trees import make_tree

from ddtree.models.adapters.hf import (
    CacheKeywordError,
    HFTarget,
    NonFiniteLogitsError,
    causal_float_mask,
    detect_cache_keyword,
)
from ddtree.models.base import Target
from ddtree.tree.layout import verify_layout
from ddtree.tree.types import DraftTree

transformers = pytest.importorskip("transformers")

TOL = 1e-4
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**TINY_QWEN3, eos_token_id=[7, 9]),
    "llama": lambda: transformers.LlamaConfig(**TINY_LLAMA, eos_token_id=5),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**TINY_DEEPSEEK_V3),
}
MODEL_CLASSES = {
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def make_model(kind: str, attn: str = "sdpa"):
    torch.manual_seed(0)
    cfg = CONFIGS[kind]()
    cfg._attn_implementation = attn
    model = getattr(transformers, MODEL_CLASSES[kind])(cfg).eval()
    if kind == "deepseek_v3":
        with torch.no_grad():
            model.model.layers[1].mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model


@pytest.fixture(
    scope="module",
    params=[("qwen3", "sdpa"), ("llama", "eager"), ("deepseek_v3", "eager")],
    ids=lambda p: "-".join(p),
)
def model(request):
    return make_model(*request.param)


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return out[::-1]


def full_forward(model, ids: list[int], layers=()):
    """Last-position logits [V] and hidden states of a plain forward without a cache."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    hidden = torch.cat([out.hidden_states[i][0, -1] for i in layers]) if layers else None
    return out.logits[0, -1], hidden


# Trees of M = 6 nodes: a branching shape and a chain, with parents before children.
PARENTS = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4], [-1, 0, 0, 0, 3, 4]]


def test_is_a_target(model):
    target = HFTarget(model)
    assert isinstance(target, Target)
    assert target.cache_keyword == "cache"  # transformers 5.24 renamed it
    assert target.info.implementation == "hf"
    assert target.info.num_layers == 2 and target.info.hidden_size == 64
    assert target.info.vocab_size == TINY_VOCAB and target.info.max_position == 64


def test_prefill_logits_every_position(model):
    target = HFTarget(model)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    logits = target.prefill(torch.tensor(prompt)).logits
    with torch.no_grad():
        ref = model(torch.tensor([prompt]), use_cache=False).logits[0]
    assert logits.shape == (7, TINY_VOCAB)
    assert (logits - ref).abs().max().item() <= TOL
    assert target.seq_len == 7


def test_verify_commit_steps_equal_full_forward(model):
    """Over several steps, every node's logits and captured hidden states equal a plain forward
    of (committed tokens + the node's path); commit keeps non-suffix subsets correctly."""
    gen = torch.Generator().manual_seed(1)
    layers = [0, 1, 2]
    target = HFTarget(model)
    target.set_capture_layers(layers)
    committed = [3, 14, 15, 92, 65]
    out = target.prefill(torch.tensor(committed))
    assert out.hidden.shape == (5, 3 * 64)
    root = 35
    worst_logits, worst_hidden = 0.0, 0.0
    accepted_paths = [[0, 1, 3], [0, 1, 2, 3, 4, 5], [0, 3]]  # each a path in its tree
    for parents, accepted in zip(PARENTS, accepted_paths, strict=True):
        tokens = [root] + torch.randint(0, TINY_VOCAB, (5,), generator=gen).tolist()
        tree = make_tree(tokens, parents)
        out = target.verify(tree)
        assert out.logits.shape == (6, TINY_VOCAB) and out.hidden.shape == (6, 3 * 64)
        for node in range(6):
            ref_logits, ref_hidden = full_forward(
                model, committed + path_tokens(tree, node), layers
            )
            worst_logits = max(worst_logits, (out.logits[node] - ref_logits).abs().max().item())
            worst_hidden = max(worst_hidden, (out.hidden[node] - ref_hidden).abs().max().item())
        target.commit(torch.tensor(accepted))
        committed += [tokens[i] for i in accepted]
        assert target.seq_len == len(committed)
        assert target.cache.get_seq_length() == len(committed)
        root = int(out.logits[accepted[-1]].argmax())
    assert worst_logits <= TOL, worst_logits
    assert worst_hidden <= TOL, worst_hidden
    # the compacted cache equals the cache of a fresh prefill of the committed tokens
    fresh = HFTarget(model)
    fresh.prefill(torch.tensor(committed))
    for ours, ref in zip(target.cache.layers, fresh.cache.layers, strict=True):
        assert (ours.keys - ref.keys).abs().max().item() <= TOL
        assert (ours.values - ref.values).abs().max().item() <= TOL


def test_prebuilt_layout_equals_internal(model):
    target = HFTarget(model)
    target.prefill(torch.tensor([1, 2, 3]))
    tree = make_tree([4, 5, 6, 7], [-1, 0, 0, 1])
    a = target.verify(tree).logits
    b = target.verify(tree, verify_layout(tree, target.seq_len, torch.float32)).logits
    assert torch.equal(a, b)  # the second verify dropped the first's provisional entries
    assert target.cache.get_seq_length() == 3 + 4


def test_bool_mask_with_eager_attention_is_silently_wrong():
    """Trap: transformers passes a 4D mask through as-is and eager attention *adds* it, so a
    boolean tree mask adds 0/1 instead of hiding entries. The additive float mask is right."""
    model = make_model("llama", "eager")
    prefix = [3, 14, 15]
    tree = make_tree([92, 65, 35, 89], [-1, 0, 0, 1])
    m, start = 4, len(prefix)
    float_mask = verify_layout(tree, start, torch.float32).attn_mask
    bool_mask = torch.ones(1, 1, m, start + m, dtype=torch.bool)
    bool_mask[0, 0, :, start:] = tree.visibility

    def run(mask):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([prefix]), cache=cache)
            return model(
                tree.tokens[None],
                attention_mask=mask,
                position_ids=(start + tree.depth)[None],
                cache=cache,
            ).logits[0]

    ref = torch.stack([full_forward(model, prefix + path_tokens(tree, i))[0] for i in range(m)])
    assert (run(float_mask) - ref).abs().max().item() <= TOL
    assert (run(bool_mask) - ref).abs().max().item() > 1e-2


def test_verify_refuses_bool_layout():
    target = HFTarget(make_model("llama", "eager"))
    tree = make_tree([1, 2], [-1, 0])
    layout = verify_layout(tree, 0, torch.float32)
    layout.attn_mask = layout.attn_mask == 0
    with pytest.raises(TypeError, match="additive float"):
        target.verify(tree, layout)


def test_detect_cache_keyword_fake_signatures():
    def new_style(input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
        pass

    def old_style(input_ids, attention_mask=None, past_key_values=None, **kwargs):
        pass

    def both(input_ids, cache=None, past_key_values=None):
        pass

    def catch_all(input_ids, **kwargs):
        pass

    assert detect_cache_keyword(new_style) == "cache"
    assert detect_cache_keyword(old_style) == "past_key_values"
    assert detect_cache_keyword(both) == "cache"
    with pytest.raises(CacheKeywordError, match="no cache parameter"):
        detect_cache_keyword(catch_all)


class OldStyleLM(torch.nn.Module):
    """A transformers < 5.24 style forward: takes ``past_key_values=`` only."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        output_hidden_states=None,
        **kwargs,
    ):
        assert "cache" not in kwargs
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=past_key_values,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
        )

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


class IgnoresCacheLM(OldStyleLM):
    """Names ``cache`` but drops it (as 5.15 silently ignores ``cache=``)."""

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        output_hidden_states=None,
        **kwargs,
    ):
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            output_hidden_states=output_hidden_states,
        )


def test_old_cache_keyword_drives_the_same_cache():
    inner = make_model("qwen3")
    old, new = HFTarget(OldStyleLM(inner)), HFTarget(inner)
    assert old.cache_keyword == "past_key_values" and new.cache_keyword == "cache"
    tree = make_tree([4, 5, 6, 7], [-1, 0, 1, 1])
    for target in (old, new):
        target.prefill(torch.tensor([1, 2, 3]))
        target.verify(tree)
        target.commit(torch.tensor([0, 1, 3]))
    a = old.verify(make_tree([8, 9], [-1, 0])).logits
    b = new.verify(make_tree([8, 9], [-1, 0])).logits
    assert torch.equal(a, b) and old.seq_len == 6


def test_ignored_cache_is_caught():
    target = HFTarget(IgnoresCacheLM(make_model("qwen3")))
    with pytest.raises(CacheKeywordError, match="ignored cache="):
        target.prefill(torch.tensor([1, 2, 3]))


def test_commit_never_uses_crop(monkeypatch):
    """Trap: ``DynamicCache.crop``'s argument changed meaning (5.24 wants a negative count to
    remove) and it only drops a suffix; compaction must not depend on it."""
    cache = transformers.DynamicCache()
    cache.update(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2), 0)
    with pytest.raises(ValueError):
        cache.crop(3)  # the "keep 3" reading of older releases is refused here
    cache.crop(-2)
    assert cache.get_seq_length() == 3

    def broken(self, *args):
        raise AssertionError("crop called")

    monkeypatch.setattr(transformers.DynamicCache, "crop", broken)
    target = HFTarget(make_model("qwen3"))
    target.prefill(torch.tensor([1, 2, 3]))
    target.verify(make_tree([4, 5, 6], [-1, 0, 0]))
    target.commit(torch.tensor([0, 2]))
    assert target.seq_len == 5 and target.cache.get_seq_length() == 5


def test_commit_validation():
    target = HFTarget(make_model("qwen3"))
    target.prefill(torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="without a preceding verify"):
        target.commit(torch.tensor([0]))
    target.verify(make_tree([3, 4], [-1, 0]))
    with pytest.raises(ValueError, match="root 0 first"):
        target.commit(torch.tensor([1]))
    with pytest.raises(ValueError, match="ids < 2"):
        target.commit(torch.tensor([0, 2]))


def test_context_length_guard():
    target = HFTarget(make_model("llama", "eager"))
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        target.prefill(torch.arange(65) % TINY_VOCAB)
    target.prefill(torch.arange(62) % TINY_VOCAB)
    with pytest.raises(ValueError, match="tree of depth 2 needs 65 positions"):
        target.verify(make_tree([1, 2, 3], [-1, 0, 1]))


def test_non_finite_logits_stop():
    model = make_model("llama", "eager")
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    target = HFTarget(model)
    with pytest.raises(NonFiniteLogitsError, match="NaN/inf in logits at positions 0..2"):
        target.prefill(torch.tensor([1, 2, 3]))


def test_info_and_capture_errors():
    qwen = HFTarget(make_model("qwen3"), name="tiny-qwen")
    assert qwen.info.eos_token_ids == (7, 9) and qwen.info.name == "tiny-qwen"
    assert HFTarget(make_model("llama", "eager")).info.eos_token_ids == (5,)
    with pytest.raises(ValueError, match=r"\[3\] outside 0..2"):
        qwen.set_capture_layers([0, 3])
    assert qwen.embed_tokens.weight.shape == (TINY_VOCAB, 64)
    assert qwen.lm_head.weight.shape == (TINY_VOCAB, 64)


def test_causal_float_mask():
    mask = causal_float_mask(2, 3, torch.float32)
    visible = mask[0, 0] == 0
    assert visible.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]


def test_from_pretrained_round_trip(tmp_path):
    from ddtree.models.loading.checkpoint import CheckpointError

    model = make_model("qwen3")
    model.save_pretrained(tmp_path / "q")
    target = HFTarget.from_pretrained(tmp_path / "q")
    assert target.info.name == "q" and target.info.architecture == "Qwen3ForCausalLM"
    ids = [5, 6, 7, 8]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (target.prefill(torch.tensor(ids)).logits - ref).abs().max().item() <= TOL
    (tmp_path / "q" / "model.safetensors").rename(tmp_path / "q" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickled weights are refused"):
        HFTarget.from_pretrained(tmp_path / "q")


def test_bfloat16_mask_in_model_dtype():
    """The layout is built in the model dtype (bf16 finfo.min), and the tree still matches a
    plain bf16 forward of each path."""
    model = make_model("qwen3").to(torch.bfloat16)
    target = HFTarget(model)
    assert target.info.dtype == "bfloat16"
    target.prefill(torch.tensor([3, 14, 15]))
    tree = make_tree([92, 65, 35, 89], [-1, 0, 0, 1])
    logits = target.verify(tree).logits
    assert logits.dtype == torch.bfloat16
    for node in range(4):
        ref, _ = full_forward(model, [3, 14, 15] + path_tokens(tree, node))
        assert (logits[node].float() - ref.float()).abs().max().item() <= 5e-2
