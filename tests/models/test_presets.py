"""Model presets: every shape parses and matches the estimator's catalogue of the same model,
memory is checked before anything is allocated, and random real-shape targets decode exactly
(DDTree = AR token for token) in bfloat16."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine import DecodeConfig, generate
from ddtree.models.loading.compat import check_drafter_compat
from ddtree.models.oracle import OracleDrafter, OracleSpec
from ddtree.models.presets import (
    MemoryPlan,
    Preset,
    PresetError,
    check_fits,
    memory_plan,
    preset_names,
    random_drafter,
    random_target,
    random_target_config,
)
from ddtree.perf.shapes.model import PRESETS, shape_from_config

PUBLISHED = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b"]


def test_the_issue_presets_exist_and_say_where_their_shapes_came_from():
    assert set(PUBLISHED) <= set(preset_names())
    for name in preset_names():
        preset = Preset.load(name)
        assert preset.name == name and preset.sources["target"] and preset.sources["drafter"]
        config = random_target_config(preset)
        assert not config.tie_word_embeddings  # random targets are untied (module docstring)
    with pytest.raises(PresetError, match="preset 'qwen9': expected one of .*qwen3-8b"):
        Preset.load("qwen9")


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_preset_is_the_estimators_shape_of_the_same_model(name):
    ours = shape_from_config(Preset.load(name).target, name)
    theirs = PRESETS[name]
    for field in ("num_layers", "hidden_size", "intermediate_size", "vocab_size", "num_heads",
                  "num_kv_heads", "head_dim", "n_routed_experts", "top_k", "moe_intermediate_size",
                  "max_positions"):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_drafter_fits_its_target(name):
    from ddtree.models.nn.decoder import model_info

    preset = Preset.load(name)
    config = random_target_config(preset)
    info = model_info(config, torch.nn.Linear(1, 1), name, torch.bfloat16)
    ids = check_drafter_compat(preset.drafter, info, name)
    assert len(ids) == preset.drafter["num_hidden_layers"] == 5
    assert preset.drafter["block_size"] == 16


def test_memory_is_checked_before_allocating(monkeypatch):
    import ddtree.models.presets as presets

    plan = memory_plan(Preset.load("qwen3-8b"), torch.bfloat16, 4096, 257)
    # the weights alone: 8.2B parameters (untied) in 2 bytes, the drafter ~1.1B
    assert 16e9 < plan.target_bytes < 17.5e9 and plan.drafter_bytes > 1.5e9
    monkeypatch.setattr(presets, "available_bytes", lambda device: 10**9)
    with pytest.raises(PresetError, match=r"qwen3-8b needs 1\d\.\d\d GB \(target .*1.00 GB"):
        check_fits(plan, torch.device("cpu"), "qwen3-8b")
    check_fits(MemoryPlan(1, 1, 1, 1), torch.device("cpu"), "tiny")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_random_target_decodes_exactly_with_the_oracle_drafter(dtype):
    """The peaked initialisation: greedy chain and DDTree equal AR token for token even in
    bfloat16, where flat random logits would flip between verify widths."""
    preset = Preset.load("tiny-qwen3")
    target = random_target(preset, dtype, torch.device("cpu"), 256)
    oracle = OracleDrafter(OracleSpec(p=0.7), random_drafter(preset, target))
    prompt = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ar = generate(target, None, prompt, DecodeConfig("ar", max_new_tokens=96))
    assert len(set(ar.tokens)) > 48  # a varied continuation, not a repeated token
    oracle.expect(prompt + ar.tokens)
    for policy, budget in (("chain", 7), ("ddtree", 32)):
        cfg = DecodeConfig(policy, block_size=8, budget=budget, max_new_tokens=96)
        out = generate(target, oracle, prompt, cfg)
        assert out.tokens == ar.tokens, policy
        assert out.mean_tau > 2
