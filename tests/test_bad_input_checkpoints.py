"""Bad checkpoint inputs, table-driven like ``tests/test_bad_input.py`` (whose Case, snapshot
and stderr helpers this reuses): every case exits 2 with exactly one line on stderr naming
the file and the field or tensor and what was expected, no traceback, before any decoding,
and leaves every file as it was.

Classes: ``layer_types`` that disagree with ``num_hidden_layers``; a weight of the wrong shape;
a tokenizer with more ids than the model's vocabulary; a garbage ``tokenizer.json`` or
``tokenizer_config.json``; a corrupt training checkpoint given to ``train ... --resume``;
config and weights that disagree (layers missing or extra, a tensor missing, a drafter given
as the target and the reverse, integer weights without a ``quantization_config``). Each
over the loader paths: our decoder (Qwen3), transformers (``--impl hf``), the MLA+MoE target
(the demo's) and the DFlash drafter; and over ``generate``, ``replay record``, ``serve``,
``bench engine`` and ``train ... --resume``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.tiny import TINY_QWEN3

from ddtree.cli import main
from ddtree.commands._decode import DEMO_DIR
from test_bad_input import Case, run_bad_input

TARGET, DRAFTER = DEMO_DIR / "target", DEMO_DIR / "drafter"
VOCAB = 2048  # the demo tokenizer's size

AR = "generate --prompt hi --policy ar --max-new-tokens 2 --target {w}"
HF = "generate --prompt hi --policy ar --max-new-tokens 2 --impl hf --target {w}"
DD = "generate --prompt hi --max-new-tokens 2 --target {w}/mla --drafter {w}"
RECORD = "replay record --n-prompts 1 --max-new-tokens 2 --out {w}/work/t.safetensors"
SERVE = "serve --port 0 --policy ar --target {w}"
BENCH = "bench engine --policies ar --n-prompts 1 --max-new-tokens 2 --records {w}/work/r.jsonl"
TRAIN_T = (
    "train target --batch-size 2 --seq-len 16 --max-files 2 --vocab-size 300 --warmup-steps 1 "
    "--save-every 1 --no-progress --threads 1 --resume --steps 2 --out {w}/train"
)
TRAIN_D = (
    f"train drafter --target {TARGET} --seqs-per-step 2 --anchors-per-step 1 --n-sequences 4 "
    "--new-tokens 8 --eval-prompts 1 --max-files 2 --save-every 1 --no-progress --threads 1 "
    "--resume --steps 2 --out {w}/train"
)
LAYER = "model.layers.1.self_attn.q_proj.weight"
LOADING = "loading the models ("  # serve's status line before it loads
TOKENIZER = ("tokenizer.json", "2060 ids", "vocab_size=2048")

CASES = [
    # 1. layer_types that disagree with num_hidden_layers
    Case("layer-types-length-decoder", AR + "/q_lt_len", ("q_lt_len/config.json", "layer_types", "3 entries", "num_hidden_layers=2")),
    Case("layer-types-unknown-decoder", AR + "/q_lt_bad", ("q_lt_bad/config.json", "layer_types", "'banana'")),
    Case("layer-types-length-hf", HF + "/q_lt_len", ("q_lt_len/config.json", "layer_types", "num_hidden_layers=2")),
    Case("layer-types-unknown-hf", HF + "/q_lt_bad", ("q_lt_bad/config.json", "'banana'")),
    Case("layer-types-length-mla-moe", AR + "/mla_lt_len", ("mla_lt_len/config.json", "layer_types", "num_hidden_layers=4")),
    Case("layer-types-length-drafter", DD + "/d_lt_len", ("d_lt_len/config.json", "layer_types", "num_hidden_layers=2")),
    Case("layer-types-unknown-drafter", DD + "/d_lt_bad", ("d_lt_bad/config.json", "'banana'")),
    # 2. a weight of the wrong shape
    Case("shape-hf", HF + "/q_shape", ("q_shape/model.safetensors", LAYER, "(64, 64)", "(7, 64)")),
    Case("shape-decoder", AR + "/q_shape", ("q_shape", LAYER, "(7, 64)", "(64, 64)")),
    Case("shape-mla-moe-serve", SERVE + "/mla_shape", ("mla_shape", "kv_a_layernorm.weight", "(5,)")),
    # 3. a tokenizer with more ids than the model's vocabulary
    Case("tokenizer-too-big-decoder", AR + "/q_vocab", ("q_vocab/tokenizer.json", "q_vocab/config.json", "2060 ids", "vocab_size=2048")),
    Case("tokenizer-too-big-hf", HF + "/q_vocab", ("q_vocab/tokenizer.json", *TOKENIZER[1:])),
    Case("tokenizer-too-big-mla-moe", AR + "/mla_vocab", ("mla_vocab/tokenizer.json", *TOKENIZER[1:])),
    Case("tokenizer-too-big-replay", RECORD + " --target {w}/mla_vocab --drafter " + str(DRAFTER), TOKENIZER),
    Case("tokenizer-too-big-serve", SERVE + "/mla_vocab", TOKENIZER),
    Case("tokenizer-too-big-bench", BENCH + " --target {w}/mla_vocab", TOKENIZER),
    # 4. garbage tokenizer files
    Case("tokenizer-not-json", AR + "/q_tok_garbage", ("q_tok_garbage/tokenizer.json", "JSON")),
    Case("tokenizer-wrong-form", AR + "/q_tok_list", ("q_tok_list/tokenizer.json", "expected a tokenizers")),
    Case("tokenizer-no-model", AR + "/q_tok_nomodel", ("q_tok_nomodel/tokenizer.json", "model")),
    Case("tokenizer-not-json-bench", BENCH + " --target {w}/mla_tok_garbage", ("mla_tok_garbage/tokenizer.json", "JSON")),
    Case("tokenizer-not-json-train-drafter", TRAIN_D.replace(str(TARGET), "{w}/mla_tok_garbage") + "/d_base", ("mla_tok_garbage/tokenizer.json", "UTF-8")),
    Case("tokenizer-config-not-json", AR + "/q_tokcfg_garbage", ("q_tokcfg_garbage/tokenizer_config.json", "JSON")),
    Case("tokenizer-config-not-json-chat", AR + "/q_tokcfg_garbage --chat", ("q_tokcfg_garbage/tokenizer_config.json", "JSON")),
    Case("tokenizer-config-not-json-serve", SERVE + "/q_tokcfg_garbage", ("q_tokcfg_garbage/tokenizer_config.json", "JSON")),
    Case("tokenizer-config-wrong-form", AR + "/q_tokcfg_list", ("q_tokcfg_list/tokenizer_config.json", "JSON object")),
    Case("tokenizer-config-bad-field", AR + "/q_tokcfg_field", ("q_tokcfg_field/tokenizer_config.json", "chat_template")),
    # 5. a corrupt training checkpoint
    Case("train-target-truncated", TRAIN_T + "/t_trunc", ("t_trunc/checkpoint/model.safetensors", "safetensors")),
    Case("train-target-no-state", TRAIN_T + "/t_nostate", ("t_nostate/checkpoint/state.json", "no checkpoint")),
    Case("train-target-state-not-json", TRAIN_T + "/t_badstate", ("t_badstate/checkpoint/state.json", "JSON")),
    Case("train-target-state-no-step", TRAIN_T + "/t_nostep", ("t_nostep/checkpoint/state.json", "step")),
    Case("train-target-shape", TRAIN_T + "/t_shape", ("t_shape/checkpoint/model.safetensors", "model.norm.weight", "(3,)")),
    Case("train-target-moment-shape", TRAIN_T + "/t_moment", ("t_moment/checkpoint/optimizer.safetensors", "model.norm.weight.exp_avg", "(3,)")),
    Case("train-target-no-optimizer", TRAIN_T + "/t_noopt", ("t_noopt/checkpoint/optimizer.safetensors",)),
    Case("train-target-other-model", TRAIN_T + "/t_other", ("t_other/checkpoint/model.safetensors", "missing tensors")),
    Case("train-drafter-truncated", TRAIN_D + "/d_trunc", ("d_trunc/checkpoint/optimizer.safetensors", "safetensors")),
    Case("train-drafter-no-state", TRAIN_D + "/d_nostate", ("d_nostate/checkpoint/state.json", "no checkpoint")),
    Case("train-drafter-shape", TRAIN_D + "/d_shape", ("d_shape/checkpoint/model.safetensors", "fc.weight")),
    Case("train-drafter-other-model", TRAIN_D + "/d_other", ("d_other/checkpoint/model.safetensors", "unexpected tensors")),
    # 6. config and weights that disagree
    Case("fewer-layers-decoder", AR + "/q_fewer", ("q_fewer", "missing tensors", "model.layers.1.")),
    Case("more-layers-decoder", AR + "/q_more", ("q_more", "unexpected tensors", "model.layers.2.")),
    Case("fewer-layers-hf", HF + "/q_fewer", ("q_fewer/model.safetensors", "missing tensors", "model.layers.1.")),
    Case("more-layers-hf", HF + "/q_more", ("q_more/model.safetensors", "unexpected tensors", "model.layers.2.")),
    Case("missing-tensor-hf", HF + "/q_nonorm", ("q_nonorm/model.safetensors", "missing tensors", "model.norm.weight")),
    Case("fewer-layers-mla-moe-replay", RECORD + " --target {w}/mla_fewer --drafter " + str(DRAFTER), ("mla_fewer", "missing tensors", "model.layers.3.")),
    Case("more-layers-mla-moe-bench", BENCH + " --target {w}/mla_more", ("mla_more", "unexpected tensors", "model.layers.4.")),
    Case("drafter-as-target", AR + "/drafter", ("drafter/config.json", "DFlash drafter", "--drafter")),
    Case("drafter-as-target-hf", HF + "/drafter", ("drafter/config.json", "DFlash drafter")),
    Case("target-as-drafter", DD + "/mla", ("mla/config.json", "architectures")),
    Case("int8-decoder", AR + "/q_int8", ("q_int8/model.safetensors", LAYER, "int8", "quantization_config")),
    Case("int8-hf", HF + "/q_int8", ("q_int8/model.safetensors", LAYER, "int8", "quantization_config")),
    Case("int8-mla-moe", AR + "/mla_int8", ("mla_int8/model.safetensors", "int8", "quantization_config")),
    Case("int16-drafter", DD + "/d_int16", ("d_int16/model.safetensors", "fc.weight", "int16")),
    Case("int8-serve", SERVE + "/q_int8", ("q_int8/model.safetensors", "int8")),
    # 7. custom code (auto_map) refused: transformers would run the checkpoint's Python
    Case("auto-map-tokenizer-config", AR + "/q_automap_tok", ("q_automap_tok/tokenizer_config.json", "auto_map", "custom code")),
    Case("auto-map-tokenizer-config-chat", AR + "/q_automap_tok --chat", ("q_automap_tok/tokenizer_config.json", "auto_map")),
    Case("auto-map-tokenizer-config-serve", SERVE + "/q_automap_tok", ("q_automap_tok/tokenizer_config.json", "auto_map")),
    Case("auto-map-config-hf", HF + "/q_automap_cfg", ("q_automap_cfg/config.json", "auto_map", "custom code")),
    # 8. shards a model.safetensors.index.json names outside the checkpoint folder
    Case("index-shard-dotdot", AR + "/q_shard_up", ("q_shard_up/model.safetensors.index.json", "../outside.safetensors", "outside the checkpoint folder")),
    Case("index-shard-absolute", HF + "/q_shard_abs", ("q_shard_abs/model.safetensors.index.json", "outside the checkpoint folder")),
    Case("index-shard-symlink-out", AR + "/q_shard_link", ("q_shard_link/model.safetensors.index.json", "link.safetensors", "symlink leading outside")),
    # 9. a config.json nested 100,000 deep: a clean error, not a RecursionError
    Case("config-deeply-nested", AR + "/q_deep", ("q_deep/config.json", "nested too deeply")),
]  # fmt: skip


def _tiny_qwen3(dst: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**{**TINY_QWEN3, "vocab_size": VOCAB}, eos_token_id=0, bos_token_id=0)
    Qwen3ForCausalLM(config).save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TARGET / name, dst / name)


def _copy(src: Path, dst: Path, config=None, tensors=None, files: dict | None = None) -> None:
    """A copy of checkpoint ``src`` with its config.json dict, its tensors dict, or whole
    files changed in place by the given functions / texts."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        weights = load_file(dst / "model.safetensors")
        tensors(weights)
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    for name, text in (files or {}).items():
        (dst / name).write_bytes(text if isinstance(text, bytes) else text.encode())


def _sharded(src: Path, dst: Path, outside: Path, shard: str) -> None:
    """A copy of ``src`` whose weights are listed by an index naming ``shard`` (which points
    at ``outside``, a file outside the folder) instead of a model.safetensors."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    if not outside.exists():
        shutil.copy(weights, outside)
    names = list(load_file(weights))
    weights.unlink()
    index = {"metadata": {}, "weight_map": {name: shard for name in names}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def _rename_layer(t: dict, old: int, new: int) -> None:
    for name in [n for n in t if n.startswith(f"model.layers.{old}.")]:
        t[name.replace(f"layers.{old}.", f"layers.{new}.")] = t[name].clone()


def _drop_layer(t: dict, layer: int) -> None:
    for name in [n for n in t if n.startswith(f"model.layers.{layer}.")]:
        del t[name]


def _bigger_tokenizer() -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    tok.add_tokens([f"<extra_{i}>" for i in range(12)])
    assert tok.get_vocab_size() == VOCAB + 12
    return tok.to_str()


def _train(w: Path, argv: str, name: str) -> Path:
    out = w / "train" / name
    args = argv.replace(" --resume --steps 2", " --steps 1").format(w=w) + f"/{name}"
    assert main(args.split()) == 0
    for leftover in ("config.json", "model.safetensors", "train_meta.json"):
        (out / leftover).unlink(missing_ok=True)  # the exported model: a resume ignores it
    return out


def _edit_json(file: Path, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def _corrupt_checkpoints(w: Path) -> None:
    target = _train(w, TRAIN_T, "t_base")
    drafter = _train(w, TRAIN_D, "d_base")
    ckpt = "checkpoint"

    def variant(base: Path, name: str, edit) -> None:
        shutil.copytree(base, w / "train" / name)
        edit(w / "train" / name / ckpt)

    def truncate(file: Path) -> None:
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])

    def retensor(file: Path, edit) -> None:
        tensors = load_file(file)
        edit(tensors)
        save_file(tensors, file)

    def remove_tokenizer(d: Path) -> None:  # nothing to load it from: a resume would train one
        (d / "state.json").unlink()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (d.parent / name).unlink()

    variant(target, "t_trunc", lambda d: truncate(d / "model.safetensors"))
    variant(target, "t_nostate", remove_tokenizer)
    variant(target, "t_badstate", lambda d: (d / "state.json").write_text("{oops"))
    variant(target, "t_nostep", lambda d: _edit_json(d / "state.json", lambda s: s.pop("step")))
    variant(
        target,
        "t_shape",
        lambda d: retensor(
            d / "model.safetensors", lambda t: t.update({"model.norm.weight": torch.ones(3)})
        ),
    )
    variant(
        target,
        "t_moment",
        lambda d: retensor(
            d / "optimizer.safetensors",
            lambda t: t.update({"model.norm.weight.exp_avg": torch.ones(3)}),
        ),
    )
    variant(target, "t_noopt", lambda d: (d / "optimizer.safetensors").unlink())
    variant(target, "t_other", lambda d: shutil.copy(drafter / ckpt / "model.safetensors", d))
    variant(drafter, "d_trunc", lambda d: truncate(d / "optimizer.safetensors"))
    variant(drafter, "d_nostate", lambda d: (d / "state.json").unlink())
    variant(
        drafter,
        "d_shape",
        lambda d: retensor(
            d / "model.safetensors", lambda t: t.update({"fc.weight": torch.ones(2, 2)})
        ),
    )
    variant(drafter, "d_other", lambda d: shutil.copy(target / ckpt / "model.safetensors", d))  # fmt: skip


def _build(w: Path) -> None:
    q = w / "q"
    _tiny_qwen3(q)
    lt_len = ["full_attention"] * 3
    lt_bad = ["full_attention", "banana"]
    _copy(q, w / "q_lt_len", config=lambda c: c.update(layer_types=lt_len))
    _copy(q, w / "q_lt_bad", config=lambda c: c.update(layer_types=lt_bad))
    _copy(q, w / "q_shape", tensors=lambda t: t.update({LAYER: torch.ones(7, 64)}))
    _copy(q, w / "q_vocab", files={"tokenizer.json": _bigger_tokenizer()})
    _copy(q, w / "q_tok_garbage", files={"tokenizer.json": "{this is not json"})
    _copy(q, w / "q_tok_list", files={"tokenizer.json": "[1, 2, 3]"})
    _copy(q, w / "q_tok_nomodel", files={"tokenizer.json": '{"version": "1.0"}'})
    _copy(q, w / "q_tokcfg_garbage", files={"tokenizer_config.json": "\x00\x01 not json"})
    _copy(q, w / "q_tokcfg_list", files={"tokenizer_config.json": '["a"]'})
    _copy(q, w / "q_tokcfg_field", files={"tokenizer_config.json": '{"chat_template": 7}'})
    _copy(q, w / "q_fewer", tensors=lambda t: _drop_layer(t, 1))
    _copy(q, w / "q_more", tensors=lambda t: _rename_layer(t, 1, 2))
    _copy(q, w / "q_nonorm", tensors=lambda t: t.pop("model.norm.weight"))
    _copy(q, w / "q_int8", tensors=lambda t: t.update({LAYER: t[LAYER].to(torch.int8)}))
    tok_config = json.loads((q / "tokenizer_config.json").read_text())
    auto_map = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    _copy(q, w / "q_automap_tok", files={"tokenizer_config.json": json.dumps({**tok_config, "auto_map": auto_map})})  # fmt: skip
    _copy(q, w / "q_automap_cfg", config=lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_evil.Evil"}))  # fmt: skip
    _sharded(q, w / "q_shard_up", w / "outside.safetensors", "../outside.safetensors")
    _sharded(q, w / "q_shard_abs", w / "outside.safetensors", str(w / "outside.safetensors"))
    _sharded(q, w / "q_shard_link", w / "outside.safetensors", "link.safetensors")
    (w / "q_shard_link" / "link.safetensors").symlink_to(w / "outside.safetensors")
    _copy(q, w / "q_deep", files={"config.json": "[" * 100_000 + "]" * 100_000})
    mla = w / "mla"
    shutil.copytree(TARGET, mla)
    _copy(TARGET, w / "mla_lt_len", config=lambda c: c.update(layer_types=lt_len))
    norm = "model.layers.0.self_attn.kv_a_layernorm.weight"
    _copy(TARGET, w / "mla_shape", tensors=lambda t: t.update({norm: torch.ones(5)}))
    _copy(TARGET, w / "mla_vocab", files={"tokenizer.json": _bigger_tokenizer()})
    _copy(TARGET, w / "mla_tok_garbage", files={"tokenizer.json": b"\xff\xfe garbage"})
    _copy(TARGET, w / "mla_fewer", tensors=lambda t: _drop_layer(t, 3))
    _copy(TARGET, w / "mla_more", tensors=lambda t: _rename_layer(t, 3, 4))
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    _copy(TARGET, w / "mla_int8", tensors=lambda t: t.update({o_proj: t[o_proj].to(torch.int8)}))
    shutil.copytree(DRAFTER, w / "drafter")
    _copy(DRAFTER, w / "d_lt_len", config=lambda c: c.update(layer_types=lt_len))
    _copy(DRAFTER, w / "d_lt_bad", config=lambda c: c.update(layer_types=lt_bad))
    _copy(DRAFTER, w / "d_int16", tensors=lambda t: t.update({"fc.weight": t["fc.weight"].to(torch.int16)}))  # fmt: skip
    _corrupt_checkpoints(w)
    (w / "work").mkdir()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("bad_checkpoints")
    torch.set_num_threads(1)
    _build(w)
    return w


def test_the_table_covers_at_least_35_cases_with_unique_ids():
    assert len(CASES) >= 35
    assert len({c.id for c in CASES}) == len(CASES)


def _listening(*args, **kwargs):  # serve got past loading: the case failed to fail there
    raise ValueError("serve: the models loaded and the server would listen now")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_bad_checkpoint_gets_one_line_before_any_decoding(case, world, capsys, monkeypatch):
    monkeypatch.chdir(world / "work")
    monkeypatch.delenv("DDTREE_DEBUG", raising=False)
    monkeypatch.setattr("ddtree.serve.server.serve", _listening)
    torch.set_num_threads(1)
    argv = case.argv.format(w=world).split()
    out = run_bad_input(argv, world, case.expect, capsys, ignore=LOADING)
    if case.argv.startswith("generate"):
        assert out == "", out  # refused before decoding: nothing printed
