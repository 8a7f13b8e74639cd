"""Measurement records: the one schema the engine and benchmarks write and the estimator reads.

A records file is JSON lines, one record per line::

    {"schema": 2, "kind": "engine_run", "created_utc": "...", "provenance": {...},
     "hardware": {...}, "config": {...}, "summary": {...}, "points": [...]}

- ``kind`` says what was measured; each kind is one typed dataclass (``EngineRun``,
  ``BenchBandwidth``, ``BenchMoe``, ``BenchTree``, ``Acceptance``, ``BenchAllreduce``)
  listed in ``RECORD_KINDS``.
  A field of the dataclass lives in the ``config`` section (what was held fixed) or the
  ``summary`` section (the headline figures) of the wire format; ``points`` holds the per-step
  or per-size measurements. Keys a kind does not declare are kept, untouched, in ``config_extra`` /
  ``summary_extra``, so a record read and written again loses nothing.
- ``provenance``: which producer wrote it (``ddtree bench moe``, ``ddtree.engine``), the
  command line, the package version and the git commit when known. Collecting it (and the
  ``hardware`` section) for this process is ``ddtree.provenance``'s job; this module only
  defines and checks the schema.
- The vocabulary (``Stage``, ``EngineMode``) lives in ``ddtree.vocab``; the engine's clock,
  the engine_run summary and the estimator's cost components and stage anchors share it.
- Units live in field names (``step_s``, ``tokens_per_s``, ``bytes_per_s``); seconds, bytes,
  tokens. No tera/giga scaling inside records.

Adding a kind: one dataclass and one entry in ``RECORD_KINDS``::

    @dataclass(kw_only=True)
    class BenchAllreduce(Record):
        kind: ClassVar[str] = "bench_allreduce"
        point_keys: ClassVar[tuple[str, ...]] = ("bytes", "seconds")
        device: str = config_field()
        world_size: int = config_field(minimum=2)
        latency_s: float = summary_field(positive=True)

    RECORD_KINDS = {cls.kind: cls for cls in (..., BenchAllreduce)}

Fields are type-checked on construction and on reading (``int``, ``float``, ``str``,
``bool``, ``dict``, ``list``, a ``StrEnum``, ``X | None``, ``dict[Stage, float]``; a string
field may name its ``choices``, e.g. ``policy`` the names in ``ddtree.vocab.POLICIES``); every
error names the file, the line and the field, in one line. Reading is forgiving where a file
can honestly be damaged: a record of a newer schema version is skipped with a warning naming
file:line, and so is a truncated last line (a writer killed mid-line); the good records are
kept. A record read twice (the same line in two files, or twice in one) counts once, with a
warning. Writing appends in place under a file lock, one write per call, undone if it fails
half-way (``write_records``); only regular records files are written (``check_records_file``).

Schema history: 1 had no ``provenance`` and no ``engine_run.config.engine_mode``; version-1
files are read as eager runs of an unknown producer.

This module imports nothing heavy (no torch), so ``ddtree.perf`` can read records cheaply.
"""

from __future__ import annotations

import codecs
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import math
import os
import reprlib
import stat
import types
import typing
import warnings
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from ddtree.files import check_output_file, failed_write, replace_atomically
from ddtree.signals import deferred
from ddtree.vocab import POLICIES, EngineMode, Stage

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)


class RecordError(ValueError):
    """A records file or record that does not follow the schema."""


class RecordWarning(UserWarning):
    """A record that was skipped (newer schema, truncated line); the others were kept."""


@dataclass
class HardwareInfo:
    cpu_model: str
    cpu_cores: int
    torch_version: str | None = None
    gpu_name: str | None = None
    gpu_count: int = 0
    hostname: str = ""

    @property
    def label(self) -> str:
        """A short name for tables: the GPU if any, else the CPU."""
        if self.gpu_name:
            return f"{self.gpu_count}x {self.gpu_name}"
        return f"{self.cpu_model} ({self.cpu_cores} cores)"


@dataclass(frozen=True)
class Provenance:
    """Who wrote a record: the producer, its command line, the package version and commit."""

    producer: str  # "ddtree bench moe", "ddtree.engine", ...
    command: str = ""  # the command line, when a CLI wrote it
    version: str = ""  # ddtree package version
    git_commit: str | None = None  # of the source tree, when it is a git checkout


UNKNOWN_PROVENANCE = Provenance("unknown (schema 1 record)")


# ---- typed fields -------------------------------------------------------------------------


def _field(
    section: str,
    default: Any,
    wire: str | None,
    positive: bool,
    minimum: float | None,
    choices: Collection[str] | None,
):
    meta = {
        "section": section,
        "wire": wire,
        "positive": positive,
        "minimum": minimum,
        "choices": choices,
    }
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def config_field(
    default: Any = dataclasses.MISSING,
    *,
    wire: str | None = None,
    positive: bool = False,
    minimum: float | None = None,
    choices: Collection[str] | None = None,
) -> Any:
    """A field stored under ``config`` (``wire``: its key there, when it differs; ``choices``:
    the strings it may hold, looked up when a record is made, so a registry may grow)."""
    return _field("config", default, wire, positive, minimum, choices)


def summary_field(
    default: Any = dataclasses.MISSING,
    *,
    wire: str | None = None,
    positive: bool = False,
    minimum: float | None = None,
) -> Any:
    """A field stored under ``summary``."""
    return _field("summary", default, wire, positive, minimum, None)


def _section_fields(cls: type, section: str) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("section") == section]


def _wire_name(f: dataclasses.Field) -> str:
    return f.metadata.get("wire") or f.name


def _type_name(hint: Any) -> str:
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return "one of " + ", ".join(m.value for m in hint)
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if hint in names:
        return names[hint]
    origin = typing.get_origin(hint)
    if origin in (dict, list):
        return "an object" if origin is dict else "a list"
    if origin in (types.UnionType, typing.Union):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in hint.__args__)
    return str(hint)


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlevel = 3
INT_BITS = 64  # every integer field fits a signed or unsigned 64-bit integer (torch, numpy)


def _short(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters and three levels of nesting, for one-line
    errors (a record may hold a megabyte string or a deeply nested list)."""
    return _SHORT.repr(value)


def _key(key: str) -> str:
    """A mapping key as it stands in a field name: as written when printable and short, else
    its short repr (a key holding a newline would split the one-line error)."""
    return key if key.isprintable() and len(key) <= 40 else _short(key)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """``value`` checked against the annotation ``hint``; raises RecordError naming ``name``."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in hint.__args__:
            return None
        for arg in hint.__args__:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except RecordError:
                pass
        raise RecordError(f"field '{name}' is {_short(value)}; expected {_type_name(hint)}")
    ok = True
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        try:
            return hint(value)
        except ValueError:
            ok = False
    elif hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = _is_int(value)
        if ok and value.bit_length() > INT_BITS:
            raise RecordError(
                f"field '{name}' is {_short(value)}; expected a {INT_BITS}-bit integer"
            )
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            try:
                value = float(value)  # an integer past 1.8e308 overflows
            except OverflowError:
                value = math.inf
            if not math.isfinite(value):
                raise RecordError(f"field '{name}' is {_short(value)}; expected a finite number")
    elif hint is str:
        ok = isinstance(value, str)
    elif origin is list or hint is list:
        ok = isinstance(value, list)
        args = typing.get_args(hint)
        if ok and args:
            return [_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)]
    elif origin is dict or hint is dict:
        ok = isinstance(value, dict)
        args = typing.get_args(hint)
        if ok and args:
            return {
                _coerce(k, args[0], f"{name}.{_key(k)}"): _coerce(v, args[1], f"{name}.{_key(k)}")
                for k, v in value.items()
            }
    if not ok:
        raise RecordError(f"field '{name}' is {_short(value)}; expected {_type_name(hint)}")
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# ---- records -------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Record:
    """Fields every kind shares. Subclasses add typed ``config_field``/``summary_field``s."""

    kind: ClassVar[str] = ""
    point_keys: ClassVar[tuple[str, ...]] = ()  # keys every point must carry

    hardware: HardwareInfo
    provenance: Provenance = UNKNOWN_PROVENANCE
    points: list[dict[str, Any]] = field(default_factory=list)
    config_extra: dict[str, Any] = field(default_factory=dict)
    summary_extra: dict[str, Any] = field(default_factory=dict)
    created_utc: str = field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds")
    )
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            section = f.metadata.get("section")
            if section is None:
                continue
            name = f"{section}.{_wire_name(f)}"
            value = _coerce(getattr(self, f.name), hints[f.name], name)
            if value is not None and f.metadata["positive"] and not value > 0:
                raise RecordError(f"field '{name}' is {_short(value)}; expected a positive number")
            low = f.metadata["minimum"]
            if value is not None and low is not None and value < low:
                raise RecordError(f"field '{name}' is {_short(value)}; expected at least {low:g}")
            choices = f.metadata["choices"]
            if choices is not None and value not in choices:
                raise RecordError(
                    f"field '{name}' is {_short(value)}; expected one of {', '.join(choices)}"
                )
            setattr(self, f.name, value)
        if not isinstance(self.points, list):
            raise RecordError("field 'points' must be a list")
        for i, p in enumerate(self.points):
            missing = [k for k in self.point_keys if not isinstance(p, dict) or k not in p]
            if missing:
                raise RecordError(f"field 'points[{i}]' lacks {', '.join(missing)}")

    def _section(self, section: str) -> dict[str, Any]:
        out = {_wire_name(f): getattr(self, f.name) for f in _section_fields(type(self), section)}
        return {**out, **getattr(self, f"{section}_extra")}

    @property
    def config(self) -> dict[str, Any]:
        """The ``config`` section as written: typed fields, then the extra keys."""
        return self._section("config")

    @property
    def summary(self) -> dict[str, Any]:
        """The ``summary`` section as written."""
        return self._section("summary")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "kind": self.kind,
            "created_utc": self.created_utc,
            "provenance": dataclasses.asdict(self.provenance),
            "hardware": dataclasses.asdict(self.hardware),
            "config": self.config,
            "summary": self.summary,
            "points": self.points,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)


# the fields of an engine_run's target / drafter (``ModelInfo``) that readers compute with
MODEL_FIELDS: dict[str, Any] = {
    "name": str,
    "n_params": int,
    "num_layers": int,
    "dtype": str,
    "tp": int,
    "ep": int,
    "config_json": dict[str, Any],
}


@dataclass(kw_only=True)
class EngineRun(Record):
    """One decode run of the engine: a policy at one (block size, budget) over a prompt set.
    points: one per step ``{"tau": int, "step_s": float, "stage_s": {stage: seconds}}``, and
    ``"context_len"`` (tokens in the target's cache when the step starts) when known."""

    kind: ClassVar[str] = "engine_run"

    policy: str = config_field(choices=POLICIES)
    block_size: int = config_field(minimum=1)
    budget: int = config_field(minimum=0)
    temperature: float = config_field(minimum=0)
    top_k: int = config_field(0)
    top_p: float = config_field(1.0)
    seed: int = config_field(0)
    max_new_tokens: int = config_field(0)
    target: dict[str, Any] = config_field()  # ModelInfo fields + config_json
    drafter: dict[str, Any] | None = config_field(None)
    dtype: str = config_field()
    device: str = config_field()
    engine_mode: EngineMode = config_field(EngineMode.EAGER)
    width_buckets: list[int] = config_field([])  # compiled mode: verify widths padded up to
    tree_backend: str | None = config_field(None)  # ddtree.tree.backend(): "native" | "python"
    tp: int = config_field(1, minimum=1)
    concurrency: int = config_field(1, minimum=1)
    threads: int | None = config_field(None, minimum=1)  # torch CPU threads; None: not recorded
    prompt_set: dict[str, Any] = config_field({}, wire="prompts")  # {"count", "lengths"}

    mean_tau: float = summary_field(positive=True)
    tokens_per_s: float = summary_field(positive=True)
    step_s_mean: float = summary_field(positive=True)
    step_s_p50: float | None = summary_field(None)
    step_s_p90: float | None = summary_field(None)
    stage_s_mean: dict[Stage, float] = summary_field()
    overhead_fraction: float | None = summary_field(None)
    steps: int = summary_field(minimum=0)
    new_tokens: int = summary_field(minimum=0)
    prefill_s_mean: float | None = summary_field(None)
    prompts: int | None = summary_field(None)
    compile_s: float | None = summary_field(None)  # compiled mode's warm-up, outside steps

    def __post_init__(self) -> None:
        super().__post_init__()
        for section, model in (("target", self.target), ("drafter", self.drafter or {})):
            for key, hint in MODEL_FIELDS.items():
                if model.get(key) is not None:
                    _coerce(model[key], hint, f"config.{section}.{key}")
        for key, hint in (("count", int), ("lengths", list[int])):
            value = self.prompt_set.get(key)
            if value is None:
                continue
            value = _coerce(value, hint, f"config.prompts.{key}")
            if any(n < 0 for n in (value if isinstance(value, list) else [value])):
                raise RecordError(
                    f"field 'config.prompts.{key}' is {_short(value)}; expected counts >= 0"
                )

    @property
    def prompt_lengths(self) -> list[int]:
        return list(self.prompt_set.get("lengths") or [])


@dataclass(kw_only=True)
class BenchBandwidth(Record):
    """Memory bandwidth of one device by one method.
    points: ``{"buffer_bytes", "seconds", "bytes_per_s", ...}`` per buffer size."""

    kind: ClassVar[str] = "bench_bandwidth"

    device: str = config_field()
    method: str = config_field()
    threads: int | None = config_field(None)
    bytes_per_s: float = summary_field(positive=True)


@dataclass(kw_only=True)
class BenchMoe(Record):
    """One MoE layer forward against verify width M. points: ``{"m", "s_per_layer",
    "experts_touched", "bytes_moved", "bytes_per_s", "fraction_of_peak", ...}``."""

    kind: ClassVar[str] = "bench_moe"
    point_keys: ClassVar[tuple[str, ...]] = ("m", "s_per_layer")

    device: str = config_field()
    precision: str = config_field()
    hidden_size: int = config_field(minimum=1)
    moe_intermediate_size: int = config_field(minimum=1)
    n_routed_experts: int = config_field(minimum=1)
    top_k: int = config_field(minimum=1)
    peak_bytes_per_s: float = summary_field(positive=True)


@dataclass(kw_only=True)
class BenchTree(Record):
    """Tree build / layout timings. points: ``{"block_size", "budget", "builder", "topk_s",
    "build_s", "layout_s", ...}``."""

    kind: ClassVar[str] = "bench_tree"

    device: str = config_field()


@dataclass(kw_only=True)
class Acceptance(Record):
    """Measured acceptance of one policy at one (block size, budget), replayed exactly from a
    trace (``ddtree replay tau``): a greedy pass of ``target`` with ``drafter``'s top-K.
    ``tau_low``/``tau_high``: bootstrap interval over prompts (``interval`` central mass).
    points: one per prompt ``{"steps": int, "tokens": int}`` (tokens committed by steps)."""

    kind: ClassVar[str] = "acceptance"
    point_keys: ClassVar[tuple[str, ...]] = ("steps", "tokens")

    policy: str = config_field(choices=POLICIES)  # "chain" | "ddtree"
    block_size: int = config_field(minimum=2)
    budget: int = config_field(minimum=1)
    trace: str = config_field()  # the trace's fingerprint, "trace:<16 hex>"
    trace_path: str = config_field("")
    target: dict[str, Any] = config_field()  # name, architecture, n_params, ..., fingerprint
    drafter: dict[str, Any] = config_field()
    top_k: int = config_field(minimum=1)  # candidates per depth stored in the trace
    max_new_tokens: int = config_field(minimum=1)
    prompt_lengths: list[int] = config_field([])  # the trace's prompts, in tokens ([]: older)

    mean_tau: float = summary_field(minimum=1)
    tau_low: float = summary_field(minimum=1)
    tau_high: float = summary_field(minimum=1)
    interval: float = summary_field(positive=True)
    steps: int = summary_field(minimum=1)
    prompts: int = summary_field(minimum=1)
    tokens: int = summary_field(minimum=1)
    histogram: list[int] = summary_field()  # steps with tau = 1 .. B
    depth_acceptance: list[float | None] = summary_field()  # depth 1 .. B-1
    rank_acceptance: list[float | None] = summary_field()  # sibling rank 1 ..
    expected_tau: float = summary_field(minimum=1)  # the drafter surrogate's
    limited_steps: int = summary_field(0, minimum=0)  # trees that reached the trace's top-K


@dataclass(kw_only=True)
class BenchAllreduce(Record):
    """All-reduce time against message size over a group of ``world_size`` ranks. points:
    ``{"m", "bytes", "seconds", "algbw_bytes_per_s", "bus_bytes_per_s", ...}``; the summary is
    the fit ``seconds = latency_s + 2(n-1)/n x bytes / bus_bytes_per_s``."""

    kind: ClassVar[str] = "bench_allreduce"
    point_keys: ClassVar[tuple[str, ...]] = ("bytes", "seconds")

    device: str = config_field()
    backend: str = config_field()  # "gloo" | "nccl"
    world_size: int = config_field(minimum=2)
    dtype: str = config_field()
    hidden_size: int = config_field(minimum=1)
    latency_s: float = summary_field(minimum=0)
    bus_bytes_per_s: float = summary_field(positive=True)


@dataclass(kw_only=True)
class BenchAttention(Record):
    """One layer's tree-verify attention, the split (prefix + tail, merged) method against the
    dense additive mask. points: ``{"context", "budget", "method", "median_s", "p10_s",
    "p90_s", "peak_bytes", "max_abs_diff"}``."""

    kind: ClassVar[str] = "bench_attention"
    point_keys: ClassVar[tuple[str, ...]] = ("context", "budget", "method", "median_s")

    device: str = config_field()
    dtype: str = config_field()
    heads: int = config_field(minimum=1)
    kv_heads: int = config_field(minimum=1)
    head_dim: int = config_field(minimum=1)


@dataclass(kw_only=True)
class BenchLinear(Record):
    """A preset's linear weights, each linear kernel against verify width M. points:
    ``{"shape", "out_features", "in_features", "kernel", "m", "median_s", "p10_s", "p90_s",
    "bytes_per_s", "vs_m1", "max_abs_diff"}``; summary: per kernel, one forward's linear
    layers at each M (``seconds_by_m``) and over their M = 1 time (``vs_m1``),
    ``ddtree.bench.linear.forward_seconds``."""

    kind: ClassVar[str] = "bench_linear"
    point_keys: ClassVar[tuple[str, ...]] = ("shape", "kernel", "m", "median_s")

    preset: str = config_field()
    device: str = config_field()
    dtype: str = config_field()
    kernels: list[str] = config_field()


RECORD_KINDS: dict[str, type[Record]] = {
    cls.kind: cls
    for cls in (
        EngineRun,
        BenchBandwidth,
        BenchMoe,
        BenchTree,
        Acceptance,
        BenchAllreduce,
        BenchAttention,
        BenchLinear,
    )
}
"""kind -> its dataclass. Adding a kind: one dataclass above and one entry here."""


def make_record(
    kind: str,
    hardware: HardwareInfo,
    config: dict[str, Any],
    summary: dict[str, Any],
    points: list | None = None,
    provenance: Provenance = UNKNOWN_PROVENANCE,
    created_utc: str | None = None,
    schema: int = SCHEMA_VERSION,
) -> Record:
    """A typed record from the wire sections (``config``/``summary`` dicts)."""
    cls = RECORD_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RecordError(
            f"field 'kind' is {_short(kind)}; expected one of {', '.join(RECORD_KINDS)}"
        )
    kwargs: dict[str, Any] = {}
    for section, data in (("config", config), ("summary", summary)):
        if not isinstance(data, dict):
            raise RecordError(f"field '{section}' must be an object")
        fields = _section_fields(cls, section)
        wire = {_wire_name(f): f for f in fields}
        missing = [
            n
            for n, f in wire.items()
            if n not in data
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise RecordError(f"{kind} record: field '{section}' lacks {', '.join(missing)}")
        kwargs.update({wire[k].name: v for k, v in data.items() if k in wire})
        kwargs[f"{section}_extra"] = {k: v for k, v in data.items() if k not in wire}
    if created_utc is not None:
        kwargs["created_utc"] = created_utc
    return cls(
        hardware=hardware,
        provenance=provenance,
        points=[] if points is None else points,
        schema=schema,
        **kwargs,
    )


def from_dict(data: Any, where: str = "record") -> Record:
    """A record from one parsed JSON line; errors start with ``where`` (file:line)."""
    if not isinstance(data, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(data).__name__}")
    problem = _json_problem(data)
    if problem is not None:
        raise RecordError(f"{where}: {problem}")
    missing = [k for k in ("kind", "hardware", "config", "summary") if k not in data]
    if missing:
        raise RecordError(f"{where}: missing field(s) {', '.join(missing)}")
    schema = data.get("schema", 1)
    if not _is_int(schema) or schema not in READABLE_SCHEMAS:
        raise RecordError(
            f"{where}: field 'schema' is {_short(schema)}; this ddtree reads "
            f"{', '.join(map(str, READABLE_SCHEMAS))}"
        )
    hw = data["hardware"]
    if not isinstance(hw, dict) or "cpu_model" not in hw or "cpu_cores" not in hw:
        raise RecordError(f"{where}: field 'hardware' needs at least cpu_model and cpu_cores")
    prov = data.get("provenance")
    created = data.get("created_utc", "")
    try:
        provenance = UNKNOWN_PROVENANCE
        if prov is not None:
            if not isinstance(prov, dict) or not isinstance(prov.get("producer"), str):
                raise RecordError("field 'provenance' needs a 'producer' string")
            provenance = _typed(Provenance, prov, "provenance")
        if not isinstance(created, str):
            raise RecordError(f"field 'created_utc' is {_short(created)}; expected a string")
        return make_record(
            data["kind"],
            _typed(HardwareInfo, hw, "hardware"),
            data["config"],
            data["summary"],
            data.get("points", []),
            provenance,
            created,
            SCHEMA_VERSION,
        )
    except RecordError as exc:
        raise RecordError(f"{where}: {exc}") from None


def _typed(cls: type, data: dict[str, Any], section: str) -> Any:
    """``cls`` (HardwareInfo, Provenance) from ``data``'s keys that are its fields, each
    checked against its annotation; other keys are dropped."""
    hints = _hints(cls)
    return cls(
        **{
            f.name: _coerce(data[f.name], hints[f.name], f"{section}.{f.name}")
            for f in dataclasses.fields(cls)
            if f.name in data
        }
    )


RECORDS_FILE = "a records file (JSON lines) or a new file's path"


def check_records_file(path: str | os.PathLike) -> Path:
    """The file ``write_records`` would append to at ``path``, checked without writing, so a
    command can refuse a bad ``--records`` before its work: a regular file (a symlink is
    followed to its target; a folder, device, named pipe, socket or dangling link is refused,
    see ``ddtree.files``), writable, with no other hard link (appending in place would change
    the other names too), holding records (its first line starts a JSON object: a TOML
    scenario or a trace is refused), or a new path. An ``OSError`` names the path."""
    target = check_output_file(path, RECORDS_FILE)
    if target.exists():
        links = target.stat().st_nlink
        if links > 1:
            raise OSError(
                errno.EINVAL,
                f"has {links} hard links (appending would change the other names too); "
                "expected a records file of its own",
                str(target),
            )
        with open(target, "rb") as fh:
            _check_records_head(fh.read(_HEAD_BYTES), target)
    return target


_HEAD_BYTES = 4096


def _check_records_head(head: bytes, path: Path) -> None:
    """``head`` (a file's first bytes) starts a JSON object, or the file is empty."""
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(head).lstrip()
    if text and not text.startswith("{"):
        raise OSError(
            errno.EINVAL,
            f"is not a records file (its first line does not start a JSON object); expected "
            f"{RECORDS_FILE}",
            str(path),
        )


def _lock(fd: int, operation: int) -> None:
    """flock, where the filesystem has it (some network and FUSE ones do not: then one
    O_APPEND write per call is what keeps two writers' lines apart)."""
    try:
        fcntl.flock(fd, operation)
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def _complete_length(fd: int, size: int) -> int:
    """Bytes of the file up to and including its last newline."""
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        chunk = os.pread(fd, end - start, start)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            return start + cut + 1
        end = start
    return 0


def write_records(path: str | os.PathLike, records: Iterable[Record], append: bool = True) -> Path:
    """Append records to ``path`` as JSON lines (``append=False``: replace its records).

    Appending is in place, under an exclusive ``flock`` of the file, in one ``O_APPEND``
    write: two processes appending at once never interleave or lose a line, and the file
    keeps its mode, owner and links. A write that fails half-way (a full disk) or a signal
    that cuts it is undone (the file is truncated back to its old length) and an ``OSError``
    says so; a signal under ``ddtree.signals`` waits until the records are written. A
    truncated last line left by a writer killed mid-line (``kill -9``) is dropped with a
    ``RecordWarning`` before appending. Replacing goes through a temporary file renamed over
    the old one. What ``check_records_file`` refuses is refused here too, before any record
    is written. Creates parent folders; returns ``path``."""
    path = Path(path)
    records = list(records)
    data = "".join(r.to_json() + "\n" for r in records).encode()  # a bad record writes nothing
    target = check_records_file(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    what = f"{len(records)} record{'' if len(records) == 1 else 's'}"
    if not append:
        with replace_atomically(target, RECORDS_FILE) as partial:
            partial.write_bytes(data)
        return path
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(target, flags, 0o666)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the check and the open
            raise OSError(
                errno.EINVAL, f"is not a regular file; expected {RECORDS_FILE}", str(target)
            )
        _lock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size  # now: other writers' records included
        _check_records_head(os.pread(fd, _HEAD_BYTES, 0), target)
        keep = _complete_length(fd, size)
        if keep < size:
            warnings.warn(
                f"{target}: dropped a truncated last line ({size - keep} bytes, a writer killed "
                "mid-write?) before appending; kept the records before it",
                RecordWarning,
                stacklevel=2,
            )
            os.ftruncate(fd, keep)
        with deferred():
            _append(fd, data, keep, target, what)
    finally:
        os.close(fd)  # and the lock with it
    return path


def _append(fd: int, data: bytes, old_size: int, path: Path, what: str) -> None:
    """Write ``data`` at the end of ``fd``; on any failure cut the file back to ``old_size``."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException as exc:
        os.ftruncate(fd, old_size)
        if isinstance(exc, OSError):
            raise failed_write(
                exc, path, f"appending {what}", "none were written, the file is as it was"
            ) from None
        raise


def _read_text(path: Path) -> str:
    """The text of a records file, read under a shared lock (never half of a line another
    process is appending)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise RecordError(f"{path}: no such records file") from None
    if stat.S_ISDIR(st.st_mode):
        raise RecordError(f"{path}: is a folder; expected a .jsonl records file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block, a device never end
        raise RecordError(f"{path}: is not a regular file; expected a .jsonl records file")
    with open(path, "rb") as fh:
        _lock(fh.fileno(), fcntl.LOCK_SH)
        data = fh.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not a text (JSON lines) file") from None


MAX_NESTING = 64  # records nest a few levels (config.target.config_json.rope_scaling)


def _not_json(word: str) -> float:
    raise ValueError(f"{word} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _json_problem(value: Any) -> str | None:
    """What keeps ``value`` from being written back as the JSON it came from, if anything:
    nesting past ``MAX_NESTING``, a NaN or infinite number, a key that is not a string, a
    value of no JSON type. Iterative, so no depth reaches the recursion limit."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= MAX_NESTING:
                return f"JSON nested too deeply (over {MAX_NESTING} levels)"
            if isinstance(item, dict):
                if not all(isinstance(k, str) for k in item):
                    return "an object key that is not a string"
                item = item.values()
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, float) and not math.isfinite(item):
            return f"{item} is not JSON"
        elif item is not None and not isinstance(item, (str, int, float)):
            return f"a {type(item).__name__} is not JSON"
    return None


def _parse_line(line: str, where: str) -> Any:
    """One JSON line as Python values; NaN, Infinity and numbers past a float are refused (no
    writer of JSON makes them, and a record holding one could not be written back)."""
    try:
        return json.loads(line, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:
        raise RecordError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, a constant or float above, too many digits
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc).split(";")[0]
        raise RecordError(f"{where}: not valid JSON ({_SHORT.repr(reason)[1:-1]})") from None


def _read_lines(path: Path) -> Iterator[tuple[str, str, Record]]:
    """(file:line, the line, its record) of every record line of ``path``; skips what
    ``iter_records`` says it skips."""
    text = _read_text(path)
    lines = text.split("\n")  # only newlines end a record (JSON strings may hold U+2028)
    if lines and lines[-1] == "":
        lines.pop()
    truncated_tail = bool(text) and not text.endswith("\n")
    for lineno, line in enumerate(lines, 1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            data = _parse_line(line, where)
        except RecordError:
            if lineno == len(lines) and truncated_tail:
                warnings.warn(
                    f"{where}: truncated last line (a writer killed mid-write?); skipped it, "
                    "kept the records before it",
                    RecordWarning,
                    stacklevel=3,
                )
                return
            raise
        schema = data.get("schema", 1) if isinstance(data, dict) else None
        if _is_int(schema) and schema > SCHEMA_VERSION:
            warnings.warn(
                f"{where}: record of schema version {_short(schema)}, newer than this ddtree reads "
                f"({SCHEMA_VERSION}); skipped it, kept the others",
                RecordWarning,
                stacklevel=3,
            )
            continue
        yield where, line, from_dict(data, where)


def iter_records(path: str | os.PathLike) -> Iterator[Record]:
    """Records of one file. A newer schema version or a truncated last line is skipped with
    a ``RecordWarning`` naming file:line; any other bad line is a ``RecordError``."""
    for _where, _line, record in _read_lines(Path(path)):
        yield record


def read_records(
    paths: str | os.PathLike | Iterable[str | os.PathLike], kind: str | None = None
) -> list[Record]:
    """Read records from one file, a folder of ``*.jsonl`` files, or several of either.

    Each record counts once: a line identical to one already read (the same file named twice,
    a folder and a file in it, a copied file, a record appended twice) is skipped with one
    ``RecordWarning`` per file, naming where it was first read. Two measurements never make
    the same line: each holds its own timings and its creation time."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Record] = []
    first: dict[str, str] = {}  # sha256 of a record's line -> the file:line it was read at
    for p in paths:
        p = Path(p)
        files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
        for f in files:
            copies: list[tuple[str, str]] = []
            for where, line, record in _read_lines(f):
                key = hashlib.sha256(line.strip().encode("utf-8", "surrogatepass")).hexdigest()
                if key in first:
                    copies.append((where, first[key]))
                    continue
                first[key] = where
                if kind is None or record.kind == kind:
                    out.append(record)
            if copies:
                (where, original), more = copies[0], len(copies) - 1
                warnings.warn(
                    f"{where}: the same record as {original}"
                    + (f" (and {more} more such lines in {f})" if more else "")
                    + "; skipped, each record counts once",
                    RecordWarning,
                    stacklevel=2,
                )
    return out
