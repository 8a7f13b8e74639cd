"""Quantized checkpoints (``ddtree.models.loading.quant``): tiny random DeepSeek-V3 / Kimi-K2 targets
quantized by our quantize functions, written in the published layouts (fp8 block scales as
DeepSeek-V3 / Kimi-K2-Instruct, int4 pack-quantized routed experts as Kimi-K2-Thinking), load
in one process and tensor parallel into logits equal to the float model of the dequantized
weights; the formats' arithmetic against hand-worked examples; bad inputs as one-line errors."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tests.engine.helpers import TINY, per_expert, tiny_mla_target
from tests.models.test_parallel import TOL, shards
from tests.trees import make_tree

from ddtree.engine.runrecord import model_config
from ddtree.models.adapters.mla_moe import MlaMoeTarget
from ddtree.models.adapters.parallel import ParallelPlan, load_shard
from ddtree.models.loading.checkpoint import CheckpointSlices
from ddtree.models.loading.quant import (
    Fp8Block,
    PackQuantized,
    QuantizationError,
    _window,
    pack_int32,
    scheme_from_config,
    unpack_int32,
)
from ddtree.models.nn.mla_moe import MlaMoeConfig, build_model, fuse_per_expert

# quantization_config of DeepSeek-V3 / Kimi-K2-Instruct (config.json)
FP8_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
# quantization_config of Kimi-K2-Thinking (config.json): W4A16 on the routed experts
INT4_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def _with(config: dict, **weights) -> dict:
    """``INT4_CONFIG`` with some fields of its weight scheme changed."""
    out = json.loads(json.dumps(config))
    out["config_groups"]["group_0"]["weights"].update(weights)
    return out


def fp8_quantized(name: str) -> bool:
    """DeepSeek-V3's choice: every linear of the decoder layers but the router."""
    return name.startswith("model.layers.") and name.endswith("proj.weight")


def experts_quantized(name: str) -> bool:
    """Kimi-K2-Thinking's choice: the routed experts only."""
    return ".mlp.experts." in name


# name -> (quantization_config, which weights it quantizes)
FORMATS = {
    "fp8": (FP8_CONFIG, fp8_quantized),
    # blocks that do not divide the tiny sizes: partial blocks, and TP slices that cut blocks
    "fp8-24x20": ({**FP8_CONFIG, "weight_block_size": [24, 20]}, fp8_quantized),
    "int4-g32": (INT4_CONFIG, experts_quantized),
    # 8-bit words of 4 values, groups of 12: a partial last group, slices that cut groups
    "int8-g12": (_with(INT4_CONFIG, num_bits=8, group_size=12), experts_quantized),
}
# Kimi-K2 shape (q LoRA, one group) and DeepSeek-V3 shape (no q LoRA, grouped routing)
MODELS = {"kimi": {}, "deepseek": dict(q_lora_rank=None, n_group=2, topk_group=1)}
O_PROJ = "model.layers.0.self_attn.o_proj."
EXPERT = "model.layers.1.mlp.experts.3.down_proj."
PROMPT = torch.tensor([5, 9, 2, 33, 7, 1, 60, 12])
TREE = ([4, 8, 15, 16, 23, 42], [-1, 0, 0, 1, 1, 2])


def write_checkpoint(path, tensors: dict, config: dict, n_shards: int = 1) -> None:
    """config.json and safetensors: one file, or ``n_shards`` files and an index.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if n_shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::n_shards]}
        save_file(part, path / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def quantized_checkpoint(path, fmt: str, model: str = "kimi", n_shards: int = 1, seed: int = 3):
    """A random target's weights written as a published quantized checkpoint (experts one by
    one); returns the float weights those stored tensors dequantize to (same names)."""
    qc, quantized = FORMATS[fmt]
    overrides = MODELS[model]
    scheme = scheme_from_config({"quantization_config": qc})
    state = per_expert(tiny_mla_target(seed=seed, **overrides).model.state_dict())
    stored, floats = {}, {}
    for name, weight in state.items():
        if not quantized(name):
            stored[name] = floats[name] = weight.contiguous()
            continue
        parts = scheme.quantize(weight)
        stored.update({name.removesuffix("weight") + s: t for s, t in parts.items()})
        floats[name] = scheme.dequantize(parts, tuple(weight.shape))
    config = {**TINY, **overrides, "quantization_config": qc}
    write_checkpoint(path, stored, config, n_shards)
    return floats


def float_target(floats: dict, model: str, dtype=torch.float32) -> MlaMoeTarget:
    """The unquantized model built from the dequantized weights."""
    config = MlaMoeConfig.from_hf(dict(TINY, **MODELS[model]), source="tiny")
    tensors = fuse_per_expert(dict(floats), config)
    return MlaMoeTarget(build_model(config, "absorbed", tensors, dtype, "cpu"), capacity=64)


def outputs(target) -> list[torch.Tensor]:
    """Prefill logits, then the logits of a tree verify after them."""
    prefill = target.prefill(PROMPT).logits
    return [prefill, target.verify(make_tree(*TREE)).logits]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every format x model written once (int4 sharded over an index.json): path, floats."""
    root = tmp_path_factory.mktemp("quantized")
    return {
        (fmt, model): (
            root / f"{fmt}-{model}",
            quantized_checkpoint(
                root / f"{fmt}-{model}", fmt, model, n_shards=3 if "int" in fmt else 1
            ),
        )
        for fmt in FORMATS
        for model in MODELS
    }


# --- loading -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_checkpoint_equals_the_dequantized_float_model(checkpoints, fmt, model):
    """Prefill and tree-verify logits equal, bit for bit, those of the float model built from
    the dequantized weights; the quantization is recorded in ModelInfo and in run records."""
    path, floats = checkpoints[fmt, model]
    loaded = MlaMoeTarget.from_pretrained(path)
    expected = float_target(floats, model)
    for got, want in zip(outputs(loaded), outputs(expected), strict=True):
        assert torch.equal(got, want)
    scheme = scheme_from_config({"quantization_config": FORMATS[fmt][0]})
    assert loaded.config.quantization == scheme
    assert loaded.info.quantization == scheme.description
    assert model_config(loaded.info, path)["quantization"] == scheme.description
    assert expected.info.quantization == ""


@pytest.mark.parametrize("fmt", ["fp8", "int4-g32"])
def test_quantized_checkpoint_loads_into_the_requested_dtype(checkpoints, fmt):
    """Dequantized into bfloat16: the parameters are bfloat16 and the logits equal those of
    the float model cast to bfloat16."""
    path, floats = checkpoints[fmt, "kimi"]
    loaded = MlaMoeTarget.from_pretrained(path, dtype=torch.bfloat16)
    experts = loaded.model.model.layers[1].mlp.experts.gate_up_proj
    assert experts.dtype == torch.bfloat16
    for got, want in zip(
        outputs(loaded), outputs(float_target(floats, "kimi", torch.bfloat16)), strict=True
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("fmt", ["fp8-24x20", "int4-g32", "int8-g12"])
def test_tensor_parallel_ranks_dequantize_their_slices(checkpoints, fmt, tp, ep):
    """Each rank dequantizes the blocks / words and groups under its slices (24x20 blocks and
    groups of 12 are cut by them): rank 0's logits equal the single-process load's."""
    path, _ = checkpoints[fmt, "kimi"]
    whole = MlaMoeTarget.from_pretrained(path)
    group, ranks = shards(path, tp, ep)
    expected = outputs(whole)
    got = group.run(lambda r: outputs(ranks[r]))
    for g, e in zip(got[0], expected, strict=True):
        assert g.shape == e.shape
        assert (g - e).abs().max() <= TOL
    assert ranks[0].info.quantization == whole.info.quantization


def test_tensor_parallel_rank_reads_only_the_parts_under_its_slices(checkpoints, monkeypatch):
    """Rank 1 of TP 2 reads columns 24..48 of o_proj [32, 48] as the 20-column blocks 1..2
    covering them (columns 20..48, two rows of blocks); at EP 2 it reads the values and scales
    of its own experts 4..7 only (and every weight_shape, two integers, to check the headers)."""
    read: dict[str, int] = {}
    original = CheckpointSlices.read

    def recording(self, name, index=()):
        tensor = original(self, name, index)
        read[name] = read.get(name, 0) + tensor.numel()
        return tensor

    monkeypatch.setattr(CheckpointSlices, "read", recording)
    load_shard(checkpoints["fp8-24x20", "kimi"][0], ParallelPlan(2, 1), 1, lambda x: x)
    assert read[O_PROJ + "weight"] == 32 * 28
    assert read[O_PROJ + "weight_scale_inv"] == 2 * 2
    read.clear()
    load_shard(checkpoints["int4-g32", "kimi"][0], ParallelPlan(2, 2), 1, lambda x: x)
    experts = {int(n.split(".")[5]) for n in read if ".mlp.experts." in n and "shape" not in n}
    assert experts == {4, 5, 6, 7}


# --- the formats' arithmetic --------------------------------------------------------------------


def test_fp8_dequantize_worked_example():
    """3x5 weight of ones, 2x3 blocks: each element is multiplied by its block's scale; the
    last row and the last two columns are partial blocks."""
    scheme = Fp8Block(block=(2, 3))
    parts = {
        "weight": torch.ones(3, 5).to(torch.float8_e4m3fn),
        "weight_scale_inv": torch.tensor([[1.0, 2.0], [4.0, 8.0]]),
    }
    expected = torch.tensor(
        [[1, 1, 1, 2, 2], [1, 1, 1, 2, 2], [4, 4, 4, 8, 8]], dtype=torch.float32
    )
    assert torch.equal(scheme.dequantize(parts, (3, 5)), expected)


def test_pack_quantized_dequantize_worked_example():
    """Word 0x76543210 stores 0..7 lowest nibble first: q = -8..-1; word 0xFEDCBA98 (a
    negative int32) stores 8..15: q = 0..7. Groups of 8 columns scaled by 1 and 0.5."""
    scheme = PackQuantized(num_bits=4, group_size=8)
    parts = {
        "weight_packed": torch.tensor([[0x76543210, 0xFEDCBA98 - 2**32]], dtype=torch.int32),
        "weight_scale": torch.tensor([[1.0, 0.5]], dtype=torch.bfloat16),
    }
    expected = torch.tensor([[*range(-8, 0), *(q / 2 for q in range(8))]])
    assert torch.equal(scheme.dequantize(parts, (1, 16)), expected)


def test_window_worked_example():
    """Rows 200..300 of a 512-row weight in 128-row blocks lie in the window 128..384, at
    72..172 inside it; columns 8..16 of 16 with words of 8 and groups of 12 need all 16."""
    window, cut = _window((slice(200, 300),), (512, 64), [(1, 1), (128, 128)])
    assert window == (slice(128, 384), slice(0, 64))
    assert cut == (slice(72, 172), slice(0, 64))
    window, cut = _window((slice(None), slice(8, 16)), (4, 16), [(1, 8), (1, 12)])
    assert window == (slice(0, 4), slice(0, 16))
    assert cut == (slice(0, 4), slice(8, 16))


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(1, 3), cols=st.integers(1, 40), data=st.data())
def test_pack_unpack_round_trip(bits, rows, cols, data):
    """pack_int32 writes each word as the sum of its values' stored bits, lowest first, the
    last word padded; unpack_int32 returns the values exactly."""
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    values = data.draw(st.lists(st.integers(low, high), min_size=rows * cols, max_size=rows * cols))
    q = torch.tensor(values, dtype=torch.int8).view(rows, cols)
    packed = pack_int32(q, bits)
    per_word = 32 // bits
    assert packed.dtype == torch.int32 and packed.shape == (rows, math.ceil(cols / per_word))
    for r in range(rows):
        for w in range(packed.shape[1]):
            columns = range(w * per_word, min((w + 1) * per_word, cols))
            word = sum((values[r * cols + j] - low) << (bits * (j % per_word)) for j in columns)
            assert int(packed[r, w]) & 0xFFFFFFFF == word
    assert torch.equal(unpack_int32(packed, bits, cols), q)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    block=st.tuples(st.integers(1, 16), st.integers(1, 16)),
    seed=st.integers(0, 2**16),
)
def test_fp8_quantize_error_is_within_e4m3_rounding(rows, cols, block, seed):
    """Every dequantized element is within half an e4m3 step of the weight: 2**-4 of its
    magnitude (3 mantissa bits), or 2**-10 of its block's scale among subnormals."""
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    scheme = Fp8Block(block=block)
    parts = scheme.quantize(weight)
    assert parts["weight"].dtype == torch.float8_e4m3fn
    assert parts["weight_scale_inv"].shape == (
        math.ceil(rows / block[0]),
        math.ceil(cols / block[1]),
    )
    scale = parts["weight_scale_inv"].repeat_interleave(block[0], 0)[:rows]
    scale = scale.repeat_interleave(block[1], 1)[:, :cols]
    error = (scheme.dequantize(parts, (rows, cols)) - weight).abs()
    assert (error <= weight.abs() * 2**-4 + scale * 2**-10).all()


@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    group=st.integers(0, 20),
    cols=st.integers(1, 50),
    seed=st.integers(0, 2**16),
)
def test_int_quantize_error_is_within_half_a_step(bits, group, cols, seed):
    """Every dequantized element is within half a step of its group's scale, plus what the
    bf16 rounding of the scale (2**-8 relative) adds at the clamped top of the range
    (``(2**b - 1) / 2`` steps); group 0 is one scale per row (strategy channel)."""
    weight = torch.randn(3, cols, generator=torch.Generator().manual_seed(seed))
    scheme = PackQuantized(num_bits=bits, group_size=group)
    parts = scheme.quantize(weight)
    size = group or cols
    assert parts["weight_scale"].shape == (3, math.ceil(cols / size))
    assert parts["weight_shape"].tolist() == [3, cols]
    scale = parts["weight_scale"].float().repeat_interleave(size, 1)[:, :cols]
    error = (scheme.dequantize(parts, (3, cols)) - weight).abs()
    assert (error <= (0.5 + (2**bits - 1) / 2 * 2**-8) * scale).all()


def test_published_configs_parse():
    assert scheme_from_config({"quantization_config": FP8_CONFIG}) == Fp8Block((128, 128))
    assert scheme_from_config({"quantization_config": INT4_CONFIG}) == PackQuantized(4, 32)
    channel = _with(INT4_CONFIG, strategy="channel", group_size=None)
    assert scheme_from_config({"quantization_config": channel}) == PackQuantized(4, 0)
    assert scheme_from_config({"quantization_config": None}) is None


# --- bad input ----------------------------------------------------------------------------------

BAD_CONFIGS = [
    ({"bits": 4}, "quantization_config.quant_method=None"),
    ({"quant_method": "awq"}, "quant_method='awq' unsupported"),
    ("fp8", "quantization_config: expected an object"),
    ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme='static'"),
    ({**FP8_CONFIG, "weight_block_size": None}, "weight_block_size=None"),
    ({**FP8_CONFIG, "weight_block_size": [128, 0]}, "weight_block_size=\\[128, 0\\]"),
    ({**INT4_CONFIG, "format": "marlin-24"}, "format='marlin-24'"),
    ({**INT4_CONFIG, "quantization_status": "frozen"}, "quantization_status='frozen'"),
    ({**INT4_CONFIG, "config_groups": {}}, "config_groups: expected at least one group"),
    (_with(INT4_CONFIG, num_bits=16), "group_0.weights.num_bits=16: expected 1..8"),
    (_with(INT4_CONFIG, group_size=0), "group_0.weights.group_size=0"),
    (_with(INT4_CONFIG, group_size=None), "group_0.weights.group_size=None"),
    (_with(INT4_CONFIG, strategy="tensor"), "strategy='tensor'"),
    (_with(INT4_CONFIG, symmetric=False), "symmetric=False"),
    (_with(INT4_CONFIG, type="float"), "type='float'"),
    (_with(INT4_CONFIG, actorder="group"), "actorder='group'"),
    (
        {
            **INT4_CONFIG,
            "config_groups": {
                **INT4_CONFIG["config_groups"],
                "group_1": _with(INT4_CONFIG, group_size=128)["config_groups"]["group_0"],
            },
        },
        "groups group_0 and group_1 quantize weights differently",
    ),
    (
        {
            **INT4_CONFIG,
            "config_groups": {
                "group_0": {
                    **INT4_CONFIG["config_groups"]["group_0"],
                    "input_activations": {"num_bits": 8},
                }
            },
        },
        "input_activations is set",
    ),
]


@pytest.mark.parametrize("qc,match", BAD_CONFIGS)
def test_bad_quantization_config_is_one_line_naming_the_field(qc, match):
    config = {**TINY, "quantization_config": qc}
    with pytest.raises(QuantizationError, match=match) as err:
        MlaMoeConfig.from_hf(config, source="ckpt/config.json")
    assert str(err.value).startswith("ckpt/config.json: field quantization_config")
    assert "\n" not in str(err.value)


def _edited(src, dst, edit):
    """A copy of checkpoint ``src`` whose tensors (one file) went through ``edit``."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


BAD_TENSORS = [
    ("fp8", lambda t: t.pop(O_PROJ + "weight_scale_inv"), f"{O_PROJ}weight is torch.float8_e4m3fn but {O_PROJ}weight_scale_inv is missing"),
    ("fp8", lambda t: t.pop(O_PROJ + "weight"), f"{O_PROJ}weight_scale_inv has no {O_PROJ}weight beside it"),
    ("fp8", lambda t: t.update({O_PROJ + "weight_scale_inv": torch.ones(2, 1)}), f"{O_PROJ}weight_scale_inv has shape \\[2, 1\\], expected \\[1, 1\\] for the \\[32, 48\\] weight"),
    ("fp8", lambda t: t.update({O_PROJ + "weight": t[O_PROJ + "weight"].bfloat16()}), f"{O_PROJ}weight is torch.bfloat16, expected torch.float8_e4m3fn"),
    ("fp8", lambda t: t.update({O_PROJ + "weight_scale_inv": torch.ones(1, 1, dtype=torch.int32)}), "weight_scale_inv is torch.int32, expected a floating-point dtype"),
    ("int4-g32", lambda t: t.pop(EXPERT + "weight_scale"), f"{EXPERT}weight_packed has no {EXPERT}weight_scale beside it"),
    ("int4-g32", lambda t: t.pop(EXPERT + "weight_shape"), f"has no {EXPERT}weight_shape beside it"),
    ("int4-g32", lambda t: t.update({EXPERT + "weight_shape": torch.tensor([32, 24], dtype=torch.int32)}), f"{EXPERT}weight_packed has shape \\[32, 2\\], expected \\[32, 3\\] for the \\[32, 24\\] weight"),
    ("int4-g32", lambda t: t.update({EXPERT + "weight_shape": torch.tensor([32.0, 16.0])}), f"{EXPERT}weight_shape is \\[2\\] torch.float32, expected 2 integers"),
    ("int4-g32", lambda t: t.update({EXPERT + "weight_packed": t[EXPERT + "weight_packed"].to(torch.int64)}), f"{EXPERT}weight_packed is torch.int64, expected torch.int32"),
]  # fmt: skip


@pytest.mark.parametrize("load", ["whole", "shard"])
@pytest.mark.parametrize("fmt,edit,match", BAD_TENSORS)
def test_bad_quantized_tensors_are_one_line_naming_file_and_tensor(
    tmp_path, fmt, edit, match, load
):
    """A missing scale or value tensor, a part of the wrong shape or dtype: one line naming
    the safetensors file and the tensor, whether loaded whole or as a rank's shard."""
    src = tmp_path / "src"
    quantized_checkpoint(src, fmt)
    path = _edited(src, tmp_path / "bad", edit)
    with pytest.raises(QuantizationError, match=match) as err:
        if load == "whole":
            MlaMoeTarget.from_pretrained(path)
        else:
            load_shard(path, ParallelPlan(2, 1), 0, lambda x: x)
    assert str(err.value).startswith(str(path / "model.safetensors"))
    assert "\n" not in str(err.value)
