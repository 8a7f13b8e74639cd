"""load_target dispatch (our MLA+MoE vs the transformers wrapper), load_drafter checks."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from tests.tiny import TINY_DEEPSEEK_V3, TINY_QWEN3

from ddtree.models import (
    UnsupportedModelError,
    check_drafter_compat,
    choose_target_impl,
    drafter_target_layer_ids,
    load_drafter,
    load_target,
    target_engine_modes,
)
from ddtree.models.base import ModelInfo
from ddtree.models.loading.checkpoint import CheckpointError

transformers = pytest.importorskip("transformers")

TOL = 1e-4


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**TINY_DEEPSEEK_V3)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("ckpt") / "tiny-dsv3"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**TINY_QWEN3)
    path = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3"
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def test_deepseek_dispatches_to_mla_moe_and_agrees_with_hf(deepseek_dir):
    from ddtree.models.adapters.hf import HFTarget
    from ddtree.models.adapters.mla_moe import MlaMoeTarget

    ours = load_target(deepseek_dir)
    assert isinstance(ours, MlaMoeTarget) and ours.info.implementation == "mla_moe"
    wrapped = load_target(deepseek_dir, impl="hf", attn_implementation="eager")
    assert isinstance(wrapped, HFTarget) and wrapped.info.implementation == "hf"
    ids = torch.tensor([3, 14, 15, 92, 65])
    diff = (ours.prefill(ids).logits - wrapped.prefill(ids).logits).abs().max().item()
    assert diff <= TOL


def test_qwen_dispatches_to_our_decoder_and_agrees_with_hf(qwen_dir):
    from ddtree.models.adapters.decoder import DecoderTarget
    from ddtree.models.adapters.hf import HFTarget

    ours = load_target(qwen_dir)
    assert isinstance(ours, DecoderTarget) and ours.info.implementation == "decoder"
    assert target_engine_modes(qwen_dir) == ("eager", "compiled")
    assert target_engine_modes(qwen_dir, impl="hf") == ("eager",)
    target = load_target(qwen_dir, impl="hf")
    assert isinstance(target, HFTarget)
    assert target.info.architecture == "Qwen3ForCausalLM" and target.info.name == "tiny-qwen3"
    ids = torch.tensor([3, 14, 15, 92, 65])
    diff = (ours.prefill(ids).logits - target.prefill(ids).logits).abs().max().item()
    assert diff <= TOL
    with pytest.raises(
        UnsupportedModelError, match=r"config\.json: impl='mla_moe' \(our MLA\+MoE.*needs"
    ):
        load_target(qwen_dir, impl="mla_moe")


@pytest.mark.parametrize(
    ("config", "impl", "expected"),
    [
        ({"model_type": "deepseek_v3"}, "auto", "mla_moe"),
        ({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}, "auto", "mla_moe"),
        ({"model_type": "kimi_k2"}, "auto", "mla_moe"),
        ({"model_type": "deepseek_v3"}, "hf", "hf"),
        ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "auto", "decoder"),
        ({"model_type": "qwen3_moe"}, "auto", "decoder"),
        ({"model_type": "llama"}, "auto", "decoder"),
        ({"model_type": "llama"}, "hf", "hf"),
        ({"model_type": "mistral"}, "auto", "hf"),
    ],
)
def test_choose_target_impl(config, impl, expected):
    assert choose_target_impl(config, "x/config.json", impl).name == expected


def test_unsupported_architectures_named():
    with pytest.raises(UnsupportedModelError, match=r"x/config\.json: model_type='resnet'"):
        choose_target_impl(
            {"model_type": "resnet", "architectures": ["ResNetModel"]}, "x/config.json"
        )
    with pytest.raises(UnsupportedModelError, match="use impl='mla_moe'"):
        choose_target_impl({"model_type": "kimi_k2"}, "x/config.json", "hf")
    with pytest.raises(UnsupportedModelError, match="impl='decoder'.*model_type='deepseek_v3'"):
        choose_target_impl({"model_type": "deepseek_v3"}, "x/config.json", "decoder")
    with pytest.raises(ValueError, match="impl='fast'"):
        choose_target_impl({"model_type": "llama"}, "x/config.json", "fast")


def test_load_target_missing_and_pickled(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match="pickled weights are refused"):
        load_target(tmp_path)


TARGET = ModelInfo(
    name="tiny",
    architecture="Qwen3ForCausalLM",
    implementation="hf",
    n_params=0,
    num_layers=6,
    hidden_size=64,
    vocab_size=101,
    dtype="float32",
)
DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 64,
    "vocab_size": 101,
    "num_hidden_layers": 2,
    "num_target_layers": 6,
    "block_size": 4,
    "dflash_config": {"mask_token_id": 100, "target_layer_ids": [1, 3]},
}


def test_drafter_compat_ok():
    assert check_drafter_compat(DRAFTER, TARGET, "d/config.json") == [1, 3]


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"hidden_size": 32}, r"d/config\.json: field hidden_size=32 but target 'tiny'.*=64"),
        ({"vocab_size": 151936}, r"field vocab_size=151936 but target 'tiny'"),
        ({"architectures": ["Qwen3ForCausalLM"]}, r"field architectures=.*DFlashDraftModel"),
        (
            {"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 6]}},
            r"target_layer_ids \[1, 6\] include \[6\], outside 0..5 .* 6 layers",
        ),
        (
            {"dflash_config": {"mask_token_id": 101, "target_layer_ids": [1]}},
            r"mask_token_id=101 outside the vocabulary",
        ),
        (
            {"dflash_config": {}, "num_target_layers": None},
            r"no dflash_config.target_layer_ids",
        ),
    ],
)
def test_drafter_compat_errors(change, pattern):
    config = {k: v for k, v in (DRAFTER | change).items() if v is not None}
    with pytest.raises(ValueError, match=pattern):
        check_drafter_compat(config, TARGET, "d/config.json")


def test_default_target_layer_ids_follow_reference():
    for n_target, n_draft in [(36, 5), (28, 1), (61, 3), (12, 2)]:
        config = {"num_target_layers": n_target, "num_hidden_layers": n_draft}
        ids = drafter_target_layer_ids(config)
        assert len(ids) == n_draft and all(0 <= i < n_target for i in ids)
        try:
            from dflash.model import build_target_layer_ids
        except ImportError:  # the reference is a test-only, optional install
            continue
        assert ids == build_target_layer_ids(n_target, n_draft)


def test_load_drafter_checks_then_delegates(tmp_path, monkeypatch):
    calls = []

    class FakeDrafter:
        @classmethod
        def from_pretrained(cls, path, target, dtype=None, device=None):
            calls.append((path, target, dtype, device))
            return "drafter"

    monkeypatch.setitem(
        sys.modules,
        "ddtree.models.adapters.dflash",
        types.SimpleNamespace(DFlashDrafter=FakeDrafter),
    )
    target = types.SimpleNamespace(info=TARGET)
    (tmp_path / "config.json").write_text(json.dumps(DRAFTER))
    assert load_drafter(tmp_path, target, dtype=torch.float32) == "drafter"
    assert calls == [(tmp_path, target, torch.float32, None)]
    (tmp_path / "config.json").write_text(json.dumps(DRAFTER | {"hidden_size": 128}))
    with pytest.raises(ValueError, match=str(tmp_path / "config.json")):
        load_drafter(tmp_path, target)
    assert len(calls) == 1


def test_the_cli_offers_every_target_implementation():
    from ddtree.commands._decode import TARGET_IMPL_CHOICES
    from ddtree.models import TARGET_IMPLS

    assert TARGET_IMPL_CHOICES == ("auto", *TARGET_IMPLS)
