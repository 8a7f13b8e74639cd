"""Render an Estimate: terminal tables (rich), JSON, the labelled chain of reasoning, and a
Markdown report with PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from ddtree.perf import units as u
from ddtree.perf.calibrate import Backtest
from ddtree.perf.cost import link_class, step_cost
from ddtree.perf.estimate import Estimate
from ddtree.perf.fromrecords import PROFILE_OF_MODE
from ddtree.perf.scenario import Range, StageAnchor, StepAnchor
from ddtree.perf.uncertainty import CaseResult, point_value
from ddtree.records import Policy, Stage


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
    rng = _article_range(r)
    if rng is None:
        return ""
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
    moe = r.point.component("routed MoE") if r.case.point.hardware else None
    if a.moe_s is not None and moe is not None:
        moe_kernel = (
            float(moe.seconds) - moe.launches * r.point_params[f"{r.case.point.engine}.launch"]
        )
        parts.append(f"routed MoE kernels {_ms(moe_kernel)} vs the article's {_ms(a.moe_s)}")
    if a.step_s is not None:
        parts.append(f"step {_ms(float(r.point.step_s))} vs {_ms(a.step_s)}")
    over = r.amdahl.overhead_fraction * float(r.point.step_s)
    parts.append(f"our overhead (host + launches + all-reduce) {_ms(over)}")
    if a.note:
        parts.append(f"article: {a.note}")
    return "; ".join(parts)


def table(est: Estimate, console) -> None:
    from rich.table import Table

    sf = est.scenario
    console.print(f"[bold]{sf.title}[/bold]  ({sf.path})")
    cal = Table(title="calibration (fitted to anchors)", show_lines=False)
    for col in ("anchor", "what", "measured", "model", "residual"):
        cal.add_column(col, justify="right" if col != "anchor" else "left")
    for res in est.calibration.residuals:
        cal.add_row(res.anchor, res.what, _ms(res.measured), _ms(res.predicted),
                    f"{res.rel_error:+.1%}")  # fmt: skip
    console.print(cal)
    fit = Table(title="parameters")
    for col in ("parameter", "value", "prior", "status"):
        fit.add_column(col)
    c = est.calibration
    for name in c.names:
        used = {a.point.engine for a in sf.anchors if hasattr(a, "point")}
        used |= {r.case.point.engine for r in est.results}
        if name.split(".")[0] in sf.engines and name.split(".")[0] not in used:
            continue
        spec = sf.specs[name]
        status = {"prior": "prior (anchors say little)"}.get(c.status(name), c.status(name))
        fit.add_row(name, _param(c.values[name], spec.unit), _param(spec.default, spec.unit),
                    status)  # fmt: skip
    console.print(fit)
    for r in est.results:
        t = Table(title=f"{r.case.name}", caption=r.amdahl.statement)
        t.add_column("component")
        t.add_column("time", justify="right")
        t.add_column("share", justify="right")
        t.add_column("bound by")
        step = float(r.point.step_s)
        for comp in r.point.components:
            s = float(comp.seconds)
            t.add_row(comp.name, _ms(s), f"{s / step:.0%}", comp.bound)
        t.add_row("[bold]step (point estimate)[/bold]", f"[bold]{_ms(step)}[/bold]", "", "")
        console.print(t)
        console.print(
            f"  tokens/s p10/p50/p90: [bold]{_tps(r.tokens_per_s[10])} / "
            f"{_tps(r.tokens_per_s[50])} / {_tps(r.tokens_per_s[90])}[/bold]"
            f"   step p10/p50/p90: {_ms(r.step_s[10])} / {_ms(r.step_s[50])} / {_ms(r.step_s[90])}"
            f"   (tau {_tau(r.case.tau)}, C={r.case.point.concurrency}, {r.samples} samples)"
        )
        if r.speedup_vs_ar is not None:
            console.print(f"  speedup vs AR p10/p50/p90: [bold]{_speedup(r)}[/bold]  {_ar_note(r)}")
        console.print(
            f"  physical limit: {_ms(r.amdahl.limit_step_s)} per step "
            f"({u.format_quantity(r.point.hbm_bytes, u.BYTES)} per GPU at peak HBM) -> "
            f"{_tps(r.amdahl.limit_tokens_per_s)} tok/s; this projection is "
            f"{r.amdahl.fraction_of_limit:.0%} of it"
        )
        if r.tornado:
            top = ", ".join(
                f"{b.input} ({_tps(b.tokens_per_s_at_low)}..{_tps(b.tokens_per_s_at_high)})"
                for b in r.tornado[:4]
            )
            console.print(f"  moves it most: {top}")
        cmp = comparison(r)
        if cmp:
            console.print(f"  vs article: {cmp}")
        console.print()


def _speedup(r: CaseResult) -> str:
    x = r.speedup_vs_ar
    return f"{x[10]:.2f}x / {x[50]:.2f}x / {x[90]:.2f}x"


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
                "amdahl": r.amdahl.statement,
                "tornado": [dataclasses.asdict(b) for b in r.tornado],
                "vs_article": comparison(r),
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
    sf, c = est.scenario, est.calibration
    m = sf.model
    out = [f"# {sf.title}", "", *(f"note: {n}" for n in sf.notes)]
    out.append(f"model {m.name}: {m.source or 'preset'}")
    out.append(
        f"  derived: routed expert = 3 x {m.hidden_size} x {m.moe_intermediate_size} = "
        f"{m.expert_params / 1e6:.2f} M params x {m.bytes_per_param('routed_experts'):.4g} B "
        f"({m.precision['routed_experts']}); attention {m.attention_params_per_layer / 1e6:.1f} M "
        f"params/layer x {m.bytes_per_param('attention'):.4g} B; KV "
        f"{m.kv_bytes_per_token_layer():.0f} B/token/layer; active params/token "
        f"{m.active_params() / 1e9:.1f} B"
    )
    if sf.drafter:
        d = sf.drafter
        out.append(
            f"drafter: {d.params / 1e9:.2g} B params, {d.layers} layers, {d.precision} "
            f"[assumed: {d.source or 'typed in'}]"
        )
    out.append("")
    out.append("anchors [measured]:")
    for a in sf.anchors:
        if isinstance(a, StepAnchor):
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
    out.append("")
    out += profile_lines(est)
    out.append("")
    out.append(
        "calibrated parameters (MAP fit, log-normal priors; 'fitted' = anchors narrowed it):"
    )
    for n in c.names:
        spec = sf.specs[n]
        lab = {"prior": "assumed (prior)"}.get(c.status(n), c.status(n))
        out.append(
            f"  {n} = {_param(c.values[n], spec.unit)} [{lab}; prior {_param(spec.default, spec.unit)}"
            f" in {_param(spec.low, spec.unit)}..{_param(spec.high, spec.unit)}] — {spec.about}"
        )
    for n, v in sf.fixed.items():
        out.append(f"  {n} = {_param(v, sf.specs[n].unit)} [user]")
    for res in c.residuals:
        out.append(
            f"  residual {res.anchor}: model {_ms(res.predicted)} vs measured "
            f"{_ms(res.measured)} ({res.rel_error:+.1%})"
        )
    for r in est.results:
        pt, hw = r.case.point, r.case.point.hardware
        out += ["", f"## {r.case.name}", r.case.question]
        out.append(f"hardware {hw.name}:")
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
        out.append(
            f"deployment: {pt.tp} GPUs, {pt.deployment.name} [{pt.deployment.about}], "
            f"C={pt.concurrency}, context {pt.context_tokens:.0f} tok, "
            f"block {pt.block_size}, budget {pt.budget} -> M = N + 1 = {pt.verify_width} [derived]; "
            f"engine {pt.engine} [{sf.engines[pt.engine].about or 'assumed'}]"
        )
        out.append(f"tau = {_tau(r.case.tau)} [{r.case.tau_source or 'assumed: scenario input'}]")
        if m.n_routed_experts:
            from ddtree.perf.cost import experts_touched

            e = float(
                experts_touched(m.n_routed_experts, m.top_k, pt.verify_width * pt.concurrency)
            )
            out.append(
                f"experts touched per layer = E(1-(1-k/E)^(M*C)) = {m.n_routed_experts}"
                f"(1-(1-{m.top_k}/{m.n_routed_experts})^{pt.verify_width * pt.concurrency}) = "
                f"{e:.1f} [derived, uniform routing]"
            )
        launch = r.point_params[f"{pt.engine}.launch"]
        for comp in r.point.components:
            out.append(
                f"  {comp.name}: {_ms(float(comp.seconds))} [derived: {comp.formula}; "
                f"{u.format_quantity(comp.hbm_bytes, u.BYTES)}/GPU, "
                f"{comp.launches:.0f} launches x {u.format_quantity(launch, u.TIME)}; "
                f"scales with {comp.rule}]"
            )
        step = float(r.point.step_s)
        out.append(
            f"step = sum = {_ms(step)}; tokens/s = C x tau / step = {pt.concurrency} x "
            f"{r.point_tau:g} / {_ms(step)} = {pt.concurrency * r.point_tau / step:.0f} [derived]"
        )
        out.append(
            f"Monte Carlo ({r.samples} samples, seed {r.seed}; {r.posterior}): tokens/s p10/p50/p90 = "
            f"{r.tokens_per_s[10]:.0f} / {r.tokens_per_s[50]:.0f} / {r.tokens_per_s[90]:.0f}"
        )
        if r.speedup_vs_ar is not None:
            out.append(
                f"speedup vs AR = tok/s / tok/s of the ar step (M = 1, tau = 1, no drafter) "
                f"with the same samples, p10/p50/p90 = {_speedup(r)} [derived] {_ar_note(r)}"
            )
        out.append(
            f"physical limit = {u.format_quantity(r.point.hbm_bytes, u.BYTES)} per GPU / "
            f"{u.format_quantity(hw.hbm_bytes_per_s, u.BANDWIDTH)} = {_ms(r.amdahl.limit_step_s)}"
            f" -> {r.amdahl.limit_tokens_per_s:.0f} tok/s [derived]; {r.amdahl.statement}"
        )
        cmp = comparison(r)
        if cmp:
            out.append(f"vs article: {cmp}")
    return "\n".join(out)


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


def write_report(est: Estimate, out_dir: str | Path) -> list[Path]:
    """Markdown + PNGs: breakdown per scenario, tok/s vs tau per hardware, tok/s vs budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sf = est.scenario
    written: list[Path] = []

    # 1. step-time breakdown per scenario (stacked bars)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r.case.name for r in est.results]
    comp_names = []
    for r in est.results:
        for comp in r.point.components:
            if comp.name not in comp_names:
                comp_names.append(comp.name)
    bottom = np.zeros(len(names))
    for cn in comp_names:
        vals = np.array(
            [sum(float(c.seconds) for c in r.point.components if c.name == cn) * 1e3
             for r in est.results]
        )  # fmt: skip
        ax.barh(names, vals, left=bottom, label=cn)
        bottom += vals
    ax.set_xlabel("step time (ms)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("step-time breakdown (point estimate)")
    fig.tight_layout()
    written.append(out / "breakdown.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    # 2. tokens/s vs tau per hardware, for the last scenario's configuration
    base = est.results[-1] if est.results else None
    sweep = sf.sweep_hardware or ([base.case.point.hardware.key] if base else [])
    taus = np.linspace(1, 20, 39)
    if base is not None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key in sweep:
            pt = dataclasses.replace(base.case.point, hardware=sf.hardware[key])
            params = _params_for(base, pt)
            cost = step_cost(sf.model, pt, params, taus)
            ax.plot(taus, pt.concurrency * taus / cost.step_s, label=key)
        ax.set_xlabel("acceptance length tau (tokens per step)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"tokens/s vs tau: {base.case.name}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(out / "tokens_vs_tau.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

        # 3. tokens/s vs budget at the scenario's tau (tau held fixed: shows the cost side)
        budgets = [8, 16, 32, 64, 128, 256]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in (x for x in est.results if x.case.point.policy is Policy.DDTREE):
            ys = []
            for n in budgets:
                pt = dataclasses.replace(r.case.point, budget=n)
                cost = step_cost(sf.model, pt, r.point_params, r.point_tau)
                ys.append(pt.concurrency * r.point_tau / float(cost.step_s))
            ax.plot(budgets, ys, marker="o", label=f"{r.case.name} (tau {r.point_tau:g})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget N (verify width M = N + 1)")
        ax.set_ylabel("tokens/s at fixed tau")
        ax.set_title("tokens/s vs budget (tau held fixed)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(out / "tokens_vs_budget.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    md = [f"# {sf.title}", "", f"Scenario file: `{sf.path}`", ""]
    md.append(
        "| scenario | tok/s p10 | p50 | p90 | speedup vs AR p10 / p50 / p90 | step p50 | "
        "limit tok/s | overhead share | vs article |"
    )
    md.append("|---|---|---|---|---|---|---|---|---|")
    for r in est.results:
        speed = "-" if r.speedup_vs_ar is None else _speedup(r)
        md.append(
            f"| {r.case.name} | {r.tokens_per_s[10]:.0f} | {r.tokens_per_s[50]:.0f} | "
            f"{r.tokens_per_s[90]:.0f} | {speed} | {_ms(r.step_s[50])} | "
            f"{r.amdahl.limit_tokens_per_s:.0f} | {r.amdahl.overhead_fraction:.0%} | "
            f"{comparison(r)} |"
        )
    md += ["", "![breakdown](breakdown.png)", "", "![tokens vs tau](tokens_vs_tau.png)", "",
           "![tokens vs budget](tokens_vs_budget.png)", "", "## Chain of reasoning", "", "```",
           explain(est), "```", ""]  # fmt: skip
    written.append(out / "report.md")
    written[-1].write_text("\n".join(md))
    return written


def _params_for(r: CaseResult, pt) -> dict:
    params = dict(r.point_params)
    link = f"allreduce_scale.{link_class(pt.hardware)}"
    params.setdefault(link, 1.0)
    return params


__all__ = [
    "backtest_dict",
    "backtest_text",
    "comparison",
    "explain",
    "point_value",
    "table",
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
                "source": p.source.key,
                "citation": f"{p.source.title} ({p.source.url}; {p.source.where})",
                "what": p.what,
                "measured_as": p.measured,
                "engine": p.engine_name,
                "profile": a.point.engine,
                "hardware": a.point.hardware.key,
                "model": a.model.name,
                "policy": str(a.point.policy),
                "tp": a.point.tp,
                "concurrency": a.point.concurrency,
                "tau": a.tau,
                "measured_tokens_per_s": r.measured_tokens_per_s,
                "predicted_tokens_per_s": r.predicted_tokens_per_s,
                "band_tokens_per_s": _pcts(r.band_tokens_per_s),
                "rel_error": r.rel_error,
                "explanation": p.note if r.needs_note else "",
                "explained": r.explained,
                "calibrated_on": r.calibrated_on,
            }
        )
    return out


def validation_json(v) -> str:
    from ddtree.perf.validate import EXPLAIN_ABOVE

    doc = {
        "folder": v.folder,
        "mode": "leave-one-source-out",
        "mape": v.mape,
        "sources": v.sources,
        "explain_above": EXPLAIN_ABOVE,
        "unexplained": [r.point.name for r in v.rows if not r.explained],
        "points": _validation_rows(v),
    }
    return json.dumps(doc, indent=2)


def validation_table(v, console) -> None:
    from rich.table import Table

    from ddtree.perf.validate import EXPLAIN_ABOVE

    t = Table(
        title=f"validation: {len(v.rows)} published points, {len(v.sources)} sources, each "
        "predicted from the other sources' points (leave-one-source-out)",
        caption="tok/s: measured; predicted: at the calibrated parameters; p10-p90: posterior",
    )
    for col in ("point", "mode", "C", "tok/s", "predicted", "p10-p90", "error"):
        t.add_column(col, justify="left" if col in ("point", "mode") else "right")
    for r in v.rows:
        a = r.point.anchor
        b = r.band_tokens_per_s
        flag = "" if not r.needs_note else (" *" if r.explained else " !")
        t.add_row(
            r.point.name, a.point.engine, str(a.point.concurrency),
            f"{r.measured_tokens_per_s:.0f}", f"{r.predicted_tokens_per_s:.0f}",
            f"{b[10]:.0f}-{b[90]:.0f}", f"{r.rel_error:+.1%}{flag}",
        )  # fmt: skip
    console.print(t)
    console.print(f"MAPE {v.mape:.1%} over {len(v.rows)} points (goal <= 20%)")
    off = [r for r in v.rows if r.needs_note]
    if off:
        console.print(f"off by more than {EXPLAIN_ABOVE:.0%} (* explained, ! unexplained):")
        for r in off:
            console.print(f"  {r.point.name} ({r.rel_error:+.1%}): {r.point.note or 'UNEXPLAINED'}")
    console.print("sources: " + "; ".join(
        f"{s}: {next(r.point.source.url for r in v.rows if r.point.source.key == s)}"
        for s in v.sources))  # fmt: skip
