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
  command line, the package version and the git commit when known.
- ``Stage`` names the timed stages of a decode step; the engine's clock, the engine_run
  summary, the estimator's cost components and its stage anchors all use it.
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
``bool``, ``dict``, ``list``, a ``StrEnum``, ``X | None``, ``dict[Stage, float]``); every error
names the file, the line and the field. Reading is forgiving where a file can honestly be
damaged: a record of a newer schema version is skipped with a warning naming file:line, and
so is a truncated last line (a writer killed mid-line); the good records are kept. Writing
is atomic: the new content (old records first when appending) goes to a temporary file in
the same folder, which then replaces the target.

Schema history: 1 had no ``provenance`` and no ``engine_run.config.engine_mode``; version-1
files are read as eager runs of an unknown producer.

This module imports nothing heavy (no torch), so ``ddtree.perf`` can read records cheaply.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import types
import typing
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)


class Stage(StrEnum):
    """A timed stage. A decode step runs ``STEP_STAGES`` in order; ``prefill`` is the target
    forward over the prompt, before the first step."""

    PREFILL = "prefill"
    DRAFT = "draft"  # drafter forward over the block
    TOPK = "topk"  # top-k over the drafter's (B-1) x V logits
    BUILD = "build"  # best-first tree build
    LAYOUT = "layout"  # verify positions and the ancestor-only mask
    VERIFY = "verify"  # one target forward over the M tree tokens
    ACCEPT = "accept"  # walk the verified tree
    COMMIT = "commit"  # keep the accepted path's KV entries
    OTHER = "other"  # the rest of the step


STEP_STAGES: tuple[Stage, ...] = tuple(s for s in Stage if s is not Stage.PREFILL)
MODEL_STAGES: frozenset[Stage] = frozenset({Stage.DRAFT, Stage.VERIFY})
"""Stages spent in model forwards; every other step stage is engine overhead."""


class Policy(StrEnum):
    """How a decode step proposes tokens: ``ar`` (no drafter, M = 1), ``chain`` (the drafter's
    top-1 per position, budget B-1, a linear mask), ``ddtree`` (best-first tree of N nodes)."""

    AR = "ar"
    CHAIN = "chain"
    DDTREE = "ddtree"


class EngineMode(StrEnum):
    """How the engine ran its forwards: ``eager`` (Python dispatch per op) or ``compiled``
    (torch.compile: inductor C++ on CPU, CUDA graphs on CUDA)."""

    EAGER = "eager"
    COMPILED = "compiled"


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

    @staticmethod
    def collect() -> HardwareInfo:
        """Describe this machine (torch and CUDA only if torch is already importable)."""
        torch_version = gpu_name = None
        gpu_count = 0
        try:
            import torch

            torch_version = torch.__version__
            if torch.cuda.is_available():
                gpu_count = torch.cuda.device_count()
                gpu_name = torch.cuda.get_device_name(0)
        except ImportError:
            pass
        return HardwareInfo(
            cpu_model=_cpu_model(),
            cpu_cores=os.cpu_count() or 1,
            torch_version=torch_version,
            gpu_name=gpu_name,
            gpu_count=gpu_count,
            hostname=platform.node(),
        )

    @property
    def label(self) -> str:
        """A short name for tables: the GPU if any, else the CPU."""
        if self.gpu_name:
            return f"{self.gpu_count}x {self.gpu_name}"
        return f"{self.cpu_model} ({self.cpu_cores} cores)"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


@dataclass(frozen=True)
class Provenance:
    """Who wrote a record: the producer, its command line, the package version and commit."""

    producer: str  # "ddtree bench moe", "ddtree.engine", ...
    command: str = ""  # the command line, when a CLI wrote it
    version: str = ""  # ddtree package version
    git_commit: str | None = None  # of the source tree, when it is a git checkout

    @staticmethod
    def here(producer: str) -> Provenance:
        """This process: ``sys.argv``, the installed ddtree version, the checkout's commit."""
        return Provenance(producer, " ".join(sys.argv), _version(), _git_commit())


UNKNOWN_PROVENANCE = Provenance("unknown (schema 1 record)")


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddtree")
    except PackageNotFoundError:
        return ""


@functools.cache
def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


# ---- typed fields -------------------------------------------------------------------------


def _field(section: str, default: Any, wire: str | None, positive: bool, minimum: float | None):
    meta = {"section": section, "wire": wire, "positive": positive, "minimum": minimum}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def config_field(
    default: Any = dataclasses.MISSING,
    *,
    wire: str | None = None,
    positive: bool = False,
    minimum: float | None = None,
) -> Any:
    """A field stored under ``config`` (``wire``: its key there, when it differs)."""
    return _field("config", default, wire, positive, minimum)


def summary_field(
    default: Any = dataclasses.MISSING,
    *,
    wire: str | None = None,
    positive: bool = False,
    minimum: float | None = None,
) -> Any:
    """A field stored under ``summary``."""
    return _field("summary", default, wire, positive, minimum)


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
        raise RecordError(f"field '{name}' is {value!r}; expected {_type_name(hint)}")
    ok = True
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        try:
            return hint(value)
        except ValueError:
            ok = False
    elif hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise RecordError(f"field '{name}' is {value!r}; expected a finite number")
        if ok:
            value = float(value)
    elif hint is str:
        ok = isinstance(value, str)
    elif origin is list or hint is list:
        ok = isinstance(value, list)
    elif origin is dict or hint is dict:
        ok = isinstance(value, dict)
        args = typing.get_args(hint)
        if ok and args:
            return {
                _coerce(k, args[0], f"{name}.{k}"): _coerce(v, args[1], f"{name}.{k}")
                for k, v in value.items()
            }
    if not ok:
        raise RecordError(f"field '{name}' is {value!r}; expected {_type_name(hint)}")
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
                raise RecordError(f"field '{name}' is {value!r}; expected a positive number")
            low = f.metadata["minimum"]
            if value is not None and low is not None and value < low:
                raise RecordError(f"field '{name}' is {value!r}; expected at least {low:g}")
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


@dataclass(kw_only=True)
class EngineRun(Record):
    """One decode run of the engine: a policy at one (block size, budget) over a prompt set.
    points: one per step ``{"tau": int, "step_s": float, "stage_s": {stage: seconds}}``, and
    ``"context_len"`` (tokens in the target's cache when the step starts) when known."""

    kind: ClassVar[str] = "engine_run"

    policy: Policy = config_field()
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

    policy: str = config_field()  # "chain" | "ddtree"
    block_size: int = config_field(minimum=2)
    budget: int = config_field(minimum=1)
    trace: str = config_field()  # the trace's fingerprint, "trace:<16 hex>"
    trace_path: str = config_field("")
    target: dict[str, Any] = config_field()  # name, architecture, n_params, ..., fingerprint
    drafter: dict[str, Any] = config_field()
    top_k: int = config_field(minimum=1)  # candidates per depth stored in the trace
    max_new_tokens: int = config_field(minimum=1)

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


RECORD_KINDS: dict[str, type[Record]] = {
    cls.kind: cls
    for cls in (EngineRun, BenchBandwidth, BenchMoe, BenchTree, Acceptance, BenchAllreduce)
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
    cls = RECORD_KINDS.get(kind)
    if cls is None:
        raise RecordError(f"field 'kind' is {kind!r}; expected one of {', '.join(RECORD_KINDS)}")
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
    missing = [k for k in ("kind", "hardware", "config", "summary") if k not in data]
    if missing:
        raise RecordError(f"{where}: missing field(s) {', '.join(missing)}")
    schema = data.get("schema", 1)
    if schema not in READABLE_SCHEMAS:
        raise RecordError(
            f"{where}: field 'schema' is {schema!r}; this ddtree reads "
            f"{', '.join(map(str, READABLE_SCHEMAS))}"
        )
    hw = data["hardware"]
    if not isinstance(hw, dict) or "cpu_model" not in hw or "cpu_cores" not in hw:
        raise RecordError(f"{where}: field 'hardware' needs at least cpu_model and cpu_cores")
    known = {f.name for f in dataclasses.fields(HardwareInfo)}
    prov = data.get("provenance")
    try:
        provenance = UNKNOWN_PROVENANCE
        if prov is not None:
            if not isinstance(prov, dict) or not isinstance(prov.get("producer"), str):
                raise RecordError("field 'provenance' needs a 'producer' string")
            names = {f.name for f in dataclasses.fields(Provenance)}
            provenance = Provenance(**{k: v for k, v in prov.items() if k in names})
        return make_record(
            data["kind"],
            HardwareInfo(**{k: v for k, v in hw.items() if k in known}),
            data["config"],
            data["summary"],
            data.get("points", []),
            provenance,
            str(data.get("created_utc", "")),
            SCHEMA_VERSION,
        )
    except RecordError as exc:
        raise RecordError(f"{where}: {exc}") from None


def write_records(path: str | os.PathLike, records: Iterable[Record], append: bool = True) -> Path:
    """Write records as JSON lines, atomically: the old content (when appending) and the new
    records go to a temporary file beside ``path``, which then replaces it. A killed writer
    leaves the old file as it was. A truncated last line in the old file (from a writer
    without this guarantee) is dropped with a ``RecordWarning``. Creates parent folders."""
    path = Path(path)
    lines = [r.to_json() + "\n" for r in records]  # serialise first: a bad record writes nothing
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_bytes() if append and path.exists() else b""
    if old and not old.endswith(b"\n"):
        keep = old.rfind(b"\n") + 1
        warnings.warn(
            f"{path}: dropped a truncated last line ({len(old) - keep} bytes, a writer killed "
            "mid-write?) before appending; kept the records before it",
            RecordWarning,
            stacklevel=2,
        )
        old = old[:keep]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(old)
            fh.write("".join(lines).encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def iter_records(path: str | os.PathLike) -> Iterator[Record]:
    """Records of one file. A newer schema version or a truncated last line is skipped with
    a ``RecordWarning`` naming file:line; any other bad line is a ``RecordError``."""
    path = Path(path)
    if not path.exists():
        raise RecordError(f"{path}: no such records file")
    if path.is_dir():
        raise RecordError(f"{path}: is a folder; expected a .jsonl records file")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not a text (JSON lines) file") from None
    lines = text.splitlines()
    truncated_tail = bool(text) and not text.endswith("\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and truncated_tail:
                warnings.warn(
                    f"{where}: truncated last line (a writer killed mid-write?); skipped it, "
                    "kept the records before it",
                    RecordWarning,
                    stacklevel=2,
                )
                return
            raise RecordError(f"{where}: not valid JSON ({exc.msg})") from None
        schema = data.get("schema", 1) if isinstance(data, dict) else None
        if isinstance(schema, int) and schema > SCHEMA_VERSION:
            warnings.warn(
                f"{where}: record of schema version {schema}, newer than this ddtree reads "
                f"({SCHEMA_VERSION}); skipped it, kept the others",
                RecordWarning,
                stacklevel=2,
            )
            continue
        yield from_dict(data, where)


def read_records(
    paths: str | os.PathLike | Iterable[str | os.PathLike], kind: str | None = None
) -> list[Record]:
    """Read records from one file, a folder of ``*.jsonl`` files, or several of either."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[Record] = []
    for p in paths:
        p = Path(p)
        files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
        for f in files:
            out.extend(r for r in iter_records(f) if kind is None or r.kind == kind)
    return out
