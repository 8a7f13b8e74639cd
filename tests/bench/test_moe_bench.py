import json

import pytest
import torch

from ddtree.bench.moe import (
    INT4_GROUP_SIZE,
    Int4Experts,
    MoeShape,
    PackedInt4,
    bench_moe,
    build_layer,
    dequant_int4,
    expected_experts_touched,
    experts_touched,
    fixed_weight_bytes,
    layer_expert_bytes,
    pack_int4,
    routed_expert_bytes,
    total_weight_bytes,
)
from ddtree.cli import main
from ddtree.records import read_records

TINY = MoeShape(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, top_k=2)


# --- INT4 pack / dequant ---------------------------------------------------------------------


def test_int4_round_trip_error_is_at_most_half_a_step_and_scales_are_group_max_over_7():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 128, generator=g) * torch.linspace(0.01, 3.0, 128)  # varied groups
    packed = pack_int4(w, INT4_GROUP_SIZE)
    assert packed.qweight.dtype == torch.uint8 and packed.qweight.shape == (3, 8, 64)
    assert packed.scales.shape == (3, 8, 128 // INT4_GROUP_SIZE)
    assert packed.shape == (3, 8, 128)
    amax = w.reshape(3, 8, 4, 32).abs().amax(-1)
    assert torch.equal(packed.scales, (amax / 7).to(torch.bfloat16))
    back = dequant_int4(packed, torch.float32)
    step = packed.scales.float().repeat_interleave(32, dim=-1)  # [3, 8, 128]
    # half a quantisation step, plus the bf16 rounding of the stored scale (clipping at +7)
    assert ((back - w).abs() <= step * 0.5 + w.abs() * 2**-7).all()
    in_bf16 = dequant_int4(packed)
    assert in_bf16.dtype == torch.bfloat16
    assert torch.allclose(in_bf16.float(), back, rtol=2**-7, atol=0)


def test_int4_values_on_the_grid_round_trip_exactly():
    q = torch.randint(-7, 8, (4, 64), generator=torch.Generator().manual_seed(1)).float()
    q[:, 0::32] = 7  # each group's max |q| is 7, so its scale is exactly 0.25
    packed = pack_int4(q * 0.25, 32)
    assert torch.equal(packed.scales.float(), torch.full((4, 2), 0.25))
    assert torch.equal(dequant_int4(packed, torch.float32), q * 0.25)


def test_int4_nibble_layout_worked_example():
    # q = [-8, 7, 0, -1] -> bytes [0 | 15 << 4, 8 | 7 << 4] = [240, 120]
    packed = PackedInt4(
        torch.tensor([[240, 120]], dtype=torch.uint8), torch.ones(1, 1, dtype=torch.bfloat16), 4
    )
    assert dequant_int4(packed, torch.float32).tolist() == [[-8.0, 7.0, 0.0, -1.0]]
    again = pack_int4(torch.tensor([[-7.0, 7.0, 0.0, -1.0]]), 4)  # max |w| = 7: scale 1
    assert again.scales.tolist() == [[1.0]]
    assert again.qweight.tolist() == [[1 | 15 << 4, 8 | 7 << 4]]


def test_int4_zero_group_and_bad_shapes():
    packed = pack_int4(torch.zeros(2, 32))
    assert torch.equal(dequant_int4(packed, torch.float32), torch.zeros(2, 32))
    with pytest.raises(ValueError, match="not a multiple of group_size=32"):
        pack_int4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="even number"):
        pack_int4(torch.zeros(2, 48), 3)


# --- layer, bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bfloat16", "int4"])
def test_bytes_per_expert_formula_matches_the_stored_tensors(precision):
    layer = build_layer(TINY, precision=precision)
    assert layer_expert_bytes(layer) == routed_expert_bytes(TINY, precision)
    shared, router = fixed_weight_bytes(TINY)
    assert shared == sum(p.nbytes for p in layer.shared_experts.parameters())
    assert router == layer.gate.weight.nbytes + layer.gate.e_score_correction_bias.nbytes
    assert total_weight_bytes(TINY, precision) == 16 * layer_expert_bytes(layer) + shared + router


def test_int4_layer_holds_no_bf16_experts_and_stays_close_to_bf16():
    bf16 = build_layer(TINY, precision="bfloat16")
    int4 = build_layer(TINY, precision="int4")
    assert isinstance(int4.experts, Int4Experts)
    assert not list(int4.experts.parameters())
    assert int4.experts.gate_up_proj.shape == bf16.experts.gate_up_proj.shape
    e = 3
    want = dequant_int4(pack_int4(bf16.experts.down_proj[e].detach()))
    assert torch.equal(int4.experts.down_proj[e], want)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        ref, got = bf16(x).float(), int4(x).float()
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < 0.2
    assert torch.equal(bf16.gate(x)[1], int4.gate(x)[1])  # same router: same experts


def test_uniform_formula_limits_and_simulation():
    assert expected_experts_touched(384, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(384, 8, 10_000) == pytest.approx(384)
    values = [expected_experts_touched(16, 2, m) for m in (1, 2, 4, 8, 16, 32)]
    assert values == sorted(values) and values[-1] <= 16
    g = torch.Generator().manual_seed(3)
    trials = [
        torch.rand(5, 16, generator=g).topk(2, dim=1)[1].unique().numel() for _ in range(4000)
    ]  # each token picks 2 distinct experts uniformly
    assert sum(trials) / len(trials) == pytest.approx(expected_experts_touched(16, 2, 5), rel=0.02)


def test_touched_experts_nest_with_the_tokens():
    layer = build_layer(TINY)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.inference_mode():
        counts = [experts_touched(layer.gate, x[:m]) for m in range(1, 65)]
    assert counts[0] == 2
    assert all(a <= b for a, b in zip(counts, counts[1:], strict=False))
    assert all(2 <= c <= min(16, 2 * m) for m, c in zip(range(1, 65), counts, strict=True))


def test_bench_points_count_bytes_by_the_formula():
    layer = build_layer(TINY, precision="int4")
    ms = [1, 4, 32]
    points = list(bench_moe(layer, TINY, ms, peak_bytes_per_s=1e10, repeats=3, warmup=1))
    assert [p.m for p in points] == ms
    per_expert = routed_expert_bytes(TINY, "int4")
    shared, router = fixed_weight_bytes(TINY)
    for p in points:
        assert 2 <= p.experts_touched <= min(16, 2 * p.m)
        assert p.experts_touched_uniform == pytest.approx(expected_experts_touched(16, 2, p.m))
        assert p.routed_weight_bytes == round(p.experts_touched * per_expert)
        assert p.fixed_weight_bytes == shared + router
        assert p.activation_bytes == 2 * p.m * 64 * 2
        assert p.bytes_moved == p.routed_weight_bytes + p.fixed_weight_bytes + p.activation_bytes
        assert p.bytes_per_s == pytest.approx(p.bytes_moved / p.s_per_layer)
        assert p.fraction_of_peak == pytest.approx(p.bytes_per_s / 1e10)
        assert p.p10_s <= p.s_per_layer <= p.p90_s
    assert points[0].experts_touched == 2


def test_shape_from_hf_config():
    cfg = {
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.827,
        "quantization_config": {"group_size": 32},
    }
    shape = MoeShape.from_hf({"text_config": cfg}, "k2/config.json")
    assert (shape.hidden_size, shape.n_routed_experts, shape.top_k) == (7168, 384, 8)
    assert total_weight_bytes(shape, "int4") < total_weight_bytes(shape, "bfloat16") / 3
    with pytest.raises(ValueError, match="k2/config.json: field model_type='llama'"):
        MoeShape.from_hf({**cfg, "model_type": "llama"}, "k2/config.json")
    with pytest.raises(ValueError, match="k2/config.json: missing field n_routed_experts"):
        MoeShape.from_hf(
            {k: v for k, v in cfg.items() if k != "n_routed_experts"}, "k2/config.json"
        )
    with pytest.raises(ValueError, match="top_k=9 exceeds n_routed_experts=8"):
        MoeShape(64, 32, 8, 9)


# --- command -------------------------------------------------------------------------------

TINY_ARGS = [
    "--hidden",
    "64",
    "--moe-intermediate",
    "32",
    "--experts",
    "16",
    "--experts-per-token",
    "2",
]
TINY_ARGS += ["--ms", "1,8", "--repeats", "2", "--device", "cpu"]


def test_command_writes_bench_moe_records(tmp_path, capsys):
    out = tmp_path / "moe.jsonl"
    argv = ["bench", "moe", *TINY_ARGS, "--peak-bytes-per-s", "2e10", "--records", str(out)]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # stdout: the JSON document alone
    assert data["bench"] == "moe" and len(data["results"]) == 2
    records = read_records(out, kind="bench_moe")
    assert [r.config["precision"] for r in records] == ["bfloat16", "int4"]
    for r in records:
        assert r.config["n_routed_experts"] == 16 and r.config["top_k"] == 2
        assert {"load_avg_1min", "omp_wait_policy", "threads"} <= set(r.config)
        assert r.summary["peak_bytes_per_s"] == 2e10
        assert [p["m"] for p in r.points] == [1, 8]
        need = {"m", "s_per_layer", "experts_touched", "bytes_moved", "bytes_per_s"}
        assert need | {"fraction_of_peak"} <= set(r.points[0])
    assert records[1].config["group_size"] == 32 and records[0].config["group_size"] is None


def test_command_takes_the_peak_from_bandwidth_records_and_a_config_file(tmp_path, capsys):
    bw = tmp_path / "bw.jsonl"
    assert (
        main(
            [
                "bench",
                "bandwidth",
                "--device",
                "cpu",
                "--sizes-mib",
                "1",
                "--repeats",
                "1",
                "--records",
                str(bw),
            ]
        )
        == 0
    )
    read_peak = next(r for r in read_records(bw) if r.config["method"] == "read")
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "deepseek_v3",
                "hidden_size": 64,
                "moe_intermediate_size": 32,
                "n_routed_experts": 16,
                "num_experts_per_tok": 2,
                "n_shared_experts": 0,
            }
        )
    )
    out = tmp_path / "moe.jsonl"
    argv = [
        "bench",
        "moe",
        "--config",
        str(tmp_path),
        "--ms",
        "2",
        "--repeats",
        "1",
        "--precisions",
        "int4",
        "--device",
        "cpu",
        "--bandwidth-records",
        str(bw),
        "--records",
        str(out),
    ]
    assert main(argv) == 0
    (record,) = read_records(out)
    assert record.summary["peak_bytes_per_s"] == read_peak.summary["bytes_per_s"]
    assert str(bw) in record.summary["peak_source"]
    assert record.config["model_source"] == str(cfg) and record.config["n_shared_experts"] == 0


def test_command_errors_name_the_problem(tmp_path, capsys):
    huge = ["--hidden", "7168", "--moe-intermediate", "2048", "--experts", "100000"]
    assert main(["bench", "moe", *huge, "--peak-bytes-per-s", "1e9", "--device", "cpu"]) == 2
    assert "GiB" in capsys.readouterr().err
    assert main(["bench", "moe", "--config", str(tmp_path / "nope.json"), "--device", "cpu"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["bench", "moe", *TINY_ARGS, "--bandwidth-records", str(tmp_path / "x")]) == 2
    assert "no such records file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "moe", "--precisions", "fp8"])
    assert "fp8" in capsys.readouterr().err
