"""Physics the estimator refuses to break (issue 18): memory, heads, positions, roofline."""

import json

import pytest

from ddtree.perf.cost.physics import RUNTIME_RESERVE_BYTES, findings, memory_per_gpu
from ddtree.perf.cost.step import Point, default_params, params_at, step_cost
from ddtree.perf.hardware.catalog import load_catalog, load_links
from ddtree.perf.inputs.scenario import ScenarioError, load_scenario
from ddtree.perf.shapes.model import PRESETS
from ddtree.vocab import AR

CAT = load_catalog()


def _ar(model, hw, tp=1, context=2048, concurrency=1, **kw):
    return Point(CAT[hw], tp, concurrency, context, 1, 0, "graphs", None, policy=AR, **kw)


def test_kimi_k2_thinking_weights_do_not_fit_one_h100():
    k2t = PRESETS["kimi-k2-thinking"]
    use = memory_per_gpu(k2t, _ar(k2t, "h100-sxm"))
    # the figure: about 590 GB of weights (INT4 g32 routed experts, BF16 elsewhere)
    assert use.weights_bytes == pytest.approx(590e9, rel=0.03)
    assert use.reserve_bytes == RUNTIME_RESERVE_BYTES
    (f,) = findings(k2t, _ar(k2t, "h100-sxm"))
    assert f.kind == "oversubscribe" and "than the 80 GB a GPU has" in f.message
    # spread over 8 B300s it fits: one eighth of the weights, the rest is small
    assert findings(k2t, _ar(k2t, "b300", tp=8)) == []


def test_kv_cache_counts_per_request_and_context():
    llama = PRESETS["llama-3.1-8b"]
    one = memory_per_gpu(llama, _ar(llama, "h100-sxm", context=1023))
    # 32 layers x 2 x 8 KV heads x 128 x 2 B = 131 kB per token, 1024 positions
    assert one.kv_bytes == pytest.approx(1024 * 32 * 2 * 8 * 128 * 2)
    four = memory_per_gpu(llama, _ar(llama, "h100-sxm", context=1023, concurrency=4))
    assert four.kv_bytes == pytest.approx(4 * one.kv_bytes)
    assert four.weights_bytes == one.weights_bytes


SCENARIO = """
[model]
preset = "{model}"
[[scenario]]
name = "q"
hardware = "{hw}"
policy = "ar"
tp = {tp}
context = "{context}"
{extra}
"""


def _load(tmp_path, allow=False, **kw):
    fields = {"model": "kimi-k2-thinking", "hw": "h100-sxm", "tp": 1, "context": "2048 tok",
              "extra": ""} | kw  # fmt: skip
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(**fields))
    return load_scenario(path, allow_oversubscribe=allow)


def test_an_oversubscribed_gpu_is_an_error_naming_the_sizes_or_a_warning(tmp_path):
    with pytest.raises(ScenarioError) as exc:
        _load(tmp_path)
    msg = str(exc.value)
    assert "s.toml: scenario[0] (q): kimi-k2-thinking on 1 x h100-sxm needs" in msg
    assert "of weights +" in msg and "more than the 80 GB a GPU has" in msg
    assert "--allow-oversubscribe" in msg and "\n" not in msg
    sf = _load(tmp_path, allow=True)
    (note,) = [n for n in sf.notes if "warning:" in n]
    assert "more than the 80 GB" in note and sf.cases[0].point.tp == 1


def test_the_cli_refuses_in_one_line_and_prices_with_allow_oversubscribe(tmp_path, capsys):
    from ddtree.cli import main

    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(model="kimi-k2-thinking", hw="h100-sxm", tp=1,
                                    context="2048 tok", extra="") + "tau = 1\n")  # fmt: skip
    assert main(["estimate", str(path), "--samples", "200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than the 80 GB a GPU has" in err[0]
    assert main(["estimate", str(path), "--samples", "200", "--json", "--allow-oversubscribe"]) == 0
    out = capsys.readouterr()
    assert "warning:" in out.err and json.loads(out.out)["scenarios"][0]["tokens_per_s"]["p50"] > 0


def test_a_ten_million_token_context_is_refused(tmp_path):
    with pytest.raises(ScenarioError, match="exceeds kimi-k2-thinking's max_position_embeddings"):
        _load(tmp_path, hw="b300", tp=8, context="10000000 tok")
    # a model whose max positions are unknown still meets the memory check: the KV of 10M
    # tokens does not fit
    llama = PRESETS["llama-3.1-8b"]
    import dataclasses

    unknown = dataclasses.replace(llama, max_positions=0)
    (f,) = findings(unknown, _ar(unknown, "h100-sxm", context=10e6))
    assert f.kind == "oversubscribe" and "of KV cache" in f.message


@pytest.mark.parametrize("tp,message", [
    (3, "tp 3 does not divide the 32 attention heads of llama-3.1-8b"),
    (12, "tp 12 does not divide the 32 attention heads"),
])  # fmt: skip
def test_tp_that_does_not_divide_the_heads_is_refused(tmp_path, tp, message):
    extra = 'inter_node = "ib-ndr"\ngpus_per_node = 4' if tp > 8 else ""
    with pytest.raises(ScenarioError, match=message):
        _load(tmp_path, model="llama-3.1-8b", tp=tp, extra=extra)


def test_kv_heads_that_neither_divide_nor_are_divided_are_refused():
    q = PRESETS["qwen3-30b-a3b"]  # 32 heads, 4 KV heads
    import dataclasses

    odd = dataclasses.replace(q, num_kv_heads=12, num_heads=48)
    msgs = [f.message for f in findings(odd, _ar(odd, "h100-sxm", tp=8))]
    assert any("neither divides nor is divided by the 12 KV heads" in m for m in msgs)


def test_a_full_layer_shape_of_its_own_is_checked_for_its_own_kv_heads():
    import dataclasses

    q = PRESETS["qwen3-30b-a3b"]  # 32 heads, 4 KV heads on every layer
    gemma_like = dataclasses.replace(q, sliding_layers=40, sliding_window=1024, global_kv_heads=2)
    msgs = [f.message for f in findings(gemma_like, _ar(gemma_like, "h100-sxm", tp=4))]
    assert msgs == [f"tp 4 > 2 KV heads of {q.name}: each KV head (and its K/V projections) is "
                    "replicated on 2 GPUs, priced as such"]  # fmt: skip
    odd = dataclasses.replace(gemma_like, global_kv_heads=3)
    msgs = [f.message for f in findings(odd, _ar(odd, "h100-sxm", tp=4))]
    assert any("neither divides nor is divided by the 3 KV heads" in m for m in msgs)


def test_tp64_replicates_the_kv_heads_and_is_slower_than_tp8():
    llama = PRESETS["llama-3.1-70b"]  # 64 heads, 8 KV heads
    ib = load_links()["ib-ndr"]
    tp64 = _ar(llama, "h100-sxm", tp=64, inter_node=ib)
    (note,) = findings(llama, tp64)
    assert note.kind == "note" and "replicated on 8 GPUs" in note.message
    # replication priced: past 8 GPUs the K/V projections no longer shrink
    attn = llama.attention_params_per_shard
    assert attn(64) - attn(128) == pytest.approx(2 * 8192 * 128 * 64 * (1 / 64 - 1 / 128))
    P = params_at(default_params())
    step8 = float(step_cost(llama, _ar(llama, "h100-sxm", tp=8), P, 1.0).step_s)
    step64 = float(step_cost(llama, tp64, P, 1.0).step_s)
    assert step64 > step8  # 8 nodes: the all-reduces' latency outgrows the weights saved


def test_an_article_on_a_dense_case_does_not_crash_the_report(tmp_path, capsys):
    from ddtree.cli import main

    path = tmp_path / "s.toml"
    path.write_text(
        SCENARIO.format(model="llama-3.1-8b", hw="h100-sxm", tp=1, context="600 tok", extra="")
        + 'article = { tokens_per_s = "158 tok/s", moe = "1 ms", note = "SGLang docs" }\n'
    )
    assert main(["estimate", str(path), "--samples", "200"]) == 0  # was KeyError: 'routed MoE'
    assert "vs article" in capsys.readouterr().out
    assert main(["estimate", str(path), "--samples", "200", "--json"]) == 0
    assert "158" in json.loads(capsys.readouterr().out)["scenarios"][0]["vs_article"]
    assert main(["estimate", str(path), "--samples", "200", "--explain"]) == 0
    assert "vs article: ours (" in capsys.readouterr().out
    rep = tmp_path / "rep"
    assert main(["estimate", str(path), "--samples", "200", "--report", str(rep)]) == 0
    # an ar case: a breakdown, no tau or budget sweep to draw
    assert sorted(p.name for p in rep.iterdir()) == ["breakdown.png", "report.md"]
    assert "| q |" in (rep / "report.md").read_text()
