"""The serving-engine cost structure of issue 27: kernel paths, efficiency by generation and
path, the per-layer floor, the speculative host costs and the stack multipliers."""

from dataclasses import replace

import numpy as np
import pytest

from ddtree.perf.cost.step import (
    MAX_MEMORY_EFFICIENCY,
    Drafter,
    Point,
    default_params,
    kernel_path,
    memory_efficiency,
    params_at,
    step_cost,
)
from ddtree.perf.hardware.catalog import load_catalog
from ddtree.perf.shapes.model import PRESETS
from ddtree.vocab import POLICIES, Stage

CAT = load_catalog()
P = params_at(default_params())
LLAMA = PRESETS["llama-3.1-8b"]
EAGLE = Drafter(params=0.3e9, layers=1, lm_head_vocab=32000, shares_target_lm_head=False)


def _point(hw="h100-sxm", policy="ar", stack="any", **kw) -> Point:
    pol = POLICIES[policy]
    if policy == "ar":
        return Point(CAT[hw], 1, 1, 1000.0, 1, 0, "graphs", None, policy=pol, stack=stack, **kw)
    # an EAGLE chain of 4 draft steps (B = 5, N = 4)
    return Point(CAT[hw], 1, 1, 1000.0, 5, 4, "graphs", EAGLE, policy=pol, stack=stack, **kw)


def test_kernel_path_worked_examples():
    assert kernel_path(CAT["a100-sxm-80gb"], "fp8") == "dequant-8bit"
    assert kernel_path(CAT["h100-sxm"], "fp8-block128") == "native-8bit"
    assert kernel_path(CAT["h100-sxm"], "mxfp4") == "dequant-fp4"
    # GPTQ / AWQ 8-bit weights are weight-only: dequantised even on a GPU with int8 units
    assert kernel_path(CAT["a100-sxm-80gb"], "int8") == "dequant-8bit"
    assert kernel_path(CAT["h100-sxm"], "int8") == "dequant-8bit"
    assert kernel_path(CAT["b200"], "fp4") == "native-4bit"
    assert kernel_path(CAT["b200"], "int4-g64") == "dequant-4bit"  # weight-only: never native
    assert kernel_path(CAT["b200"], "bf16") == "16bit"


def test_memory_efficiency_is_component_x_generation_x_path_capped():
    hw = CAT["h100-sxm"]
    p = {**P, "weights_efficiency": 0.6, "gen_efficiency.hopper": 1.2,
         "path_efficiency.native-8bit": 0.5}  # fmt: skip
    assert memory_efficiency(p, "weights_efficiency", hw, "bf16") == pytest.approx(0.72)
    assert memory_efficiency(p, "weights_efficiency", hw, "fp8") == pytest.approx(0.36)
    # another generation's multiplier does not apply
    assert memory_efficiency(p, "weights_efficiency", CAT["a100-sxm-80gb"], "bf16") == 0.6
    hot = {**p, "gen_efficiency.hopper": 1.5, "weights_efficiency": 0.9}
    assert memory_efficiency(hot, "weights_efficiency", hw, "bf16") == MAX_MEMORY_EFFICIENCY
    # x the serving stack's kernels; a projection for no stack in particular ("any") takes 1
    q = {**p, "stack_kernel.vllm": 0.5, "stack_kernel.sglang": 1.25}
    assert memory_efficiency(q, "weights_efficiency", hw, "bf16", "vllm") == pytest.approx(0.36)
    assert memory_efficiency(q, "weights_efficiency", hw, "bf16", "sglang") == pytest.approx(0.9)
    assert memory_efficiency(q, "weights_efficiency", hw, "bf16", "any") == pytest.approx(0.72)
    # "other" (engines of no named stack) has a host multiplier but no kernel multiplier: it
    # streams at the shared efficiencies
    assert "stack_host.other" in P and "stack_kernel.other" not in P
    assert "stack_kernel.sglang" in P and "stack_kernel.any" not in P
    assert memory_efficiency(q, "weights_efficiency", hw, "bf16", "other") == pytest.approx(0.72)


def test_a_stacks_kernel_multiplier_scales_its_memory_bound_work_only():
    # Llama-3.1-8B at C = 1 on an H100 (launches priced at 0): the weights stream, memory-bound;
    # the stack's kernels at half its share of the peak take twice as long, another stack's and
    # the host costs do not move
    p0 = {**P, "graphs.launch": 0.0}
    half = {**p0, "stack_kernel.vllm": 0.5 * p0.get("stack_kernel.vllm", 1.0)}
    for name in ("dense MLP layers", "attention (weights + KV)", "LM head over M"):
        b = step_cost(LLAMA, _point(stack="vllm"), p0, 1.0).find(name)
        assert b.bound.value == "memory"
        assert float(step_cost(LLAMA, _point(stack="vllm"), half, 1.0).find(name).seconds) == (
            pytest.approx(2 * float(b.seconds)))  # fmt: skip
        sg = _point(stack="sglang")
        assert float(step_cost(LLAMA, sg, half, 1.0).find(name).seconds) == pytest.approx(
            float(step_cost(LLAMA, sg, p0, 1.0).find(name).seconds))  # fmt: skip
    host = [step_cost(LLAMA, _point(stack="vllm"), q, 1.0).find("framework overhead").seconds
            for q in (p0, half)]  # fmt: skip
    assert float(host[0]) == pytest.approx(float(host[1]))


def test_the_layer_floor_binds_a_small_forward_only():
    tiny = PRESETS["qwen3-0.6b"]
    for model, binds in ((tiny, True), (PRESETS["llama-3.1-70b"], False)):
        p = {**P, "layer_floor.hopper": 60e-6}
        cost = step_cost(model, _point(), p, 1.0)
        floor = cost.find("per-layer kernel floor")
        device = sum(c.seconds for c in cost.components
                     if c.stage is Stage.VERIFY and c.bound.value in ("memory", "compute"))  # fmt: skip
        assert float(floor.seconds) == pytest.approx(max(0.0, model.num_layers * 60e-6 - device))
        assert (float(floor.seconds) > 0) == binds


def test_speculative_host_costs_scale_with_draft_steps_and_the_stack():
    ar = step_cost(LLAMA, _point(), P, 1.0)
    assert (
        ar.find("spec step overhead") is None
        and ar.find("4 draft steps: draft step overhead") is None
    )
    base = step_cost(LLAMA, _point(policy="eagle", draft_topk=1), P, 3.0)
    glue = base.find("4 draft steps: draft step overhead")
    host = P["host_speed.xeon-8480c"] if "host_speed.xeon-8480c" in P else 1.0
    assert float(glue.seconds) == pytest.approx(4 * P["draft_step_overhead"] / host)
    assert float(base.find("spec step overhead").seconds) == pytest.approx(
        P["spec_step_overhead"] / host)  # fmt: skip
    lean = {**P, "stack_spec.vllm": 0.5, "stack_host.vllm": 2.0}
    vllm = step_cost(LLAMA, _point(policy="eagle", stack="vllm", draft_topk=1), lean, 3.0)
    assert float(vllm.find("4 draft steps: draft step overhead").seconds) == pytest.approx(
        0.5 * float(glue.seconds))  # fmt: skip
    assert float(vllm.find("framework overhead").seconds) == pytest.approx(
        2.0 * float(base.find("framework overhead").seconds))  # fmt: skip


def test_a_device_without_a_generation_pays_no_serving_engine_costs():
    cpu = replace(CAT["h100-sxm"], key="cpu", generation="")
    cost = step_cost(LLAMA, replace(_point(policy="eagle", draft_topk=1), hardware=cpu), P, 3.0)
    names = {c.name for c in cost.components}
    assert not {"spec step overhead", "per-layer kernel floor"} & names
    assert not any("draft step overhead" in n for n in names)
    assert np.isfinite(float(cost.step_s))


def test_transformers_eager_moe_pays_a_host_loop_over_every_expert():
    # transformers' eager MoE block loops over all E experts of a layer, a host sync each:
    # L_moe x E x expert_loop, whatever the batch; a serving stack, a graph engine or a dense
    # model pays none
    moe = PRESETS["qwen3-30b-a3b"]
    hf = replace(_point(hw="h20", stack="transformers"), engine="eager")
    cost = step_cost(moe, hf, P, 1.0)
    loop = cost.find("per-expert loop")
    host = P.get(f"host_speed.{hf.host_cpu}", 1.0)
    assert float(loop.seconds) == pytest.approx(48 * 128 * P["expert_loop"] / host)
    assert float(loop.seconds) > 0.5 * float(cost.step_s)  # it is most of a step at batch 1
    wide = step_cost(moe, replace(hf, concurrency=8), P, 1.0)
    assert float(wide.find("per-expert loop").seconds) == pytest.approx(float(loop.seconds))
    assert step_cost(moe, replace(hf, stack="sglang"), P, 1.0).find("per-expert loop") is None
    graphs = replace(hf, engine="graphs")
    assert step_cost(moe, graphs, P, 1.0).find("per-expert loop") is None
    assert step_cost(LLAMA, hf, P, 1.0).find("per-expert loop") is None


def test_speculative_host_costs_grow_by_spec_tp_scale_per_doubling_of_tp():
    steep = {**P, "spec_tp_scale": 1.5}
    one = step_cost(LLAMA, _point(policy="eagle", draft_topk=1), steep, 3.0)
    four = step_cost(LLAMA, replace(_point(policy="eagle", draft_topk=1), tp=4), steep, 3.0)
    for name in ("4 draft steps: draft step overhead", "spec step overhead"):
        assert float(four.find(name).seconds) == pytest.approx(
            1.5**2 * float(one.find(name).seconds))  # fmt: skip
    assert "spec_tp_scale^log2(4)" in four.find("spec step overhead").formula
    flat = step_cost(LLAMA, replace(_point(policy="eagle", draft_topk=1), tp=4), P, 3.0)
    assert float(flat.find("spec step overhead").seconds) == pytest.approx(
        P["spec_tp_scale"] ** 2 * float(one.find("spec step overhead").seconds))  # fmt: skip
