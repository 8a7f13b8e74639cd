"""The linear-layer kernels (ddtree.models.nn.linear): the choice and its refusals, packed layers
that equal nn.Linear eager and compiled, a loaded model that holds one copy of each weight and
names its kernel, and a random bfloat16 target that decodes exactly through packed layers in
both engine modes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddtree.engine import DecodeConfig, generate
from ddtree.models.nn.linear import (
    ATEN,
    ENV_VAR,
    ONEDNN_PACKED,
    PackedLinear,
    choose_linear_kernel,
    packed_unavailable,
    use_linear_kernel,
    weight_tensors,
)
from ddtree.models.oracle import OracleDrafter, OracleSpec
from ddtree.models.presets import Preset, random_drafter, random_target

CPU = torch.device("cpu")
PACKED_HERE = packed_unavailable(CPU, torch.bfloat16)
needs_packed = pytest.mark.skipif(PACKED_HERE is not None, reason=f"onednn-packed: {PACKED_HERE}")


def test_the_kernel_is_chosen_by_device_and_dtype_and_forcing_it_says_why_not(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert choose_linear_kernel(CPU, torch.float32) == ATEN
    assert choose_linear_kernel(torch.device("meta"), torch.bfloat16) == ATEN
    assert packed_unavailable(CPU, torch.float32) == "dtype float32 (bfloat16 only)"
    monkeypatch.setenv(ENV_VAR, ONEDNN_PACKED)
    with pytest.raises(ValueError, match=f"{ENV_VAR}=onednn-packed: cannot run here: dtype"):
        choose_linear_kernel(CPU, torch.float32)
    monkeypatch.setenv(ENV_VAR, "mkl")
    with pytest.raises(ValueError, match="expected one of aten, onednn-packed"):
        choose_linear_kernel(CPU, torch.bfloat16)
    monkeypatch.setenv(ENV_VAR, ATEN)
    assert choose_linear_kernel(CPU, torch.bfloat16) == ATEN


@needs_packed
def test_default_on_a_bf16_cpu_is_packed(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert choose_linear_kernel(CPU, torch.bfloat16) == ONEDNN_PACKED


@needs_packed
@pytest.mark.parametrize("rows", [1, 16, 33, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_equals_nn_linear_eager_and_compiled(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)  # [M, in]
    want = linear(x)  # [M, out]
    packed = PackedLinear(linear)
    torch.testing.assert_close(packed(x), want)
    compiled = torch.compile(packed, fullgraph=True)  # one opaque op: no graph break
    torch.testing.assert_close(compiled(x), want)


@needs_packed
def test_packing_replaces_every_linear_keeps_the_outputs_and_one_copy_of_each_weight():
    model = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Sequential(nn.Linear(64, 16)))
    model = model.to(torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    want = model(x)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert use_linear_kernel(model, ONEDNN_PACKED) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    torch.testing.assert_close(model(x), want)
    weights = dict(weight_tensors(model))  # the packed weights are buffers, not parameters
    assert set(weights) == {"0.weight", "0.bias", "2.0.weight", "2.0.bias"}
    assert sum(t.numel() * t.element_size() for t in weights.values()) == nbytes
    assert use_linear_kernel(model, ATEN) == 0
    with pytest.raises(RuntimeError, match="0.weight is packed for inference"):
        model.state_dict()


@needs_packed
def test_a_random_bf16_target_decodes_exactly_through_packed_layers_in_both_modes(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    preset = Preset.load("tiny-qwen3")
    target = random_target(preset, torch.bfloat16, CPU, 256)
    drafter = random_drafter(preset, target)
    assert target.info.linear_kernel == drafter.info.linear_kernel == ONEDNN_PACKED
    assert isinstance(target.lm_head, PackedLinear)  # the drafter's logits go through it too
    oracle = OracleDrafter(OracleSpec(p=0.7), drafter)
    prompt = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    ar = generate(target, None, prompt, DecodeConfig("ar", max_new_tokens=40))
    oracle.expect(prompt + ar.tokens)
    for mode in ("eager", "compiled"):
        cfg = DecodeConfig(
            "ddtree", 8, 16, max_new_tokens=40, engine_mode=mode, compile_scope="layer"
        )
        out = generate(target, oracle, prompt, cfg)
        assert out.tokens == ar.tokens, mode
        assert out.mean_tau > 2


@needs_packed
def test_the_bundled_mla_target_packs_all_but_the_layer_absorbed_attention_reads(monkeypatch):
    from ddtree.commands._decode import DEMO_DIR
    from ddtree.models import load_drafter, load_target

    monkeypatch.delenv(ENV_VAR, raising=False)
    target = load_target(DEMO_DIR / "target", dtype=torch.bfloat16)
    drafter = load_drafter(DEMO_DIR / "drafter", target)
    assert target.info.linear_kernel == drafter.info.linear_kernel == ONEDNN_PACKED
    attn = target.model.model.layers[0].self_attn
    assert type(attn.kv_b_proj) is nn.Linear and isinstance(attn.o_proj, PackedLinear)
    prompt = list(range(5, 30))
    ar = generate(target, None, prompt, DecodeConfig("ar", max_new_tokens=24))
    out = generate(target, drafter, prompt, DecodeConfig("ddtree", 8, 16, max_new_tokens=24))
    assert out.tokens == ar.tokens
