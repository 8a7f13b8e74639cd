"""The hardware catalog's entries (issue 27, item 5): enough of them, each sourced, each with a
valid vendor / generation / native formats, figures as their datasheets give them."""

import pytest

from ddtree.perf.hardware.catalog import (
    GENERATIONS,
    NATIVE_FORMATS,
    VENDORS,
    CatalogError,
    catalog_from_toml,
    hardware_from_dict,
    load_catalog,
    match_gpu,
)

CAT = load_catalog()
NEW = ("rtx-3090", "rtx-4090", "rtx-a6000", "rtx-6000-ada", "l4", "a10g", "a10", "t4",
       "a100-pcie-40gb", "a100-pcie-80gb", "a100-sxm-40gb", "h800", "gh200", "mi250x", "mi210",
       "v100-sxm-32gb")  # fmt: skip


def test_catalog_is_large_and_has_both_vendors():
    assert len(CAT) >= 25
    assert set(NEW) <= set(CAT)
    assert {hw.vendor for hw in CAT.values()} == set(VENDORS)


@pytest.mark.parametrize("key", sorted(CAT))
def test_every_entry_is_sourced_and_classified(key):
    hw = CAT[key]
    assert hw.vendor in VENDORS and hw.generation in GENERATIONS
    assert hw.native_formats and set(hw.native_formats) <= set(NATIVE_FORMATS)
    assert hw.generation.startswith("cdna") == (hw.vendor == "amd")
    figures = ["memory", "hbm_bandwidth", "link_bandwidth", "allreduce_latency", "interconnect"]
    figures += [f"{p}_dense" for p in hw.dense_flops] + [f"{p}_sparse" for p in hw.sparse_flops]
    for f in [*figures, "vendor", "generation", "native_formats"]:
        prov = hw.provenance[f]
        assert prov.kind in ("catalog", "assumed") and prov.source, (key, f)
    assert hw.allreduce_latency_s > 0 and hw.link_bytes_per_s > 0 and hw.memory_bytes > 0
    for pattern in hw.match:  # each pattern's own words name this entry and no other
        words = " ".join(w for w in pattern.split() if not w.startswith("!"))
        assert getattr(match_gpu(words), "key", None) == key, (key, pattern)
    # a dense rate for each compute precision the formats name, and none for one they do not
    assert ("fp8" in hw.dense_flops) == ("fp8" in hw.native_formats), key
    assert ("fp4" in hw.dense_flops) == ("fp4" in hw.native_formats), key
    # no BF16 (V100, T4): an FP16 figure instead, which BF16 work runs at
    assert ("bf16" in hw.dense_flops) == ("bf16" in hw.native_formats), key
    if "bf16" not in hw.native_formats:
        assert hw.peak_flops("bf16") == hw.dense_flops["fp16"]
    for p, sparse in hw.sparse_flops.items():  # 2:4 sparsity: twice the dense rate, but
        if p == "fp4":  # Blackwell FP4 is quoted at less (B300: 13.125 dense vs 18 sparse)
            assert hw.dense_flops[p] < sparse <= 2.2 * hw.dense_flops[p], key
        else:
            assert sparse == pytest.approx(2 * hw.dense_flops[p], rel=0.02), (key, p)


def test_one_generation_one_set_of_formats():
    by_gen: dict[str, set[tuple[str, ...]]] = {}
    for hw in CAT.values():
        by_gen.setdefault(hw.generation, set()).add(tuple(sorted(hw.native_formats)))
    assert all(len(v) == 1 for v in by_gen.values()), by_gen
    assert CAT["rtx-5090"].generation == CAT["rtx-pro-6000"].generation == "blackwell-consumer"
    assert CAT["b200"].generation == "blackwell" and CAT["b300"].generation == "blackwell-ultra"
    assert set(CAT["t4"].native_formats) == {"fp16", "int8"}
    assert CAT["v100-sxm-32gb"].native_formats == ("fp16",)


@pytest.mark.parametrize(
    "key,memory,bandwidth,flops",
    [
        ("rtx-4090", 24e9, 1008e9, ("bf16", 165.15e12)),
        ("rtx-3090", 24e9, 936e9, ("bf16", 71e12)),
        ("l4", 24e9, 300e9, ("fp8", 242e12)),
        ("mi250x", 128e9, 3.2e12, ("bf16", 383e12)),
        ("mi210", 64e9, 1.6e12, ("bf16", 181e12)),
        ("a100-sxm-40gb", 40e9, 1.555e12, ("bf16", 312e12)),
        ("a100-pcie-80gb", 80e9, 1.935e12, ("bf16", 312e12)),
        ("rtx-a6000", 48e9, 768e9, ("bf16", 154.8e12)),
        ("t4", 16e9, 320e9, ("fp16", 65e12)),
        ("v100-sxm-32gb", 32e9, 900e9, ("fp16", 125e12)),
        ("h800", 80 * 2**30, 3.35e12, ("fp8", 1978e12)),
    ],
)
def test_figures_match_their_sources(key, memory, bandwidth, flops):
    hw = CAT[key]
    assert hw.memory_bytes == pytest.approx(memory) and hw.hbm_bytes_per_s == pytest.approx(
        bandwidth
    )
    assert hw.dense_flops[flops[0]] == pytest.approx(flops[1])


def test_interconnects():
    assert CAT["h800"].link_bytes_per_s == 200e9  # NVLink capped at 400 GB/s bidirectional
    assert CAT["a100-sxm-40gb"].link_bytes_per_s == 300e9
    assert CAT["v100-sxm-32gb"].link_bytes_per_s == 150e9
    assert CAT["t4"].link_bytes_per_s == 16e9 and CAT["t4"].interconnect.startswith("PCIe 3")
    assert CAT["gh200"].host_cpu == "grace" and CAT["mi250x"].host_cpu == "epyc"


@pytest.mark.parametrize(
    "device,key",
    [
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("NVIDIA GeForce RTX 3090 Ti", None),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 4090 D", None),  # fewer SMs
        ("NVIDIA RTX A6000", "rtx-a6000"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
        ("Quadro RTX 6000", None),  # Turing
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA A10", "a10"),
        ("Tesla T4", "t4"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
        ("NVIDIA H800", "h800"),
        ("NVIDIA H800 PCIe", None),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA H200", "h200"),  # not a GH200
        ("AMD Instinct MI250X", "mi250x"),
        ("AMD Instinct MI250X/MI250", "mi250x"),
        ("AMD Instinct MI210", "mi210"),
        ("Tesla V100-SXM2-32GB", "v100-sxm-32gb"),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_new_device_names_match_one_entry(device, key):
    hw = match_gpu(device)
    assert (hw.key if hw else None) == key


def test_native_formats():
    a100, h100, b200 = CAT["a100-sxm-80gb"], CAT["h100-sxm"], CAT["b200"]
    assert not a100.native("fp8") and h100.native("fp8") and h100.native("fp8-block128")
    assert b200.native("fp4") and b200.native("nvfp4") and not h100.native("fp4")
    assert CAT["mi355x"].native("mxfp4") and not CAT["mi300x"].native("mxfp4")
    assert CAT["rtx-4090"].native("fp8") and not CAT["rtx-3090"].native("fp8")
    assert CAT["t4"].native("fp16") and not CAT["t4"].native("bf16")
    for hw in CAT.values():  # weight-only int8 / int4 and fp32 never compute natively
        assert not any(hw.native(f) for f in ("int8", "int4-g32", "int4-g128", "fp32"))
        assert hw.native("bf16") or hw.native("fp16")
    with pytest.raises(CatalogError, match="h100-sxm.*unknown weight format 'fp6'"):
        h100.native("fp6")


def test_no_bf16_runs_at_the_fp16_rate():
    v100, t4 = CAT["v100-sxm-32gb"], CAT["t4"]
    assert "bf16" not in v100.dense_flops and v100.peak_flops("bf16") == 125e12
    assert t4.peak_flops("fp8") == t4.peak_flops("fp4") == 65e12  # int8 / fp8 fall back too
    assert CAT["h100-sxm"].peak_flops("fp16") == CAT["h100-sxm"].dense_flops["bf16"]


def _entry(**extra):
    return {"hbm_bandwidth": "1 TB/s", "bf16_dense": "100 TFLOP/s", **extra}


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("vendor", "intel", "hardware.x.vendor: 'intel' is not one of nvidia, amd"),
        ("generation", "pascal", "hardware.x.generation: 'pascal' is not one of"),
        ("native_formats", ["fp16", "fp6"], "hardware.x.native_formats: unknown 'fp6'"),
        ("native_formats", ["fp16", "fp16"], "hardware.x.native_formats: empty or repeated"),
        ("native_formats", "fp16", "hardware.x.native_formats must be a list"),
    ],
)
def test_unknown_values_name_file_entry_and_field(field, value, needle):
    with pytest.raises(CatalogError, match="s.toml: " + needle.replace(".", r"\.")):
        hardware_from_dict("x", _entry(**{field: {"value": value, "source": "s"}}), "s.toml")


def test_scenario_tables_load_without_the_new_fields():
    hw = hardware_from_dict("x", _entry(fp8_dense="200 TFLOP/s"), "s.toml", default_kind="user")
    assert hw.vendor == hw.generation == "" and hw.native_formats == ()
    assert hw.native("fp8") and hw.native("bf16") and not hw.native("fp4")  # from its figures
    slow = hardware_from_dict("h", {"hbm_bandwidth": "2 TB/s"}, "s.toml", base=CAT["h100-sxm"])
    assert slow.generation == "hopper" and slow.native("fp8") and not slow.native("fp4")


def test_a_catalog_entry_without_them_is_an_error():
    text = '[x]\nname = "x"\nhbm_bandwidth = { value = "1 TB/s", source = "s" }\n'
    with pytest.raises(CatalogError, match="c.toml: hardware.x needs 'memory'"):
        catalog_from_toml(text, "c.toml")
