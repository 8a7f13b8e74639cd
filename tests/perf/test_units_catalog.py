import pytest

from ddtree.perf.hardware import units as u
from ddtree.perf.hardware.catalog import (
    CatalogError,
    hardware_from_dict,
    link_from_dict,
    load_catalog,
    load_links,
    match_gpu,
    this_machine,
)
from ddtree.perf.shapes.model import PRESETS, ModelError, load_model, shape_from_config
from ddtree.records import BenchBandwidth, HardwareInfo


@pytest.mark.parametrize(
    "text,dim,value",
    [
        ("8 TB/s", u.BANDWIDTH, 8e12),
        ("1.8 TB/s", u.BANDWIDTH, 1.8e12),
        ("900 GB/s", u.BANDWIDTH, 9e11),
        ("14.5 ms", u.STEP_TIME, 0.0145),
        ("14.5 ms/step", u.STEP_TIME, 0.0145),
        ("303 tok/s", u.TOKEN_RATE, 303.0),
        ("2.2 PFLOP/s", u.FLOP_RATE, 2.2e15),
        ("989 TFLOPS", u.FLOP_RATE, 9.89e14),
        ("96 GB", u.BYTES, 96e9),
        ("275040 MiB", u.BYTES, 275040 * 2**20),
        ("3 µs", u.TIME, 3e-6),
        ("3 us", u.TIME, 3e-6),
        (4.4, u.TOKENS_PER_STEP, 4.4),
        ("70%", u.NUMBER, 0.7),
    ],
)
def test_parse_quantities_in_si(text, dim, value):
    assert u.parse_quantity(text, dim, "f") == pytest.approx(value, rel=1e-12)


def test_tera_is_decimal():
    assert u.parse_quantity("1 TB", u.BYTES, "f") == 1e12
    assert u.parse_quantity("1 TiB", u.BYTES, "f") == 2.0**40


@pytest.mark.parametrize(
    "text,dim,needle",
    [
        ("3.3 ms/tok", u.STEP_TIME, "per token"),
        ("8 TB", u.BANDWIDTH, "expected a bandwidth"),
        (8, u.BANDWIDTH, "unit written out"),
        ("8 Tb/s", u.BANDWIDTH, "bits"),
        ("fast", u.BANDWIDTH, "cannot read"),
        ("303 tok/s", u.STEP_TIME, "expected a time per step"),
    ],
)
def test_wrong_dimension_is_an_error_naming_the_field(text, dim, needle):
    with pytest.raises(u.UnitError) as exc:
        u.parse_quantity(text, dim, "scenario.toml: hardware.x.hbm_bandwidth")
    assert "scenario.toml: hardware.x.hbm_bandwidth" in str(exc.value)
    assert needle in str(exc.value)


def test_format_round_trip():
    assert u.format_quantity(8e12, u.BANDWIDTH) == "8 TB/s"
    assert u.format_quantity(0.0145, u.TIME) == "14.5 ms"
    assert u.parse_quantity(u.format_quantity(2.25e15, u.FLOP_RATE), u.FLOP_RATE, "f") == 2.25e15


def test_catalog_has_every_gpu_with_a_source_for_every_figure():
    cat = load_catalog()
    want = {"rtx-pro-6000", "h100-sxm", "h200", "b200", "b300", "gb300", "mi300x", "mi355x",
            "h20", "a100-sxm-80gb", "h100-pcie", "h100-nvl", "l40s", "gb200", "mi325x",
            "rtx-5090"}  # fmt: skip
    assert want <= set(cat)
    for key, hw in cat.items():
        figures = ["hbm_bandwidth", "memory", "link_bandwidth", "allreduce_latency"]
        figures += [f"{p}_dense" for p in hw.dense_flops] + [f"{p}_sparse" for p in hw.sparse_flops]
        for f in figures:
            prov = hw.provenance[f]
            assert prov.kind in ("catalog", "assumed"), (key, f)
            assert prov.source, (key, f)
        # the smallest: L4 300 GB/s, T4 65 TF (FP16: no BF16, which runs at the FP16 rate)
        assert hw.hbm_bytes_per_s >= 3e11 and hw.peak_flops("bf16") >= 6.5e13
    # the issue-18 additions, as their datasheets give them (per GPU, dense)
    assert cat["h20"].hbm_bytes_per_s == 4e12 and cat["h20"].dense_flops["bf16"] == 148e12
    assert cat["l40s"].hbm_bytes_per_s == 864e9 and cat["l40s"].interconnect.startswith("PCIe 4")
    assert cat["h100-pcie"].dense_flops["bf16"] * 2 == cat["h100-pcie"].sparse_flops["bf16"]
    assert cat["gb200"].gpus_per_node == 72 and cat["h100-sxm"].gpus_per_node == 8
    assert cat["mi325x"].memory_bytes == 256e9 and cat["rtx-5090"].hbm_bytes_per_s == 1.792e12


def test_inter_node_links_have_sources():
    links = load_links()
    assert {"ib-ndr", "ib-xdr", "roce-400g"} <= set(links)
    assert links["ib-ndr"].bytes_per_s == 50e9 and links["ib-xdr"].bytes_per_s == 100e9
    for link in links.values():
        assert all(p.source for p in link.provenance.values()), link.key
    with pytest.raises(CatalogError, match="s.toml: link.x needs 'allreduce_latency'"):
        link_from_dict("x", {"bandwidth": "50 GB/s"}, "s.toml")


@pytest.mark.parametrize(
    "device,key",
    [("NVIDIA H20", "h20"), ("NVIDIA L40S", "l40s"), ("NVIDIA GeForce RTX 5090", "rtx-5090"),
     ("AMD Instinct MI325X", "mi325x")],
)  # fmt: skip
def test_new_entries_match_their_device_names(device, key):
    assert match_gpu(device).key == key


def test_dense_and_sparse_kept_apart():
    cat = load_catalog()
    assert cat["b300"].dense_flops["fp4"] == pytest.approx(13.125e15)
    assert cat["b300"].sparse_flops["fp4"] == pytest.approx(18e15)
    h100 = cat["h100-sxm"]
    assert h100.dense_flops["bf16"] * 2 == pytest.approx(h100.sparse_flops["bf16"], rel=1e-3)
    # an int4 weight-only kernel computes in bf16: no fp4 figure on H100 -> fp8 -> bf16 fallback
    assert cat["h100-sxm"].peak_flops("fp4") == cat["h100-sxm"].dense_flops["fp8"]


def test_user_hardware_overrides_a_base_and_is_labelled_user():
    base = load_catalog()["b300"]
    hw = hardware_from_dict(
        "b300-slow", {"hbm_bandwidth": "6 TB/s"}, "s.toml", base=base, default_kind="user"
    )
    assert hw.hbm_bytes_per_s == 6e12 and hw.dense_flops == base.dense_flops
    assert hw.provenance["hbm_bandwidth"].kind == "user"
    with pytest.raises(CatalogError, match=r"s.toml: hardware.x.hbm_bandwidth.*bandwidth"):
        hardware_from_dict("x", {"hbm_bandwidth": "6 TB", "bf16_dense": "1 PFLOP/s"}, "s.toml")
    with pytest.raises(CatalogError, match="unknown field"):
        hardware_from_dict("x", {"hbm_bw": "6 TB/s"}, "s.toml")


def test_presets_match_reference_arithmetic():
    k2t = PRESETS["kimi-k2-thinking"]
    assert k2t.expert_params == 3 * 7168 * 2048
    assert k2t.attention_params_per_layer == pytest.approx(101.1e6, rel=1e-3)
    assert k2t.active_params() == pytest.approx(31.5e9, rel=0.01)
    assert k2t.bytes_per_param("routed_experts") == 0.5625
    assert k2t.bytes_per_param("attention") == 2.0
    assert PRESETS["deepseek-v3"].active_params() == pytest.approx(36.5e9, rel=0.01)


@pytest.mark.parametrize(
    "name,active,total",
    [("llama-2-7b", 6.61e9, 6.74e9), ("llama-3.1-70b", 69.5e9, 70.55e9),
     ("gpt-oss-120b", 5.13e9, None), ("gpt-oss-20b", 3.61e9, None), ("glm-4.5", 32.8e9, None),
     ("qwen3-30b-a3b", 3.03e9, None)],
)  # fmt: skip
def test_new_presets_have_their_published_sizes(name, active, total):
    # published: Llama 2 7B 6.74 B, Llama 3.1 70B 70.6 B, gpt-oss-120b 5.1 B active,
    # gpt-oss-20b 3.6 B active, GLM-4.5 32 B active, Qwen3-30B-A3B 3.3 B active (with embeddings)
    m = PRESETS[name]
    assert m.active_params() == pytest.approx(active, rel=0.01)
    if total is not None:  # dense: active + the input embedding
        assert m.active_params() + m.lm_head_params == pytest.approx(total, rel=0.01)
    assert m.max_positions > 0


def test_sliding_window_layers_read_at_most_the_window():
    m = PRESETS["gpt-oss-120b"]
    assert (m.sliding_layers, m.sliding_window) == (18, 128)
    assert m.kv_tokens_read(2048) == 18 * 2048 + 18 * 128
    assert m.kv_tokens_read(100) == 36 * 100
    assert PRESETS["llama-3.1-8b"].kv_tokens_read(2048) == 32 * 2048


def test_gpt_oss_config_reads_experts_window_and_mxfp4(tmp_path):
    cfg = {
        "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
        "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "max_position_embeddings": 4096, "quantization_config": {"quant_method": "mxfp4"},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    m = load_model({"config": str(tmp_path)}, "s.toml")
    assert (m.n_routed_experts, m.top_k, m.moe_intermediate_size) == (8, 2, 96)
    assert (m.sliding_window, m.sliding_layers, m.max_positions) == (32, 2, 4096)
    assert (
        m.precision["routed_experts"] == "mxfp4" and m.bytes_per_param("routed_experts") == 0.53125
    )


def test_shape_from_hf_config(tmp_path):
    cfg = {
        "model_type": "qwen3",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 1000,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    shape = load_model({"config": str(tmp_path)}, "s.toml")
    assert shape.attention == "gqa" and shape.num_moe_layers == 0
    assert shape.kv_bytes_per_token_layer() == 2 * 2 * 16 * 4
    assert shape.attention_params_per_layer == 64 * 16 * (4 + 4) + 4 * 16 * 64
    with pytest.raises(ModelError, match="lacks field 'vocab_size'"):
        shape_from_config({k: v for k, v in cfg.items() if k != "vocab_size"})
    with pytest.raises(ModelError, match="model.preset"):
        load_model({"preset": "gpt-9"}, "s.toml")


@pytest.mark.parametrize(
    "device,key",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 SXM5 80GB", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),  # not the SXM part (a first-word match said h100-sxm)
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA GB300", "gb300"),  # not a B300 (a substring match could say b300)
        ("NVIDIA B300 SXM6 AC", "b300"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GB200", "gb200"),  # not a B200
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", None),
        ("AMD Instinct MI300X", "mi300x"),
        ("NVIDIA A800-SXM4-80GB", "a800"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
        ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),  # not the SXM part
        ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),  # not the 80 GB one
    ],
)
def test_gpu_names_match_whole_words_of_one_entry(device, key):
    hw = match_gpu(device)
    assert (hw.key if hw else None) == key


def _bandwidth_record(device, gpu=None, bytes_per_s=3.0e12):
    hw = HardwareInfo(cpu_model="cpu", cpu_cores=16, gpu_name=gpu, gpu_count=1 if gpu else 0)
    return BenchBandwidth(hardware=hw, device=device, method="read", bytes_per_s=bytes_per_s)


def test_this_machine_on_a_gpu_takes_the_catalog_flops_and_the_measured_bandwidth():
    # it used to take the CPU's assumed FMA peak for a CUDA device too
    hw = this_machine([_bandwidth_record("cuda:0", "NVIDIA H100 80GB HBM3")])
    h100 = load_catalog()["h100-sxm"]
    assert hw.key == "this-machine" and hw.hbm_bytes_per_s == 3.0e12
    assert hw.dense_flops == h100.dense_flops and hw.overlaps_memory_and_compute
    assert hw.provenance["hbm_bandwidth"].kind == "measured"
    assert hw.provenance["bf16_dense"].kind == "catalog"
    with pytest.raises(CatalogError, match="'NVIDIA Tesla P100-PCIE-16GB', which is not in the"):
        this_machine([_bandwidth_record("cuda", "NVIDIA Tesla P100-PCIE-16GB")])
    cpu = this_machine([_bandwidth_record("cpu", bytes_per_s=2e10)])
    assert cpu.provenance["bf16_dense"].kind == "assumed" and not cpu.overlaps_memory_and_compute
