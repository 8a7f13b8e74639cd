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

from ddtree.files import read_input_bytes
from ddtree.perf.cost.physics import findings
from ddtree.perf.cost.step import (
    DEPLOYMENTS,
    ENGINE_ALIASES,
    ENGINE_PARAMS,
    ENGINES,
    STACKS,
    Deployment,
    Drafter,
    EngineProfile,
    ParamSpec,
    Point,
    corpus_params,
    engine_param,
    mixed_deployment,
)
from ddtree.perf.hardware import units as u
from ddtree.perf.hardware.catalog import (
    CatalogError,
    Hardware,
    Link,
    hardware_from_dict,
    link_from_dict,
    load_catalog,
    load_hosts,
    load_links,
)
from ddtree.perf.inputs.schema import (
    SCENARIO_NAMES,
    DeploymentFields,
    DrafterTable,
    MoeAnchorTable,
    ParallelTable,
    ParamTable,
    ScenarioDoc,
    StepAnchorTable,
    StepFields,
    parse,
)
from ddtree.perf.inputs.values import Range, ScenarioError, Value, flag, one_of, text
from ddtree.perf.shapes.model import PRECISION_BYTES, ModelError, ModelShape, load_model
from ddtree.vocab import DEFAULT_POLICY, POLICIES, Drafting, Policy, Stage

DEFAULT_ANCHOR_NOISE = 0.01
"""Relative 1-sigma noise of an anchor that does not say (an engine run of many steps)."""


METRICS = ("tpot", "itl", "e2e_tokens_per_s")


@dataclass(frozen=True)
class Metric:
    """What a published figure measures (issue 18: like is compared with like).

    ``tpot``: decode speed, C x tau / step time, or the time per output token (step / tau):
    the prompt's prefill is not in it. ``itl``: the time between streamed chunks, one chunk
    per step (a speculative step streams tau tokens at once), so the step time. ``e2e_tokens_
    per_s``: tokens over the whole request's wall time, the time to the first token (TTFT)
    included: ``counts_prompt`` says whether the prompt's tokens are counted ((prompt +
    generated) / time) or only the generated ones; the TTFT is the measured one when the
    source gives it, else the predicted prefill of ``prompt_tokens``.

    Worked example: 128 tokens generated after a 1024-token prompt, TTFT 0.1 s, step 13 ms
    at tau 1: wall = 0.1 + 127 x 13 ms = 1.751 s; 128 / 1.751 = 73.1 tok/s (76.9 by TPOT).
    """

    kind: str = "tpot"
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    counts_prompt: bool = False
    ttft_s: float | None = None

    @property
    def counted_tokens(self) -> float:
        return self.output_tokens + (self.prompt_tokens if self.counts_prompt else 0.0)

    def wall_s(self, step_s, tau, prefill_s):
        """One request's wall time: TTFT, then the other output tokens at tau per step."""
        ttft = prefill_s if self.ttft_s is None else self.ttft_s
        return ttft + (self.output_tokens - 1.0) / tau * step_s


@dataclass
class StepAnchor:
    """A measured decode step: configuration, tau, and step time (from tokens/s / tau); or,
    for an ``e2e_tokens_per_s`` metric, one request's measured wall time ``wall_s``."""

    name: str
    model: ModelShape
    point: Point
    tau: float
    step_s: float  # measured step time (0 for an e2e figure: its wall_s is what was measured)
    source: str
    noise: float = DEFAULT_ANCHOR_NOISE  # relative 1-sigma measurement noise
    from_records: bool = False  # an engine_run record (else typed into a scenario)
    metric: Metric = Metric()
    wall_s: float = 0.0  # e2e only: counted tokens x C / tokens/s

    @property
    def e2e(self) -> bool:
        return self.metric.kind == "e2e_tokens_per_s"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_s_at(self.step_s if not self.e2e else None, self.wall_s)

    def tokens_per_s_at(self, step_s, wall_s=None):
        """Tokens/s in this anchor's metric: C x tau / step, or C x counted tokens / wall."""
        if self.e2e:
            return self.point.concurrency * self.metric.counted_tokens / wall_s
        return self.point.concurrency * self.tau / step_s


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
    measurements: list = field(default_factory=list)  # the records read for its anchors
    notes: list[str] = field(default_factory=list)  # said once to the user (renamed fields)
    deployment: dict = field(default_factory=dict)  # the raw [deployment] table
    links: dict[str, Link] = field(default_factory=load_links)  # inter-node links by key
    allow_oversubscribe: bool = False

    def point_at(self, hardware: str, policy: Policy, block_size: int, budget: int) -> Point:
        """This file's deployment (TP, C, context, engine, drafter) on ``hardware`` at one
        policy / block size / budget (what ``ddtree tune`` sweeps)."""
        ctx = ParseContext(
            self.path, self.hardware, self.engines, self.deployment, self.drafter, [],
            links=self.links, allow_oversubscribe=self.allow_oversubscribe,
        )  # fmt: skip
        table = {"hardware": hardware, "policy": str(policy), "block_size": block_size}
        if policy.needs_drafter:
            table["budget"] = budget
        where = f"{self.path}: deployment on {hardware}"
        point = _point(table, ctx, self.drafter, where, self.model)
        ctx.check(self.model, point, where)
        self.notes.extend(n for n in ctx.notes if n not in self.notes)
        return point


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


def _rate_or_range(raw: Any, where: str) -> Value:
    """A published token rate or a range of them: every bound finite and > 0."""
    v = _value(raw, u.TOKEN_RATE, where)
    low = v.low if isinstance(v, Range) else v
    if not low > 0:
        raise ScenarioError(f"{where}: {raw!r} must be a positive token rate")
    return v


def _int(raw: Any, where: str, low: int = 1) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < low:
        raise ScenarioError(f"{where}: expected an integer >= {low}, got {raw!r}")
    return raw


_DEPLOY = set(DeploymentFields.model_fields)
_PARAM_DIMS = {"": u.NUMBER, "s": u.TIME}


def unknown_parameter(name: str, specs: dict, where: str) -> ScenarioError:
    """The one-line error for a parameter the cost model does not have: the known names of its
    family (``stack_host.``, ``layer_floor.``, ...), at most 12, or the first 12 of all."""
    close = [n for n in specs if n.split(".")[0] == name.split(".")[0]] or list(specs)
    more = f", ... ({len(close)} in all)" if len(close) > 12 else ""
    return ScenarioError(
        f"{where}: unknown parameter; known: {', '.join(close[:12])}{more} "
        "(estimate --explain lists every one)"
    )


def _positive(raw: Any, dim: u.Dim, where: str) -> float:
    """A quantity that must be finite and > 0 (a rate, a time)."""
    value = u.parse_quantity(raw, dim, where)
    if not (math.isfinite(value) and value > 0):
        raise ScenarioError(f"{where}: {raw!r} must be a positive, finite quantity")
    return value


def _at_least_0(raw: Any, dim: u.Dim, where: str) -> float:
    """A quantity that must be finite and >= 0 (a size that may be nothing)."""
    value = u.parse_quantity(raw, dim, where)
    if not (math.isfinite(value) and value >= 0):
        raise ScenarioError(f"{where}: {raw!r} must be a finite quantity >= 0")
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
    links: dict[str, Link] = field(default_factory=load_links)  # inter-node links by key
    allow_oversubscribe: bool = False  # memory over a GPU's: a warning, not an error

    def check(self, model: ModelShape, point: Point, where: str) -> None:
        """The physics checks (``ddtree.perf.cost.physics``) of a point before it is priced: a
        refusal is a one-line error naming the field; memory over the GPU's is one too, or
        with ``allow_oversubscribe`` a warning; notes are said once."""
        for f in findings(model, point):
            if f.kind == "refuse" or (f.kind == "oversubscribe" and not self.allow_oversubscribe):
                hint = " (or pass --allow-oversubscribe)" if f.kind == "oversubscribe" else ""
                raise ScenarioError(f"{where}: {f.message}{hint}")
            prefix = "warning: " if f.kind == "oversubscribe" else ""
            note = f"{where}: {prefix}{f.message}"
            if note not in self.notes:
                self.notes.append(note)

    def engine(self, raw: Any, where: str) -> str:
        name = text(raw, f"{where}.engine")
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
    """A ``[drafter]`` table: ``params`` and ``layers`` (with ``precision``, ``kv_bytes_per_
    token``, ``lm_head_vocab`` for an EAGLE-3 head's own draft vocabulary, ``source``); or only
    ``precision`` / ``source`` for policy ``mtp``, whose drafter is the target's own MTP layer
    (``layers = 0`` here: the shape comes from the model)."""
    parse(DrafterTable, spec, where)
    prec = one_of(spec.get("precision", "bf16"), PRECISION_BYTES, f"{where}.precision")
    source = spec.get("source", "")
    if "params" not in spec and "layers" not in spec and not set(spec) - {"precision", "source"}:
        return Drafter(params=0.0, layers=0, precision=prec, source=source)  # MTP: from the model
    if "params" not in spec or "layers" not in spec:
        raise ScenarioError(f"{where}: drafter needs 'params' (a count like 1.5e9) and 'layers'")
    kv = spec.get("kv_bytes_per_token", "0 B")
    vocab = _int(spec["lm_head_vocab"], f"{where}.lm_head_vocab") if "lm_head_vocab" in spec else 0
    return Drafter(
        params=_positive(spec["params"], u.NUMBER, f"{where}.params"),
        layers=_int(spec["layers"], f"{where}.layers"),
        precision=prec,
        kv_bytes_per_token=_at_least_0(kv, u.BYTES, f"{where}.kv_bytes_per_token"),
        shares_target_lm_head=spec.get("shares_target_lm_head", not vocab),
        source=source,
        lm_head_vocab=vocab,
    )


def mtp_drafter(model: ModelShape, given: Drafter | None, where: str) -> Drafter:
    """Policy ``mtp``'s drafter: one decoder layer of the target's own shape (its experts if
    it is MoE; full attention, as the MTP layers of DeepSeek-V3, Qwen3-Next / 3.5 and
    MiniMax-M2 are, whatever the target's sliding or linear layers), at ``given``'s precision
    (else the target's attention precision), sharing the target's LM head, plus eh_proj
    (2h -> h); refused for a model that ships no MTP layer."""
    if not model.mtp_layers:
        raise ScenarioError(
            f"{where}.policy: 'mtp' drafts with the target's multi-token-prediction layer; "
            f"{model.name} has none (num_nextn_predict_layers = 0)"
        )
    prec = given.precision if given is not None else model.precision["attention"]
    layer = replace(
        model, name=f"{model.name} MTP layer", num_layers=1,
        first_k_dense=0 if model.n_routed_experts else 1, moe_layers=-1, linear_layers=0,
        sliding_layers=0,
        precision={**{c: prec for c in model.precision if c != "kv_cache"},
                   "kv_cache": model.precision["kv_cache"]},
    )  # fmt: skip
    per_token_kv = layer.kv_bytes_per_token()
    return Drafter(
        params=float(layer.active_params() - layer.lm_head_params), layers=1, precision=prec,
        kv_bytes_per_token=per_token_kv,
        source=(given.source if given is not None and given.source else "")
        or f"{model.name}'s MTP layer (its own decoder-layer shape)",
        layer_shape=layer, projection_params=2.0 * model.hidden_size**2,
    )  # fmt: skip


def _draft_steps(merged: dict, table: dict, policy: Policy, where: str) -> tuple[int, int, int]:
    """(block size B = num_steps + 1, budget N = num_draft_tokens - 1, topk) of a policy that
    drafts in steps, from SGLang's names: ``num_steps`` (k), ``topk`` (kept per step, default
    1: a chain) and ``num_draft_tokens`` (tokens verified, root included; a chain verifies
    k + 1). Example: num_steps 5, topk 8, num_draft_tokens 32 -> B = 6, N = 31, K = 8."""
    for f in ("block_size", "budget"):
        if f in table:
            raise ScenarioError(
                f"{where}.{f}: policy {policy.name!r} takes num_steps, topk and "
                "num_draft_tokens (SGLang's names) instead of block_size / budget"
            )
    if "num_steps" not in merged:
        raise ScenarioError(f"{where}: policy {policy.name!r} needs 'num_steps' (draft steps k)")
    k = _int(merged["num_steps"], f"{where}.num_steps")
    topk = _int(merged.get("topk", 1), f"{where}.topk")
    if topk == 1:
        draft = _int(merged.get("num_draft_tokens", k + 1), f"{where}.num_draft_tokens", 2)
        if draft != k + 1:
            raise ScenarioError(
                f"{where}.num_draft_tokens: a top-1 chain of {k} steps verifies {k + 1} tokens "
                f"(root included); got {draft}"
            )
    else:
        if "num_draft_tokens" not in merged:
            raise ScenarioError(
                f"{where}: with topk = {topk} the tree's size 'num_draft_tokens' must be given"
            )
        draft = _int(merged["num_draft_tokens"], f"{where}.num_draft_tokens", 2)
        # steps keep top-k tokens in all (a beam); heads' trees branch top-k at every node
        heads = policy.drafting is Drafting.HEADS
        most = sum(topk**d for d in range(1, k + 1)) if heads else k * topk
        if draft > most + 1:
            raise ScenarioError(
                f"{where}.num_draft_tokens: {draft} is more than {k} "
                f"{'heads' if heads else 'steps'} of top-{topk} can propose (at most {most} "
                "nodes + the root)"
            )
    return k + 1, draft - 1, topk


def _hardware_ref(name: Any, hardware: dict[str, Hardware], where: str) -> Hardware:
    if not isinstance(name, str):
        raise ScenarioError(
            f"{where}: expected a hardware name (a string like 'b300'), got {name!r:.60}"
        )
    if name not in hardware:
        raise ScenarioError(
            f"{where}: unknown hardware {name!r}; known: {', '.join(sorted(hardware))} "
            "(or define it under [hardware.NAME])"
        )
    return hardware[name]


def _point(
    table: dict, ctx: ParseContext, drafter: Drafter | None, where: str, model: ModelShape
) -> Point:
    """hardware, policy (default ddtree), block_size and budget (where the policy's tree takes
    it; num_steps / topk / num_draft_tokens for one that drafts in steps), deployment fields."""
    merged = {**ctx.deploy, **{k: v for k, v in table.items() if k in _DEPLOY}}
    if "hardware" not in table:
        raise ScenarioError(f"{where}: missing field 'hardware'")
    policy = POLICIES[one_of(merged.get("policy", DEFAULT_POLICY), POLICIES, f"{where}.policy")]
    if not policy.needs_drafter:
        block = 1  # no drafter: one token per step
        budget = _int(table.get("budget", 0), f"{where}.budget", 0)
        if budget:
            raise ScenarioError(
                f"{where}.budget: policy {policy.name!r} has no draft tree; leave it out"
            )
        drafter = None
    elif policy.drafting.step_fields:
        block, budget, topk = _draft_steps(merged, table, policy, where)
        if policy.drafting is Drafting.MTP:
            drafter = mtp_drafter(model, drafter, where)
        elif policy.drafting is Drafting.LOOKUP:
            if drafter is not None:
                raise ScenarioError(
                    f"{where}.drafter: policy {policy.name!r} looks its tokens up on the host "
                    "and runs no drafter; leave the drafter out"
                )
        elif drafter is None or not drafter.layers:
            raise ScenarioError(
                f"{where}: policy {policy.name!r} needs a drafter with 'params' and 'layers' "
                "(its own layers, run once per draft step)"
            )
        elif policy.drafting is Drafting.HEADS:
            drafter = replace(drafter, shares_target_lm_head=False)  # each head projects itself
    else:
        if "block_size" not in table:
            raise ScenarioError(f"{where}: missing field 'block_size'")
        block = _int(table["block_size"], f"{where}.block_size", 2)
        if not policy.uses_budget:
            fixed = policy.budget(block, 0)
            budget = _int(table.get("budget", fixed), f"{where}.budget", 1)
            if budget != fixed:
                raise ScenarioError(
                    f"{where}.budget: policy {policy.name!r} verifies the B-1 = {fixed} drafted "
                    f"tokens; got {budget} (leave it out)"
                )
        else:
            if "budget" not in table:
                raise ScenarioError(f"{where}: missing field 'budget'")
            budget = _int(table["budget"], f"{where}.budget", policy.min_budget)
    ctx_raw = merged.get("context", "2048 tok")
    context = u.parse_quantity(
        f"{ctx_raw} tok" if type(ctx_raw) is int else ctx_raw, u.TOKENS, f"{where}.context"
    )
    if not (math.isfinite(context) and context >= 0):
        raise ScenarioError(f"{where}.context: {ctx_raw!r} must be >= 0 tokens")
    hardware = _hardware_ref(table["hardware"], ctx.hardware, f"{where}.hardware")
    tp = _int(merged.get("tp", 1), f"{where}.tp")
    deployment = _deployment(merged.get("parallel", "tp"), tp, f"{where}.parallel")
    per_node, inter = _nodes(merged, hardware, tp, ctx, where)
    return Point(
        hardware=hardware,
        tp=tp,
        concurrency=_int(merged.get("concurrency", 1), f"{where}.concurrency"),
        context_tokens=float(context),
        block_size=block,
        budget=budget,
        engine=(engine := ctx.engine(merged.get("engine", "eager"), where)),
        launches=ctx.engines[engine].launches,
        drafter=drafter,
        policy=policy,
        deployment=deployment,
        gpus_per_node=per_node,
        inter_node=inter,
        draft_topk=topk if policy.needs_drafter and policy.drafting.step_fields else 1,
        host=_host_cpu(merged.get("host_cpu", ""), hardware, f"{where}.host_cpu"),
        stack=one_of(merged.get("stack", "any"), STACKS, f"{where}.stack"),
    )


def _host_cpu(raw: Any, hardware: Hardware, where: str) -> str:
    """A deployment's ``host_cpu`` (a class of ``data/hosts.toml``), else the hardware's."""
    hosts = load_hosts()
    text(raw, where)
    for key in (raw, hardware.host_cpu):
        if key and key not in hosts:
            raise ScenarioError(f"{where}: {key!r}; known host classes: {', '.join(hosts)}")
    return str(raw)


def _deployment(raw: Any, tp: int, where: str) -> Deployment:
    """``parallel = "tp" | "tp-ep" | "dp-ep"`` or a table ``{ attention = "tp", moe_tp = 2,
    moe_ep = 4 }`` (tensor-parallel attention over the group, routed experts as moe_ep groups
    of moe_tp GPUs: moe_tp x moe_ep = tp)."""
    if isinstance(raw, dict):
        parse(ParallelTable, raw, where)
        if raw.get("attention", "tp") != "tp":
            raise ScenarioError(
                f"{where}.attention: {raw['attention']!r}; a table takes tensor-parallel "
                'attention ("tp"); data-parallel attention is parallel = "dp-ep"'
            )
        moe_tp = _int(raw.get("moe_tp", 1), f"{where}.moe_tp")
        moe_ep = _int(raw.get("moe_ep", 1), f"{where}.moe_ep")
        if moe_tp * moe_ep != tp:
            raise ScenarioError(
                f"{where}: moe_tp x moe_ep = {moe_tp} x {moe_ep} = {moe_tp * moe_ep}; "
                f"it must equal tp = {tp} (every GPU holds part of the experts)"
            )
        return mixed_deployment(moe_tp, moe_ep)
    if not isinstance(raw, str) or raw not in DEPLOYMENTS:
        raise ScenarioError(
            f"{where}: {raw!r:.60}; expected one of {', '.join(DEPLOYMENTS)} or a table "
            '{ attention = "tp", moe_tp = 2, moe_ep = 4 }'
        )
    return DEPLOYMENTS[raw]


def _nodes(merged: dict, hardware: Hardware, tp: int, ctx: ParseContext, where: str):
    """(GPUs per node, inter-node link) of a group of ``tp`` GPUs: a group larger than a node
    (``gpus_per_node``, else the hardware's) must fill whole nodes and name the link between
    them (``inter_node``): pricing it as one NVLink domain would be wrong."""
    per_node = _int(merged.get("gpus_per_node", hardware.gpus_per_node), f"{where}.gpus_per_node")
    raw = merged.get("inter_node")
    link = None
    if raw is not None:
        if not isinstance(raw, str) or raw not in ctx.links:
            raise ScenarioError(
                f"{where}.inter_node: {raw!r}; known links: {', '.join(ctx.links)} "
                "(or define one under [link.NAME])"
            )
        link = ctx.links[raw]
    if tp > per_node:
        nodes = math.ceil(tp / per_node)
        if tp % per_node:
            raise ScenarioError(
                f"{where}.tp: {tp} GPUs do not fill whole nodes of {per_node} "
                f"({hardware.key}: gpus_per_node); use a multiple of {per_node}"
            )
        if link is None:
            raise ScenarioError(
                f"{where}: tp {tp} spans {nodes} nodes of {per_node} GPUs ({hardware.key}); "
                f"name the link between them with inter_node = one of {', '.join(ctx.links)}"
            )
    return per_node, link


def hardware_tables(tables: Any, where: str, catalog: dict[str, Hardware]) -> dict[str, Hardware]:
    """The catalog plus a file's ``[hardware.NAME]`` tables (figures typed into the file are
    labelled ``user`` unless a table gives a ``source``); ``base = "h100-sxm"`` starts from
    another entry."""
    hardware = dict(catalog)
    for key, entry in (tables or {}).items():
        if not isinstance(entry, dict):
            raise ScenarioError(f"{where}: hardware.{key} must be a table")
        base = None
        if "base" in entry:
            base = _hardware_ref(entry["base"], hardware, f"{where}: hardware.{key}.base")
        hardware[key] = hardware_from_dict(key, entry, where, base=base, default_kind="user")
    return hardware


def link_tables(tables: Any, where: str) -> dict[str, Link]:
    """The built-in inter-node links plus a file's ``[link.NAME]`` tables."""
    links = load_links()
    for key, entry in (tables or {}).items():
        if not isinstance(entry, dict):
            raise ScenarioError(f"{where}: link.{key} must be a table")
        links[key] = link_from_dict(key, entry, where, default_kind="user")
    return links


def _tau(raw: Any, point: Point, where: str) -> Value:
    """tau (a value or a range): at least 1 (the bonus token), at most B (every drafted token
    accepted, plus the bonus); an ar step commits exactly 1."""
    if raw is None:
        if not point.policy.needs_drafter:
            return 1.0
        raise ScenarioError(f"{where}: missing field 'tau' (accepted tokens per step)")
    tau = _value(raw, u.TOKENS_PER_STEP, f"{where}.tau")
    low, high = (tau.low, tau.high) if isinstance(tau, Range) else (tau, tau)
    block = point.policy.block(point.block_size)
    # a tree of N nodes commits at most N accepted tokens plus the bonus
    nodes = point.policy.budget(point.block_size, point.budget) if point.policy.needs_drafter else 0
    top = min(block, nodes + 1)
    if not (math.isfinite(low) and math.isfinite(high)) or low < 1 or high > top:
        if not point.policy.needs_drafter:
            bound = f"1 for {point.policy}"
        elif top < block:
            bound = f"budget + 1 = {top} (a tree of {nodes} nodes commits at most {top} tokens)"
        else:
            bound = f"block_size = {top}"
        raise ScenarioError(
            f"{where}.tau: {raw!r} is outside [1, {top}]: tau counts the accepted drafted "
            f"tokens plus the bonus token, so 1 <= tau <= {bound}"
        )
    return tau


MIN_ANCHOR_NOISE = 1e-3
"""No measurement of a decode speed is known to better than 0.1% (the fit weighs an anchor by
1 / noise^2: a denormal noise made the calibration's SVD fail)."""


def noise_of(raw: Any, where: str) -> float:
    if raw is None:
        return DEFAULT_ANCHOR_NOISE
    if (
        isinstance(raw, bool)
        or not isinstance(raw, (int, float))
        or not MIN_ANCHOR_NOISE <= raw < 1
    ):
        raise ScenarioError(
            f"{where}.noise: expected a relative 1-sigma noise in [{MIN_ANCHOR_NOISE:g}, 1) like "
            f"0.03, got {raw!r}"
        )
    return float(raw)


def _below_one(name: str, values: list[float], where: str) -> None:
    """An efficiency is a fraction of a peak: strictly below 1 (at 1 a kernel would run at
    the roofline; a prior or a range reaching it is refused, not clipped)."""
    if name.split("@")[0].endswith("efficiency") and any(v >= 1 for v in values):
        raise ScenarioError(
            f"{where}: {name} is a fraction of the hardware's peak and must stay below 1, got "
            f"{max(values):g}"
        )


def _param_entry(name: str, raw: Any, spec: ParamSpec, where: str):
    """-> (pinned value or None, new spec). ``x = value`` pins a parameter; ``x = [lo, hi]`` or
    ``{range = [lo, hi]}`` makes that its prior (calibration may move it);
    ``{value = v, fit = true}`` makes v the prior's centre."""
    dim = _PARAM_DIMS[spec.unit]
    if isinstance(raw, dict):
        parse(ParamTable, raw, where)
        value = _positive(raw["value"], dim, f"{where}.value") if "value" in raw else None
        rng = _value(raw["range"], dim, f"{where}.range") if "range" in raw else None
        if rng is not None and not isinstance(rng, Range):
            raise ScenarioError(f"{where}.range: expected [low, high]")
        fit = raw.get("fit", spec.fit)
    else:
        v = _value(raw, dim, where)
        value, rng, fit = (None, v, spec.fit) if isinstance(v, Range) else (v, None, False)
    if rng is not None and not rng.low > 0:
        raise ScenarioError(f"{where}: a parameter's range must be positive, got {rng.low:g}")
    _below_one(name, [x for x in (value, rng.high if rng else None) if x is not None], where)
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


def load_scenario(
    path: str | Path,
    records_hw: dict[str, Hardware] | None = None,
    allow_oversubscribe: bool = False,
) -> ScenarioFile:
    path = Path(path)
    where = str(path)
    try:  # a regular file only, checked before it is opened (a FIFO would block forever)
        data = tomllib.loads(read_input_bytes(path, "a TOML scenario file").decode("utf-8"))
    except FileNotFoundError:
        raise ScenarioError(f"{where}: no such scenario file") from None
    except OSError as exc:
        raise ScenarioError(f"{where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{where}: not valid TOML ({exc})") from None
    try:
        return _parse(data, where, path.parent, records_hw or {}, allow_oversubscribe)
    except (u.UnitError, CatalogError, ModelError) as exc:
        msg = str(exc)
        raise ScenarioError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _parse(
    data: dict, where: str, base_dir: Path, records_hw: dict, allow_oversubscribe: bool = False
) -> ScenarioFile:
    parse(ScenarioDoc, data, where, top=True, names=SCENARIO_NAMES)
    if "model" not in data:
        raise ScenarioError(f"{where}: missing [model] (preset = ... or config = ...)")
    model = load_model(data["model"], where, base_dir)
    drafter = drafter_from(data["drafter"], f"{where}: drafter") if "drafter" in data else None
    hardware = hardware_tables(data.get("hardware"), where, {**load_catalog(), **records_hw})
    links = link_tables(data.get("link"), where)
    engines = dict(ENGINES)
    own = set()  # engine parameters the scenario set itself: its values, not the corpus's
    for name, entry in (data.get("engine") or {}).items():
        w = f"{where}: engine.{name}"
        base = engines.get(name, ENGINES["eager"])
        times = {f"{f}_s": _positive(entry[f], u.TIME, f"{w}.{f}") for f in ENGINE_PARAMS
                 if f in entry}  # fmt: skip
        about = entry.get("about", base.about)
        engines[name] = replace(base, name=name, about=about, **times)
        own |= {engine_param(name, f) for f in ENGINE_PARAMS if f in entry}
    specs = corpus_params(engines, frozenset(own))
    fixed = {}
    for name, raw in (data.get("parameters") or {}).items():
        w = f"{where}: parameters.{name}"
        if name not in specs:
            raise unknown_parameter(name, specs, w)
        pinned, specs[name] = _param_entry(name, raw, specs[name], w)
        if pinned is not None:
            fixed[name] = pinned
    deploy = data.get("deployment") or {}
    ctx = ParseContext(where, hardware, engines, deploy, drafter, [], base_dir, links,
                       allow_oversubscribe)  # fmt: skip
    anchors: list[Anchor] = []
    for i, a in enumerate(data.get("anchor") or []):
        anchors.append(_anchor(a, i, model, ctx))
    names = [a.name for a in anchors]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{where}: anchor names must be unique, got {names}")
    cases = []
    for i, s in enumerate(data.get("scenario") or []):
        cases.append(_case(s, i, ctx, specs, names, model))
    sweep = (data.get("report") or {}).get("hardware", [])
    for h in sweep:
        _hardware_ref(h, hardware, f"{where}: report.hardware")
    recs = data.get("records") or {}
    return ScenarioFile(
        path=where,
        title=data.get("title", Path(where).stem),
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
        links=links,
        allow_oversubscribe=allow_oversubscribe,
    )


STEP_ANCHOR_KEYS = set(StepFields.model_fields)
_FIGURE_FIELDS = {"tpot": ("tokens_per_s", "step", "tpot"), "itl": ("itl",),
                  "e2e_tokens_per_s": ("tokens_per_s",)}  # fmt: skip


def _metric(a: dict, where: str) -> Metric:
    kind = one_of(a.get("metric", "tpot"), METRICS, f"{where}.metric")
    e2e_fields = ("prompt_tokens", "output_tokens", "counts_prompt", "ttft")
    if kind != "e2e_tokens_per_s":
        extra = [f for f in e2e_fields if f in a]
        if extra:
            raise ScenarioError(
                f"{where}: {', '.join(extra)} describe an e2e_tokens_per_s figure; "
                f"metric is {kind!r}"
            )
        return Metric(kind)
    for f in ("prompt_tokens", "output_tokens"):
        if f not in a:
            raise ScenarioError(f"{where}: metric e2e_tokens_per_s needs '{f}' (a token count)")
    prompt = _int(a["prompt_tokens"], f"{where}.prompt_tokens", 0)
    output = _int(a["output_tokens"], f"{where}.output_tokens", 2)
    ttft = _positive(a["ttft"], u.TIME, f"{where}.ttft") if "ttft" in a else None
    counts = flag(a.get("counts_prompt", False), f"{where}.counts_prompt")
    return Metric(kind, prompt, output, counts, ttft)


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
    """A measured step from a table with ``STEP_ANCHOR_KEYS``: the point, tau, what the figure
    measures (``metric``, default ``tpot``) and the figure: ``tokens_per_s`` (aggregate over
    the C requests), ``step`` (time per step) or ``tpot`` (time per output token: step / tau)
    for ``tpot``; ``itl`` (time between streamed chunks: a step) for ``itl``;
    ``tokens_per_s`` for ``e2e_tokens_per_s`` (whose context defaults to the prompt plus
    half the output: the mean context of its decode steps)."""
    metric = _metric(a, where)
    if metric.kind == "e2e_tokens_per_s" and "context" not in a:
        a = {**a, "context": f"{metric.prompt_tokens + metric.output_tokens / 2:g} tok"}
    point = _point(a, ctx, drafter, where, model)
    tau = _tau(a.get("tau"), point, where)
    if isinstance(tau, Range):
        raise ScenarioError(f"{where}.tau: an anchor's tau is one measured value, not a range")
    allowed = _FIGURE_FIELDS[metric.kind]
    given = [f for f in ("tokens_per_s", "step", "tpot", "itl") if f in a]
    if len(given) != 1 or given[0] not in allowed:
        raise ScenarioError(
            f"{where}: a {metric.kind} figure is exactly one of {', '.join(allowed)} "
            f"(like '303 tok/s' or '14.5 ms'); got {', '.join(given) or 'none'}"
        )
    field_ = given[0]
    if field_ == "tokens_per_s":
        tps = _positive(a["tokens_per_s"], u.TOKEN_RATE, f"{where}.tokens_per_s")
        if metric.kind == "e2e_tokens_per_s":
            wall = point.concurrency * metric.counted_tokens / tps
            ctx.check(model, point, where)
            return StepAnchor(name, model, point, tau, 0.0, source, noise, metric=metric,
                              wall_s=wall)  # fmt: skip
        step_s = point.concurrency * tau / tps
    elif field_ == "tpot":
        step_s = _positive(a["tpot"], u.TIME, f"{where}.tpot") * tau
    else:  # a step, or the inter-token latency of one streamed chunk per step
        step_s = _positive(a[field_], u.STEP_TIME, f"{where}.{field_}")
    ctx.check(model, point, where)
    return StepAnchor(name, model, point, tau, step_s, source, noise, metric=metric)


def _anchor(a, i: int, model: ModelShape, ctx: ParseContext) -> Anchor:
    name = a.get("name", f"anchor{i}")
    w = f"{ctx.where}: anchor[{i}]" + (f" ({name})" if isinstance(name, str) else "")
    kind = a.get("kind", "step")
    if kind in ("step", "moe_layer"):  # each kind's own fields
        parse(StepAnchorTable if kind == "step" else MoeAnchorTable, a, w)
    source = a.get("source", "")
    noise = noise_of(a.get("noise"), w)
    if kind == "step":
        return step_anchor(a, name, model, ctx.drafter, ctx, w, source, noise)
    if kind == "moe_layer":
        for key in ("hardware", "m", "time"):
            if key not in a:
                raise ScenarioError(f"{w}: missing field '{key}'")
        if not model.n_routed_experts:
            raise ScenarioError(
                f"{w}.kind: a moe_layer anchor times the routed experts; {model.name} is dense "
                "(no routed experts): use a step anchor"
            )
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


def _case(
    s, i: int, ctx: ParseContext, specs: dict[str, ParamSpec], anchor_names, model: ModelShape
) -> ScenarioCase:
    """One ``[[scenario]]`` entry, its fields checked by ``ScenarioDoc``."""
    name = s.get("name", f"scenario{i}")
    w = f"{ctx.where}: scenario[{i}] ({name})"
    d = drafter_from(s["drafter"], f"{w}.drafter") if "drafter" in s else ctx.drafter
    point = _point(s, ctx, d, w, model)
    tau_source = ""
    if isinstance(s.get("tau"), dict):  # tau = { records = "acc.jsonl" }: measured
        from ddtree.perf.inputs.acceptance import tau_from_records

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
    for pname, raw in s.get("parameters", {}).items():
        if pname not in specs:
            raise unknown_parameter(pname, specs, f"{w}.parameters.{pname}")
        v = _value(raw, _PARAM_DIMS[specs[pname].unit], f"{w}.parameters.{pname}")
        if (v.low if isinstance(v, Range) else v) <= 0:
            raise ScenarioError(f"{w}.parameters.{pname}: must be positive, got {raw!r}")
        _below_one(pname, [v.high if isinstance(v, Range) else v], f"{w}.parameters.{pname}")
        overrides[pname] = v
    article = None
    if "article" in s:
        aw = f"{w}.article"
        art = s["article"]
        article = Article(
            tokens_per_s=_rate_or_range(art["tokens_per_s"], f"{aw}.tokens_per_s")
            if "tokens_per_s" in art
            else None,
            step_s=_positive(art["step"], u.STEP_TIME, f"{aw}.step") if "step" in art else None,
            moe_s=_positive(art["moe"], u.STEP_TIME, f"{aw}.moe") if "moe" in art else None,
            note=art.get("note", ""),
        )
    question = s.get("question", "")
    ctx.check(model, point, w)
    return ScenarioCase(name, point, tau, anchors, overrides, article, question, tau_source)
