import dataclasses

import numpy as np
import pytest

from ddtree.perf.cost import step as cost
from ddtree.perf.cost.step import (
    Drafter,
    Point,
    amdahl,
    default_params,
    experts_touched,
    host_speed,
    moe_layer_s,
    params_at,
    step_cost,
    tokens_per_s,
)
from ddtree.perf.hardware.catalog import load_catalog, with_bandwidth
from ddtree.perf.shapes.model import PRESETS
from ddtree.vocab import POLICIES, STEP_STAGES, Stage

K2T = PRESETS["kimi-k2-thinking"]
DRAFTER = Drafter(params=1.5e9, layers=3, kv_bytes_per_token=12288)


def _point(hw="b300", **kw):
    base = dict(
        hardware=load_catalog()[hw],
        tp=8,
        concurrency=1,
        context_tokens=2048,
        block_size=8,
        budget=8,
        engine="eager",
        drafter=DRAFTER,
    )
    base.update(kw)
    return Point(**base)


def test_experts_touched_formula():
    # E(1-(1-k/E)^T) by hand: Kimi 8 -> 59.5, 16 -> 110; DeepSeek 8 -> 57
    assert experts_touched(384, 8, 8) == pytest.approx(59.5, abs=0.1)
    assert experts_touched(384, 8, 16) == pytest.approx(110, abs=0.5)
    assert experts_touched(256, 8, 8) == pytest.approx(57, abs=0.5)
    assert experts_touched(384, 8, 1) == pytest.approx(8)
    assert experts_touched(384, 8, 10**6) == pytest.approx(384)
    curve = ((1, 8), (9, 50), (33, 150))
    assert experts_touched(384, 8, 21, curve) == pytest.approx(100)


def test_doubling_bandwidth_halves_memory_bound_terms():
    P = params_at(default_params())
    hw = load_catalog()["b300"]
    a = step_cost(K2T, _point(engine="graphs"), P, 4.4)
    b = step_cost(
        K2T, _point(engine="graphs", hardware=with_bandwidth(hw, 2 * hw.hbm_bytes_per_s)), P, 4.4
    )
    launch = P["graphs.launch"]  # a replayed graph node: the GPU's time, whatever the host
    for ca, cb in zip(a.components, b.components, strict=True):
        if ca.bound == "memory":
            ta, tb = ca.seconds - ca.launches * launch, cb.seconds - cb.launches * launch
            assert tb == pytest.approx(ta / 2), ca.name
        elif ca.bound in ("host", "link"):
            assert cb.seconds == pytest.approx(ca.seconds), ca.name
    assert b.limit_step_s == pytest.approx(a.limit_step_s / 2)


def test_moe_grows_with_verify_width_and_tp_splits_weights():
    P = {**params_at(default_params()), "routing_locality": 1.0}  # uniform: tokens independent
    m9 = step_cost(K2T, _point(budget=8), P).component("routed MoE")
    m33 = step_cost(K2T, _point(budget=32), P).component("routed MoE")
    assert m33.hbm_bytes / m9.hbm_bytes == pytest.approx(192.31 / 66.28, rel=1e-3)
    tp4 = step_cost(K2T, _point(tp=4), P).component("routed MoE")
    assert tp4.hbm_bytes == pytest.approx(2 * m9.hbm_bytes)
    # per full layer (tp 1) at M=9 on a 1.8 TB/s card at 100% efficiency: 66.3 x 24.8 MB / bw
    hw = load_catalog()["rtx-pro-6000"]
    t = moe_layer_s(K2T, hw, 9, {**P, "moe_efficiency": 1.0})
    assert t == pytest.approx(66.28 * 44.04e6 * 0.5625 / 1.792e12, rel=1e-3)


def test_concurrency_shares_weights_but_not_kv():
    P = params_at(default_params())
    c1 = step_cost(K2T, _point(), P)
    c4 = step_cost(K2T, _point(concurrency=4), P)
    a1, a4 = c1.component("attention (weights + KV)"), c4.component("attention (weights + KV)")
    kv1 = K2T.num_layers * 2048 * K2T.kv_bytes_per_token_layer()
    assert a4.hbm_bytes - a1.hbm_bytes == pytest.approx(3 * kv1)
    assert c4.component("LM head over M").hbm_bytes == c1.component("LM head over M").hbm_bytes
    assert tokens_per_s(c4, 4.4) > tokens_per_s(c1, 4.4)


def test_allreduce_latency_and_link():
    P = params_at(default_params())
    cat = load_catalog()
    pcie = step_cost(K2T, _point("rtx-pro-6000"), P).component("TP all-reduce")
    nvl = step_cost(K2T, _point("b300"), P).component("TP all-reduce")
    assert pcie.seconds > nvl.seconds
    assert pcie.seconds >= 2 * K2T.num_layers * cat["rtx-pro-6000"].allreduce_latency_s
    names = [c.name for c in step_cost(K2T, _point(tp=1), P).components]
    assert "TP all-reduce" not in names


def test_vectorised_params_broadcast():
    P = params_at(default_params())
    P["moe_efficiency"] = np.array([0.5, 0.75, 1.0])
    cost = step_cost(K2T, _point(engine="graphs"), P, 4.4)
    assert np.shape(cost.step_s) == (3,)
    assert cost.step_s[0] > cost.step_s[1] > cost.step_s[2]


def test_native_engine_only_changes_host_terms():
    P = params_at(default_params())
    py = step_cost(K2T, _point(engine="eager"), P)
    nat = step_cost(K2T, _point(engine="native"), P)
    assert nat.step_s < py.step_s
    assert nat.hbm_bytes == py.hbm_bytes


def test_amdahl_flags_overheads_on_fast_hardware():
    P = params_at(default_params())
    P["eager.step_overhead"] = 0.02
    a = amdahl(step_cost(K2T, _point(), P, 4.4), P, 4.4)
    assert a.overhead_fraction > 0.5 and "overheads dominate" in a.statement
    assert a.limit_tokens_per_s > 4.4 / step_cost(K2T, _point(), P).step_s
    low = dataclasses.replace(_point(), engine="native")
    b = amdahl(step_cost(K2T, low, P, 4.4), P, 4.4)
    assert b.overhead_fraction < a.overhead_fraction


# ---- each component alone, against hand-computed bytes and FLOPs (Kimi K2-Thinking, TP 8,
# C = 1, context 2048, B = 8, N = 8 -> M = 9; the published config.json shapes) ----
EXPERT = 3 * 7168 * 2048  # 44,040,192 params
ATTN = (7168 * 1536 + 1536 * 64 * 192) + (7168 * 576 + 512 * 64 * 256) + 64 * 128 * 7168
TOUCHED_M9 = 384 * (1 - (1 - 8 / 384) ** 9)  # 66.28 experts
LM_HEAD = 163840 * 7168
VERIFY = cost.Forward(Stage.VERIFY, 9, 2048)


def test_the_hand_computed_shapes():
    assert ATTN == K2T.attention_params_per_layer == 101_122_048  # 101 M per layer, by hand
    assert TOUCHED_M9 == pytest.approx(66.3, abs=0.05)
    assert K2T.kv_bytes_per_token_layer() == (512 + 64) * 2


@pytest.mark.parametrize(
    "make,stage,want_bytes,want_flops",
    [
        (lambda p, P: cost.routed_moe(K2T, p, P, VERIFY), Stage.VERIFY,
         60 * TOUCHED_M9 * EXPERT * 0.5625 / 8, 2 * 9 * 8 * EXPERT * 60 / 8),
        (lambda p, P: cost.attention(K2T, p, P, VERIFY), Stage.VERIFY,
         61 * ATTN * 2 / 8 + 61 * 2048 * 1152,
         2 * 9 * 61 * ATTN / 8 + 9 * 61 * (2048 + 9) * 2 * 64 * (2 * 512 + 64) / 8),
        (lambda p, P: cost.shared_experts(K2T, p, P, VERIFY), Stage.VERIFY,
         60 * EXPERT * 2 / 8, 2 * 9 * 60 * EXPERT / 8),
        (lambda p, P: cost.dense_mlp(K2T, p, P, VERIFY), Stage.VERIFY,
         1 * 3 * 7168 * 18432 * 2 / 8, 2 * 9 * 3 * 7168 * 18432 / 8),
        (lambda p, P: cost.lm_head(K2T, p, P, VERIFY), Stage.VERIFY,
         LM_HEAD * 2 / 8, 2 * 9 * LM_HEAD / 8),
        (lambda p, P: cost.drafter_forward(K2T, p, P), Stage.DRAFT,
         1.5e9 * 2 / 8 + 2048 * 12288 / 8 + LM_HEAD * 2 / 8,
         2 * 8 * 1.5e9 / 8 + 2 * 7 * LM_HEAD / 8),
        (lambda p, P: cost.topk(K2T, p, P), Stage.TOPK, 7 * 163840 * 4 * 3, 0.0),
        (lambda p, P: cost.accept(K2T, p, P), Stage.ACCEPT, 9 * 163840 * 4, 0.0),
        (lambda p, P: cost.kv_commit(K2T, p, P, 4.4), Stage.COMMIT, 4.4 * 61 * 1152 * 2, 0.0),
    ],
)  # fmt: skip
def test_each_device_component_alone(make, stage, want_bytes, want_flops):
    P = {**params_at(default_params()), "routing_locality": 1.0}  # uniform: tokens independent
    c = make(_point(), P)
    assert c.stage is stage
    assert c.hbm_bytes == pytest.approx(want_bytes, rel=1e-9)
    assert c.flops == pytest.approx(want_flops, rel=1e-9)


def test_each_host_component_alone():
    P = params_at(default_params())
    p = _point(concurrency=2, host="xeon-8480c")  # the reference host: speed 1
    eng = cost.ENGINES["eager"]
    assert cost.tree_build(p, P).seconds == pytest.approx(
        2 * (eng.tree_fixed_s + 8 * eng.tree_per_node_s)
    )
    assert cost.verify_layout(p, P).stage is Stage.LAYOUT
    assert cost.verify_layout(p, P).seconds == pytest.approx(
        2 * (eng.layout_fixed_s + 8 * eng.layout_per_node_s)
    )
    assert cost.accept_walk(p, P).seconds == pytest.approx(
        2 * (eng.accept_fixed_s + 8 * eng.accept_per_node_s)
    )
    assert cost.commit_glue(p, P).seconds == pytest.approx(2 * eng.commit_fixed_s)
    # the sort of the K = min(N, V) kept candidates grows with the budget
    sort8, sort64 = (cost.topk_sort(K2T, _point(budget=n, host="xeon-8480c"), P) for n in (8, 64))
    assert sort8.seconds == pytest.approx(eng.topk_fixed_s + 7 * 8 * eng.topk_per_candidate_s)
    assert sort64.seconds - sort8.seconds == pytest.approx(7 * 56 * eng.topk_per_candidate_s)
    chain = _point(policy=POLICIES["chain"], budget=7, host="xeon-8480c")
    assert cost.topk_sort(K2T, chain, P).seconds == pytest.approx(
        eng.topk_fixed_s + 7 * eng.topk_per_candidate_s
    )
    assert cost.framework_overhead(p, P).seconds == eng.step_overhead_s
    ar = cost.tp_allreduce(K2T, _point(), P, VERIFY)
    b300 = load_catalog()["b300"]
    want = 2 * 61 * (b300.allreduce_latency_s + 2 * 7 / 8 * 9 * 7168 * 2 / b300.link_bytes_per_s)
    assert ar.seconds == pytest.approx(want)


def test_a_faster_host_divides_the_host_costs_and_launches_only():
    P = params_at(default_params())
    # eager PyTorch's dispatch: host launches that run ahead of the GPU
    ref, desk = _point(host="xeon-8480c"), _point(host="desktop")
    speed = P["host_speed.desktop"]
    assert speed == pytest.approx(1.45)  # 5.5 / 3.8 GHz (assumed)
    a, b = step_cost(K2T, ref, P, 4.4), step_cost(K2T, desk, P, 4.4)
    for ca, cb in zip(a.components, b.components, strict=True):
        if ca.name.startswith(cost.EXPOSED_DISPATCH):  # max(0, launches / speed - device)
            stage = [c for c in b.components if c.stage is cb.stage and c.launches]
            device = sum(c.seconds for c in stage if c.bound in ("memory", "compute"))
            dispatch = sum(c.launches for c in stage) * P["eager.launch"] / speed
            assert cb.seconds == pytest.approx(max(0.0, dispatch - device)), ca.name
        elif ca.bound == "host":
            assert cb.seconds == pytest.approx(ca.seconds / speed), ca.name
        else:  # device work and links unchanged
            assert cb.seconds == pytest.approx(ca.seconds), ca.name
    assert ref.host_cpu == "xeon-8480c" and _point().host_cpu == "xeon-6776p"  # DGX B300
    # a graph's replayed kernels are the GPU's: the same on either host
    on = {
        h: step_cost(K2T, _point(host=h, engine="graphs"), P, 4.4)
        for h in ("xeon-8480c", "desktop")
    }
    launches = sum(c.launches for c in on["desktop"].components)
    host = sum(c.seconds for c in on["xeon-8480c"].components if c.bound == "host")
    saved = on["xeon-8480c"].step_s - on["desktop"].step_s
    assert saved == pytest.approx(host * (1 - 1 / speed)) and launches > 1000


def test_accept_reads_the_logits_once_per_token_not_per_request_squared():
    # the old accept term was C x T x 4 B with T = M x C: concurrency counted twice, no vocab
    P = params_at(default_params())
    one, four = (cost.accept(K2T, _point(concurrency=c), P) for c in (1, 4))
    assert four.hbm_bytes == pytest.approx(4 * one.hbm_bytes)
    assert one.hbm_bytes == 9 * 163840 * 4


def test_every_component_carries_a_stage_and_stages_cover_the_engine():
    P = params_at(default_params())
    comps = step_cost(K2T, _point(), P, 4.4).components
    assert {c.stage for c in comps} == set(STEP_STAGES)
    pre = cost.prefill_cost(K2T, _point(), P, 512)
    assert {c.stage for c in pre.components} == {Stage.PREFILL}
    assert pre.component("routed MoE").hbm_bytes == pytest.approx(
        60 * experts_touched(384, 8, 512) * EXPERT * 0.5625 / 8
    )


def test_ar_is_the_target_forward_at_m_1_and_the_overhead():
    P = params_at(default_params())
    ar = step_cost(K2T, _point().as_ar(), P, 1.0)
    assert {c.stage for c in ar.components} == {Stage.VERIFY, Stage.OTHER}
    assert ar.component("routed MoE").hbm_bytes == pytest.approx(60 * 8 * EXPERT * 0.5625 / 8)
    assert ar.point.verify_width == 1 and ar.point.drafter is None
    spec = step_cost(K2T, _point(), P, 4.4)
    assert spec.step_s > ar.step_s
    with pytest.raises(ValueError, match="ar step has budget 0"):
        _point(policy=POLICIES["ar"])
    with pytest.raises(ValueError, match="chain step has budget 7"):
        _point(policy=POLICIES["chain"], budget=8)


def test_graphs_profile_cuts_launches_not_device_time():
    P = params_at(default_params())
    eager = step_cost(K2T, _point(engine="eager", host="xeon-8480c"), P, 4.4)
    graphs = step_cost(K2T, _point(engine="graphs", host="xeon-8480c"), P, 4.4)
    assert graphs.step_s < eager.step_s
    assert graphs.hbm_bytes == eager.hbm_bytes
    launches = sum(c.launches for c in eager.components)
    # eager: the dispatch the device work does not hide; graphs: every launch, added
    exposed = sum(c.seconds for c in eager.components if c.name.startswith(cost.EXPOSED_DISPATCH))
    saved = (
        exposed
        - launches * P["graphs.launch"]
        + (P["eager.step_overhead"] - P["graphs.step_overhead"])
    )
    assert eager.step_s - graphs.step_s == pytest.approx(saved, rel=1e-6)


def test_eager_dispatch_runs_ahead_of_the_gpu_not_of_the_cpu():
    # Llama-3.1-8B at M = 1 on an A100, eager: 32 layers x 65 kernels + the head's 10 = 2,090
    # dispatches. At 10 us each (20.9 ms) they hide the weight reads of bf16 and int4 alike,
    # so the forward takes the dispatch and quantising does not speed it up; at 0.5 us (1 ms)
    # the bf16 reads (~8 ms) hide the dispatch instead. On a device without a GPU generation
    # (this machine's CPU) the host runs the kernels itself: launches add to the work.
    model = PRESETS["llama-3.1-8b"]
    int4 = dataclasses.replace(model, precision={**model.precision, "attention": "int4-g128",
                                                 "dense_mlp": "int4-g128"})  # fmt: skip
    a100 = load_catalog()["a100-sxm-80gb"]
    pt = _point("a100-sxm-80gb", tp=1, drafter=None, policy=POLICIES["ar"], budget=0)
    for launch, bound in ((10e-6, "dispatch"), (0.5e-6, "device")):
        P = {**params_at(default_params()), "eager.launch": launch}
        speed = host_speed(P, a100.host_cpu)
        times = {}
        for name, m in (("bf16", model), ("int4", int4)):
            c = step_cost(m, pt, P, 1.0)
            forward = [x for x in c.components if x.stage is Stage.VERIFY]
            device = sum(x.seconds for x in forward if x.bound in ("memory", "compute"))
            dispatch = sum(x.launches for x in forward) * launch / speed
            assert sum(x.launches for x in forward) == 32 * 65 + 10
            exposed = c.component(f"{cost.EXPOSED_DISPATCH} (verify)").seconds
            assert exposed == pytest.approx(max(0.0, dispatch - device))
            assert device + exposed == pytest.approx(max(device, dispatch))
            times[name] = c.step_s
        if bound == "dispatch":
            assert times["int4"] == pytest.approx(times["bf16"])
        else:
            assert times["int4"] < 0.6 * times["bf16"]
    cpu = dataclasses.replace(a100, generation="")
    P = {**params_at(default_params()), "eager.launch": 10e-6}
    on_cpu = step_cost(model, dataclasses.replace(pt, hardware=cpu), P, 1.0)
    assert not [x for x in on_cpu.components if x.name.startswith(cost.EXPOSED_DISPATCH)]
    head = on_cpu.component("LM head over M")
    assert head.seconds > 10 * 10e-6 / host_speed(P, cpu.host_cpu)  # its 10 launches inside


def test_routing_locality_worked_examples():
    # a chain of 16 at g = 0.5: 4 tokens' worth a request; a 16-node tree over 4 positions:
    # 4 siblings a position, each position 2 tokens' worth; one token a request: g does nothing
    assert cost.routed_tokens(16, 2, 0.5) == pytest.approx(8.0)
    assert cost.routed_tokens(16, 2, 0.5, depth=4) == pytest.approx(16.0)
    assert cost.routed_tokens(1, 3, 0.3, depth=8) == pytest.approx(3.0)
    assert cost.routed_tokens(9, 1, 1.0, depth=8) == pytest.approx(9.0)


def test_a_verify_touches_the_experts_of_its_routed_tokens_and_a_prompt_of_every_token():
    P = {**params_at(default_params()), "routing_locality": 0.5}
    # M = 9 verify tokens over the block's 8 positions: T = 9/8 x 8^0.5 = 3.18 tokens' worth
    t = 9 / 8 * 8**0.5
    moe = step_cost(K2T, _point(), P, 4.4).component("routed MoE")
    assert moe.hbm_bytes == pytest.approx(
        60 * experts_touched(384, 8, t) * EXPERT * 0.5625 / 8, rel=1e-9
    )
    assert moe.flops == pytest.approx(2 * 9 * 8 * EXPERT * 60 / 8)  # every token's FLOPs
    uniform = step_cost(K2T, _point(), {**P, "routing_locality": 1.0}, 4.4)
    # 24.9 experts a layer against 66.3 when the 9 tokens route independently
    assert moe.hbm_bytes / uniform.component("routed MoE").hbm_bytes == pytest.approx(
        24.88 / 66.28, rel=1e-3
    )
    # AR (one token) and a prompt (its tokens taken as independent) do not depend on g
    for p in (_point().as_ar(),):
        a, b = (step_cost(K2T, p, {**P, "routing_locality": g}, 1.0) for g in (0.5, 1.0))
        assert a.component("routed MoE").hbm_bytes == b.component("routed MoE").hbm_bytes
    a, b = (
        cost.prefill_cost(K2T, _point(), {**P, "routing_locality": g}, 512).component("routed MoE")
        for g in (0.5, 1.0)
    )
    assert a.hbm_bytes == b.hbm_bytes


def test_looped_moe_launches_per_touched_expert_only_in_eager_mode():
    # ddtree's own MoE (this machine's records) loops over touched experts when eager; its
    # compiled mode (read as the graphs profile) dispatches at a fixed shape, no per-expert ops
    P = {**params_at(default_params()), "routing_locality": 1.0}  # uniform: tokens independent
    looped = dataclasses.replace(load_catalog()["b300"], looped_moe=True)
    eager = step_cost(K2T, _point(hardware=looped), P).component("routed MoE")
    graphs = step_cost(K2T, _point(hardware=looped, engine="graphs"), P).component("routed MoE")
    fused = step_cost(K2T, _point(engine="graphs"), P).component("routed MoE")
    touched = experts_touched(K2T.n_routed_experts, K2T.top_k, 9)
    per_expert = cost.KERNELS["routed_moe_per_expert"] * touched / 8 * K2T.num_moe_layers
    assert eager.launches == pytest.approx(graphs.launches + per_expert)
    assert graphs.launches == pytest.approx(fused.launches)


def test_a_draft_vocabulary_costs_its_k_head_rows_and_a_top_k_over_k():
    # --draft-vocab 32768 on a DFlash drafter: its head reads and multiplies K x hidden, not
    # V x hidden; the top-k streams (B-1) x K float32 logits
    P = params_at(default_params())
    pt = _point(drafter=dataclasses.replace(DRAFTER, lm_head_vocab=32768))
    c = cost.drafter_forward(K2T, pt, P)
    head = 32768 * 7168
    assert c.hbm_bytes == pytest.approx(1.5e9 * 2 / 8 + 2048 * 12288 / 8 + head * 2 / 8, rel=1e-9)
    assert c.flops == pytest.approx(2 * 8 * 1.5e9 / 8 + 2 * 7 * head / 8, rel=1e-9)
    assert cost.topk(K2T, pt, P).hbm_bytes == pytest.approx(7 * 32768 * 4 * 3, rel=1e-9)


def test_a_scenarios_own_engine_keeps_its_base_profiles_dispatch(tmp_path):
    # [engine.mine] is a new name, built on the eager profile: its launches run ahead of the GPU
    # as eager's do; the built-in graphs profile's add to the device work
    from ddtree.perf.inputs.scenario import load_scenario

    case = '[[scenario]]\nname = "{0}"\nhardware = "b300"\nengine = "{0}"\nblock_size = 8\n'
    path = tmp_path / "own.toml"
    path.write_text(
        '[model]\npreset = "kimi-k2-thinking"\n[deployment]\ntp = 8\n'
        '[engine.mine]\nstep_overhead = "2 ms"\n'
        + (case + "budget = 8\ntau = 4\n").format("mine")
        + (case + "budget = 8\ntau = 4\n").format("graphs")
    )
    scenario = load_scenario(path)
    mine, graphs = (c.point for c in scenario.cases)
    assert mine.launches is cost.Launches.AHEAD and cost.dispatch_overlaps(mine)
    assert graphs.launches is cost.Launches.DEVICE and not cost.dispatch_overlaps(graphs)
    P = params_at(scenario.specs)
    exposed = {
        pt.engine: [c for c in step_cost(K2T, pt, P, 4.0).components
                    if c.name.startswith(cost.EXPOSED_DISPATCH)]
        for pt in (mine, graphs)
    }  # fmt: skip
    assert Stage.VERIFY in {c.stage for c in exposed["mine"]}
    assert exposed["graphs"] == []
