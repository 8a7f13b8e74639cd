"""Our DFlash drafter against the PyPI ``dflash`` reference, incremental decoding, loading."""

from __future__ import annotations

import json

import pytest
import torch
from tests.engine.helpers import tiny_mla_target
from torch import nn

from ddtree.errors import NonFiniteLogitsError
from ddtree.models import load_drafter
from ddtree.models.adapters.dflash import DFlashDrafter
from ddtree.models.loading.checkpoint import CheckpointError
from ddtree.models.nn.dflash import DFlashConfig, DFlashModel

TOL = 1e-4
VOCAB, HIDDEN = 61, 32
RAW = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": HIDDEN,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "block_size": 4,
    "num_target_layers": 2,
    "dflash_config": {"mask_token_id": 60, "target_layer_ids": [0, 1]},
}


def _random_model(seed=0) -> DFlashModel:
    torch.manual_seed(seed)
    model = DFlashModel(DFlashConfig.from_dict(RAW))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def _shared(seed=1):
    torch.manual_seed(seed)
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
    return embed, head


# Reference configs: hidden 64, 2 layers, GQA; each adds one feature the drafter must honour.
REF_BASE = dict(
    RAW,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
REF_CONFIGS = {
    "gqa": REF_BASE,
    "bias_scales_softcap": dict(
        REF_BASE,
        attention_bias=True,
        dflash_config=dict(
            RAW["dflash_config"],
            input_embedding_scale=1.7,
            output_multiplier=0.6,
            final_logit_softcapping=3.0,
        ),
    ),
    # W = 5 < C + B, so the window hides part of the context from the block
    "sliding": dict(
        REF_BASE,
        use_sliding_window=True,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        is_causal=False,
    ),
    "causal_sliding_default": dict(
        REF_BASE, use_sliding_window=True, sliding_window=6, max_window_layers=1
    ),
}


def _random(raw: dict, seed=0) -> tuple[DFlashModel, nn.Embedding, nn.Linear]:
    torch.manual_seed(seed)
    model = DFlashModel(DFlashConfig.from_dict(raw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    h, v = raw["hidden_size"], raw["vocab_size"]
    return model, nn.Embedding(v, h), nn.Linear(h, v, bias=False)


def _reference(raw: dict, ours: DFlashModel):
    dflash = pytest.importorskip("dflash.model")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    cfg.block_size, cfg.num_target_layers = raw["block_size"], raw["num_target_layers"]
    cfg.dflash_config = dict(raw["dflash_config"])
    if "is_causal" in raw:
        cfg.is_causal = raw["is_causal"]
    ref = dflash.DFlashDraftModel(cfg).eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    return ref, dflash


def _scale(raw: dict) -> float:
    return raw["dflash_config"].get("input_embedding_scale", 1.0)


@pytest.mark.parametrize("name", list(REF_CONFIGS))
def test_block_logits_match_the_dflash_reference(name):
    raw = REF_CONFIGS[name]
    ours, embed, head = _random(raw)
    ref, _ = _reference(raw, ours)
    torch.manual_seed(2)
    rows, ctx_len, b = 2, 9, raw["block_size"]
    context = torch.randn(rows, ctx_len, 2 * raw["hidden_size"])  # [R, C, F]
    block = torch.tensor([[17] + [60] * (b - 1), [3] + [60] * (b - 1)])  # [R, B]
    with torch.no_grad():
        got = ours.block_logits(context, block, embed, head)
        hidden = ref(
            position_ids=torch.arange(ctx_len + b)[None],
            noise_embedding=embed(block) * _scale(raw),
            target_hidden=context,
        )
        want = ref.compute_logits(hidden[:, 1:], head)
    assert got.shape == (rows, b - 1, raw["vocab_size"])
    diff = float((got - want).abs().max())
    assert diff <= TOL, diff
    assert diff < 1e-2 * float(want.abs().max())  # and the logits are not tiny
    assert not torch.allclose(got[0], got[1])  # rows are independent blocks


@pytest.mark.parametrize("name", ["gqa", "sliding"])
def test_propose_matches_the_reference_cached_decode(name):
    """Our incremental context cache against the reference's own DynamicCache decode
    (context k/v appended, the block's cropped away after every step)."""
    raw = REF_CONFIGS[name]
    ours, embed, head = _random(raw)
    ref, dflash = _reference(raw, ours)
    drafter = DFlashDrafter(ours, embed, head, capacity=2)  # grows several times
    cache = dflash._make_cache(ref.config)
    torch.manual_seed(5)
    b, seen = raw["block_size"], 0
    for t_new, root in ((6, 7), (1, 11), (3, 13), (2, 2)):
        chunk = torch.randn(t_new, 2 * raw["hidden_size"])  # [T_new, F]
        got = drafter.propose(chunk, root)
        block = torch.tensor([[root] + [60] * (b - 1)])
        with torch.no_grad():
            hidden = ref(
                position_ids=torch.arange(seen, seen + t_new + b)[None],
                noise_embedding=embed(block) * _scale(raw),
                target_hidden=chunk[None],
                past_key_values=cache,
                use_cache=True,
            )
            want = ref.compute_logits(hidden[0, 1:], head)
        seen += t_new
        dflash._crop_to(cache, seen)
        assert drafter.seen == seen
        assert float((got - want).abs().max()) <= TOL, (seen, float((got - want).abs().max()))


@pytest.mark.parametrize("name", list(REF_CONFIGS))
def test_propose_at_many_roots_equals_propose_at_each_position(name):
    """One forward over many roots (block-structured mask) drafts what ``propose`` drafts at
    each position after committing the tokens before it, windows and causal layers included."""
    raw = REF_CONFIGS[name]
    model, embed, head = _random(raw)
    drafter = DFlashDrafter(model, embed, head)
    torch.manual_seed(7)
    seq_len = 14
    hidden = torch.randn(seq_len, 2 * raw["hidden_size"])  # [S, F]
    tokens = torch.randint(0, VOCAB, (seq_len + 1,))
    roots = torch.tensor([3, 4, 5, 9, 14, 1])  # any order, context 0..p-1 each
    got = drafter.propose_at(hidden, tokens[roots], roots)
    assert got.shape == (len(roots), raw["block_size"] - 1, VOCAB)
    for i, p in enumerate(roots.tolist()):
        drafter.reset()
        want = drafter.propose(hidden[:p], int(tokens[p]))
        diff = float((got[i] - want).abs().max())
        assert diff <= TOL, (p, diff)
    assert not torch.allclose(got[0], got[1])
    with pytest.raises(ValueError, match=r"root_positions must be .* in 1\.\.14"):
        drafter.propose_at(hidden, tokens[:1], torch.tensor([15]))
    with pytest.raises(ValueError, match="root_tokens outside"):
        drafter.propose_at(hidden, torch.tensor([VOCAB]), torch.tensor([2]))


def test_saved_drafter_loads_into_the_reference(tmp_path):
    """Our save format is the z-lab one: the reference's from_pretrained reads it."""
    dflash = pytest.importorskip("dflash.model")
    raw = REF_CONFIGS["bias_scales_softcap"]
    ours, embed, head = _random(raw)
    DFlashDrafter(ours, embed, head).save_pretrained(tmp_path)
    ref = dflash.DFlashDraftModel.from_pretrained(tmp_path).float().eval()
    torch.manual_seed(6)
    context, block = torch.randn(1, 5, 128), torch.tensor([[9, 60, 60, 60]])
    with torch.no_grad():
        got = ours.block_logits(context, block, embed, head)
        hidden = ref(
            position_ids=torch.arange(9)[None],
            noise_embedding=embed(block) * ref.config.dflash_config["input_embedding_scale"],
            target_hidden=context,
        )
        want = ref.compute_logits(hidden[:, 1:], head)
    assert float((got - want).abs().max()) <= TOL


def test_incremental_propose_equals_a_full_recompute():
    model = _random_model()
    embed, head = _shared()
    drafter = DFlashDrafter(model, embed, head)
    assert drafter.target_layer_ids == [1, 2]  # HF hidden_states indexing
    torch.manual_seed(3)
    chunks = [torch.randn(n, 2 * HIDDEN) for n in (5, 1, 3, 2)]  # committed per step
    roots = [7, 11, 13, 2]
    for step in range(len(chunks)):
        got = drafter.propose(chunks[step], roots[step])
        context = torch.cat(chunks[: step + 1])[None]
        block = torch.tensor([[roots[step]] + [60] * 3])
        with torch.no_grad():
            want = drafter.block_logits(context, block)[0]
        assert (got - want).abs().max() <= TOL, step
    drafter.reset()
    assert drafter.seen == 0
    with pytest.raises(ValueError, match="needs context"):
        drafter.propose(torch.zeros(0, 2 * HIDDEN), 1)


def _save(tmp_path, raw=RAW, model=None):
    target = tiny_mla_target()
    model = model or _random_model()
    drafter = DFlashDrafter(model, target.embed_tokens, target.lm_head)
    drafter.save_pretrained(tmp_path)
    if raw is not RAW:
        (tmp_path / "config.json").write_text(json.dumps(raw))
    return target, drafter


def test_save_and_load_round_trip(tmp_path):
    target, drafter = _save(tmp_path)
    loaded = load_drafter(tmp_path, target)
    assert isinstance(loaded, DFlashDrafter) and loaded.block_size == 4
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dflash_config"] == RAW["dflash_config"] and saved["block_size"] == 4
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert names == set(drafter.model.state_dict())  # the drafter's own tensors only
    assert "fc.weight" in names and not any("embed" in n or "lm_head" in n for n in names)
    torch.manual_seed(4)
    ctx = torch.randn(6, 2 * HIDDEN)
    assert torch.equal(loaded.propose(ctx, 5), drafter.propose(ctx, 5))


def test_bad_drafters_get_errors_naming_the_file_and_field(tmp_path):
    target, _ = _save(tmp_path / "wide", dict(RAW, hidden_size=64))
    with pytest.raises(ValueError, match=r"wide/config.json: field hidden_size=64"):
        load_drafter(tmp_path / "wide", target)
    far = dict(RAW, dflash_config={"mask_token_id": 60, "target_layer_ids": [0, 5]})
    _save(tmp_path / "far", far)
    with pytest.raises(ValueError, match=r"target_layer_ids \[0, 5\] include \[5\]"):
        load_drafter(tmp_path / "far", target)
    _save(tmp_path / "shape", dict(RAW, intermediate_size=40))
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight"):
        load_drafter(tmp_path / "shape", target)
    nomask = dict(RAW, dflash_config={"target_layer_ids": [0, 1]})
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_dict(nomask, "x/config.json")
    with pytest.raises(ValueError, match=r"x/config.json: field layer_types=.*'chunked'"):
        DFlashConfig.from_dict(
            dict(RAW, layer_types=["chunked", "full_attention"]), "x/config.json"
        )
    with pytest.raises(ValueError, match=r"x/config.json: field hidden_act='gelu'"):
        DFlashConfig.from_dict(dict(RAW, hidden_act="gelu"), "x/config.json")
    drafter = DFlashDrafter(_random_model(), *_shared())
    with pytest.raises(ValueError, match="expects 64"):
        drafter.propose(torch.zeros(3, HIDDEN), 1)
    with pytest.raises(ValueError, match="root_token=61 outside"):
        drafter.propose(torch.zeros(3, 2 * HIDDEN), VOCAB)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    target, _ = _save(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("layers.1.self_attn.k_norm.weight")
    tensors["layers.2.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_drafter(tmp_path, target)
    message = str(err.value)
    assert str(tmp_path) in message
    assert "missing tensors: layers.1.self_attn.k_norm.weight" in message
    assert "unexpected tensors: layers.2.mlp.up_proj.weight" in message


def test_absent_optional_fields_default_as_the_reference_builds_them():
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in RAW.items() if k not in ("head_dim", "rope_theta")}
    ours = DFlashConfig.from_dict(raw)
    ref = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    assert ours.head_dim == ref.head_dim
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.layer_types == tuple(ref.layer_types) and ours.sliding_window is None


def test_nan_logits_stop_decoding_with_an_error():
    model, (embed, head) = _random_model(), _shared()
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    drafter = DFlashDrafter(model, embed, head)
    with pytest.raises(NonFiniteLogitsError, match="NaN/inf logits .* 3 context tokens"):
        drafter.propose(torch.ones(3, 2 * HIDDEN), 1)
