"""Our DFlash drafter against the PyPI ``dflash`` reference, incremental decoding, loading."""

from __future__ import annotations

import json

import pytest
import torch
from tests.engine.helpers import tiny_mla_target
from torch import nn

from ddtree.models import load_drafter
from ddtree.models.checkpoint import CheckpointError
from ddtree.models.dflash import DFlashConfig, DFlashDrafter, DFlashModel

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


def test_block_logits_match_the_dflash_reference():
    dflash = pytest.importorskip("dflash.model")
    transformers = pytest.importorskip("transformers")
    ours = _random_model()
    cfg = transformers.Qwen3Config(**{k: v for k, v in RAW.items() if k != "architectures"})
    cfg.block_size, cfg.num_target_layers = RAW["block_size"], RAW["num_target_layers"]
    cfg.dflash_config = dict(RAW["dflash_config"])
    ref = dflash.DFlashDraftModel(cfg).eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    embed, head = _shared()
    torch.manual_seed(2)
    ctx_len, b = 9, RAW["block_size"]
    context = torch.randn(1, ctx_len, 2 * HIDDEN)  # [R, C, F]
    block = torch.tensor([[17] + [60] * (b - 1)])  # [R, B]
    with torch.no_grad():
        got = ours.block_logits(context, block, embed, head)
        hidden = ref(
            position_ids=torch.arange(ctx_len + b)[None],
            noise_embedding=embed(block),
            target_hidden=context,
        )
        want = ref.compute_logits(hidden[:, 1:], head)
    assert got.shape == (1, b - 1, VOCAB)
    assert (got - want).abs().max() <= TOL
    assert (got - want).abs().max() < 1e-2 * want.abs().max()  # and the logits are not tiny


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
            want = model.block_logits(context, block, embed, head)[0]
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
    with pytest.raises(ValueError, match="layer_types"):
        DFlashConfig.from_dict(dict(RAW, layer_types=["sliding_attention"] * 2), "x")
    drafter = DFlashDrafter(_random_model(), *_shared())
    with pytest.raises(ValueError, match="expects 64"):
        drafter.propose(torch.zeros(3, HIDDEN), 1)
