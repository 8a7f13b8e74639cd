"""Scenario files (TOML): model, drafter, deployment, hardware, anchors, parameters, scenarios.

Every quantity carries its unit (``"8 TB/s"``, ``"14.5 ms"``, ``"303 tok/s"``); every error
names the file, the field and what was expected. See ``examples/seed_kimi_b300.toml``.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ddtree.perf import units as u
from ddtree.perf.catalog import CatalogError, Hardware, hardware_from_dict, load_catalog
from ddtree.perf.cost import (
    ENGINES,
    HOST_PARAMS,
    Drafter,
    EngineProfile,
    ParamSpec,
    Point,
    default_params,
)
from ddtree.perf.model import PRECISION_BYTES, ModelError, ModelShape, load_model
from ddtree.records import Stage


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names file and field."""


@dataclass(frozen=True)
class Range:
    """An uncertain input: uniform on [low, high], or triangular with a mode."""

    low: float
    high: float
    mode: float | None = None

    @property
    def mid(self) -> float:
        return self.mode if self.mode is not None else 0.5 * (self.low + self.high)


Value = float | Range


@dataclass
class StepAnchor:
    """A measured decode step: configuration, tau, and step time (from tokens/s / tau)."""

    name: str
    model: ModelShape
    point: Point
    tau: float
    step_s: float
    source: str

    @property
    def tokens_per_s(self) -> float:
        return self.point.concurrency * self.tau / self.step_s


@dataclass
class MoeAnchor:
    """A measured routed-MoE layer time at verify width M (``bench moe`` or typed in)."""

    name: str
    model: ModelShape
    hardware: Hardware
    m: int
    tp: int
    s_per_layer: float
    source: str
    curve: tuple[tuple[float, float], ...] | None = None


@dataclass
class StageAnchor:
    """A measured stage of an engine run (``summary.stage_s_mean``), fitted by the cost-model
    components tagged with that ``Stage`` at the run's configuration. ``run`` names the run's
    step anchor, so a backtest holds a run's stages out together with it. The prefill is a
    stage too: the target forward over ``prompt_tokens`` (mean prompt length), no context."""

    name: str
    run: str
    stage: Stage
    model: ModelShape
    point: Point
    tau: float
    seconds: float
    source: str
    prompt_tokens: float = 0.0


Anchor = StepAnchor | MoeAnchor | StageAnchor


@dataclass
class Article:
    """A published answer to compare with (the seed's figures)."""

    tokens_per_s: Range | float | None = None
    step_s: float | None = None
    moe_s: float | None = None
    note: str = ""


@dataclass
class ScenarioCase:
    name: str
    point: Point
    tau: Value
    anchors: list[str] | None  # names to calibrate on (None: all)
    overrides: dict[str, Value]  # parameter overrides for this projection
    article: Article | None = None
    question: str = ""


@dataclass
class ScenarioFile:
    path: str
    title: str
    model: ModelShape
    drafter: Drafter | None
    hardware: dict[str, Hardware]
    engines: dict[str, EngineProfile]
    specs: dict[str, ParamSpec]
    fixed: dict[str, float]  # parameters the user pinned
    ranges: dict[str, Range]  # parameters the user gave a range for (projection)
    anchors: list[Anchor]
    cases: list[ScenarioCase]
    sweep_hardware: list[str] = field(default_factory=list)
    records: list[str] = field(default_factory=list)


def _value(raw: Any, dim: u.Dim, where: str) -> Value:
    """A point value or a range: ``[lo, hi]``, ``[lo, mode, hi]`` or ``"12-16"`` (numbers)."""
    if isinstance(raw, list):
        if len(raw) not in (2, 3):
            raise ScenarioError(f"{where}: a range is [low, high] or [low, mode, high]")
        vals = [u.parse_quantity(x, dim, where) for x in raw]
        if sorted(vals) != vals:
            raise ScenarioError(f"{where}: range {raw!r} is not in increasing order")
        return Range(vals[0], vals[-1], vals[1] if len(vals) == 3 else None)
    if isinstance(raw, dict):
        raise ScenarioError(f"{where}: expected a value or [low, high], got a table")
    return u.parse_quantity(raw, dim, where)


def _int(raw: Any, where: str, low: int = 1) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < low:
        raise ScenarioError(f"{where}: expected an integer >= {low}, got {raw!r}")
    return raw


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    extra = set(table) - allowed
    if extra:
        raise ScenarioError(
            f"{where}: unknown field(s) {', '.join(sorted(extra))}; "
            f"expected some of {', '.join(sorted(allowed))}"
        )


_DEPLOY = {"tp", "concurrency", "context", "engine"}
_PARAM_DIMS = {"": u.NUMBER, "s": u.TIME}


def _drafter(spec: dict, where: str) -> Drafter:
    _check_keys(
        spec,
        {"params", "layers", "precision", "kv_bytes_per_token", "shares_target_lm_head", "source"},
        where,
    )
    if "params" not in spec or "layers" not in spec:
        raise ScenarioError(f"{where}: drafter needs 'params' (a count like 1.5e9) and 'layers'")
    prec = str(spec.get("precision", "bf16"))
    if prec not in PRECISION_BYTES:
        raise ScenarioError(
            f"{where}.precision: {prec!r}; expected one of {', '.join(PRECISION_BYTES)}"
        )
    kv = spec.get("kv_bytes_per_token", "0 B")
    return Drafter(
        params=float(u.parse_quantity(spec["params"], u.NUMBER, f"{where}.params")),
        layers=_int(spec["layers"], f"{where}.layers"),
        precision=prec,
        kv_bytes_per_token=u.parse_quantity(kv, u.BYTES, f"{where}.kv_bytes_per_token"),
        shares_target_lm_head=bool(spec.get("shares_target_lm_head", True)),
        source=str(spec.get("source", "")),
    )


def _hardware_ref(name: Any, hardware: dict[str, Hardware], where: str) -> Hardware:
    if name not in hardware:
        raise ScenarioError(
            f"{where}: unknown hardware {name!r}; known: {', '.join(sorted(hardware))} "
            "(or define it under [hardware.NAME])"
        )
    return hardware[name]


def _point(
    table: dict,
    defaults: dict,
    hardware: dict[str, Hardware],
    engines: dict,
    drafter: Drafter | None,
    where: str,
) -> Point:
    merged = {**defaults, **{k: v for k, v in table.items() if k in _DEPLOY}}
    for key in ("hardware", "block_size", "budget"):
        if key not in table:
            raise ScenarioError(f"{where}: missing field '{key}'")
    engine = str(merged.get("engine", "python"))
    if engine not in engines:
        raise ScenarioError(f"{where}.engine: {engine!r}; expected one of {', '.join(engines)}")
    block = _int(table["block_size"], f"{where}.block_size", 2)
    budget = _int(table["budget"], f"{where}.budget", 1)
    ctx = merged.get("context", "2048 tok")
    return Point(
        hardware=_hardware_ref(table["hardware"], hardware, f"{where}.hardware"),
        tp=_int(merged.get("tp", 1), f"{where}.tp"),
        concurrency=_int(merged.get("concurrency", 1), f"{where}.concurrency"),
        context_tokens=float(
            u.parse_quantity(
                ctx if not isinstance(ctx, int) else f"{ctx} tok", u.TOKENS, f"{where}.context"
            )
        ),  # fmt: skip
        block_size=block,
        budget=budget,
        engine=engine,
        drafter=drafter,
    )


def _param_entry(name: str, raw: Any, spec: ParamSpec, where: str):
    """-> (pinned value or None, range or None, new spec)."""
    dim = _PARAM_DIMS[spec.unit]
    if isinstance(raw, dict):
        _check_keys(raw, {"value", "range", "fit", "source"}, where)
        value = u.parse_quantity(raw["value"], dim, f"{where}.value") if "value" in raw else None
        rng = _value(raw["range"], dim, f"{where}.range") if "range" in raw else None
        if rng is not None and not isinstance(rng, Range):
            raise ScenarioError(f"{where}.range: expected [low, high]")
        fit = bool(raw.get("fit", spec.fit))
    else:
        v = _value(raw, dim, where)
        value, rng, fit = (None, v, spec.fit) if isinstance(v, Range) else (v, None, False)
    new = spec
    if rng is not None:
        geo = math.sqrt(rng.low * rng.high) if rng.low > 0 else rng.mid
        new = replace(new, low=rng.low, high=rng.high, default=value or rng.mode or geo)
    elif value is not None:
        new = replace(new, default=value)
    new = replace(new, fit=fit)
    pinned = value if (value is not None and rng is None and not fit) else None
    return pinned, rng, new


def load_scenario(path: str | Path, records_hw: dict[str, Hardware] | None = None) -> ScenarioFile:
    path = Path(path)
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{where}: no such scenario file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{where}: not valid TOML ({exc})") from None
    try:
        return _parse(data, where, path.parent, records_hw or {})
    except (u.UnitError, CatalogError, ModelError) as exc:
        msg = str(exc)
        raise ScenarioError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _parse(data: dict, where: str, base_dir: Path, records_hw: dict) -> ScenarioFile:
    _check_keys(
        data,
        {"title", "model", "drafter", "deployment", "hardware", "engine", "parameters",
         "anchor", "scenario", "report", "records"},
        where,
    )  # fmt: skip
    if "model" not in data:
        raise ScenarioError(f"{where}: missing [model] (preset = ... or config = ...)")
    model = load_model(data["model"], where, base_dir)
    drafter = _drafter(data["drafter"], f"{where}: drafter") if "drafter" in data else None
    hardware = {**load_catalog(), **records_hw}
    for key, entry in (data.get("hardware") or {}).items():
        if not isinstance(entry, dict):
            raise ScenarioError(f"{where}: hardware.{key} must be a table")
        base = None
        if "base" in entry:
            base = _hardware_ref(entry["base"], hardware, f"{where}: hardware.{key}.base")
        hardware[key] = hardware_from_dict(key, entry, where, base=base, default_kind="user")
    engines = dict(ENGINES)
    for name, entry in (data.get("engine") or {}).items():
        w = f"{where}: engine.{name}"
        _check_keys(entry, {*HOST_PARAMS, "about"}, w)
        base = engines.get(name, ENGINES["python"])
        times = {
            f"{f}_s": u.parse_quantity(entry[f], u.TIME, f"{w}.{f}")
            for f in HOST_PARAMS
            if f in entry
        }
        engines[name] = replace(
            base, name=name, about=str(entry.get("about", base.about)),
            fit_step_overhead=base.fit_step_overhead and name in engines, **times,
        )  # fmt: skip
    specs = default_params(engines)
    fixed, ranges = {}, {}
    for name, raw in (data.get("parameters") or {}).items():
        w = f"{where}: parameters.{name}"
        if name not in specs:
            raise ScenarioError(f"{w}: unknown parameter; known: {', '.join(specs)}")
        pinned, rng, specs[name] = _param_entry(name, raw, specs[name], w)
        if pinned is not None:
            fixed[name] = pinned
        if rng is not None and not specs[name].fit:
            ranges[name] = rng
    deploy = data.get("deployment") or {}
    _check_keys(deploy, _DEPLOY, f"{where}: deployment")
    anchors: list[Anchor] = []
    for i, a in enumerate(data.get("anchor") or []):
        anchors.append(_anchor(a, i, model, drafter, hardware, engines, deploy, where))
    names = [a.name for a in anchors]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{where}: anchor names must be unique, got {names}")
    cases = []
    for i, s in enumerate(data.get("scenario") or []):
        cases.append(_case(s, i, drafter, hardware, engines, deploy, specs, names, where))
    report = data.get("report") or {}
    sweep = list(report.get("hardware", []))
    for h in sweep:
        _hardware_ref(h, hardware, f"{where}: report.hardware")
    recs = data.get("records") or {}
    return ScenarioFile(
        path=where,
        title=str(data.get("title", Path(where).stem)),
        model=model,
        drafter=drafter,
        hardware=hardware,
        engines=engines,
        specs=specs,
        fixed=fixed,
        ranges=ranges,
        anchors=anchors,
        cases=cases,
        sweep_hardware=sweep,
        records=[str(base_dir / p) for p in recs.get("paths", [])],
    )


def _anchor(a, i, model, drafter, hardware, engines, deploy, where) -> Anchor:
    w = f"{where}: anchor[{i}]"
    if not isinstance(a, dict):
        raise ScenarioError(f"{w}: must be a table ([[anchor]])")
    kind = a.get("kind", "step")
    name = str(a.get("name", f"anchor{i}"))
    w = f"{where}: anchor[{i}] ({name})"
    source = str(a.get("source", ""))
    if kind == "step":
        _check_keys(
            a,
            {"kind", "name", "hardware", "block_size", "budget", "tau", "tokens_per_s", "step",
             "source"} | _DEPLOY,
            w,
        )  # fmt: skip
        if "tau" not in a:
            raise ScenarioError(f"{w}: missing field 'tau' (accepted tokens per step)")
        point = _point(a, deploy, hardware, engines, drafter, w)
        tau = u.parse_quantity(a["tau"], u.TOKENS_PER_STEP, f"{w}.tau")
        if ("tokens_per_s" in a) == ("step" in a):
            raise ScenarioError(
                f"{w}: give exactly one of 'tokens_per_s' (like '303 tok/s') or 'step' "
                "(time per step, like '14.5 ms')"
            )
        if "tokens_per_s" in a:
            tps = u.parse_quantity(a["tokens_per_s"], u.TOKEN_RATE, f"{w}.tokens_per_s")
            step_s = point.concurrency * tau / tps
        else:
            step_s = u.parse_quantity(a["step"], u.STEP_TIME, f"{w}.step")
        return StepAnchor(name, model, point, tau, step_s, source)
    if kind == "moe_layer":
        _check_keys(a, {"kind", "name", "hardware", "m", "time", "tp", "source"}, w)
        for key in ("hardware", "m", "time"):
            if key not in a:
                raise ScenarioError(f"{w}: missing field '{key}'")
        return MoeAnchor(
            name,
            model,
            _hardware_ref(a["hardware"], hardware, f"{w}.hardware"),
            _int(a["m"], f"{w}.m"),
            _int(a.get("tp", 1), f"{w}.tp"),
            u.parse_quantity(a["time"], u.TIME, f"{w}.time"),
            source,
        )
    raise ScenarioError(f"{w}.kind: {kind!r}; expected 'step' or 'moe_layer'")


def _case(s, i, drafter, hardware, engines, deploy, specs, anchor_names, where) -> ScenarioCase:
    name = str(s.get("name", f"scenario{i}"))
    w = f"{where}: scenario[{i}] ({name})"
    _check_keys(
        s,
        {"name", "question", "hardware", "block_size", "budget", "tau", "anchors", "parameters",
         "article", "drafter"} | _DEPLOY,
        w,
    )  # fmt: skip
    d = _drafter(s["drafter"], f"{w}.drafter") if "drafter" in s else drafter
    point = _point(s, deploy, hardware, engines, d, w)
    if "tau" not in s:
        raise ScenarioError(f"{w}: missing field 'tau' (a value or [low, high])")
    tau = _value(s["tau"], u.TOKENS_PER_STEP, f"{w}.tau")
    anchors = s.get("anchors")
    if anchors is not None:
        bad = [a for a in anchors if a not in anchor_names]
        if bad:
            raise ScenarioError(f"{w}.anchors: unknown {bad}; anchors are {anchor_names}")
    overrides: dict[str, Value] = {}
    for pname, raw in (s.get("parameters") or {}).items():
        if pname not in specs:
            raise ScenarioError(f"{w}.parameters.{pname}: unknown; known: {', '.join(specs)}")
        overrides[pname] = _value(raw, _PARAM_DIMS[specs[pname].unit], f"{w}.parameters.{pname}")
    article = None
    if "article" in s:
        art = s["article"]
        aw = f"{w}.article"
        _check_keys(art, {"tokens_per_s", "step", "moe", "note"}, aw)
        article = Article(
            tokens_per_s=_value(art["tokens_per_s"], u.TOKEN_RATE, f"{aw}.tokens_per_s")
            if "tokens_per_s" in art
            else None,
            step_s=u.parse_quantity(art["step"], u.STEP_TIME, f"{aw}.step")
            if "step" in art
            else None,
            moe_s=u.parse_quantity(art["moe"], u.STEP_TIME, f"{aw}.moe") if "moe" in art else None,
            note=str(art.get("note", "")),
        )
    if isinstance(tau, Range) and tau.low <= 0 or not isinstance(tau, Range) and tau <= 0:
        raise ScenarioError(f"{w}.tau: must be positive")
    if isinstance(tau, float) and not math.isfinite(tau):
        raise ScenarioError(f"{w}.tau: must be finite")
    return ScenarioCase(name, point, tau, anchors, overrides, article, str(s.get("question", "")))
