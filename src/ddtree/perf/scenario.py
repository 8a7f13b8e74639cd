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
    DEPLOYMENTS,
    ENGINE_ALIASES,
    ENGINE_PARAMS,
    ENGINES,
    Drafter,
    EngineProfile,
    ParamSpec,
    Point,
    default_params,
)
from ddtree.perf.model import PRECISION_BYTES, ModelError, ModelShape, load_model
from ddtree.records import Policy, Stage

DEFAULT_ANCHOR_NOISE = 0.01
"""Relative 1-sigma noise of an anchor that does not say (an engine run of many steps)."""


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
    noise: float = DEFAULT_ANCHOR_NOISE  # relative 1-sigma measurement noise
    from_records: bool = False  # an engine_run record (else typed into a scenario)

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
    noise: float = DEFAULT_ANCHOR_NOISE
    from_records: bool = False


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
    noise: float = DEFAULT_ANCHOR_NOISE
    from_records: bool = True


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
    tau_source: str = ""  # provenance of a measured tau ("" : typed into the scenario)


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
    anchors: list[Anchor]
    cases: list[ScenarioCase]
    sweep_hardware: list[str] = field(default_factory=list)
    records: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # said once to the user (renamed fields)
    deployment: dict = field(default_factory=dict)  # the raw [deployment] table

    def point_at(self, hardware: str, policy: Policy, block_size: int, budget: int) -> Point:
        """This file's deployment (TP, C, context, engine, drafter) on ``hardware`` at one
        policy / block size / budget (what ``ddtree tune`` sweeps)."""
        ctx = ParseContext(
            self.path, self.hardware, self.engines, self.deployment, self.drafter, []
        )
        table = {"hardware": hardware, "policy": str(policy), "block_size": block_size}
        if policy is not Policy.AR:
            table["budget"] = budget
        return _point(table, ctx, self.drafter, f"{self.path}: deployment on {hardware}")


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


def check_keys(table: dict, allowed: set[str], where: str) -> None:
    extra = set(table) - allowed
    if extra:
        raise ScenarioError(
            f"{where}: unknown field(s) {', '.join(sorted(extra))}; "
            f"expected some of {', '.join(sorted(allowed))}"
        )


_DEPLOY = {"tp", "concurrency", "context", "engine", "policy", "parallel"}
_PARAM_DIMS = {"": u.NUMBER, "s": u.TIME}


def _positive(raw: Any, dim: u.Dim, where: str) -> float:
    """A quantity that must be finite and > 0 (a rate, a time)."""
    value = u.parse_quantity(raw, dim, where)
    if not (math.isfinite(value) and value > 0):
        raise ScenarioError(f"{where}: {raw!r} must be a positive, finite quantity")
    return value


@dataclass
class ParseContext:
    """What parsing a point needs: the file, its hardware and engines, the deployment
    defaults, the drafter, and where notes for the user go."""

    where: str
    hardware: dict[str, Hardware]
    engines: dict[str, EngineProfile]
    deploy: dict
    drafter: Drafter | None
    notes: list[str]
    base_dir: Path = Path(".")  # relative paths in the file are relative to it

    def engine(self, raw: Any, where: str) -> str:
        name = str(raw)
        if name in ENGINE_ALIASES and name not in self.engines:
            new = ENGINE_ALIASES[name]
            note = f"{self.where}: engine {name!r} is now called {new!r}; read as {new!r}"
            if note not in self.notes:
                self.notes.append(note)
            name = new
        if name not in self.engines:
            raise ScenarioError(
                f"{where}.engine: {name!r}; expected one of {', '.join(self.engines)}"
            )
        return name


def drafter_from(spec: dict, where: str) -> Drafter:
    check_keys(
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


def _point(table: dict, ctx: ParseContext, drafter: Drafter | None, where: str) -> Point:
    """hardware, policy (default ddtree), block_size and budget (ddtree), deployment fields."""
    merged = {**ctx.deploy, **{k: v for k, v in table.items() if k in _DEPLOY}}
    if "hardware" not in table:
        raise ScenarioError(f"{where}: missing field 'hardware'")
    raw_policy = merged.get("policy", Policy.DDTREE)
    try:
        policy = Policy(raw_policy)
    except ValueError:
        raise ScenarioError(
            f"{where}.policy: {raw_policy!r}; expected one of {', '.join(Policy)}"
        ) from None
    if policy is Policy.AR:
        block = 1
        budget = _int(table.get("budget", 0), f"{where}.budget", 0)
        if budget:
            raise ScenarioError(f"{where}.budget: an ar step has no draft tree; leave it out")
        drafter = None
    else:
        if "block_size" not in table:
            raise ScenarioError(f"{where}: missing field 'block_size'")
        block = _int(table["block_size"], f"{where}.block_size", 2)
        if policy is Policy.CHAIN:
            budget = _int(table.get("budget", block - 1), f"{where}.budget", 1)
            if budget != block - 1:
                raise ScenarioError(
                    f"{where}.budget: a chain verifies the B-1 = {block - 1} drafted tokens; "
                    f"got {budget} (leave it out)"
                )
        else:
            if "budget" not in table:
                raise ScenarioError(f"{where}: missing field 'budget'")
            budget = _int(table["budget"], f"{where}.budget", 1)
    ctx_raw = merged.get("context", "2048 tok")
    context = u.parse_quantity(
        ctx_raw if not isinstance(ctx_raw, int) else f"{ctx_raw} tok", u.TOKENS, f"{where}.context"
    )
    if not (math.isfinite(context) and context >= 0):
        raise ScenarioError(f"{where}.context: {ctx_raw!r} must be >= 0 tokens")
    parallel = str(merged.get("parallel", "tp"))
    if parallel not in DEPLOYMENTS:
        raise ScenarioError(
            f"{where}.parallel: {parallel!r}; expected one of {', '.join(DEPLOYMENTS)}"
        )
    return Point(
        hardware=_hardware_ref(table["hardware"], ctx.hardware, f"{where}.hardware"),
        tp=_int(merged.get("tp", 1), f"{where}.tp"),
        concurrency=_int(merged.get("concurrency", 1), f"{where}.concurrency"),
        context_tokens=float(context),
        block_size=block,
        budget=budget,
        engine=ctx.engine(merged.get("engine", "eager"), where),
        drafter=drafter,
        policy=policy,
        deployment=DEPLOYMENTS[parallel],
    )


def _tau(raw: Any, point: Point, where: str) -> Value:
    """tau (a value or a range): at least 1 (the bonus token), at most B (every drafted token
    accepted, plus the bonus); an ar step commits exactly 1."""
    if raw is None:
        if point.policy is Policy.AR:
            return 1.0
        raise ScenarioError(f"{where}: missing field 'tau' (accepted tokens per step)")
    tau = _value(raw, u.TOKENS_PER_STEP, f"{where}.tau")
    low, high = (tau.low, tau.high) if isinstance(tau, Range) else (tau, tau)
    top = 1 if point.policy is Policy.AR else point.block_size
    if not (math.isfinite(low) and math.isfinite(high)) or low < 1 or high > top:
        raise ScenarioError(
            f"{where}.tau: {raw!r} is outside [1, {top}]: tau counts the accepted drafted "
            f"tokens plus the bonus token, so 1 <= tau <= "
            + ("1 for ar" if point.policy is Policy.AR else f"block_size = {top}")
        )
    return tau


def noise_of(raw: Any, where: str) -> float:
    if raw is None:
        return DEFAULT_ANCHOR_NOISE
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw < 1:
        raise ScenarioError(
            f"{where}.noise: expected a relative 1-sigma noise in (0, 1) like 0.03, got {raw!r}"
        )
    return float(raw)


def _param_entry(name: str, raw: Any, spec: ParamSpec, where: str):
    """-> (pinned value or None, new spec). ``x = value`` pins a parameter; ``x = [lo, hi]`` or
    ``{range = [lo, hi]}`` makes that its prior (calibration may move it);
    ``{value = v, fit = true}`` makes v the prior's centre."""
    dim = _PARAM_DIMS[spec.unit]
    if isinstance(raw, dict):
        check_keys(raw, {"value", "range", "fit", "source"}, where)
        value = _positive(raw["value"], dim, f"{where}.value") if "value" in raw else None
        rng = _value(raw["range"], dim, f"{where}.range") if "range" in raw else None
        if rng is not None and not isinstance(rng, Range):
            raise ScenarioError(f"{where}.range: expected [low, high]")
        fit = bool(raw.get("fit", spec.fit))
    else:
        v = _value(raw, dim, where)
        value, rng, fit = (None, v, spec.fit) if isinstance(v, Range) else (v, None, False)
    if rng is not None and not rng.low > 0:
        raise ScenarioError(f"{where}: a parameter's range must be positive, got {rng.low:g}")
    if value is not None and not value > 0:
        raise ScenarioError(f"{where}: a parameter must be positive, got {value:g}")
    new = spec
    if rng is not None:
        new = replace(new, low=rng.low, high=rng.high,
                      default=value or rng.mode or math.sqrt(rng.low * rng.high))  # fmt: skip
    elif value is not None:
        new = replace(new, default=value)
    new = replace(new, fit=fit)
    pinned = value if (value is not None and rng is None and not fit) else None
    return pinned, new


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
    check_keys(
        data,
        {"title", "model", "drafter", "deployment", "hardware", "engine", "parameters",
         "anchor", "scenario", "report", "records"},
        where,
    )  # fmt: skip
    if "model" not in data:
        raise ScenarioError(f"{where}: missing [model] (preset = ... or config = ...)")
    model = load_model(data["model"], where, base_dir)
    drafter = drafter_from(data["drafter"], f"{where}: drafter") if "drafter" in data else None
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
        if not isinstance(entry, dict):
            raise ScenarioError(f"{w} must be a table")
        check_keys(entry, {*ENGINE_PARAMS, "about"}, w)
        base = engines.get(name, ENGINES["eager"])
        times = {f"{f}_s": _positive(entry[f], u.TIME, f"{w}.{f}") for f in ENGINE_PARAMS
                 if f in entry}  # fmt: skip
        about = str(entry.get("about", base.about))
        engines[name] = replace(base, name=name, about=about, **times)
    specs = default_params(engines)
    fixed = {}
    for name, raw in (data.get("parameters") or {}).items():
        w = f"{where}: parameters.{name}"
        if name not in specs:
            raise ScenarioError(f"{w}: unknown parameter; known: {', '.join(specs)}")
        pinned, specs[name] = _param_entry(name, raw, specs[name], w)
        if pinned is not None:
            fixed[name] = pinned
    deploy = data.get("deployment") or {}
    check_keys(deploy, _DEPLOY, f"{where}: deployment")
    ctx = ParseContext(where, hardware, engines, deploy, drafter, [], base_dir)
    anchors: list[Anchor] = []
    for i, a in enumerate(data.get("anchor") or []):
        anchors.append(_anchor(a, i, model, ctx))
    names = [a.name for a in anchors]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{where}: anchor names must be unique, got {names}")
    cases = []
    for i, s in enumerate(data.get("scenario") or []):
        cases.append(_case(s, i, ctx, specs, names))
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
        anchors=anchors,
        cases=cases,
        sweep_hardware=sweep,
        records=[str(base_dir / p) for p in recs.get("paths", [])],
        notes=ctx.notes,
        deployment=dict(deploy),
    )


STEP_ANCHOR_KEYS = {"hardware", "block_size", "budget", "tau", "tokens_per_s", "step"} | _DEPLOY


def step_anchor(
    a: dict,
    name: str,
    model: ModelShape,
    drafter: Drafter | None,
    ctx: ParseContext,
    where: str,
    source: str,
    noise: float = DEFAULT_ANCHOR_NOISE,
) -> StepAnchor:
    """A measured step from a table with ``STEP_ANCHOR_KEYS``: the point, tau and one of
    ``tokens_per_s`` (aggregate over the C requests) or ``step`` (time per step, e.g. TPOT)."""
    point = _point(a, ctx, drafter, where)
    tau = _tau(a.get("tau"), point, where)
    if isinstance(tau, Range):
        raise ScenarioError(f"{where}.tau: an anchor's tau is one measured value, not a range")
    if ("tokens_per_s" in a) == ("step" in a):
        raise ScenarioError(
            f"{where}: give exactly one of 'tokens_per_s' (like '303 tok/s') or 'step' "
            "(time per step, like '14.5 ms')"
        )
    if "tokens_per_s" in a:
        tps = _positive(a["tokens_per_s"], u.TOKEN_RATE, f"{where}.tokens_per_s")
        step_s = point.concurrency * tau / tps
    else:
        step_s = _positive(a["step"], u.STEP_TIME, f"{where}.step")
    return StepAnchor(name, model, point, tau, step_s, source, noise)


def _anchor(a, i: int, model: ModelShape, ctx: ParseContext) -> Anchor:
    where = ctx.where
    w = f"{where}: anchor[{i}]"
    if not isinstance(a, dict):
        raise ScenarioError(f"{w}: must be a table ([[anchor]])")
    kind = a.get("kind", "step")
    name = str(a.get("name", f"anchor{i}"))
    w = f"{where}: anchor[{i}] ({name})"
    source = str(a.get("source", ""))
    noise = noise_of(a.get("noise"), w)
    if kind == "step":
        check_keys(a, STEP_ANCHOR_KEYS | {"kind", "name", "source", "noise"}, w)
        return step_anchor(a, name, model, ctx.drafter, ctx, w, source, noise)
    if kind == "moe_layer":
        check_keys(a, {"kind", "name", "hardware", "m", "time", "tp", "source", "noise"}, w)
        for key in ("hardware", "m", "time"):
            if key not in a:
                raise ScenarioError(f"{w}: missing field '{key}'")
        return MoeAnchor(
            name,
            model,
            _hardware_ref(a["hardware"], ctx.hardware, f"{w}.hardware"),
            _int(a["m"], f"{w}.m"),
            _int(a.get("tp", 1), f"{w}.tp"),
            _positive(a["time"], u.TIME, f"{w}.time"),
            source,
            noise=noise,
        )
    raise ScenarioError(f"{w}.kind: {kind!r}; expected 'step' or 'moe_layer'")


def _case(s, i: int, ctx: ParseContext, specs: dict[str, ParamSpec], anchor_names) -> ScenarioCase:
    name = str(s.get("name", f"scenario{i}"))
    w = f"{ctx.where}: scenario[{i}] ({name})"
    if not isinstance(s, dict):
        raise ScenarioError(f"{ctx.where}: scenario[{i}] must be a table ([[scenario]])")
    check_keys(
        s,
        {"name", "question", "hardware", "block_size", "budget", "tau", "anchors", "parameters",
         "article", "drafter"} | _DEPLOY,
        w,
    )  # fmt: skip
    d = drafter_from(s["drafter"], f"{w}.drafter") if "drafter" in s else ctx.drafter
    point = _point(s, ctx, d, w)
    tau_source = ""
    if isinstance(s.get("tau"), dict):  # tau = { records = "acc.jsonl" }: measured
        from ddtree.perf.acceptance import tau_from_records

        measured = tau_from_records(
            s["tau"], point.policy, point.block_size, point.budget, ctx.base_dir, f"{w}.tau"
        )
        raw = measured.value
        raw = [raw.low, raw.mode, raw.high] if isinstance(raw, Range) else raw
        tau, tau_source = _tau(raw, point, w), measured.label
    else:
        tau = _tau(s.get("tau"), point, w)
    anchors = s.get("anchors")
    if anchors is not None:
        bad = [a for a in anchors if a not in anchor_names]
        if bad:
            raise ScenarioError(f"{w}.anchors: unknown {bad}; anchors are {anchor_names}")
    overrides: dict[str, Value] = {}
    for pname, raw in (s.get("parameters") or {}).items():
        if pname not in specs:
            raise ScenarioError(f"{w}.parameters.{pname}: unknown; known: {', '.join(specs)}")
        v = _value(raw, _PARAM_DIMS[specs[pname].unit], f"{w}.parameters.{pname}")
        if (v.low if isinstance(v, Range) else v) <= 0:
            raise ScenarioError(f"{w}.parameters.{pname}: must be positive, got {raw!r}")
        overrides[pname] = v
    article = None
    if "article" in s:
        art = s["article"]
        aw = f"{w}.article"
        check_keys(art, {"tokens_per_s", "step", "moe", "note"}, aw)
        article = Article(
            tokens_per_s=_value(art["tokens_per_s"], u.TOKEN_RATE, f"{aw}.tokens_per_s")
            if "tokens_per_s" in art
            else None,
            step_s=_positive(art["step"], u.STEP_TIME, f"{aw}.step") if "step" in art else None,
            moe_s=_positive(art["moe"], u.STEP_TIME, f"{aw}.moe") if "moe" in art else None,
            note=str(art.get("note", "")),
        )
    question = str(s.get("question", ""))
    return ScenarioCase(name, point, tau, anchors, overrides, article, question, tau_source)
