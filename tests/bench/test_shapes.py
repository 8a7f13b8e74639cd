"""bench shapes: the bytes a step must read (worked examples against hand counts), and the
command end to end on the tiny preset (records that name the shape and the synthetic drafter)."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree.bench.shapes import experts_touched, kv_bytes, step_bytes, weight_bytes
from ddtree.cli import main
from ddtree.engine import DecodeConfig
from ddtree.models.nn.decoder import DecoderModel
from ddtree.models.oracle import OracleDrafter, OracleSpec
from ddtree.models.presets import Preset, random_drafter, random_target, random_target_config
from ddtree.records import read_records


def test_experts_touched_worked_example():
    assert experts_touched(128, 8, 1) == pytest.approx(8)
    assert experts_touched(128, 8, 33) == pytest.approx(128 * (1 - (120 / 128) ** 33))
    assert experts_touched(128, 8, 33) == pytest.approx(112.8, abs=0.05)


@pytest.fixture(scope="module")
def pair():
    preset = Preset.load("tiny-qwen3")
    target = random_target(preset, torch.float32, torch.device("cpu"), 128)
    return preset, target, OracleDrafter(OracleSpec(), random_drafter(preset, target))


def test_weight_bytes_count_every_matrix_once_and_the_untied_embedding_by_rows(pair):
    preset, target, _ = pair
    c = preset.target  # hidden 64, 4 layers, vocab 512, heads 4 / kv 2 of dim 16
    h, v, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    attn = h * 4 * 16 + 2 * h * 2 * 16 + 4 * 16 * h + 2 * 16  # q, k, v, o, q/k norms
    mlp = 3 * h * c["intermediate_size"]
    per_layer = attn + mlp + 2 * h  # two layer norms
    params = layers * per_layer + h + v * h  # final norm, LM head
    m = 33
    assert weight_bytes(target.model, m) == 4 * (params + m * h)  # float32, m embedding rows


def test_packed_layers_count_the_same_bytes_as_the_weights_they_replace():
    from ddtree.models.nn.linear import PackedLinear, packed_unavailable

    if packed_unavailable(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no oneDNN bf16 here")
    preset = Preset.load("tiny-qwen3")
    model = random_target(preset, torch.bfloat16, torch.device("cpu"), 64).model
    unpacked = random_target_config(preset)  # the same shape, nn.Linear layers
    with torch.device("meta"):
        plain = DecoderModel(unpacked).to(torch.bfloat16)
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    for m in (1, 33):
        assert weight_bytes(model, m) == weight_bytes(plain, m)


def test_kv_bytes_per_committed_row(pair):
    _, target, _ = pair
    c = target.config  # per layer k and v of kv_heads x head_dim
    per_row = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    assert kv_bytes(target.cache.tensors(), 1, 10) == pytest.approx(10 * per_row)


def test_a_drafting_step_adds_the_drafter_and_the_lm_head_again(pair):
    _, target, oracle = pair
    ar, _ = step_bytes(DecodeConfig("ar"), target, oracle, 50, 0)
    dd, parts = step_bytes(DecodeConfig("ddtree", budget=32), target, oracle, 50, 0)
    head = target.lm_head.weight
    own = sum(p.numel() for p in oracle.base.model.parameters()) * 4
    assert parts["drafter_weights"] == own + head.numel() * 4
    assert parts["target_weights"] - ar + parts["target_kv"] == pytest.approx(32 * 64 * 4)
    assert dd == pytest.approx(sum(parts.values()))


def test_a_draft_vocabulary_reads_k_rows_of_the_head_and_the_records_say_k(pair):
    preset, target, _ = pair
    oracle = OracleDrafter(OracleSpec(), random_drafter(preset, target, draft_vocab=100))
    _, parts = step_bytes(DecodeConfig("ddtree", budget=32), target, oracle, 50, 0)
    own = sum(p.numel() for p in oracle.base.model.parameters()) * 4
    assert parts["drafter_weights"] == own + 100 * preset.target["hidden_size"] * 4
    assert oracle.info.draft_vocab == 100 and oracle.draft_tokens is None  # synthetic ranks
    # no corpus for random weights: the EOS tokens and the smallest ids
    eos = [t for t in target.info.eos_token_ids if t < preset.target["vocab_size"]]
    assert oracle.base.draft_tokens.tolist() == sorted({*eos, *range(100 - len(eos))})


@pytest.mark.slow
def test_bench_shapes_on_the_tiny_preset_writes_its_records(tmp_path, capsys):
    records = tmp_path / "shapes.jsonl"
    argv = ["bench", "shapes", "--preset", "tiny-qwen3", "--dtype", "float32", "--budgets", "8"]
    argv += ["--prompts", "1", "--context", "16", "--max-new-tokens", "12", "--engine-modes"]
    argv += ["eager", "--records", str(records)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "SYNTHETIC acceptance" in out and "of the memory roofline" in out
    assert main([*argv, "--json"]) == 0
    line = json.loads(capsys.readouterr().out)  # one JSON document and nothing else
    assert [r["policy"] for r in line["rows"]] == ["ar", "chain", "ddtree"]
    assert all(r["identical_to_ar"] for r in line["rows"])
    runs = [r for r in read_records(records) if r.kind == "engine_run"]
    assert len(runs) == 6 and [r.kind for r in read_records(records)][0] == "bench_bandwidth"
    extra = runs[2].config_extra
    assert extra["preset"] == "tiny-qwen3" and extra["random_weights"] is True
    assert extra["synthetic_drafter"].startswith("synthetic-oracle(")
    assert extra["step_bytes"] > 0 and 0 < extra["roofline_fraction"] < 1.5
    # the estimator reads them as anchors (the shape is in the record)
    from ddtree.perf.inputs.fromrecords import anchors_from_records

    anchors, machine = anchors_from_records(read_records(records))
    assert anchors and machine is not None


def test_bench_shapes_refuses_a_shape_that_does_not_fit_before_allocating(monkeypatch, capsys):
    import ddtree.models.presets as presets

    monkeypatch.setattr(presets, "available_bytes", lambda device: 10**9)
    monkeypatch.setattr(presets, "random_target", lambda *a, **k: pytest.fail("allocated"))
    assert main(["bench", "shapes", "--preset", "qwen3-8b"]) == 2
    err = capsys.readouterr().err
    assert "error: preset qwen3-8b in bfloat16 needs" in err and "has 1.00 GB available" in err


def test_a_roofline_past_100_percent_warns_that_the_bandwidth_is_too_low():
    from ddtree.bench.shapes import ShapeRow
    from ddtree.commands.bench_shapes import ShapesReport

    def row(fraction):
        return ShapeRow("eager", "ar", 0, 1, {}, None, 8e9, roofline_fraction=fraction)

    report = ShapesReport(Preset.load("tiny-qwen3"), "bfloat16", "cpu", 1, "layer", "oracle",
                          7.1e9, "measured now", [row(0.9), row(1.65)])  # fmt: skip
    (line,) = report.warnings()
    assert "1 of 2 rows" in line and "165% of 7.1 GB/s" in line and "measured now" in line
    report.rows = [row(0.74)]
    assert report.warnings() == []


def test_rows_read_the_weights_once_and_their_own_kv(pair):
    """At C rows a step reads the weights once for all C x M tokens and every row's KV."""
    _, target, oracle = pair
    config = DecodeConfig("ddtree", budget=8)
    one, p1 = step_bytes(config, target, oracle, 50, 0)
    four, p4 = step_bytes(config, target, oracle, 50, 0, rows=4)
    assert p4["target_kv"] == pytest.approx(4 * p1["target_kv"])
    assert p4["drafter_kv"] == pytest.approx(4 * p1["drafter_kv"])
    assert p4["drafter_weights"] == p1["drafter_weights"]
    # the untied embedding: 4 x 9 rows instead of 9; every other matrix once
    row = target.model.model.embed_tokens.weight[0].numel() * 4
    assert p4["target_weights"] - p1["target_weights"] == pytest.approx(3 * 9 * row)
    assert four < 4 * one


def test_oracle_forks_follow_their_own_reference_and_draft_together(pair):
    """A batch's oracles: each fork proposes as a lone oracle told the same reference, and
    their base drafters run in one forward."""
    from ddtree.models.static import EnginePlan

    _, target, oracle = pair
    refs = [list(range(3, 40)), list(range(10, 60))]
    forks = [oracle.fork(), oracle.fork()]
    alone = [oracle.fork(), oracle.fork()]
    for o, ref in zip(forks + alone, refs + refs, strict=True):
        o.set_engine_mode(EnginePlan())
        o.expect(ref)
    features = oracle.base.config.context_features
    contexts = [torch.zeros(5, features), torch.zeros(8, features)]
    roots = [refs[0][5], refs[1][8]]
    together = type(oracle).propose_many(forks, contexts, roots)
    for o, ctx, root, got in zip(alone, contexts, roots, together, strict=True):
        torch.testing.assert_close(got, o.propose(ctx, root))
    assert forks[0].batches_with(forks[1]) and [f.base.seen for f in forks] == [5, 8]
    assert forks[0].base.model is oracle.base.model  # weights shared, caches not
    assert forks[0].base._k.data_ptr() != forks[1].base._k.data_ptr()


@pytest.mark.slow
def test_bench_shapes_concurrency_records_each_c(tmp_path, capsys):
    records = tmp_path / "c.jsonl"
    argv = ["bench", "shapes", "--preset", "tiny-qwen3", "--dtype", "float32", "--budgets", "8"]
    argv += ["--prompts", "3", "--context", "16", "--max-new-tokens", "12", "--engine-modes"]
    argv += ["eager", "--concurrency", "1,3", "--records", str(records), "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["concurrency"], r["policy"]) for r in rows] == [
        (c, p) for c in (1, 3) for p in ("ar", "chain", "ddtree")
    ]
    assert all(r["identical_to_ar"] for r in rows)
    # each request follows its own prompt: the oracle's tau is the same one at a time or not
    tau = {(r["concurrency"], r["policy"]): r["mean_tau"] for r in rows}
    assert tau[(3, "ddtree")] == pytest.approx(tau[(1, "ddtree")], rel=0.15)
    runs = [r for r in read_records(records) if r.kind == "engine_run"]
    assert [r.concurrency for r in runs] == [1, 1, 1, 3, 3, 3]


def test_bench_shapes_budget_auto_states_the_trees_it_verified(tmp_path, capsys):
    """--budgets 8,auto: the auto row's N is the mean of the trees it verified (at most
    AUTO_MAX_BUDGET), labelled as such, its output equal to AR's, its record marked."""
    from ddtree.vocab import AUTO_MAX_BUDGET

    records = tmp_path / "auto.jsonl"
    argv = ["bench", "shapes", "--preset", "tiny-qwen3", "--dtype", "float32", "--budgets"]
    argv += ["8,auto", "--prompts", "2", "--context", "16", "--max-new-tokens", "12"]
    argv += ["--engine-modes", "eager", "--records", str(records), "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["policy"], r["auto_budget"]) for r in rows] == [
        ("ar", False), ("chain", False), ("ddtree", False), ("ddtree", True)
    ]  # fmt: skip
    auto = rows[-1]
    assert 1 <= auto["budget"] <= AUTO_MAX_BUDGET and auto["width"] == auto["budget"] + 1
    assert all(r["identical_to_ar"] for r in rows)
    runs = [r for r in read_records(records) if r.kind == "engine_run"]
    assert runs[-1].config_extra["auto_budget"] is True and runs[-1].budget == auto["budget"]
    assert runs[2].config_extra["auto_budget"] is False and runs[2].budget == 8
