"""Check the estimator against published decode measurements, leave-one-source-out.

A validation folder holds one TOML file per independent source (``examples/validation``)::

    [source]
    key = "benhamm-b200-sweep"            # points of one key are held out together
    title = "..."; url = "..."; where = "Results Summary table"

    [defaults]                             # any point field, for every point of the file
    hardware = "b200"; tp = 8; engine = "graphs"; engine_name = "SGLang 0.5.8 (CUDA graphs)"

    [[point]]
    name = "b200-qwen3-235b-a22b-ar"
    what = "TPOT at concurrency 1, random 1K in / 1K out"
    model = { preset = "qwen3-235b-a22b" }  # or config = "path/config.json"; precision = {...}
    policy = "ar"
    step = "6.70 ms"                       # or tokens_per_s (aggregate over the C requests)
    note = "why this point may be off"     # printed when the prediction misses by > 30%

Every point is a step anchor (``scenario.step_anchor``: hardware, tp, concurrency, context,
engine, policy, block_size, budget, tau, drafter). ``validate`` calibrates on every other
source's points, predicts each held-out point (p10/p50/p90 from the posterior), and reports
the error of the p50 per point and the mean absolute percentage error (MAPE).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddtree.perf import units as u
from ddtree.perf.calibrate import Calibration, calibrate, posterior_samples
from ddtree.perf.catalog import CatalogError, load_catalog
from ddtree.perf.cost import ENGINES, default_params, step_cost
from ddtree.perf.model import ModelError, load_model
from ddtree.perf.scenario import (
    STEP_ANCHOR_KEYS,
    ParseContext,
    ScenarioError,
    StepAnchor,
    check_keys,
    drafter_from,
    noise_of,
    step_anchor,
)

EXPLAIN_ABOVE = 0.30  # a point off by more than this must carry a note
DEFAULT_NOISE = 0.05  # a published figure: run-to-run spread and reading off a table (assumed)
_SOURCE_KEYS = {"key", "title", "url", "where", "published"}
_POINT_KEYS = STEP_ANCHOR_KEYS | {"name", "what", "model", "drafter", "noise", "engine_name",
                                  "note", "measured"}  # fmt: skip


@dataclass(frozen=True)
class Source:
    key: str
    title: str
    url: str
    where: str  # table / section
    path: str


@dataclass
class ValidationPoint:
    anchor: StepAnchor
    source: Source
    what: str  # what was measured
    engine_name: str  # the engine and its mode, as published
    measured: str  # the figure as published (e.g. "TPOT 6.70 ms")
    note: str  # why it may be off (printed when it is)

    @property
    def name(self) -> str:
        return self.anchor.name


@dataclass
class ValidationRow:
    point: ValidationPoint
    measured_tokens_per_s: float
    predicted_tokens_per_s: float  # at the calibrated (MAP) parameters
    band_tokens_per_s: dict[int, float]  # p10/p50/p90 over the posterior
    calibrated_on: list[str]  # source keys
    posterior: str  # how the band's samples were drawn

    @property
    def rel_error(self) -> float:
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1.0

    @property
    def needs_note(self) -> bool:
        return abs(self.rel_error) > EXPLAIN_ABOVE

    @property
    def explained(self) -> bool:
        return not self.needs_note or bool(self.point.note)


@dataclass
class Validation:
    rows: list[ValidationRow]
    folder: str
    samples: int

    @property
    def mape(self) -> float:
        return float(np.mean([abs(r.rel_error) for r in self.rows]))

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(r.point.source.key for r in self.rows))


def load_points(folder: str | Path) -> list[ValidationPoint]:
    """Every ``*.toml`` in ``folder``; errors name the file and the field."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ScenarioError(f"{folder}: no such validation folder")
    files = sorted(folder.glob("*.toml"))
    if not files:
        raise ScenarioError(f"{folder}: no *.toml validation files")
    points: list[ValidationPoint] = []
    for path in files:
        try:
            points += _load_file(path)
        except (u.UnitError, CatalogError, ModelError) as exc:
            msg = str(exc)
            raise ScenarioError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    names = [p.name for p in points]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ScenarioError(f"{folder}: point names must be unique; repeated: {', '.join(dup)}")
    return points


def _load_file(path: Path) -> list[ValidationPoint]:
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{where}: not valid TOML ({exc})") from None
    check_keys(data, {"source", "defaults", "point"}, where)
    src = data.get("source")
    if not isinstance(src, dict) or not src.get("key") or not src.get("url"):
        raise ScenarioError(f"{where}: [source] needs 'key' and 'url' (the citation)")
    check_keys(src, _SOURCE_KEYS, f"{where}: source")
    source = Source(str(src["key"]), str(src.get("title", "")), str(src["url"]),
                    str(src.get("where", "")), where)  # fmt: skip
    defaults = data.get("defaults") or {}
    check_keys(defaults, _POINT_KEYS - {"name"}, f"{where}: defaults")
    ctx = ParseContext(where, load_catalog(), dict(ENGINES), {}, None, [])
    out = []
    for i, raw in enumerate(data.get("point") or []):
        if not isinstance(raw, dict):
            raise ScenarioError(f"{where}: point[{i}] must be a table ([[point]])")
        a = {**defaults, **raw}
        name = str(a.get("name", f"{source.key}-{i}"))
        w = f"{where}: point[{i}] ({name})"
        check_keys(a, _POINT_KEYS, w)
        for key in ("model", "what"):
            if key not in a:
                raise ScenarioError(f"{w}: missing field '{key}'")
        model = load_model(a["model"], f"{w}.model", path.parent)
        drafter = drafter_from(a["drafter"], f"{w}.drafter") if "drafter" in a else None
        noise = noise_of(a.get("noise", DEFAULT_NOISE), w)
        anchor = step_anchor(a, name, model, drafter, ctx, w, f"{source.key}: {source.url}", noise)
        out.append(ValidationPoint(anchor, source, str(a["what"]), str(a.get("engine_name", "")),
                                   str(a.get("measured", "")), str(a.get("note", ""))))  # fmt: skip
    if not out:
        raise ScenarioError(f"{where}: no [[point]] entries")
    return out


def _predict(a: StepAnchor, cal: Calibration, samples: int, seed: int):
    """(tok/s at the calibrated values, p10/p50/p90 over the posterior, how it was drawn)."""
    point = (
        a.point.concurrency * a.tau / float(step_cost(a.model, a.point, cal.values, a.tau).step_s)
    )
    draws = posterior_samples(cal, samples, np.random.default_rng(seed))
    step = step_cost(a.model, a.point, draws.params, a.tau).step_s
    tps = a.point.concurrency * a.tau / np.broadcast_to(np.asarray(step), samples)
    return point, {p: float(np.percentile(tps, p)) for p in (10, 50, 90)}, draws.describe()


def validate(points: list[ValidationPoint], samples: int = 2000, seed: int = 0) -> list:
    """Leave-one-source-out: for each source, calibrate on the others' points, predict its own."""
    specs = default_params()
    rows = []
    keys = list(dict.fromkeys(p.source.key for p in points))
    for k, key in enumerate(keys):
        cal = calibrate([p.anchor for p in points if p.source.key != key], specs)
        others = [s for s in keys if s != key]
        for i, p in enumerate(x for x in points if x.source.key == key):
            point, band, how = _predict(p.anchor, cal, samples, seed + 100 * k + i)
            rows.append(ValidationRow(p, p.anchor.tokens_per_s, point, band, others, how))
    return rows


def run(folder: str | Path, samples: int = 2000, seed: int = 0) -> Validation:
    return Validation(validate(load_points(folder), samples, seed), str(folder), samples)
