import dataclasses

import numpy as np
import pytest

from ddtree.perf.catalog import load_catalog, with_bandwidth
from ddtree.perf.cost import (
    Drafter,
    Point,
    amdahl,
    default_params,
    experts_touched,
    moe_layer_s,
    params_at,
    step_cost,
    tokens_per_s,
)
from ddtree.perf.model import PRESETS

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
        engine="python",
        drafter=DRAFTER,
    )
    base.update(kw)
    return Point(**base)


def test_experts_touched_formula():
    # E(1-(1-k/E)^T): REFERENCE.md B6 gives Kimi 8 -> 59.5, 16 -> 110; DeepSeek 8 -> 57
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
    a = step_cost(K2T, _point(), P, 4.4)
    b = step_cost(K2T, _point(hardware=with_bandwidth(hw, 2 * hw.hbm_bytes_per_s)), P, 4.4)
    launch = P["python.launch"]
    for ca, cb in zip(a.components, b.components, strict=True):
        if ca.bound == "memory":
            ta, tb = ca.seconds - ca.launches * launch, cb.seconds - cb.launches * launch
            assert tb == pytest.approx(ta / 2), ca.name
        elif ca.bound in ("host", "link"):
            assert cb.seconds == pytest.approx(ca.seconds), ca.name
    assert b.limit_step_s == pytest.approx(a.limit_step_s / 2)


def test_moe_grows_with_verify_width_and_tp_splits_weights():
    P = params_at(default_params())
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
    cost = step_cost(K2T, _point(), P, 4.4)
    assert np.shape(cost.step_s) == (3,)
    assert cost.step_s[0] > cost.step_s[1] > cost.step_s[2]


def test_native_engine_only_changes_host_terms():
    P = params_at(default_params())
    py = step_cost(K2T, _point(engine="python"), P)
    nat = step_cost(K2T, _point(engine="native"), P)
    assert nat.step_s < py.step_s
    assert nat.hbm_bytes == py.hbm_bytes


def test_amdahl_flags_overheads_on_fast_hardware():
    P = params_at(default_params())
    P["python.step_overhead"] = 0.02
    a = amdahl(step_cost(K2T, _point(), P, 4.4), P, 4.4)
    assert a.overhead_fraction > 0.5 and "overheads dominate" in a.statement
    assert a.limit_tokens_per_s > 4.4 / step_cost(K2T, _point(), P).step_s
    low = dataclasses.replace(_point(), engine="native")
    b = amdahl(step_cost(K2T, low, P, 4.4), P, 4.4)
    assert b.overhead_fraction < a.overhead_fraction
