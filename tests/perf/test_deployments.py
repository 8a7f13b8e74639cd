"""Deployments in the cost model (TP, TP attention + EP experts, DP attention + EP with
all-to-all), the busiest-GPU expert statistics, and measured all-reduce anchors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from ddtree.perf.cost.step import (
    DEPLOYMENTS,
    EXPOSED_DISPATCH,
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
from ddtree.perf.hardware.catalog import load_catalog, this_machine
from ddtree.perf.inputs.fromrecords import anchors_from_records, measured_links
from ddtree.perf.inputs.scenario import ScenarioError, load_scenario
from ddtree.perf.shapes.model import PRESETS
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
        elif a.name.startswith(EXPOSED_DISPATCH):  # more device work hides more of the dispatch
            assert b.seconds <= a.seconds
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


# ---- groups that span nodes --------------------------------------------------------------


def test_allreduce_bytes_in_a_node_and_between_nodes():
    from ddtree.perf.cost.step import allreduce_bytes
    from ddtree.perf.hardware.catalog import load_links

    h100 = load_catalog()["h100-sxm"]
    one = dataclasses.replace(point(hw="h100-sxm"), hardware=h100)
    assert allreduce_bytes(one, 14e3) == (pytest.approx(2 * 7 / 8 * 14e3), 0.0)
    two = dataclasses.replace(one, tp=16, inter_node=load_links()["ib-ndr"])
    assert (two.per_node, two.nodes) == (8, 2)
    # the docstring's example: TP 16 as 2 x 8, S = 14 kB -> 24.5 kB in the node, 1.75 kB out
    assert allreduce_bytes(two, 14e3) == (pytest.approx(24.5e3), pytest.approx(1.75e3))


def test_tp16_over_infiniband_pays_the_link_between_nodes():
    from ddtree.perf.hardware.catalog import load_links

    ds = PRESETS["deepseek-v3"]
    h100 = load_catalog()["h100-sxm"]
    ib = load_links()["ib-ndr"]
    tp8 = point(hw="h100-sxm").as_ar()
    tp16 = dataclasses.replace(tp8, tp=16, inter_node=ib)
    ar8 = step_cost(ds, tp8, P).component("TP all-reduce")
    ar16 = step_cost(ds, tp16, P).component("TP all-reduce")
    S = 1 * ds.hidden_size * 2.0  # M = 1, C = 1, bf16
    want16 = 2 * 61 * (ib.allreduce_latency_s + 2 * 7 / 8 * S / h100.link_bytes_per_s
                       + 2 * 1 / 2 * S / 8 / ib.bytes_per_s)  # fmt: skip
    assert float(ar16.seconds) == pytest.approx(want16)
    assert float(ar16.seconds) > 2 * float(ar8.seconds)  # 25 us a collective, not NVLink's 8
    assert "InfiniBand NDR" in ar16.rule and "2 nodes of 8 GPUs" in ar16.rule


SPAN = """
[model]
preset = "deepseek-v3"
[deployment]
tp = {tp}
engine = "graphs"
policy = "ar"
{extra}
[[scenario]]
name = "s"
hardware = "h100-sxm"
"""


@pytest.mark.parametrize(
    "tp,extra,message",
    [
        (16, "", "tp 16 spans 2 nodes of 8 GPUs (h100-sxm); name the link between them with "
                 "inter_node = one of ib-ndr"),
        (12, 'inter_node = "ib-ndr"', "tp: 12 GPUs do not fill whole nodes of 8"),
        (16, 'inter_node = "ib-fast"', "inter_node: 'ib-fast'; known links: ib-ndr"),
    ],
)  # fmt: skip
def test_a_group_across_nodes_must_name_its_link(tmp_path, tp, extra, message):
    path = tmp_path / "s.toml"
    path.write_text(SPAN.format(tp=tp, extra=extra))
    with pytest.raises(ScenarioError, match="s.toml") as exc:
        load_scenario(path)
    assert message in str(exc.value)


def test_a_file_can_define_its_own_link_and_node_size(tmp_path):
    path = tmp_path / "s.toml"
    text = SPAN.format(tp=16, extra='inter_node = "slow"\ngpus_per_node = 4')
    text += '[link.slow]\nbandwidth = "10 GB/s"\nallreduce_latency = "50 us"\n'
    path.write_text(text)
    pt = load_scenario(path).cases[0].point
    assert (pt.per_node, pt.nodes, pt.inter_node.bytes_per_s) == (4, 4, 10e9)
    assert pt.inter_node.provenance["bandwidth"].kind == "user"


# ---- attention TP with the experts as MoE TP x EP -------------------------------------------


def test_moe_tp_by_ep_reads_between_pure_tp_and_pure_ep():
    from ddtree.perf.cost.step import mixed_deployment

    tokens = 9  # M = 9 at C = 1
    uniform = {**P, "routing_locality": 1.0}  # the 9 tokens route independently
    mixed = dataclasses.replace(point(), deployment=mixed_deployment(2, 4))
    assert (mixed.experts_ep, mixed.experts_tp) == (4, 2)
    moe = step_cost(K2T, mixed, uniform).component("routed MoE")
    ep4_bytes, _, _ = expert_parallel_moe_layer(K2T, tokens, 4)
    assert moe.hbm_bytes == pytest.approx(K2T.num_moe_layers * ep4_bytes / 2)
    tp_bytes = step_cost(K2T, point("tp"), uniform).component("routed MoE").hbm_bytes
    ep_bytes = step_cost(K2T, point("tp-ep"), uniform).component("routed MoE").hbm_bytes
    # 66.3 of 384 experts touched: 8.3 per GPU split evenly, 12.1 on the busiest of 8 groups;
    # 4 groups of 96 experts, each split over 2 GPUs, sit in between
    assert tp_bytes < moe.hbm_bytes < ep_bytes
    # the collectives are the TP layer's: 2 all-reduces per layer, no all-to-all
    cost = step_cost(K2T, mixed, uniform)
    assert "EP all-to-all" not in [c.name for c in cost.components]
    assert cost.component("TP all-reduce").seconds == pytest.approx(
        step_cost(K2T, point("tp"), uniform).component("TP all-reduce").seconds
    )


MIXED = """
[model]
preset = "deepseek-v3"
[[scenario]]
name = "s"
hardware = "b200"
policy = "ar"
tp = 8
parallel = {parallel}
"""


@pytest.mark.parametrize(
    "parallel,message",
    [
        ('{ attention = "tp", moe_tp = 2, moe_ep = 2 }',
         "moe_tp x moe_ep = 2 x 2 = 4; it must equal tp = 8"),
        ('{ attention = "dp", moe_ep = 8 }', "a table takes tensor-parallel attention"),
        ("{ moe_tp = 8, ep = 1 }", "unknown field(s) ep"),
        ('"ep"', "parallel: 'ep'; expected one of tp, tp-ep, dp-ep or a table"),
    ],
)  # fmt: skip
def test_bad_parallel_tables_name_the_field(tmp_path, parallel, message):
    path = tmp_path / "s.toml"
    path.write_text(MIXED.format(parallel=parallel))
    with pytest.raises(ScenarioError, match="s.toml") as exc:
        load_scenario(path)
    assert message in str(exc.value)


def test_a_parallel_table_reads(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(MIXED.format(parallel='{ attention = "tp", moe_tp = 2, moe_ep = 4 }'))
    pt = load_scenario(path).cases[0].point
    assert (pt.experts_tp, pt.experts_ep, pt.weight_shards) == (2, 4, 8)
    assert pt.deployment.name == "tp-attention, MoE TP2 x EP4"


def test_a_deployment_names_its_host_cpu(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(MIXED.format(parallel='"tp"') + 'host_cpu = "desktop"\n')
    pt = load_scenario(path).cases[0].point
    assert (pt.host_cpu, pt.hardware.host_cpu) == ("desktop", "xeon-8570")
    path.write_text(MIXED.format(parallel='"tp"') + 'host_cpu = "m3-max"\n')
    with pytest.raises(ScenarioError, match="host_cpu: 'm3-max'; known host classes: xeon-8480c"):
        load_scenario(path)
    path.write_text(MIXED.format(parallel='"tp"') + 'host_cpu = "grace"\n')
    from ddtree.cli import main

    assert main(["estimate", str(path), "--explain", "--samples", "200"]) == 0
    assert "host CPU: NVIDIA Grace" in capsys.readouterr().out
