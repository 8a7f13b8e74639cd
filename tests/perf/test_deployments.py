"""Deployments in the cost model (TP, TP attention + EP experts, DP attention + EP with
all-to-all), the busiest-GPU expert statistics, and measured all-reduce anchors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from ddtree.perf.catalog import load_catalog, this_machine
from ddtree.perf.cost import (
    DEPLOYMENTS,
    Drafter,
    Point,
    collectives_per_forward,
    default_params,
    expected_max_binomial,
    expert_parallel_moe_layer,
    params_at,
    routed_moe_layer,
    step_cost,
)
from ddtree.perf.fromrecords import anchors_from_records, measured_links
from ddtree.perf.model import PRESETS
from ddtree.perf.scenario import ScenarioError, load_scenario
from ddtree.records import BenchAllreduce, BenchBandwidth, HardwareInfo

K2T = PRESETS["kimi-k2-thinking"]
P = params_at(default_params())


def point(parallel="tp", concurrency=1, hw="b300", **kw):
    return Point(
        hardware=kw.pop("hardware", None) or load_catalog()[hw],
        tp=8,
        concurrency=concurrency,
        context_tokens=2048,
        block_size=8,
        budget=8,
        engine="eager",
        drafter=Drafter(params=1.5e9, layers=3, kv_bytes_per_token=12288),
        deployment=DEPLOYMENTS[parallel],
        **kw,
    )


def test_collectives_per_forward():
    assert collectives_per_forward(K2T, DEPLOYMENTS["tp"]).all_reduce == 2 * 61
    assert collectives_per_forward(K2T, DEPLOYMENTS["tp-ep"]).all_reduce == 2 * 61
    dp = collectives_per_forward(K2T, DEPLOYMENTS["dp-ep"])
    assert (dp.all_reduce, dp.all_to_all) == (0, 2 * 60)  # first layer dense: no dispatch


@pytest.mark.parametrize(
    "n,p,groups", [(1, 0.5, 2), (48, 0.17, 8), (48, 0.9, 8), (30, 0.3, 3), (9000, 0.125, 8)]
)
def test_expected_max_binomial_against_sampling(n, p, groups):
    rng = np.random.default_rng(0)
    sampled = rng.binomial(n, p, size=(200_000, groups)).max(axis=1).mean()
    sd = math.sqrt(n * p * (1 - p))
    assert expected_max_binomial(n, p, groups) == pytest.approx(sampled, abs=0.01 * sd + 0.01)
    assert expected_max_binomial(1, 0.5, 2) == 0.75  # the docstring's example


def test_busiest_gpu_reads_more_experts_than_an_even_split():
    """The docstring's example (Kimi, T = 9, 8 GPUs: 12.1 experts on the busiest GPU, 8.3 on
    average); the gap closes when every expert is touched (C = 64)."""
    per_expert = K2T.expert_params * K2T.bytes_per_param("routed_experts")
    ep_bytes, ep_flops, _ = expert_parallel_moe_layer(K2T, 9, 8)
    tp_bytes, tp_flops, _ = routed_moe_layer(K2T, 9, 8)
    assert ep_bytes / per_expert == pytest.approx(12.14, abs=0.01)
    assert tp_bytes / per_expert == pytest.approx(8.29, abs=0.01)
    assert ep_flops > tp_flops
    ep_bytes, _, _ = expert_parallel_moe_layer(K2T, 9 * 64, 8)
    assert ep_bytes / per_expert == pytest.approx(48, abs=1e-6)


def test_tp_ep_costs_like_tp_but_for_the_experts():
    tp, ep = step_cost(K2T, point("tp"), P, 4.4), step_cost(K2T, point("tp-ep"), P, 4.4)
    for a, b in zip(tp.components, ep.components, strict=True):
        if a.name == "routed MoE":
            assert b.seconds > a.seconds
        else:
            assert b.seconds == pytest.approx(a.seconds), a.name


def test_dp_attention_replicates_weights_and_swaps_the_all_reduce_for_all_to_all():
    tp, dp = step_cost(K2T, point("tp"), P, 4.4), step_cost(K2T, point("dp-ep"), P, 4.4)
    names = [c.name for c in dp.components]
    assert "EP all-to-all" in names and not [n for n in names if n.startswith("TP ")]
    assert dp.component("LM head over M").hbm_bytes == pytest.approx(
        8 * tp.component("LM head over M").hbm_bytes
    )
    # at C = 64 each GPU's host serves 8 requests, not 64
    tp64, dp64 = step_cost(K2T, point("tp", 64), P, 4.4), step_cost(K2T, point("dp-ep", 64), P, 4.4)
    assert dp64.component("tree build").seconds == pytest.approx(
        tp64.component("tree build").seconds / 8
    )
    # dispatch + combine of 9 x 8 tokens' k = 8 copies, 7/8 of them remote, bf16
    a2a = dp64.component("EP all-to-all")
    hw = load_catalog()["b300"]
    per = hw.allreduce_latency_s * P["allreduce_scale.nvlink"] + (
        9 * 8 * 8 * 7 / 8 * 7168 * 2 / hw.link_bytes_per_s
    )
    assert a2a.seconds == pytest.approx(2 * 60 * per)


def test_scenario_parallel_field(tmp_path):
    text = """
[model]
preset = "kimi-k2-thinking"
[deployment]
tp = 8
parallel = "{parallel}"
[[scenario]]
name = "x"
hardware = "b300"
block_size = 8
budget = 8
tau = 4
"""
    good = tmp_path / "good.toml"
    good.write_text(text.format(parallel="dp-ep"))
    assert load_scenario(good).cases[0].point.deployment is DEPLOYMENTS["dp-ep"]
    bad = tmp_path / "bad.toml"
    bad.write_text(text.format(parallel="zigzag"))
    with pytest.raises(ScenarioError, match=r"scenario\[0\] \(x\)\.parallel: 'zigzag'; expected"):
        load_scenario(bad)


def _allreduce_record(device="cpu", gpu_name=None, latency_s=400e-6, bus=0.4e9):
    hw = HardwareInfo(cpu_model="test cpu", cpu_cores=2, gpu_name=gpu_name, gpu_count=8)
    return BenchAllreduce(
        hardware=hw,
        device=device,
        backend="gloo" if device == "cpu" else "nccl",
        world_size=2 if device == "cpu" else 8,
        dtype="bf16",
        hidden_size=7168,
        latency_s=latency_s,
        bus_bytes_per_s=bus,
        points=[{"bytes": 14336, "seconds": 4e-4}, {"bytes": 14680064, "seconds": 0.037}],
    )


def test_this_machines_all_reduce_is_measured():
    """A bench_allreduce record on the CPU gives this machine its link: the TP all-reduce
    uses the measured latency as it is (no assumed scale)."""
    bw = BenchBandwidth(
        hardware=HardwareInfo(cpu_model="test cpu", cpu_cores=2),
        device="cpu",
        method="copy",
        bytes_per_s=10e9,
    )
    assert this_machine([bw]).allreduce_latency_s == 0.0
    _, machine = anchors_from_records([bw, _allreduce_record()])
    assert machine.allreduce_latency_s == 400e-6 and machine.link_bytes_per_s == 0.4e9
    assert machine.provenance["allreduce_latency"].kind == "measured"
    pt = dataclasses.replace(point(hardware=machine), tp=2)
    for scale in (0.5, 4.0):
        params = {**P, **{f"allreduce_scale.{k}": scale for k in ("pcie", "nvlink", "fabric")}}
        cost = step_cost(K2T, pt, params, 4.4)
        ar = cost.component("TP all-reduce")
        assert ar.seconds == pytest.approx(2 * 61 * (400e-6 + 9 * 7168 * 2 / 0.4e9))
        assert "measured" in ar.rule
        # rank 0's header + payload broadcasts for the verify and for the commit
        for name in ("TP control broadcasts", "TP control broadcasts (commit)"):
            assert cost.component(name).seconds == pytest.approx(2 * 400e-6)
    one_gpu = step_cost(K2T, dataclasses.replace(pt, tp=1), P, 4.4)
    assert not [c for c in one_gpu.components if c.name.startswith("TP ")]


def test_a_gpu_run_replaces_the_catalog_link():
    links = measured_links([_allreduce_record("cuda", "NVIDIA B300 SXM6 AC", 12e-6, 350e9)])
    b300 = links["b300"]
    assert (b300.allreduce_latency_s, b300.link_bytes_per_s) == (12e-6, 350e9)
    assert b300.provenance["link_bandwidth"].kind == "measured"
    assert b300.hbm_bytes_per_s == load_catalog()["b300"].hbm_bytes_per_s
