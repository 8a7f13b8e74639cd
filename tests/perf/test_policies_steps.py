"""EAGLE and MTP: drafting in k sequential steps, priced from the drafter's shape (issue 18)."""

from dataclasses import replace

import pytest

from ddtree.perf.cost.step import (
    Drafter,
    Forward,
    Point,
    default_params,
    experts_touched,
    params_at,
    step_cost,
    target_forward,
)
from ddtree.perf.hardware.catalog import load_catalog
from ddtree.perf.inputs.scenario import ScenarioError, load_scenario, mtp_drafter
from ddtree.perf.projection.estimate import estimate
from ddtree.perf.shapes.model import PRESETS
from ddtree.vocab import POLICIES, Stage

CAT = load_catalog()
P = params_at(default_params())
LLAMA = PRESETS["llama-3.1-8b"]
DS = PRESETS["deepseek-v3"]
EAGLE3 = Drafter(params=0.3e9, layers=1, kv_bytes_per_token=4096, shares_target_lm_head=False,
                 lm_head_vocab=32000)  # fmt: skip

HEAD = """
[model]
preset = "{model}"
[drafter]
params = 0.3e9
layers = 1
lm_head_vocab = 32000
[[scenario]]
name = "s"
hardware = "h100-sxm"
tau = 3.0
{fields}
"""


def _load(tmp_path, fields, model="llama-3.1-8b"):
    path = tmp_path / "s.toml"
    path.write_text(HEAD.format(model=model, fields=fields))
    return load_scenario(path)


def test_sglang_names_set_the_tree():
    # the docstring example: num_steps 5, topk 8, num_draft_tokens 32 -> B = 6, N = 31, K = 8
    from ddtree.perf.inputs.scenario import _draft_steps

    eagle = POLICIES["eagle"]
    assert _draft_steps({"num_steps": 5, "topk": 8, "num_draft_tokens": 32}, {}, eagle, "w") == (
        6, 31, 8)  # fmt: skip
    assert _draft_steps({"num_steps": 3}, {}, eagle, "w") == (4, 3, 1)  # a top-1 chain


@pytest.mark.parametrize(
    "fields,message",
    [
        ('policy = "eagle"\nblock_size = 8', "takes num_steps, topk and num_draft_tokens"),
        ('policy = "eagle"\ntopk = 2', "needs 'num_steps'"),
        ('policy = "eagle"\nnum_steps = 3\nnum_draft_tokens = 6',
         "a top-1 chain of 3 steps verifies 4 tokens"),
        ('policy = "eagle"\nnum_steps = 3\ntopk = 4', "num_draft_tokens' must be given"),
        ('policy = "eagle"\nnum_steps = 2\ntopk = 4\nnum_draft_tokens = 10',
         "10 is more than 2 steps of top-4 can propose"),
        ('policy = "mtp"\nnum_steps = 2', "kimi-k2 has none (num_nextn_predict_layers = 0)"),
    ],
)  # fmt: skip
def test_bad_draft_steps_are_one_line_errors(tmp_path, fields, message):
    model = "kimi-k2" if "mtp" in fields else "llama-3.1-8b"
    with pytest.raises(ScenarioError, match="s.toml") as exc:
        _load(tmp_path, fields, model)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_an_eagle_step_is_k_drafter_passes_then_one_verify():
    k, topk, n = 5, 8, 31
    pt = Point(CAT["h100-sxm"], 1, 1, 600, k + 1, n, "graphs", EAGLE3, policy=POLICIES["eagle"],
               draft_topk=topk)  # fmt: skip
    cost = step_cost(LLAMA, pt, P, 4.0)
    step = cost.find("5 draft steps: drafter step")
    # one pass: its weights + its own 32k head (bf16) + its KV over the context
    one = (0.3e9 * 2 + 32000 * 4096 * 2) + 600 * 4096
    assert step.hbm_bytes == pytest.approx(5 * one)
    assert step.flops == pytest.approx(5 * 2 * topk * (0.3e9 + 32000 * 4096))
    topk_bytes = cost.find("5 draft steps: top-k over w x V").hbm_bytes
    assert topk_bytes == pytest.approx(5 * topk * 32000 * 4 * 3)  # the draft vocabulary
    assert cost.find("TP all-reduce") is None  # one GPU
    verify = step_cost(LLAMA, pt.as_ar(), P, 1.0)  # the verify is the target at M = N + 1
    assert cost.component("attention (weights + KV)").flops > verify.component(
        "attention (weights + KV)").flops  # fmt: skip
    assert pt.verify_width == 32


def test_an_mtp_step_runs_the_targets_own_layer_k_times():
    drafter = mtp_drafter(DS, Drafter(0, 0, precision="bf16"), "w")
    layer = drafter.layer_shape
    assert (layer.num_layers, layer.num_moe_layers, layer.n_routed_experts) == (1, 1, 256)
    assert layer.precision["routed_experts"] == "bf16" and drafter.projection_params == 2 * 7168**2
    pt = Point(CAT["b200"], 8, 1, 2000, 4, 3, "graphs", drafter, policy=POLICIES["mtp"])
    cost = step_cost(DS, pt, P, 2.8)
    draft = cost.stage_s(Stage.DRAFT)
    one = sum(c.seconds for c in target_forward(layer, pt, P, Forward(Stage.DRAFT, 1, 2000)))
    proj = cost.find("3 draft steps: MTP eh_proj").seconds / 3
    glue = cost.find("3 draft steps: draft step overhead").seconds / 3
    assert glue == pytest.approx(P["draft_step_overhead"] / P["host_speed.xeon-8570"])
    assert draft == pytest.approx(3 * (one + proj + glue))
    moe = cost.find("3 draft steps: routed MoE")
    # one token routes to 8 of 256 experts: 8 whole bf16 experts split over 8 GPUs, 3 times
    assert float(experts_touched(256, 8, 1)) == pytest.approx(8)
    assert moe.hbm_bytes == pytest.approx(3 * 8 * DS.expert_params * 2 / 8)


def test_an_mtp_layer_is_one_full_attention_layer_whatever_the_config_counted():
    # a config.json reader sets moe_layers (DeepSeek-R1: 58, MiniMax-M2: 62) and a hybrid's
    # linear_layers; the MTP layer keeps none of those counts: one layer, its experts, its KV
    r1 = PRESETS["deepseek-r1"]
    assert r1.moe_layers == 58  # read from config.json, unlike the deepseek-v3 preset's -1
    from_config = mtp_drafter(r1, None, "w")
    assert from_config.layer_shape.num_moe_layers == 1
    assert (
        from_config.layer_shape.active_params()
        == mtp_drafter(DS, None, "w").layer_shape.active_params()
    )
    pt = Point(CAT["b200"], 8, 1, 2000, 4, 3, "graphs", from_config, policy=POLICIES["mtp"])
    same = Point(CAT["b200"], 8, 1, 2000, 4, 3, "graphs", mtp_drafter(DS, None, "w"),
                 policy=POLICIES["mtp"])  # fmt: skip
    assert step_cost(r1, pt, P, 2.8).stage_s(Stage.DRAFT) == pytest.approx(
        step_cost(DS, same, P, 2.8).stage_s(Stage.DRAFT))  # fmt: skip
    hybrid = replace(PRESETS["qwen3-next-80b-a3b"], mtp_layers=1)  # 36 linear, 12 full
    layer = mtp_drafter(hybrid, None, "w").layer_shape
    assert (layer.num_layers, layer.linear_layers, layer.attention_layers) == (1, 0, 1)
    assert layer.kv_tokens_read(4096) == 4096


def test_an_eagle_case_reports_its_speedup_over_ar(tmp_path):
    sf = _load(tmp_path, 'policy = "eagle"\nnum_steps = 3\nengine = "graphs"')
    (r,) = estimate(sf, samples=300).results
    assert r.speedup_vs_ar is not None and r.speedup_vs_ar[50] > 1.5  # tau 3 over 4 steps' cost
    assert r.case.point.budget == 3 and r.case.point.block_size == 4


def test_the_engine_refuses_policies_only_the_estimator_prices():
    from ddtree.engine import DecodeConfig

    for name in ("eagle", "mtp"):
        with pytest.raises(ValueError, match=f"policy '{name}': the engine has no proposer"):
            DecodeConfig(name)
