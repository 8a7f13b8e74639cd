"""Checkpoint directories: config.json + (sharded) safetensors, pickle refusal, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tests.tiny import TINY_DEEPSEEK_V3

from ddtree.models.loading.checkpoint import (
    CheckpointError,
    load_safetensors,
    match_state_dict,
    read_config,
    save_safetensors,
)

transformers = pytest.importorskip("transformers")

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_deepseek():
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**TINY_DEEPSEEK_V3)
    cfg._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model


@pytest.mark.parametrize("max_shard_size", [None, "40KB"], ids=["single", "sharded"])
def test_mla_moe_from_hf_save_pretrained(tmp_path, hf_deepseek, max_shard_size):
    from ddtree.models.adapters.mla_moe import MlaMoeTarget

    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_deepseek.save_pretrained(tmp_path, **kwargs)
    n_shards = len(list(tmp_path.glob("*.safetensors")))
    assert (n_shards > 1) == (max_shard_size is not None)
    assert (tmp_path / "model.safetensors.index.json").exists() == (n_shards > 1)

    target = MlaMoeTarget.from_pretrained(tmp_path)
    ids = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
    ours = target.prefill(ids).logits
    with torch.no_grad():
        ref = hf_deepseek(ids[None]).logits[0]
    assert ours.shape == ref.shape == (8, TINY_DEEPSEEK_V3["vocab_size"])
    assert (ours - ref).abs().max().item() <= TOL


def test_sharded_equals_single(tmp_path, hf_deepseek):
    hf_deepseek.save_pretrained(tmp_path / "one")
    hf_deepseek.save_pretrained(tmp_path / "many", max_shard_size="40KB")
    one, many = load_safetensors(tmp_path / "one"), load_safetensors(tmp_path / "many")
    assert set(one) == set(many) and len(one) > 10
    for name in one:
        assert torch.equal(one[name], many[name]), name


def test_missing_shard_named(tmp_path, hf_deepseek):
    hf_deepseek.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(CheckpointError, match=victim) as err:
        load_safetensors(tmp_path)
    assert "model.safetensors.index.json" in str(err.value)


def test_index_lists_tensor_absent_from_shard(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "s1.safetensors")
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"s1\.safetensors.*absent: b"):
        load_safetensors(tmp_path)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickles_refused(tmp_path, name):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / name).write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=rf"{name}.*convert .*safetensors"):
        load_safetensors(tmp_path)
    with pytest.raises(CheckpointError, match="pickled weights are refused"):
        load_safetensors(tmp_path / name)


def test_pickle_shard_in_index_refused(tmp_path):
    index = {"weight_map": {"a": "pytorch_model-00001-of-00001.bin"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="pickled weights are refused"):
        load_safetensors(tmp_path)


def test_empty_and_ambiguous_directories(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_safetensors(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_safetensors(tmp_path)
    save_file({"a": torch.zeros(1)}, tmp_path / "x.safetensors")
    assert set(load_safetensors(tmp_path)) == {"a"}  # one file, any name
    save_file({"b": torch.zeros(1)}, tmp_path / "y.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        load_safetensors(tmp_path)


def test_corrupt_safetensors_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable"):
        load_safetensors(tmp_path)


def test_read_config_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: .*not"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 1,\n "b": }')
    with pytest.raises(CheckpointError, match=r"config\.json: invalid JSON at line 2"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert read_config(tmp_path) == {"model_type": "llama"}
    assert read_config(tmp_path / "config.json") == {"model_type": "llama"}


def test_match_state_dict_lists_every_problem():
    expected = {"a.weight": (4, 3), "b.weight": (2,), "c.weight": (5,)}
    tensors = {"a.weight": torch.zeros(4, 3), "b.weight": torch.zeros(3), "d.bias": torch.zeros(1)}
    with pytest.raises(CheckpointError) as err:
        match_state_dict(expected, tensors, "/ckpt/dir")
    msg = str(err.value)
    assert msg.startswith("/ckpt/dir: ")
    assert "missing tensors: c.weight" in msg
    assert "unexpected tensors: d.bias" in msg
    assert "b.weight (3,) in the checkpoint, (2,) from config.json" in msg
    assert "a.weight" not in msg
    match_state_dict({"a.weight": (4, 3)}, {"a.weight": torch.zeros(4, 3)}, "ok")


def test_match_state_dict_truncates_long_lists():
    expected = {f"t{i}": (1,) for i in range(20)}
    with pytest.raises(CheckpointError, match=r"and 12 more"):
        match_state_dict(expected, {}, "x")


def test_mla_moe_errors_name_file_and_tensor(tmp_path, hf_deepseek):
    from ddtree.models.adapters.mla_moe import MlaMoeTarget

    hf_deepseek.save_pretrained(tmp_path)
    tensors = load_safetensors(tmp_path)
    # shape disagreeing with config.json
    cfg = read_config(tmp_path)
    cfg["v_head_dim"] = 12
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"shape mismatches: .*kv_b_proj") as err:
        MlaMoeTarget.from_pretrained(tmp_path)
    assert str(tmp_path) in str(err.value)
    # missing and unexpected tensors
    (tmp_path / "config.json").write_text(json.dumps(read_config(tmp_path) | TINY_DEEPSEEK_V3))
    tensors["model.extra.weight"] = torch.zeros(2)
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        MlaMoeTarget.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "missing tensors: model.norm.weight" in msg
    assert "unexpected tensors: model.extra.weight" in msg


def test_save_round_trip_with_tied_and_views(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    base = torch.arange(12.0).view(3, 4)
    state = {
        "embed.weight": emb.weight,
        "head.weight": head.weight,
        "rows.first": base[:1],  # contiguous slices of one storage
        "rows.rest": base[1:],
        "cols": base[:, 1],  # non-contiguous view
    }
    written = save_safetensors(tmp_path / "ckpt", state, {"model_type": "toy", "n": 3})
    assert "head.weight" not in written and "embed.weight" in written
    assert read_config(tmp_path / "ckpt") == {"model_type": "toy", "n": 3}
    loaded = load_safetensors(tmp_path / "ckpt")
    assert set(loaded) == {"embed.weight", "rows.first", "rows.rest", "cols"}
    assert torch.equal(loaded["embed.weight"], emb.weight.detach())
    assert torch.equal(loaded["rows.rest"], base[1:])
    assert torch.equal(loaded["cols"], torch.tensor([1.0, 5.0, 9.0]))


def test_save_then_mla_moe_load(tmp_path, hf_deepseek):
    """Our writer produces directories our loader (and its shape checks) accept."""
    from ddtree.models.adapters.mla_moe import MlaMoeTarget

    save_safetensors(tmp_path, hf_deepseek.state_dict(), hf_deepseek.config.to_dict())
    target = MlaMoeTarget.from_pretrained(tmp_path)
    ids = torch.tensor([5, 6, 7])
    with torch.no_grad():
        ref = hf_deepseek(ids[None]).logits[0]
    assert (target.prefill(ids).logits - ref).abs().max().item() <= TOL


def test_weight_files_without_reading(tmp_path, hf_deepseek):
    from ddtree.models.loading.checkpoint import weight_files

    hf_deepseek.save_pretrained(tmp_path / "many", max_shard_size="40KB")
    files = weight_files(tmp_path / "many")
    assert len(files) > 1 and all(f.suffix == ".safetensors" and f.is_file() for f in files)
    hf_deepseek.save_pretrained(tmp_path / "one")
    assert weight_files(tmp_path / "one") == [tmp_path / "one" / "model.safetensors"]
    with pytest.raises(CheckpointError, match=r"expected a \.safetensors file"):
        weight_files(tmp_path / "one" / "config.json")
