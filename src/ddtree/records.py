"""Measurement records: the one schema the engine and benchmarks write and the estimator reads.

A records file is JSON lines, one ``Record`` per line::

    {"schema": 1, "kind": "engine_run", "created_utc": "...", "hardware": {...},
     "config": {...}, "summary": {...}, "points": [...]}

- ``kind`` says what was measured (see ``KINDS``); ``config`` holds what was held fixed
  (model identity and sizes, policy, block size, budget, dtype, ...), ``summary`` the headline
  figures, ``points`` the per-step or per-size measurements.
- Units live in field names (``step_s``, ``tokens_per_s``, ``bytes_per_s``); seconds, bytes,
  tokens. No tera/giga scaling inside records.

This module imports nothing heavy (no torch), so ``ddtree.perf`` can read records cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

# kind -> (required config keys, required summary keys)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # One decode run of the engine: a policy at one (block size, budget) over a prompt set.
    # points: one per step {"tau": int, "step_s": float, "stage_s": {stage: seconds}}.
    "engine_run": (
        ("policy", "block_size", "budget", "temperature", "target", "dtype", "device"),
        ("mean_tau", "tokens_per_s", "step_s_mean", "stage_s_mean", "steps", "new_tokens"),
    ),
    # Memory bandwidth of one device. points: {"bytes": int, "seconds": float, "bytes_per_s": float}.
    "bench_bandwidth": (("device", "method"), ("bytes_per_s",)),
    # One MoE layer forward against verify width M. points: {"m": int, "s_per_layer": float,
    # "experts_touched": float, "bytes_moved": int, "bytes_per_s": float, "fraction_of_peak": float}.
    "bench_moe": (
        (
            "device",
            "precision",
            "hidden_size",
            "moe_intermediate_size",
            "n_routed_experts",
            "top_k",
        ),
        ("peak_bytes_per_s",),
    ),
    # Tree build / layout timings. points: {"block_size", "budget", "builder", "topk_s", "build_s", "layout_s"}.
    "bench_tree": (("device",), ()),
}

ENGINE_STAGES = ("draft", "topk", "build", "layout", "verify", "accept", "commit", "other")
"""Stages of one decode step, in order. ``other`` is the rest of the step."""


class RecordError(ValueError):
    """A records file or record that does not follow the schema."""


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


@dataclass
class Record:
    kind: str
    hardware: HardwareInfo
    config: dict[str, Any]
    summary: dict[str, Any]
    points: list[dict[str, Any]] = field(default_factory=list)
    created_utc: str = field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds")
    )
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        validate(self)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=False, allow_nan=False)

    @staticmethod
    def from_dict(data: dict[str, Any], where: str = "record") -> Record:
        if not isinstance(data, dict):
            raise RecordError(f"{where}: expected a JSON object, got {type(data).__name__}")
        missing = [k for k in ("kind", "hardware", "config", "summary") if k not in data]
        if missing:
            raise RecordError(f"{where}: missing field(s) {', '.join(missing)}")
        schema = data.get("schema", SCHEMA_VERSION)
        if schema != SCHEMA_VERSION:
            raise RecordError(
                f"{where}: field 'schema' is {schema!r}, this ddtree reads {SCHEMA_VERSION}"
            )
        hw = data["hardware"]
        if not isinstance(hw, dict) or "cpu_model" not in hw or "cpu_cores" not in hw:
            raise RecordError(f"{where}: field 'hardware' needs at least cpu_model and cpu_cores")
        known = {f.name for f in dataclasses.fields(HardwareInfo)}
        try:
            return Record(
                kind=data["kind"],
                hardware=HardwareInfo(**{k: v for k, v in hw.items() if k in known}),
                config=data["config"],
                summary=data["summary"],
                points=data.get("points", []),
                created_utc=data.get("created_utc", ""),
                schema=schema,
            )
        except RecordError as exc:
            raise RecordError(f"{where}: {exc}") from None


def validate(record: Record) -> None:
    if record.kind not in KINDS:
        raise RecordError(f"field 'kind' is {record.kind!r}; expected one of {', '.join(KINDS)}")
    need_config, need_summary = KINDS[record.kind]
    for name, need, got in (
        ("config", need_config, record.config),
        ("summary", need_summary, record.summary),
    ):
        if not isinstance(got, dict):
            raise RecordError(f"field '{name}' must be an object")
        missing = [k for k in need if k not in got]
        if missing:
            raise RecordError(f"{record.kind} record: field '{name}' lacks {', '.join(missing)}")
    if not isinstance(record.points, list):
        raise RecordError("field 'points' must be a list")


def write_records(path: str | os.PathLike, records: Iterable[Record], append: bool = True) -> Path:
    """Append (or write) records as JSON lines; creates parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w") as fh:
        for record in records:
            fh.write(record.to_json() + "\n")
    return path


def iter_records(path: str | os.PathLike) -> Iterator[Record]:
    path = Path(path)
    if not path.exists():
        raise RecordError(f"{path}: no such records file")
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecordError(f"{where}: not valid JSON ({exc.msg})") from None
            yield Record.from_dict(data, where)


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
