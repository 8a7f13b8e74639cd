"""Hardware catalog: per-GPU figures with the source of each (``data/hardware.toml``).

Every figure carries a ``Provenance``: ``catalog`` (a public source, named), ``assumed``
(a judgement, named as such), ``measured`` (a measurement record) or ``user`` (typed into the
scenario). FLOP rates are dense; sparse (2:4) figures are kept in ``sparse_flops`` and never
used by the cost model.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from ddtree.perf.units import BANDWIDTH, BYTES, FLOP_RATE, TIME, Dim, UnitError, parse_quantity
from ddtree.records import BenchBandwidth

PRECISIONS = ("bf16", "fp8", "fp4")

# field in the TOML -> (dimension, attribute)
_FIGURES: dict[str, Dim] = {
    "memory": BYTES,
    "hbm_bandwidth": BANDWIDTH,
    "link_bandwidth": BANDWIDTH,
    "allreduce_latency": TIME,
    **{f"{p}_dense": FLOP_RATE for p in PRECISIONS},
    **{f"{p}_sparse": FLOP_RATE for p in PRECISIONS},
}
_TEXT_FIELDS = ("name", "interconnect", "base")


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

    def peak_flops(self, precision: str) -> float:
        """Dense FLOP/s for a compute precision; falls back to the next wider one."""
        order = ["fp4", "fp8", "bf16"]
        for p in order[order.index(precision) :] if precision in order else ["bf16"]:
            if p in self.dense_flops:
                return self.dense_flops[p]
        raise CatalogError(f"hardware {self.key!r} has no dense FLOP/s figure for {precision}")


def _figure(entry: dict, key: str, name: str, where: str, default_kind: str):
    raw = entry[name]
    if isinstance(raw, dict):
        if "value" not in raw:
            raise CatalogError(f"{where}: {key}.{name} needs a 'value'")
        value, source = raw["value"], str(raw.get("source", ""))
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
    unknown = set(entry) - set(_FIGURES) - set(_TEXT_FIELDS)
    if unknown:
        raise CatalogError(
            f"{where}: hardware.{key} has unknown field(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(list(_TEXT_FIELDS) + list(_FIGURES))}"
        )
    vals: dict[str, float] = {}
    prov: dict[str, Provenance] = dict(base.provenance) if base else {}
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
    }
    for name in _TEXT_FIELDS:
        if name in entry and name != "base":
            value, p = _figure(entry, key, name, where, default_kind)
            text[name] = str(value)
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
    )


def load_catalog() -> dict[str, Hardware]:
    """The built-in catalog, keyed by short name (``b300``, ``rtx-pro-6000``, ...)."""
    text = resources.files("ddtree.perf").joinpath("data/hardware.toml").read_text()
    data = tomllib.loads(text)
    where = "ddtree/perf/data/hardware.toml"
    return {key: hardware_from_dict(key, entry, where) for key, entry in data.items()}


CPU_THREAD_PEAK_FLOPS = 2 * 8 * 2 * 3.0e9  # FLOP/s per thread, float32 AVX2 FMA (assumed)


def this_machine(records: list) -> Hardware | None:
    """A Hardware for this machine from ``bench_bandwidth`` records (highest bytes/s wins).

    Only the bandwidth is measured; FLOP/s and interconnect are assumptions, labelled as
    such, so calibration fits ``compute_efficiency@this-machine``: a CPU thread's float32 FMA
    peak is taken as CPU_THREAD_PEAK_FLOPS (two 256-bit FMA units: 2 x 8 lanes x 2 FLOPs per
    cycle at ~3 GHz), times the threads the benchmark ran with (its cores when not recorded).
    """
    bw = [r for r in records if isinstance(r, BenchBandwidth)]
    if not bw:
        return None
    best = max(bw, key=lambda r: r.bytes_per_s)
    device = best.device
    cores = best.hardware.cpu_cores
    threads = best.threads or cores or 1
    flops = CPU_THREAD_PEAK_FLOPS * threads
    label = best.hardware.gpu_name if device.startswith("cuda") else best.hardware.cpu_model
    return Hardware(
        key="this-machine",
        name=f"this machine ({label}, {device})",
        memory_bytes=0.0,
        hbm_bytes_per_s=best.bytes_per_s,
        dense_flops={"bf16": flops},
        sparse_flops={},
        interconnect="none (single device)",
        link_bytes_per_s=0.0,
        overlaps_memory_and_compute=device.startswith("cuda"),
        allreduce_latency_s=0.0,
        provenance={
            "hbm_bandwidth": Provenance(
                "measured",
                f"ddtree bench bandwidth ({best.method}, {best.created_utc})",
            ),
            "bf16_dense": Provenance(
                "assumed",
                f"{threads} thread(s) x {CPU_THREAD_PEAK_FLOPS / 1e9:.0f} GFLOP/s float32 FMA "
                "peak (2 x 8 lanes x 2 FLOPs/cycle x 3 GHz); fit compute_efficiency",
            ),
            "allreduce_latency": Provenance("assumed", "single device: no all-reduce"),
        },
    )


def with_bandwidth(hw: Hardware, hbm_bytes_per_s: float) -> Hardware:
    """A copy with another memory bandwidth (used by tests and sensitivity)."""
    return replace(hw, hbm_bytes_per_s=hbm_bytes_per_s)
