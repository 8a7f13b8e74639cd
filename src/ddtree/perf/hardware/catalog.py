"""Hardware catalog: per-GPU figures with the source of each (``data/hardware.toml``).

Every figure carries a ``Provenance``: ``catalog`` (a public source, named), ``assumed``
(a judgement, named as such), ``measured`` (a measurement record) or ``user`` (typed into the
scenario). FLOP rates are dense; sparse (2:4) figures are kept in ``sparse_flops`` and never
used by the cost model.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from ddtree.perf.hardware.units import (
    BANDWIDTH,
    BYTES,
    FLOP_RATE,
    TIME,
    Dim,
    UnitError,
    parse_quantity,
)
from ddtree.records import BenchAllreduce, BenchBandwidth

PRECISIONS = ("bf16", "fp16", "fp8", "fp4")
"""Compute precisions with a dense (and sparse) FLOP/s figure. ``fp16`` is given only for GPUs
with no BF16 (V100, T4); ``peak_flops`` runs BF16 work there at the FP16 rate."""

VENDORS = ("nvidia", "amd")
GENERATIONS = (
    "volta", "turing", "ampere", "ada", "hopper", "blackwell", "blackwell-consumer",
    "blackwell-ultra", "cdna2", "cdna3", "cdna4",
)  # fmt: skip
"""``blackwell`` is the data-centre part (B200, GB200: sm_100, tcgen05 tensor memory);
``blackwell-consumer`` the GeForce / RTX PRO part (RTX 5090, RTX PRO 6000: sm_120, no
tcgen05, warp-level MMA): the same number formats, but the serving kernels written for sm_100
(trtllm-gen, DeepGEMM, FlashMLA) do not run there. ``blackwell-ultra``: B300, GB300."""
NATIVE_FORMATS = ("fp16", "bf16", "int8", "fp8", "fp4", "mxfp4")
"""Number formats a tensor / matrix unit computes in natively (``native_formats``)."""
# a weight format (``model.PRECISION_BYTES``) -> the native format it needs, None: never native
# (int4 is weight-only, dequantised to BF16 before the MMA; fp32 runs no tensor-core MMA)
_WEIGHT_NATIVE: dict[str, str | None] = {
    "fp32": None,
    "bf16": "bf16",
    "fp16": "fp16",
    "int8": None,  # weight-only int8 (GPTQ / AWQ 8-bit, gpt-fast): dequantised to 16 bits
    "fp8": "fp8",
    "fp8-block128": "fp8",
    "int4": None,  # per-channel
    "int4-g32": None,
    "int4-g64": None,
    "int4-g128": None,
    "fp4": "fp4",  # nvfp4
    "nvfp4": "fp4",
    "mxfp4": "mxfp4",
}

# field in the TOML -> (dimension, attribute)
_FIGURES: dict[str, Dim] = {
    "memory": BYTES,
    "hbm_bandwidth": BANDWIDTH,
    "link_bandwidth": BANDWIDTH,
    "allreduce_latency": TIME,
    **{f"{p}_dense": FLOP_RATE for p in PRECISIONS},
    **{f"{p}_sparse": FLOP_RATE for p in PRECISIONS},
}
_TEXT_FIELDS = ("name", "interconnect", "base", "host_cpu")
# sourced text fields (``{ value, source }``) checked against a fixed set of values
_CHOICE_FIELDS: dict[str, tuple[str, ...]] = {"vendor": VENDORS, "generation": GENERATIONS}
# figures that may be 0 (unknown: no memory fit check, no link term, no all-reduce latency);
# every other figure (a bandwidth, a FLOP rate) divides a time and must be > 0
_MAY_BE_ZERO = ("memory", "link_bandwidth", "allreduce_latency")
_LIST_FIELDS = ("match", "native_formats")
_INT_FIELDS = ("gpus_per_node",)
DEFAULT_GPUS_PER_NODE = 8
"""GPUs that share an entry's interconnect when the entry does not say (an HGX node)."""


class CatalogError(ValueError):
    """A hardware entry that is malformed or unknown."""


@dataclass(frozen=True)
class Provenance:
    kind: str  # "catalog" | "assumed" | "measured" | "user" | "derived" | "fitted"
    source: str

    def label(self) -> str:
        return f"{self.kind} ({self.source})" if self.source else self.kind


@dataclass(frozen=True)
class Hardware:
    key: str
    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    dense_flops: dict[str, float]  # precision -> dense FLOP/s
    sparse_flops: dict[str, float]
    interconnect: str
    link_bytes_per_s: float  # per GPU, per direction
    allreduce_latency_s: float
    provenance: dict[str, Provenance] = field(default_factory=dict)
    # True (GPU): a kernel overlaps its memory traffic with its math, time = max(bytes / bw,
    # FLOPs / rate). False (a CPU thread running small eager GEMMs): it streams the operands,
    # then computes, time = bytes / bw + FLOPs / rate (assumed; what this machine's records fit)
    overlaps_memory_and_compute: bool = True
    # device names (as torch / nvidia-smi report them) this entry stands for: each pattern is
    # words that must all appear as whole words; "!word" must not appear (see ``match_gpu``)
    match: tuple[str, ...] = ()
    # runs ddtree's own MoE, which in eager mode loops over the touched experts (a few kernels
    # each); GPU serving engines run a fused MoE kernel. True for ``this_machine`` (our records)
    looped_moe: bool = False
    # GPUs that share ``interconnect`` (an HGX node: 8; a GB200 NVL72 rack: 72); a group larger
    # than this spans nodes and needs an inter-node ``Link``
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    # the host CPU class (``data/hosts.toml``) that runs the engine's host side
    host_cpu: str = "xeon-8480c"
    # "nvidia" | "amd" ("" where a scenario's own table does not say)
    vendor: str = ""
    # architecture generation, one of GENERATIONS ("" where not said)
    generation: str = ""
    # number formats the tensor / matrix units compute in natively, from NATIVE_FORMATS
    # (empty where not said: ``native`` then goes by the dense FLOP/s figures given)
    native_formats: tuple[str, ...] = ()

    def peak_flops(self, precision: str) -> float:
        """Dense FLOP/s for a compute precision; falls back to the next wider one (fp4 ->
        fp8 -> bf16). A GPU with no BF16 (V100, T4) runs BF16 work at its FP16 rate (the
        weights converted to FP16), and FP16 work runs at the BF16 rate where only that is given.
        """
        chains = {
            "fp4": ("fp4", "fp8", "bf16", "fp16"),
            "fp8": ("fp8", "bf16", "fp16"),
            "bf16": ("bf16", "fp16"),
            "fp16": ("fp16", "bf16"),
        }
        for p in chains.get(precision, ("bf16", "fp16")):
            if p in self.dense_flops:
                return self.dense_flops[p]
        raise CatalogError(f"hardware {self.key!r} has no dense FLOP/s figure for {precision}")

    def native(self, fmt: str) -> bool:
        """Whether weights in ``fmt`` (a ``model.PRECISION_BYTES`` format, or ``nvfp4``) compute
        natively on this GPU's tensor / matrix units: ``fp8-block128`` needs fp8, ``fp4`` /
        ``nvfp4`` fp4, ``mxfp4`` mxfp4; the int formats (int8 and int4: weight-only GPTQ / AWQ /
        gpt-fast weights, dequantised to 16 bits before a BF16 / FP16 MMA, whatever int8 units
        the GPU has) and fp32 never.
        An entry without ``native_formats`` goes by its dense figures: bf16 / fp16 yes, fp8
        where it has an fp8 figure, fp4 and mxfp4 where it has an fp4 figure."""
        if fmt not in _WEIGHT_NATIVE:
            raise CatalogError(
                f"hardware {self.key!r}: unknown weight format {fmt!r}; "
                f"known: {', '.join(_WEIGHT_NATIVE)}"
            )
        need = _WEIGHT_NATIVE[fmt]
        if need is None:
            return False
        if self.native_formats:
            return need in self.native_formats
        if need in ("bf16", "fp16"):
            return True
        return ("fp8" if need == "fp8" else "fp4") in self.dense_flops


def _figure(entry: dict, key: str, name: str, where: str, default_kind: str):
    raw = entry[name]
    if isinstance(raw, dict):
        if "value" not in raw:
            raise CatalogError(f"{where}: {key}.{name} needs a 'value'")
        extra = sorted(set(raw) - {"value", "source", "assumed"})
        if extra:
            raise CatalogError(
                f"{where}: {key}.{name}: unknown field(s) {', '.join(extra)}; "
                "expected value, source, assumed"
            )
        value, source = raw["value"], raw.get("source", "")
        if not isinstance(source, str) or not isinstance(raw.get("assumed", False), bool):
            raise CatalogError(
                f"{where}: {key}.{name}: 'source' is a string and 'assumed' true or false"
            )
        kind = "assumed" if raw.get("assumed") else default_kind
        if default_kind == "catalog" and not source:
            raise CatalogError(f"{where}: {key}.{name} has no 'source'")
    else:
        value, source, kind = raw, "typed in the scenario", default_kind
    return value, Provenance(kind, source)


def hardware_from_dict(
    key: str,
    entry: dict[str, Any],
    where: str,
    base: Hardware | None = None,
    default_kind: str = "catalog",
) -> Hardware:
    """Build a Hardware from a TOML table; ``base`` supplies any figure not given."""
    known = [*_TEXT_FIELDS, *_CHOICE_FIELDS, *_LIST_FIELDS, *_INT_FIELDS, *_FIGURES]
    unknown = set(entry) - set(known)
    if unknown:
        raise CatalogError(
            f"{where}: hardware.{key} has unknown field(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(known)}"
        )
    per_node = entry.get("gpus_per_node", base.gpus_per_node if base else DEFAULT_GPUS_PER_NODE)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise CatalogError(f"{where}: hardware.{key}.gpus_per_node must be an integer >= 1")
    match = entry.get("match", base.match if base else ())
    if not isinstance(match, (list, tuple)) or not all(isinstance(m, str) for m in match):
        raise CatalogError(f"{where}: hardware.{key}.match must be a list of strings")
    vals: dict[str, float] = {}
    prov: dict[str, Provenance] = dict(base.provenance) if base else {}
    choice = {name: getattr(base, name) if base else "" for name in _CHOICE_FIELDS}
    for name, allowed in _CHOICE_FIELDS.items():
        if name in entry:
            value, prov[name] = _figure(entry, key, name, where, default_kind)
            if value not in allowed:
                raise CatalogError(
                    f"{where}: hardware.{key}.{name}: {value!r} is not one of {', '.join(allowed)}"
                )
            choice[name] = value
    formats = base.native_formats if base else ()
    if "native_formats" in entry:
        value, prov["native_formats"] = _figure(entry, key, "native_formats", where, default_kind)
        if not isinstance(value, (list, tuple)) or not all(isinstance(f, str) for f in value):
            raise CatalogError(
                f"{where}: hardware.{key}.native_formats must be a list of format names"
            )
        bad = [f for f in value if f not in NATIVE_FORMATS]
        if bad or len(set(value)) != len(value) or not value:
            what = f"unknown {', '.join(map(repr, bad))}" if bad else "empty or repeated names"
            raise CatalogError(
                f"{where}: hardware.{key}.native_formats: {what}; "
                f"expected some of {', '.join(NATIVE_FORMATS)}"
            )
        formats = tuple(value)
    if base is not None:
        vals.update(
            memory=base.memory_bytes,
            hbm_bandwidth=base.hbm_bytes_per_s,
            link_bandwidth=base.link_bytes_per_s,
            allreduce_latency=base.allreduce_latency_s,
        )
        vals.update({f"{p}_dense": v for p, v in base.dense_flops.items()})
        vals.update({f"{p}_sparse": v for p, v in base.sparse_flops.items()})
    text = {
        "name": base.name if base else key,
        "interconnect": base.interconnect if base else "",
        "host_cpu": base.host_cpu if base else REFERENCE_HOST,
    }
    for name in _TEXT_FIELDS:
        if name in entry:
            value, p = _figure(entry, key, name, where, default_kind)
            if not isinstance(value, str):
                raise CatalogError(
                    f"{where}: hardware.{key}.{name}: expected a string, got {value!r:.60}"
                )
            if name == "base":
                continue
            text[name] = value
            if name == "interconnect":
                prov[name] = p
    for name, dim in _FIGURES.items():
        if name not in entry:
            continue
        value, p = _figure(entry, key, name, where, default_kind)
        try:
            vals[name] = parse_quantity(value, dim, f"{where}: hardware.{key}.{name}")
        except UnitError as exc:
            raise CatalogError(str(exc)) from None
        if not (vals[name] >= 0 if name in _MAY_BE_ZERO else vals[name] > 0):
            bound = ">= 0 (0: unknown)" if name in _MAY_BE_ZERO else "> 0"
            raise CatalogError(f"{where}: hardware.{key}.{name}: {value!r} must be {bound}")
        prov[name] = p
    for need in ("hbm_bandwidth",):
        if need not in vals:
            raise CatalogError(f"{where}: hardware.{key} needs '{need}' (like '8 TB/s')")
    if not any(f"{p}_dense" in vals for p in PRECISIONS):
        raise CatalogError(f"{where}: hardware.{key} needs a dense FLOP rate, e.g. bf16_dense")
    vals.setdefault("memory", 0.0)
    vals.setdefault("link_bandwidth", 0.0)
    if "allreduce_latency" not in vals:
        vals["allreduce_latency"] = 25e-6
        prov["allreduce_latency"] = Provenance("assumed", "default 25 µs (no figure given)")
    return Hardware(
        key=key,
        name=text["name"],
        memory_bytes=vals["memory"],
        hbm_bytes_per_s=vals["hbm_bandwidth"],
        dense_flops={p: vals[f"{p}_dense"] for p in PRECISIONS if f"{p}_dense" in vals},
        sparse_flops={p: vals[f"{p}_sparse"] for p in PRECISIONS if f"{p}_sparse" in vals},
        interconnect=text["interconnect"],
        link_bytes_per_s=vals["link_bandwidth"],
        allreduce_latency_s=vals["allreduce_latency"],
        provenance=prov,
        match=tuple(match),
        gpus_per_node=per_node,
        host_cpu=text["host_cpu"],
        vendor=choice["vendor"],
        generation=choice["generation"],
        native_formats=formats,
    )


REFERENCE_HOST = "xeon-8480c"
"""The host whose speed is 1: the engine profiles' host costs are this host's."""


@dataclass(frozen=True)
class Host:
    """A host CPU class: its single-thread speed relative to ``REFERENCE_HOST`` scales the
    engine's host work (framework overhead, kernel launches, host tree build)."""

    key: str
    name: str
    speed: float
    low: float
    high: float
    provenance: Provenance

    @property
    def param(self) -> str | None:
        """The parameter that carries its speed (None for the reference: speed 1)."""
        return None if self.key == REFERENCE_HOST else f"host_speed.{self.key}"


def load_hosts() -> dict[str, Host]:
    """The host CPU classes (``data/hosts.toml``)."""
    text = resources.files("ddtree.perf").joinpath("data/hosts.toml").read_text(encoding="utf-8")
    where = "ddtree/perf/data/hosts.toml"
    out = {}
    for key, e in tomllib.loads(text).items():
        value, prov = _figure(e, key, "speed", where, "catalog")
        v = float(value)
        out[key] = Host(key, str(e["name"]), v, float(e.get("low", v)), float(e.get("high", v)),
                        prov)  # fmt: skip
    return out


@dataclass(frozen=True)
class Link:
    """A link between nodes (InfiniBand, RoCE): what a TP or EP group uses between GPUs of
    different nodes. Per GPU (one NIC each), per direction."""

    key: str
    name: str
    bytes_per_s: float
    allreduce_latency_s: float  # small-message all-reduce of a group that spans nodes
    provenance: dict[str, Provenance] = field(default_factory=dict)


_LINK_FIGURES: dict[str, Dim] = {"bandwidth": BANDWIDTH, "allreduce_latency": TIME}


def link_from_dict(key: str, entry: dict[str, Any], where: str, default_kind: str = "catalog"):
    """A ``Link`` from a ``[link.NAME]`` table (``bandwidth``, ``allreduce_latency``, ``name``)."""
    unknown = set(entry) - set(_LINK_FIGURES) - {"name"}
    if unknown:
        raise CatalogError(
            f"{where}: link.{key} has unknown field(s) {', '.join(sorted(unknown))}; "
            f"known: name, {', '.join(_LINK_FIGURES)}"
        )
    vals, prov = {}, {}
    for name, dim in _LINK_FIGURES.items():
        if name not in entry:
            raise CatalogError(f"{where}: link.{key} needs '{name}'")
        value, prov[name] = _figure(entry, key, name, where, default_kind)
        try:
            vals[name] = parse_quantity(value, dim, f"{where}: link.{key}.{name}")
        except UnitError as exc:
            raise CatalogError(str(exc)) from None
        if not vals[name] > 0:
            raise CatalogError(f"{where}: link.{key}.{name} must be positive")
    return Link(key, str(entry.get("name", key)), vals["bandwidth"], vals["allreduce_latency"],
                prov)  # fmt: skip


def load_links() -> dict[str, Link]:
    """The built-in inter-node links (``data/links.toml``), keyed ``ib-ndr``, ``ib-xdr``, ..."""
    text = resources.files("ddtree.perf").joinpath("data/links.toml").read_text(encoding="utf-8")
    where = "ddtree/perf/data/links.toml"
    return {k: link_from_dict(k, e, where) for k, e in tomllib.loads(text).items()}


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def _pattern_score(pattern: str, words: set[str]) -> int:
    """How many words of ``pattern`` the device name has (0: the pattern does not match)."""
    need = pattern.lower().split()
    if any(w[1:] in words for w in need if w.startswith("!")):
        return 0
    want = [w for w in need if not w.startswith("!")]
    return len(want) if all(w in words for w in want) else 0


def match_gpu(device_name: str, catalog: dict[str, Hardware] | None = None) -> Hardware | None:
    """The catalog entry for a device name such as ``"NVIDIA H100 80GB HBM3"``, or None.

    Whole words only ("GB300" is not a "B300"), every word of one of the entry's ``match``
    patterns present, none of its ``!`` words ("H100 PCIe" is not the SXM part). The entry
    whose best pattern matches the most words wins; a tie between entries is no match.
    """
    words = _words(device_name)
    scores = {
        key: max((_pattern_score(p, words) for p in hw.match), default=0)
        for key, hw in (catalog or load_catalog()).items()
    }
    best = max(scores.values(), default=0)
    winners = [k for k, v in scores.items() if v == best and v > 0]
    return (catalog or load_catalog())[winners[0]] if len(winners) == 1 else None


def load_catalog() -> dict[str, Hardware]:
    """The built-in catalog, keyed by short name (``b300``, ``rtx-pro-6000``, ...)."""
    text = resources.files("ddtree.perf").joinpath("data/hardware.toml").read_text("utf-8")
    return catalog_from_toml(text, "ddtree/perf/data/hardware.toml")


def catalog_from_toml(text: str, where: str) -> dict[str, Hardware]:
    """A catalog from TOML text in ``data/hardware.toml``'s form: every entry gives the
    ``CATALOG_REQUIRED`` fields, each figure with a source."""
    data = tomllib.loads(text)
    for key, entry in data.items():
        for need in CATALOG_REQUIRED:
            if need not in entry:
                raise CatalogError(f"{where}: hardware.{key} needs '{need}'")
    return {key: hardware_from_dict(key, entry, where) for key, entry in data.items()}


CATALOG_REQUIRED = (
    "name", "memory", "hbm_bandwidth", "interconnect", "link_bandwidth", "allreduce_latency",
    "match", "host_cpu", "vendor", "generation", "native_formats",
)  # fmt: skip
"""Fields every built-in entry gives (a scenario's own tables may leave them out)."""


CPU_THREAD_PEAK_FLOPS = 2 * 8 * 2 * 3.0e9  # FLOP/s per thread, float32 AVX2 FMA (assumed)


def this_machine(records: list) -> Hardware | None:
    """A Hardware for this machine from ``bench_bandwidth`` records (highest bytes/s wins).

    Only the bandwidth is measured. On a CPU, FLOP/s and interconnect are assumptions,
    labelled as such, so calibration fits ``compute_efficiency@this-machine``: a CPU thread's
    float32 FMA peak is taken as CPU_THREAD_PEAK_FLOPS (two 256-bit FMA units: 2 x 8 lanes x
    2 FLOPs per cycle at ~3 GHz), times the threads the benchmark ran with (its cores when not
    recorded). On a GPU the catalog entry of that GPU (``match_gpu``) gives every figure but
    the bandwidth; a GPU the catalog does not know is an error (its FLOP/s would be a guess).
    """
    bw = [r for r in records if isinstance(r, BenchBandwidth)]
    if not bw:
        return None
    best = max(bw, key=lambda r: r.bytes_per_s)
    measured = Provenance("measured", f"ddtree bench bandwidth ({best.method}, {best.created_utc})")
    if best.device.startswith("cuda"):
        gpu = best.hardware.gpu_name or ""
        entry = match_gpu(gpu)
        if entry is None:
            raise CatalogError(
                f"records: bench_bandwidth ran on GPU {gpu!r}, which is not in the hardware "
                "catalog; its FLOP/s are unknown (add it to ddtree/perf/data/hardware.toml)"
            )
        return replace(
            entry,
            key="this-machine",
            name=f"this machine ({gpu}, {best.device}; catalog {entry.key})",
            hbm_bytes_per_s=best.bytes_per_s,
            provenance={**entry.provenance, "hbm_bandwidth": measured},
            looped_moe=True,
        )
    threads = best.threads or best.hardware.cpu_cores or 1
    return Hardware(
        key="this-machine",
        name=f"this machine ({best.hardware.cpu_model}, {best.device})",
        memory_bytes=0.0,
        hbm_bytes_per_s=best.bytes_per_s,
        dense_flops={"bf16": CPU_THREAD_PEAK_FLOPS * threads},
        sparse_flops={},
        interconnect="none (single device)",
        link_bytes_per_s=0.0,
        overlaps_memory_and_compute=False,
        looped_moe=True,
        allreduce_latency_s=0.0,
        provenance={
            "hbm_bandwidth": measured,
            "bf16_dense": Provenance(
                "assumed",
                f"{threads} thread(s) x {CPU_THREAD_PEAK_FLOPS / 1e9:.0f} GFLOP/s float32 FMA "
                "peak (2 x 8 lanes x 2 FLOPs/cycle x 3 GHz); fit compute_efficiency",
            ),
            "allreduce_latency": Provenance("assumed", "single device: no all-reduce"),
        },
    )


def with_measured_allreduce(hw: Hardware, record: BenchAllreduce) -> Hardware:
    """``hw`` with the all-reduce latency and link (bus) bandwidth a ``bench allreduce`` record
    fitted, labelled measured (the cost model then uses them without the assumed
    ``allreduce_scale``)."""
    source = (
        f"ddtree bench allreduce: {record.backend} on {record.device}, {record.world_size} ranks, "
        f"{record.dtype}, fit over {len(record.points)} sizes ({record.created_utc})"
    )
    return replace(
        hw,
        interconnect=f"{record.backend} over {hw.interconnect or 'its link'} (measured)",
        allreduce_latency_s=record.latency_s,
        link_bytes_per_s=record.bus_bytes_per_s,
        provenance={
            **hw.provenance,
            "allreduce_latency": Provenance("measured", source),
            "link_bandwidth": Provenance("measured", source + ", bus bandwidth"),
        },
    )


def with_bandwidth(hw: Hardware, hbm_bytes_per_s: float) -> Hardware:
    """A copy with another memory bandwidth (used by tests and sensitivity)."""
    return replace(hw, hbm_bytes_per_s=hbm_bytes_per_s)
