"""Render an Estimate: terminal tables (rich), JSON, the labelled chain of reasoning, and a
Markdown report with PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddtree.files import replace_atomically
from ddtree.perf.cost.physics import memory_per_gpu
from ddtree.perf.cost.step import LIMITS, dispatch_overlaps, launch_s, launch_seconds, link_class
from ddtree.perf.hardware import units as u
from ddtree.perf.hardware.catalog import load_hosts
from ddtree.perf.inputs.fromrecords import PROFILE_OF_MODE
from ddtree.perf.inputs.scenario import Range, StageAnchor, StepAnchor
from ddtree.perf.projection.calibrate import Backtest
from ddtree.perf.projection.estimate import Estimate, records_warning
from ddtree.perf.projection.uncertainty import CaseResult, point_value
from ddtree.vocab import Stage


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def _tps(x: float) -> str:
    return f"{x:.0f}"


def _article_range(r: CaseResult) -> tuple[float, float] | None:
    a = r.case.article
    if a is None or a.tokens_per_s is None:
        return None
    t = a.tokens_per_s
    return (t.low, t.high) if isinstance(t, Range) else (float(t), float(t))


def comparison(r: CaseResult) -> str:
    """Where our p10-p90 sits against the article's figure, and which components differ."""
    return "; ".join(comparison_parts(r))


def comparison_parts(r: CaseResult) -> list[str]:
    """[where our p10-p90 sits against the article's figure, then the components that
    differ]; empty without an article."""
    rng = _article_range(r)
    if rng is None:
        return []
    lo, hi = r.tokens_per_s[10], r.tokens_per_s[90]
    a = r.case.article
    art = f"{rng[0]:.0f}" if rng[0] == rng[1] else f"{rng[0]:.0f}-{rng[1]:.0f}"
    if hi < rng[0] * 0.99:
        where = f"ours ({lo:.0f}-{hi:.0f}) is below the article's {art} tok/s"
    elif lo > rng[1] * 1.01:
        where = f"ours ({lo:.0f}-{hi:.0f}) is above the article's {art} tok/s"
    else:
        where = f"ours ({lo:.0f}-{hi:.0f}) overlaps the article's {art} tok/s"
    parts = [where]
    moe = r.point.find("routed MoE")
    if a.moe_s is not None and moe is not None:
        moe_kernel = float(moe.seconds) - launch_seconds(r.case.point, r.point_params, moe.launches)
        parts.append(f"routed MoE kernels {_ms(moe_kernel)} vs the article's {_ms(a.moe_s)}")
    if a.step_s is not None:
        parts.append(f"step {_ms(float(r.point.step_s))} vs {_ms(a.step_s)}")
    over = r.amdahl.overhead_fraction * float(r.point.step_s)
    parts.append(f"our overhead (host + launches + all-reduce) {_ms(over)}")
    if a.note:
        parts.append(f"article: {a.note}")
    return parts


def calibration_warnings(est: Estimate) -> list[str]:
    """One line each: what the estimate rests on no measurement for, and records behind its
    anchors that differ in workload or setup."""
    if not est.scenario.anchors:
        return [
            "nothing is calibrated: the scenario has no anchors and no --records, so every "
            "parameter is its prior (centred on the corpus's train fit, data/corpus_prior.toml) "
            "and every range is the priors' and the cost model's own error"
        ]
    out = [records_warning(est.scenario)]
    bare = [r.case.name for r in est.results if not r.calibration.anchors_used]
    if bare:
        out.append(f"calibrated on no anchor (its anchors list is empty), every parameter its "
                   f"prior (the corpus's train fit): {', '.join(bare)}")  # fmt: skip
    return [w for w in out if w]


def _moves_most(r: CaseResult) -> str:
    if not r.tornado:
        return "-"
    b = r.tornado[0]
    lo, hi = sorted((b.tokens_per_s_at_low, b.tokens_per_s_at_high))
    return f"{b.input} {_tps(lo)}..{_tps(hi)}"


def summary_table(est: Estimate):
    """The answer per case, first: tokens/s and speedup over AR with their ranges, the limit
    that binds and the input that moves tokens/s most."""
    from rich.markup import escape
    from rich.table import Table

    sf = est.scenario
    t = Table(title=escape(f"{sf.title}  ({sf.path})"))
    for col in ("case", "tau", "tok/s p10 / p50 / p90", "speedup vs AR", "binds", "moves it most"):
        t.add_column(col, justify="left" if col in ("case", "binds", "moves it most") else "right")
    for r in est.results:
        x = r.tokens_per_s
        mark = " *" if r.model_form_sigma >= 0.01 else ""
        t.add_row(
            escape(r.case.name), _tau(r.case.tau),
            f"{_tps(x[10])} / {_tps(x[50])} / {_tps(x[90])}{mark}",
            "-" if r.speedup_vs_ar is None else _speedup(r), r.amdahl.binds,
            escape(_moves_most(r)),
        )  # fmt: skip
    return t


def calibration_line(est: Estimate) -> str:
    c = est.calibration
    if not c.residuals:
        return "calibration: no anchors; every parameter at its prior [assumed]"
    worst = max(c.residuals, key=lambda r: abs(r.rel_error))
    fitted = sum(c.status(n) != "prior" for n in c.names)
    return (
        f"calibration: {len(c.residuals)} anchors ({', '.join(c.anchors_used)}), the model "
        f"within {abs(worst.rel_error):.1%} of each [measured vs derived]; {fitted} of "
        f"{len(c.names)} parameters moved by them, the rest at their priors [assumed]"
    )


def summary_lines(est: Estimate) -> list[str]:
    """What the summary table rests on, after it: the legend, the calibration, the model's own
    error where it widens a range, the comparison with a published figure."""
    out = [
        "tok/s, speedup: p10 / p50 / p90 over the calibrated parameters and tau [derived]; "
        "binds: what most of the step is spent on; moves it most: the input whose p10..p90 "
        "swings tok/s most (tok/s at its two ends)",
        calibration_line(est),
    ]
    forms = sorted(
        {round(r.model_form_sigma, 3) for r in est.results if r.model_form_sigma >= 0.01}
    )
    if forms:
        out.append(
            f"* the range includes the cost model's own error, +-{' / +-'.join(f'{s:.1%}' for s in forms)}"
            " (1 sigma): the leave-one-source-out fit where no anchor ran on the setup, else what "
            "the calibration still misses that setup's anchors by"
        )
    out += [
        f"{r.case.name} vs article: {cmp[0]}" for r in est.results if (cmp := comparison_parts(r))
    ]
    out.append(
        "--explain: every parameter, each case's step breakdown and the chain of reasoning; "
        "--json; --report DIR for plots"
    )
    return out


def summary(est: Estimate, console, details: bool = True) -> None:
    """``ddtree estimate``'s default output: the summary table, then (``details``) what it
    rests on."""
    if est.results:
        console.print(summary_table(est))
    else:
        console.print(
            f"{est.scenario.path}: no [[scenario]] cases to project (a `ddtree tune` scenario "
            "sweeps the budgets of its --acceptance records instead)",
            markup=False, highlight=False,
        )  # fmt: skip
    for line in summary_lines(est) if details else []:
        console.print(line, markup=False, highlight=False)


def _model_form(r: CaseResult) -> str:
    return (
        f"ranges include the cost model's own error, +-{r.model_form_sigma:.1%} (1 sigma; "
        "leave-one-source-out on the validation set where no anchor ran on this setup, else "
        "what the calibration still misses this setup's anchors by)"
    )


def _speedup(r: CaseResult) -> str:
    x = r.speedup_vs_ar
    return f"{x[10]:.2f} / {x[50]:.2f} / {x[90]:.2f}x"


def _ar_note(r: CaseResult) -> str:
    a, pt = r.ar_tokens_per_s, r.case.point
    return (
        f"(ar on {pt.hardware.key}, TP {pt.tp}, C={pt.concurrency}, context "
        f"{pt.context_tokens:.0f} tok, {pt.engine}: {_tps(a[10])} / {_tps(a[50])} / "
        f"{_tps(a[90])} tok/s)"
    )


def _pcts(x: dict[int, float] | None) -> dict[str, float] | None:
    return None if x is None else {f"p{k}": v for k, v in x.items()}


def _tau(v) -> str:
    if not isinstance(v, Range):
        return f"{v:g}"
    mode = "" if v.mode is None else f" (mode {v.mode:.3g})"
    return f"{v.low:.3g}-{v.high:.3g}{mode}"


def _param(v: float, unit: str) -> str:
    return u.format_quantity(v, u.TIME) if unit == "s" else f"{v:.3g}"


def to_dict(est: Estimate) -> dict[str, Any]:
    c = est.calibration
    return {
        "scenario": est.scenario.path,
        "title": est.scenario.title,
        "notes": est.scenario.notes,
        "warnings": calibration_warnings(est),
        "calibration": {
            "values": c.values,
            "fitted": [n for n in c.names if c.constrained(n)],
            "residuals": [{**dataclasses.asdict(r), "rel_error": r.rel_error} for r in c.residuals],
        },
        "scenarios": [
            {
                "name": r.case.name,
                "question": r.case.question,
                "hardware": r.case.point.hardware.key,
                "tp": r.case.point.tp,
                "parallel": r.case.point.deployment.name,
                "concurrency": r.case.point.concurrency,
                "block_size": r.case.point.block_size,
                "budget": r.case.point.budget,
                "engine": r.case.point.engine,
                "tau": dataclasses.asdict(r.case.tau)
                if isinstance(r.case.tau, Range)
                else r.case.tau,
                "tau_source": r.case.tau_source or "assumed: scenario input",
                "anchors": r.calibration.anchors_used,
                "policy": str(r.case.point.policy),
                "tokens_per_s": _pcts(r.tokens_per_s),
                "step_s": _pcts(r.step_s),
                "speedup_vs_ar": _pcts(r.speedup_vs_ar),
                "ar_tokens_per_s": _pcts(r.ar_tokens_per_s),
                "point_step_s": float(r.point.step_s),
                "breakdown_s": {comp.name: float(comp.seconds) for comp in r.point.components},
                "hbm_bytes_per_gpu": r.point.hbm_bytes,
                "limit_step_s": r.amdahl.limit_step_s,
                "limit_tokens_per_s": r.amdahl.limit_tokens_per_s,
                "overhead_fraction": r.amdahl.overhead_fraction,
                "shares_by_limit": r.amdahl.shares,
                "binds": r.amdahl.binds,
                "amdahl": r.amdahl.statement,
                "tornado": [dataclasses.asdict(b) for b in r.tornado],
                "vs_article": comparison(r),
                "model_form_sigma": r.model_form_sigma,
                "samples": r.samples,
                "seed": r.seed,
            }
            for r in est.results
        ],
    }


def to_json(est: Estimate) -> str:
    return json.dumps(to_dict(est), indent=2, default=float)


def explain(est: Estimate) -> str:
    """The chain of reasoning, every number labelled measured / catalog / derived / assumed."""
    out = _model_lines(est) + [""] + _anchor_lines(est) + [""] + profile_lines(est) + [""]
    out += _calibration_lines(est)
    for r in est.results:
        out += ["", *_case_lines(est, r)]
    return "\n".join(out)


def _model_lines(est: Estimate) -> list[str]:
    """The scenario's title, notes, the model's derived sizes and the drafter."""
    sf = est.scenario
    m = sf.model
    out = [f"# {sf.title}", "", *(f"note: {n}" for n in sf.notes)]
    out.append(f"model {m.name}: {m.source or 'preset'}")
    out.append(
        f"  derived: routed expert = 3 x {m.hidden_size} x {m.moe_intermediate_size} = "
        f"{m.expert_params / 1e6:.2f} M params x {m.bytes_per_param('routed_experts'):.4g} B "
        f"({m.precision['routed_experts']}); attention {m.attention_params_per_layer / 1e6:.1f} M "
        f"params/layer x {m.bytes_per_param('attention'):.4g} B; KV "
        f"{m.kv_bytes_per_token() / 1e3:.1f} kB/token over {m.attention_layers} KV layers; "
        "active params/token "
        f"{m.active_params() / 1e9:.1f} B"
    )
    if sf.drafter:
        d = sf.drafter
        out.append(
            f"drafter: {d.params / 1e9:.2g} B params, {d.layers} layers, {d.precision} "
            f"[assumed: {d.source or 'typed in'}]"
        )
    return out


def _anchor_lines(est: Estimate) -> list[str]:
    """Each anchor and what it measured [measured]."""
    sf = est.scenario
    out = ["anchors [measured]:"]
    for a in sf.anchors:
        if isinstance(a, StepAnchor) and a.e2e:
            fig = a.metric
            ttft = "measured TTFT" if fig.ttft_s is not None else (
                f"the predicted prefill of {fig.prompt_tokens:g} tokens"
            )  # fmt: skip
            out.append(
                f"  {a.name}: {a.point.hardware.key}, tau {a.tau:g}, {a.tokens_per_s:.1f} tok/s "
                f"end to end over {fig.counted_tokens:g} tokens -> wall = C x tokens / tok/s = "
                f"{a.wall_s:.3f} s [derived], compared with {ttft} + "
                f"({fig.output_tokens:g} - 1) / tau x step  ({a.source})"
            )
        elif isinstance(a, StepAnchor):
            out.append(
                f"  {a.name}: {a.point.hardware.key}, B={a.point.block_size} N={a.point.budget} "
                f"tau {a.tau:g}, {a.tokens_per_s:.1f} tok/s -> step = C x tau / tok/s = "
                f"{_ms(a.step_s)} [derived]  ({a.source})"
            )
        elif isinstance(a, StageAnchor):
            at = (
                f"over a {a.prompt_tokens:.0f}-token prompt"
                if a.stage is Stage.PREFILL
                else f"at M = {a.point.verify_width}, context {a.point.context_tokens:.0f} tok"
            )
            out.append(
                f"  {a.name}: {a.stage} stage {at} = {_ms(a.seconds)} +- {a.noise:.0%} -> fits "
                f"the components tagged {a.stage}  ({a.source})"
            )
        else:
            out.append(
                f"  {a.name}: routed MoE layer at M={a.m} (TP {a.tp}) on {a.hardware.key}: "
                f"{_ms(a.s_per_layer)}  ({a.source})"
            )
    return out


def _calibration_lines(est: Estimate) -> list[str]:
    """The calibrated parameters, with their priors, and the anchors' residuals."""
    sf, c = est.scenario, est.calibration
    out = ["calibrated parameters (MAP fit, log-normal priors; 'fitted' = anchors narrowed it):"]
    unused = unused_scopes(est)
    shown = [n for n in c.names if _scope(n, est) not in unused]
    for n in shown:
        spec = sf.specs[n]
        prior = "assumed (prior)" if spec.centre == "assumed" else "corpus fit (prior)"
        lab = prior if c.status(n) == "prior" else c.status(n)
        out.append(
            f"  {n} = {_param(c.values[n], spec.unit)} [{lab}; prior {_param(spec.default, spec.unit)}"
            f" in {_param(spec.low, spec.unit)}..{_param(spec.high, spec.unit)}] — {spec.about}"
        )
    if len(shown) < len(c.names):
        out.append(
            f"  ({len(c.names) - len(shown)} parameters of engine profiles, hosts and links no "
            f"anchor or case runs on ({', '.join(sorted(unused))}) stay at their priors, not "
            "shown)"
        )
    for n, v in sf.fixed.items():
        out.append(f"  {n} = {_param(v, sf.specs[n].unit)} [user]")
    for res in c.residuals:
        out.append(
            f"  residual {res.anchor}: model {_ms(res.predicted)} vs measured "
            f"{_ms(res.measured)} ({res.rel_error:+.1%})"
        )
    return out


def _case_lines(est: Estimate, r: CaseResult) -> list[str]:
    """One case: hardware, deployment, the step by component, bands, limit, sensitivity."""
    sf, c, m = est.scenario, est.calibration, est.scenario.model
    pt, hw = r.case.point, r.case.point.hardware
    out = [f"## {r.case.name}", r.case.question, f"hardware {hw.name}:"]
    for key, val, dim in (
        ("hbm_bandwidth", hw.hbm_bytes_per_s, u.BANDWIDTH),
        ("bf16_dense", hw.dense_flops.get("bf16", 0.0), u.FLOP_RATE),
        ("link_bandwidth", hw.link_bytes_per_s, u.BANDWIDTH),
        ("allreduce_latency", hw.allreduce_latency_s, u.TIME),
    ):
        prov = hw.provenance.get(key)
        out.append(
            f"  {key} = {u.format_quantity(val, dim)} [{prov.label() if prov else 'assumed'}]"
        )
    if pt.nodes > 1:
        link = pt.inter_node
        out.append(
            f"  inter_node = {link.key}: {link.name}, "
            f"{u.format_quantity(link.bytes_per_s, u.BANDWIDTH)} per GPU "
            f"[{link.provenance['bandwidth'].label()}], all-reduce latency "
            f"{u.format_quantity(link.allreduce_latency_s, u.TIME)} "
            f"[{link.provenance['allreduce_latency'].label()}]; {pt.nodes} nodes of "
            f"{pt.per_node} GPUs"
        )
    out.append(
        f"deployment: {pt.tp} GPUs, {pt.deployment.name} [{pt.deployment.about}], "
        f"C={pt.concurrency}, context {pt.context_tokens:.0f} tok, "
        f"block {pt.block_size}, budget {pt.budget} -> M = N + 1 = {pt.verify_width} [derived]; "
        f"engine {pt.engine} [{sf.engines[pt.engine].about or 'assumed'}]"
    )
    host = load_hosts()[pt.host_cpu]
    speed = r.point_params.get(host.param, 1.0) if host.param else 1.0
    state = "reference" if host.param is None else (
        c.status(host.param) if host.param in c.names else "user"
    )  # fmt: skip
    out.append(
        f"host CPU: {host.name}; speed {speed:.3g} x the reference host [{state}; prior "
        f"{host.speed:g} in {host.low:g}..{host.high:g}, {host.provenance.label()}] divides "
        "the framework overhead, host tree work and kernel launches"
    )
    out.append(
        f"memory per GPU: {memory_per_gpu(m, pt).describe()} of "
        f"{u.format_quantity(hw.memory_bytes, u.BYTES)} [derived; runtime reserve assumed]"
    )
    out.append(f"tau = {_tau(r.case.tau)} [{r.case.tau_source or 'assumed: scenario input'}]")
    if m.n_routed_experts:
        from ddtree.perf.cost.step import Forward, experts_touched, forward_routing

        verify = Forward(Stage.VERIFY, pt.verify_width, pt.context_tokens)
        t, g = (float(v) for v in forward_routing(pt, r.point_params, verify))
        e = float(experts_touched(m.n_routed_experts, m.top_k, t, pt.experts_curve))
        depth = min(pt.block_size, pt.verify_width)
        gname = f"routing_locality@{hw.key}"
        gname = gname if gname in c.names else "routing_locality"
        out.append(
            f"experts touched per layer = E(1-(1-k/E)^T), T = C x M/D x D^g = "
            f"{pt.concurrency} x {pt.verify_width}/{depth} x {depth}^{g:.3g} = {t:.1f}: "
            f"{m.n_routed_experts}(1-(1-{m.top_k}/{m.n_routed_experts})^{t:.1f}) = {e:.1f} "
            f"[derived: uniform routing of T tokens; a request's M verify tokens over D "
            f"positions, consecutive ones routing alike; g = routing_locality, "
            f"{c.status(gname) if gname in c.names else 'prior'}]"
        )
    launch = launch_s(pt, r.point_params)
    ahead = " dispatched ahead of the GPU" if dispatch_overlaps(pt) else ""
    step = float(r.point.step_s)
    for comp in r.point.components:
        s = float(comp.seconds)
        out.append(
            f"  {comp.name}: {_ms(s)} ({s / step:.0%}, {comp.bound}) [derived: {comp.formula}; "
            f"{u.format_quantity(comp.hbm_bytes, u.BYTES)}/GPU, "
            f"{comp.launches:.0f} launches x {u.format_quantity(launch, u.TIME)}{ahead}; "
            f"scales with {comp.rule}]"
        )
    out.append(
        f"step = sum = {_ms(step)}; tokens/s = C x tau / step = {pt.concurrency} x "
        f"{r.point_tau:g} / {_ms(step)} = {pt.concurrency * r.point_tau / step:.0f} [derived]"
    )
    out.append(
        f"Monte Carlo ({r.samples} samples, seed {r.seed}; {r.posterior}): tokens/s p10/p50/p90 = "
        f"{r.tokens_per_s[10]:.0f} / {r.tokens_per_s[50]:.0f} / {r.tokens_per_s[90]:.0f}"
    )
    out.append(f"  {_model_form(r)} [fitted]")
    if r.speedup_vs_ar is not None:
        out.append(
            f"speedup vs AR = tok/s / tok/s of the ar step (M = 1, tau = 1, no drafter) "
            f"with the same samples, p10/p50/p90 = {_speedup(r)} [derived] {_ar_note(r)}"
        )
    out.append(
        f"physical limit = {u.format_quantity(r.point.hbm_bytes, u.BYTES)} per GPU / "
        f"{u.format_quantity(hw.hbm_bytes_per_s, u.BANDWIDTH)} = {_ms(r.amdahl.limit_step_s)}"
        f" -> {r.amdahl.limit_tokens_per_s:.0f} tok/s [derived]; this projection is "
        f"{r.amdahl.fraction_of_limit:.0%} of it; {r.amdahl.statement}"
    )
    shares = ", ".join(f"{LIMITS[k]} {v:.0%}" for k, v in r.amdahl.shares.items() if v >= 0.005)
    out.append(f"the step by what bounds it: {shares} [derived]; binds: {r.amdahl.binds}")
    if r.tornado:
        out.append(
            "moves it most (one input at its p10 and p90, the others at the point): "
            + ", ".join(
                f"{b.input} ({_tps(b.tokens_per_s_at_low)}..{_tps(b.tokens_per_s_at_high)} tok/s)"
                for b in r.tornado[:4]
            )
        )
    cmp = comparison(r)
    if cmp:
        out.append(f"vs article: {cmp}")
    return out


def profile_lines(est: Estimate) -> list[str]:
    """Which engine profile (mode) on which hardware its host costs came from."""
    sf, c = est.scenario, est.calibration
    groups: dict[tuple[str, str, bool], list[str]] = {}
    for a in sf.anchors:
        if not isinstance(a, StepAnchor):
            continue
        eng, hw = a.point.engine, a.point.hardware.key
        scoped = f"{eng}.step_overhead@{hw}"
        name = scoped if scoped in c.values else f"{eng}.step_overhead"
        groups.setdefault((eng, name, a.from_records), []).append(hw)
    out = ["engine profiles (host costs per mode; device efficiencies shared by every mode):"]
    for (eng, name, rec), hws in sorted(groups.items()):
        status = c.status(name) if name in c.names else "user"
        if rec:
            modes = "/".join(m for m, p in PROFILE_OF_MODE.items() if p == eng)
            what = f"{len(hws)} engine_run record(s) with engine_mode {modes}"
        else:
            what = f"{len(hws)} scenario anchor(s)"
        where = f"{eng} profile on {', '.join(sorted(set(hws)))}"
        if "@" in name:
            where += " (host costs of its own)"
        out.append(f"  {where}: {status} from {what}; step overhead "
                   f"{_param(c.values[name], 's')}")  # fmt: skip
    used = {eng for eng, _, _ in groups}
    for eng in dict.fromkeys(r.case.point.engine for r in est.results):
        if eng not in used:
            out.append(f"  {eng} profile: no anchor ran in it; its host costs are assumed "
                       f"({sf.engines[eng].about})")  # fmt: skip
    return out


def _scope(name: str, est: Estimate) -> str | None:
    """The engine profile, host class or link class a parameter belongs to (None: shared)."""
    head = name.split("@")[0]
    if head.split(".")[0] in est.scenario.engines:
        return head.split(".")[0]
    return head if head.startswith(("host_speed.", "allreduce_scale.")) else None


def unused_scopes(est: Estimate) -> set[str]:
    """Engine profiles, host classes and link classes no anchor and no case runs on: their
    parameters keep their priors and say nothing about this scenario."""
    sf = est.scenario
    used: set[str] = set()
    points = [a.point for a in sf.anchors if hasattr(a, "point")]
    for pt in points + [r.case.point for r in est.results]:
        used |= {
            pt.engine,
            f"host_speed.{pt.host_cpu}",
            f"allreduce_scale.{link_class(pt.hardware)}",
        }
        if pt.nodes > 1:
            used.add("allreduce_scale.inter_node")
    scopes = {s for n in est.calibration.names if (s := _scope(n, est))}
    return scopes - used


def backtest_text(bt: Backtest) -> str:
    lines = [f"backtest ({bt.mode}):"]
    for row in bt.rows:
        lines.append(
            f"  {row.anchor}: measured {row.measured_tokens_per_s:.2f} tok/s, predicted "
            f"{row.predicted_tokens_per_s:.2f} ({row.rel_error:+.1%})"
        )
    lines.append(f"  MAPE {bt.mape:.1%} over {len(bt.rows)} held-out runs")
    return "\n".join(lines)


def backtest_dict(bt: Backtest) -> dict[str, Any]:
    return {
        "mode": bt.mode,
        "mape": bt.mape,
        "rows": [{**dataclasses.asdict(r), "rel_error": r.rel_error} for r in bt.rows],
    }


def write_report(
    est: Estimate,
    out_dir: str | Path,
    samples: int = 1000,
    on_written: Callable[[Path], None] | None = None,
) -> list[Path]:
    """report.md and its PNGs (``ddtree.perf.report.plots``): the breakdown per case, tokens/s
    against tau per hardware for the last case with a drafter, tokens/s against the budget
    for the cases that sweep one. ``samples``: Monte Carlo draws behind each plotted point.
    Each file is written whole as soon as it is made (``on_written(path)`` after each),
    report.md last, so an interrupt keeps the finished plots and leaves no partial file."""
    from ddtree.perf.report import plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sf = est.scenario
    drafted = [r for r in est.results if r.case.point.policy.needs_drafter]
    makers = {
        "breakdown": lambda: plots.breakdown_figure(est.results) if est.results else None,
        "tokens_vs_tau": lambda: plots.tau_figure(sf, drafted[-1], samples) if drafted else None,
        "tokens_vs_budget": lambda: plots.budget_figure(sf, est.results, samples),
    }
    written = []
    for name, make in makers.items():
        fig = make()
        if fig is not None:
            written.append(plots.save(fig, out / f"{name}.png", on_saved=on_written))
    figures = [p.stem for p in written]
    md = [f"# {sf.title}", "", f"Scenario file: `{sf.path}`", ""]
    md.append(
        "| scenario | tok/s p10 | p50 | p90 | speedup vs AR p10 / p50 / p90 | step p50 | "
        "limit tok/s | binds | vs article |"
    )
    md.append("|---|---|---|---|---|---|---|---|---|")
    for r in est.results:
        speed = "-" if r.speedup_vs_ar is None else _speedup(r)
        md.append(
            f"| {r.case.name} | {r.tokens_per_s[10]:.0f} | {r.tokens_per_s[50]:.0f} | "
            f"{r.tokens_per_s[90]:.0f} | {speed} | {_ms(r.step_s[50])} | "
            f"{r.amdahl.limit_tokens_per_s:.0f} | {r.amdahl.binds} | {comparison(r)} |"
        )
    md.append("")
    md += [f"![{name}]({name}.png)\n" for name in figures]
    md += ["## Chain of reasoning", "", "```", explain(est), "```", ""]
    written.append(out / "report.md")
    with replace_atomically(written[-1], on_replaced=on_written) as partial:
        partial.write_text("\n".join(md), encoding="utf-8")
    return written


__all__ = [
    "backtest_dict",
    "backtest_text",
    "calibration_warnings",
    "comparison",
    "explain",
    "point_value",
    "summary",
    "summary_table",
    "to_dict",
    "to_json",
    "write_report",
]


def _validation_rows(v) -> list[dict[str, Any]]:
    out = []
    for r in v.rows:
        a, p = r.point.anchor, r.point
        out.append(
            {
                "point": p.name,
                "split": r.split,
                "source": p.source.key,
                "citation": f"{p.source.title} ({p.source.url}; {p.source.where})",
                "what": p.what,
                "measured_as": p.measured,
                "assumed": list(p.assumed),
                "engine": p.engine_name,
                "profile": a.point.engine,
                "hardware": a.point.hardware.key,
                "model": a.model.name,
                "policy": str(a.point.policy),
                "stack": a.point.stack,
                "metric": a.metric.kind,
                "tp": a.point.tp,
                "concurrency": a.point.concurrency,
                "tau": a.tau,
                "measured_tokens_per_s": r.measured_tokens_per_s,
                "predicted_tokens_per_s": r.predicted_tokens_per_s,
                "band_tokens_per_s": _pcts(r.band_tokens_per_s),
                "inside_p10_p90": r.inside(10, 90),
                "inside_p25_p75": r.inside(25, 75),
                "noise": a.noise,
                "model_form_sigma": r.model_form_sigma,
                "rel_error": r.rel_error,
                "explanation": p.note if r.needs_note else "",
                "explained": r.explained,
                "calibrated_on": r.calibrated_on,
            }
        )
    return out


def _scores(rows) -> dict[str, Any]:
    from ddtree.perf.validation.corpus import BANDS, coverage, mape, pairs

    spec = [r for r in rows if r.speculative]
    paired = pairs(rows)
    return {
        "points": len(rows),
        "sources": len({r.point.source.key for r in rows}),
        "mape": mape(rows),
        **{f"coverage_p{lo}_p{hi}": coverage(rows, lo, hi) for lo, hi in BANDS},
        "speculative_points": len(spec),
        "speculative_mape": mape(spec),
        "ar_mape": mape([r for r in rows if not r.speculative]),
        "speedup_pairs": len(paired),
        "speedup_sign_right": (
            sum(x.sign_right for x in paired) / len(paired) if paired else float("nan")
        ),
    }


def validation_json(v) -> str:
    from ddtree.perf.validation.corpus import EXPLAIN_ABOVE, SOURCE_KINDS, TEST_FRACTION

    doc = {
        "folder": v.folder,
        "mode": "train: leave-one-source-out over the train sources; test: calibrated on every "
        f"train point (the test sources, {TEST_FRACTION:.0%} by sha256 of the key, are never "
        "fitted)",
        "test": _scores(v.part("test")),
        "train": _scores(v.part("train")),
        "model_form_sigma": v.model_form_sigma,
        "noise_by_source_kind": {k.name: k.noise for k in SOURCE_KINDS.values()},
        "sources": v.sources,
        "by_source": {
            key: {"kind": rows[0].point.source.kind.name, "split": rows[0].split, **_scores(rows)}
            for key, rows in v.by_source().items()
        },
        "explain_above": EXPLAIN_ABOVE,
        "unexplained": [r.point.name for r in v.rows if not r.explained],
        "points": _validation_rows(v),
    }
    return json.dumps(doc, indent=2)


def _score_line(name: str, rows) -> str:
    sc = _scores(rows)
    if not rows:
        return f"{name}: no points"
    return (
        f"{name}: {sc['points']} points from {sc['sources']} sources: p50 MAPE {sc['mape']:.1%} "
        f"(AR {sc['ar_mape']:.1%}, speculative {sc['speculative_mape']:.1%} over "
        f"{sc['speculative_points']}); inside p10-p90 {sc['coverage_p10_p90']:.0%}, inside "
        f"p25-p75 {sc['coverage_p25_p75']:.0%}; speedup sign right in "
        f"{sc['speedup_sign_right']:.0%} of {sc['speedup_pairs']} AR-paired speculative points"
    )


def validation_table(v, console) -> None:
    from rich.table import Table

    from ddtree.perf.validation.corpus import EXPLAIN_ABOVE
    from ddtree.perf.validation.corpus import mape as _mape

    for split, how in (
        ("train", "each predicted from the other train sources (leave-one-source-out)"),
        ("test", "each predicted from a calibration on every train point; never fitted"),
    ):
        rows = v.part(split)
        if not rows:
            continue
        t = Table(
            title=f"{split}: {len(rows)} published points, "
            f"{len({r.point.source.key for r in rows})} sources, {how}",
            caption="tok/s: measured; predicted: at the calibrated parameters; p10-p90: what a "
            "measurement would show (posterior x the source kind's noise and the model-form "
            "error of its kind); in: inside p10-p90",
        )
        for col in ("point", "mode", "policy", "C", "tok/s", "predicted", "p10-p90", "in",
                    "error"):  # fmt: skip
            t.add_column(col, justify="left" if col in ("point", "mode", "policy") else "right")
        for r in rows:
            a = r.point.anchor
            b = r.band_tokens_per_s
            flag = "" if not r.needs_note else (" *" if r.explained else " !")
            t.add_row(
                r.point.name, a.point.engine, str(a.point.policy), str(a.point.concurrency),
                f"{r.measured_tokens_per_s:.0f}", f"{r.predicted_tokens_per_s:.0f}",
                f"{b[10]:.0f}-{b[90]:.0f}", "yes" if r.inside(10, 90) else "no",
                f"{r.rel_error:+.1%}{flag}",
            )  # fmt: skip
        console.print(t)
    sig = ", ".join(f"{k} {x:.1%}" for k, x in v.model_form_sigma.items())
    console.print(
        _score_line("train (leave-one-source-out)", v.part("train"))
        + f"; model-form error sigma_m {sig} (fitted on the train held-out residuals of each "
        "kind; a train source's band uses the value fitted without it)"
    )
    per = Table(title="per source (noise from its kind)")
    for col in ("source", "split", "kind", "noise", "points", "MAPE", "in p10-p90",
                "in p25-p75"):  # fmt: skip
        per.add_column(col, justify="left" if col in ("source", "split", "kind") else "right")
    for key, rows in v.by_source().items():
        kind = rows[0].point.source.kind
        per.add_row(
            key, rows[0].split, kind.name, f"{kind.noise:.0%}", str(len(rows)),
            f"{_mape(rows):.1%}", f"{sum(r.inside(10, 90) for r in rows)}/{len(rows)}",
            f"{sum(r.inside(25, 75) for r in rows)}/{len(rows)}",
        )  # fmt: skip
    console.print(per)
    off = [r for r in v.rows if r.needs_note]
    if off:
        console.print(f"off by more than {EXPLAIN_ABOVE:.0%} (* explained, ! unexplained):")
        for r in off:
            console.print(
                f"  [{r.split}] {r.point.name} ({r.rel_error:+.1%}): "
                f"{r.point.note or 'UNEXPLAINED'}"
            )
    console.print("sources: " + "; ".join(
        f"{s}: {next(r.point.source.url for r in v.rows if r.point.source.key == s)}"
        for s in v.sources))  # fmt: skip
    console.print("HEADLINE " + _score_line("test (sources never fitted)", v.part("test")))
