"""The figures of ``ddtree estimate --report`` and ``ddtree tune --report`` (matplotlib,
Agg). Each function returns a Figure; the callers save it. Rules they keep, so a plot does
not mislead:

- a stacked breakdown has at most as many parts as distinct colours (``PALETTE`` plus grey
  for "other", which gathers the smallest parts);
- curves that lie within ``SAME_WITHIN`` of each other everywhere are one line, labelled
  with every name it stands for, instead of lines drawn over each other;
- every curve with a range has its p10-p90 band;
- a tau axis stops at the block size (no step commits more than B tokens);
- tokens/s against the budget moves tau with the budget (measured, or ``tau_by_budget``'s
  model), never holding it fixed;
- tune's curves carry the measured engine runs where there are any.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddtree.perf.cost.physics import findings
from ddtree.perf.cost.step import link_class, step_cost
from ddtree.perf.inputs.acceptance import DEPTH_DECAY, tau_by_budget
from ddtree.perf.inputs.scenario import Range, StepAnchor
from ddtree.perf.projection.uncertainty import (
    PERCENTILES,
    CaseResult,
    case_model_form,
    point_value,
    run_case,
    sample_inputs,
)
from ddtree.vocab import Drafting

# tab10 without its grey: nine colours a reader tells apart; grey is "other"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#bcbd22", "#17becf")  # fmt: skip
OTHER_COLOUR = "#7f7f7f"
MAX_PARTS = len(PALETTE) + 1
LINESTYLES = ("-", "--", "-.", ":")
SAME_WITHIN = 0.02  # curves closer than 2% at every x are drawn as one
BUDGETS = (8, 16, 32, 64, 128, 256)  # the budget plot's sweep (plus each case's own)
TAU_POINTS = 25  # points on a tokens/s-vs-tau curve


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, on_saved: Callable[[Path], None] | None = None) -> Path:
    """Write ``fig`` as a PNG (atomically: ``ddtree.files.replace_atomically``, which calls
    ``on_saved(path)`` in the replace's section) and free it."""
    from ddtree.files import replace_atomically

    try:
        with replace_atomically(path, on_replaced=on_saved) as partial:
            fig.savefig(partial, dpi=110, format="png")
    finally:
        _pyplot().close(fig)
    return path


@dataclass
class Part:
    """One part of the breakdown: a component, or the smaller ones together."""

    name: str
    ms: list[float]  # per case, at the point estimate
    members: list[str]  # the components it stands for


def breakdown_parts(results: Sequence[CaseResult], max_parts: int = MAX_PARTS) -> list[Part]:
    """The step's components per case, at most ``max_parts``: when there are more, the ones
    with the largest share of a step (in any case) keep their names and the rest are one
    "other" part. Every case's parts add up to its step."""
    ms: dict[str, list[float]] = {}
    for i, r in enumerate(results):
        for comp in r.point.components:
            ms.setdefault(comp.name, [0.0] * len(results))[i] += float(comp.seconds) * 1e3
    if len(ms) <= max_parts:
        return [Part(n, v, [n]) for n, v in ms.items()]
    steps = [float(r.point.step_s) * 1e3 for r in results]
    share = {n: max(x / s for x, s in zip(v, steps, strict=True)) for n, v in ms.items()}
    keep = set(sorted(ms, key=lambda n: -share[n])[: max_parts - 1])
    small = [n for n in ms if n not in keep]
    other = [sum(ms[n][i] for n in small) for i in range(len(results))]
    top = max(share[n] for n in small)
    parts = [Part(n, v, [n]) for n, v in ms.items() if n in keep]
    return [
        *parts,
        Part(f"other ({len(small)} parts, each at most {top:.1%} of a step)", other, small),
    ]


def breakdown_figure(results: Sequence[CaseResult]):
    """Stacked step-time bars per case, each bar labelled with its step and tokens/s."""
    plt = _pyplot()
    parts = breakdown_parts(results)
    names = [r.case.name for r in results]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * len(results)))
    left = np.zeros(len(results))
    for i, part in enumerate(parts):
        colour = OTHER_COLOUR if len(part.members) > 1 else PALETTE[i % len(PALETTE)]
        ax.barh(names, part.ms, left=left, label=part.name, color=colour)
        left += np.asarray(part.ms)
    for y, (r, total) in enumerate(zip(results, left, strict=True)):
        ax.annotate(f" {total:.1f} ms, {r.tokens_per_s[50]:.0f} tok/s p50", (total, y),
                    va="center", fontsize=7)  # fmt: skip
    ax.set_xlim(0, left.max() * 1.25)
    ax.set_xlabel("step time (ms), point estimate")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title("step-time breakdown per case")
    fig.tight_layout()
    return fig


@dataclass
class Curve:
    """One line of a figure: x, its p10/p50/p90, and the names it stands for."""

    labels: list[str]
    x: np.ndarray  # [P]
    p10: np.ndarray  # [P]
    p50: np.ndarray  # [P]
    p90: np.ndarray  # [P]

    @property
    def label(self) -> str:
        return " = ".join(self.labels)


def merge_close(curves: Sequence[Curve], within: float = SAME_WITHIN) -> list[Curve]:
    """Curves whose p50 differ by less than ``within`` (relative) at every x, as one (the
    first's values, every label)."""
    out: list[Curve] = []
    for c in curves:
        twin = next(
            (m for m in out if np.array_equal(m.x, c.x)
             and np.all(np.abs(c.p50 / m.p50 - 1.0) < within)),
            None,
        )  # fmt: skip
        if twin is None:
            out.append(dataclasses.replace(c, labels=list(c.labels)))
        else:
            twin.labels += c.labels
    return out


def _draw(ax, curves: Sequence[Curve], marker: str | None = None, bands=None) -> dict[str, str]:
    """Each curve as a line (a colour and a dash each) with its p10-p90 band (only the
    curves whose label is in ``bands``, when given); -> label: colour. Drawn in the order
    of their last p50, highest first, so the legend reads like the lines."""
    colours = {}
    ordered = sorted(curves, key=lambda c: -float(c.p50[-1]))
    for i, c in enumerate(ordered):
        colour = PALETTE[i % len(PALETTE)]
        style = LINESTYLES[(i // len(PALETTE)) % len(LINESTYLES)]
        ax.plot(c.x, c.p50, style, color=colour, label=c.label, marker=marker)
        if np.any(c.p90 > c.p10) and (bands is None or c.label in bands):
            ax.fill_between(c.x, c.p10, c.p90, color=colour, alpha=0.15, linewidth=0)
        colours[c.label] = colour
    return colours


def _plain_log(axis, base: int = 10) -> None:
    """A log axis with its ticks as plain numbers (200, 300, 500; 8, 16, 32), not 2 x 10^2
    or 2^3."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(
        LogLocator(base=base, subs=(1.0, 2.0, 3.0, 5.0) if base == 10 else (1.0,))
    )
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _merged_note(curves: Sequence[Curve]) -> str | None:
    """The legend's title when some line stands for several curves."""
    if any(len(c.labels) > 1 for c in curves):
        return f"'a = b': within {SAME_WITHIN:.0%} of each other everywhere"
    return None


def _legend(ax, title: str | None = None) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              title=title, title_fontsize=7)  # fmt: skip


def _fits(sf, pt) -> bool:
    kinds = {f.kind for f in findings(sf.model, pt)}
    return "refuse" not in kinds and (sf.allow_oversubscribe or "oversubscribe" not in kinds)


def tau_curves(sf, r: CaseResult, samples: int, seed: int) -> tuple[list[Curve], list[str]]:
    """tokens/s against tau, 1..B, at the case's configuration on each hardware of the
    scenario's sweep (p10-p90 over the posterior and the model-form error at that setup);
    -> (curves, hardware left out because the model does not fit there)."""
    keys = sf.sweep_hardware or [r.case.point.hardware.key]
    taus = np.linspace(1.0, r.case.point.block_size, TAU_POINTS)
    params, _, _ = sample_inputs(r.calibration, r.case, samples, seed)
    curves, left_out = [], []
    for key in keys:
        pt = dataclasses.replace(r.case.point, hardware=sf.hardware[key])
        if not _fits(sf, pt):
            left_out.append(key)
            continue
        p = dict(params)
        p.setdefault(f"allreduce_scale.{link_class(pt.hardware)}", np.ones(samples))
        case = dataclasses.replace(r.case, point=pt)
        sigma = case_model_form(sf.model, case, r.calibration)
        form = np.exp(np.random.default_rng(seed + 1).normal(0.0, sigma, samples))  # [n]
        band = np.empty((len(PERCENTILES), len(taus)))
        for j, tau in enumerate(taus):
            step = np.broadcast_to(step_cost(sf.model, pt, p, tau).step_s, (samples,)) * form
            band[:, j] = np.percentile(pt.concurrency * tau / step, PERCENTILES)
        curves.append(Curve([key], taus, *band))
    return curves, left_out


def tau_figure(sf, r: CaseResult, samples: int = 1000, seed: int = 0):
    """tokens/s against tau per hardware for one case, its tau marked. The p10-p90 band is
    drawn for the case's own hardware; the other lines say theirs at the case's tau in the
    legend (bands of eight lines would hide each other)."""
    plt = _pyplot()
    curves, left_out = tau_curves(sf, r, samples, seed)
    curves = merge_close(curves)
    tau = point_value(r.case.tau)
    own = next(c for c in curves if r.case.point.hardware.key in c.labels) if curves else None
    for c in curves:  # each line's range at the case's tau, in its label
        lo, hi = (float(np.interp(tau, c.x, y)) for y in (c.p10, c.p90))
        c.labels[-1] += f" (p10-p90 {lo:.0f}-{hi:.0f} at tau {tau:g})"
    fig, ax = plt.subplots(figsize=(9.5, 5))
    _draw(ax, curves, bands=set() if own is None else {own.label})
    if isinstance(r.case.tau, Range):
        t = r.case.tau
        ax.axvspan(
            t.low, t.high, color="k", alpha=0.08, label=f"the case's tau {t.low:g}-{t.high:g}"
        )
    else:
        ax.axvline(tau, color="k", lw=0.8, ls=":", label=f"the case's tau {tau:g}")
    block = r.case.point.block_size
    ax.set_xlim(1, block)
    ax.set_yscale("log")
    _plain_log(ax.yaxis)
    ax.set_xlabel(f"acceptance length tau (tokens per step; at most the block size, {block})")
    ax.set_ylabel("tokens/s (p50; band: p10-p90 on the case's hardware)")
    title = f"tokens/s vs tau: {r.case.name}"
    if left_out:
        title += f"\n(left out, the model does not fit: {', '.join(left_out)})"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    _legend(ax, _merged_note(curves))
    fig.tight_layout()
    return fig


def sweeps_budget(r: CaseResult) -> bool:
    """A best-first tree over a block drafter's distributions: what ``tau_by_budget``
    models."""
    policy = r.case.point.policy
    return policy.uses_budget and policy.drafting is Drafting.BLOCK


@dataclass
class BudgetCurve:
    case: str
    block_size: int
    budget: int  # the case's own
    tau: dict[int, object]  # budget -> modelled tau (Value)
    tokens: Curve


def budget_curves(sf, results: Sequence[CaseResult], samples: int, seed: int) -> list[BudgetCurve]:
    """tokens/s against the budget for every case that sweeps one, with tau(N) from
    ``tau_by_budget`` (the case's tau at its own budget, the depth decay assumed) and the
    step from the case's calibration: p10/p50/p90 over both."""
    out = []
    for r in results:
        if not sweeps_budget(r):
            continue
        pt = r.case.point
        budgets = sorted({*BUDGETS, pt.budget})
        taus = tau_by_budget(r.case.tau, pt.block_size, pt.budget, budgets)
        band = np.empty((len(PERCENTILES), len(budgets)))
        for j, n in enumerate(budgets):
            case = dataclasses.replace(r.case, point=dataclasses.replace(pt, budget=n),
                                       tau=taus[n])  # fmt: skip
            res = run_case(sf.model, case, r.calibration, samples, seed + j)
            band[:, j] = [res.tokens_per_s[p] for p in PERCENTILES]
        curve = Curve([r.case.name], np.asarray(budgets, dtype=float), *band)
        out.append(BudgetCurve(r.case.name, pt.block_size, pt.budget, taus, curve))
    return out


def _budget_panels():
    """tokens/s against the budget above, tau against the budget below (shared x)."""
    fig, (top, bottom) = _pyplot().subplots(2, 1, figsize=(9.5, 7.5), sharex=True,
                                            gridspec_kw={"height_ratios": (3, 2)})  # fmt: skip
    return fig, top, bottom


def _label_budget_panels(top, bottom, title: str, merged, block: int, tau: str, x: str) -> None:
    """Log-2 budgets, log tokens/s with plain ticks, tau from 1 to the block size."""
    top.set_xscale("log", base=2)
    top.set_yscale("log")
    _plain_log(top.yaxis)
    _plain_log(bottom.xaxis, base=2)
    top.set_ylabel("tokens/s (p50, band p10-p90)")
    top.set_title(title, fontsize=10)
    top.grid(alpha=0.3, which="both")
    _legend(top, _merged_note(merged))
    bottom.set_ylim(1, block)
    bottom.set_ylabel(f"tau ({tau}; at most B = {block})")
    bottom.set_xlabel(x)
    bottom.grid(alpha=0.3)


def budget_figure(sf, results: Sequence[CaseResult], samples: int = 1000, seed: int = 0):
    """Two panels: tokens/s against the budget (each case's own budget starred) over the
    modelled tau(N) below it (one line per distinct tau input), on an axis that stops at the
    largest block size. None when no case sweeps a budget."""
    curves = budget_curves(sf, results, samples, seed)
    if not curves:
        return None
    fig, top, bottom = _budget_panels()
    merged = merge_close([c.tokens for c in curves])
    colours = _draw(top, merged, marker="o")
    colour_of = {label: colours[m.label] for m in merged for label in m.labels}
    for c in curves:
        k = list(c.tau).index(c.budget)
        top.plot([c.budget], [c.tokens.p50[k]], "*", ms=14, color=colour_of[c.case])
    taus: dict[tuple, BudgetCurve] = {}
    for c in curves:  # cases with the same tau input share one tau(N)
        taus.setdefault((c.block_size, c.budget, tuple(c.tau.values())), c)
    for i, c in enumerate(taus.values()):
        v = list(c.tau.values())
        mid, low, high = ([x.mid if isinstance(x, Range) else float(x) for x in v],
                          [x.low if isinstance(x, Range) else float(x) for x in v],
                          [x.high if isinstance(x, Range) else float(x) for x in v])  # fmt: skip
        own = c.tau[c.budget]
        given = f"{own.low:g}-{own.high:g}" if isinstance(own, Range) else f"{float(own):g}"
        colour = ("k", "#555555", "#999999")[i % 3]
        bottom.plot(c.tokens.x, mid, marker="o", color=colour, ms=4,
                    ls=LINESTYLES[i % len(LINESTYLES)],
                    label=f"B = {c.block_size}, tau {given} at N = {c.budget}")  # fmt: skip
        bottom.fill_between(c.tokens.x, low, high, color=colour, alpha=0.12, linewidth=0)
    _label_budget_panels(
        top, bottom, "tokens/s vs budget, tau moving with the budget (* the case's own budget)",
        merged, max(c.block_size for c in curves), "modelled", "budget N (verify width M = N + 1)",
    )  # fmt: skip
    _legend(bottom, "tau(N), from the case's tau")
    fig.text(
        0.01, 0.01, "tau(N) [assumed model]: the drafter's top-1 acceptance fitted to the case's "
        f"tau at its budget, x {DEPTH_DECAY.low:g}-{DEPTH_DECAY.high:g} per depth level (mode "
        f"{DEPTH_DECAY.mid:g});\nthe band spans that and the case's tau range",
        fontsize=7,
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def tune_figure(curves, anchors: Sequence = ()):
    """``ddtree tune``: tokens/s against the budget per hardware and policy (band, best
    starred, curves within ``SAME_WITHIN`` of each other as one), the measured engine runs
    on each hardware as crosses, and the measured tau(N) with its bootstrap interval below,
    on an axis that stops at the block size."""
    fig, top, bottom = _budget_panels()
    lines = [
        Curve([f"{c.hardware} {c.policy}"], np.array([p.budget for p in c.points], dtype=float),
              *(np.array([p.tokens_per_s[q] for p in c.points]) for q in PERCENTILES))
        for c in curves
    ]  # fmt: skip
    merged = merge_close(lines)
    colours = _draw(top, merged, marker="o")
    colour_of = {label: colours[m.label] for m in merged for label in m.labels}
    for c in curves:
        colour = colour_of[f"{c.hardware} {c.policy}"]
        top.plot([c.best.budget], [c.best.tokens_per_s[50]], "*", ms=14, color=colour)
    runs = measured_runs(curves, anchors)
    for (hardware, policy), pts in runs.items():
        colour = colour_of[f"{hardware} {policy}"]
        xs, ys = zip(*pts, strict=True)
        top.scatter(xs, ys, marker="x", s=60, color=colour, zorder=3,
                    label=f"{hardware} {policy}: measured engine runs")  # fmt: skip
    _label_budget_panels(
        top, bottom, "tokens/s vs budget per hardware (measured tau, modelled step; * best)",
        merged, max(c.block_size for c in curves), "measured", "budget N (non-root tree nodes)",
    )  # fmt: skip
    seen = {}
    for c in curves:  # tau is the hardware's no matter: one per policy and block size
        seen.setdefault((c.policy, c.block_size), c)
    for i, c in enumerate(seen.values()):
        x = [p.budget for p in c.points]
        mean = np.array([p.tau.mean for p in c.points])
        err = [mean - [p.tau.low for p in c.points], [p.tau.high for p in c.points] - mean]
        bottom.errorbar(x, mean, yerr=err, fmt="o-", ms=4, capsize=3, color=PALETTE[i],
                        label=f"{c.policy}, block {c.block_size}")  # fmt: skip
    _legend(bottom, "tau: mean, bootstrap interval")
    fig.tight_layout()
    return fig


def measured_runs(curves, anchors: Sequence) -> dict[tuple[str, object], list[tuple[int, float]]]:
    """(hardware, policy) -> [(budget, measured tokens/s)] of the engine-run anchors on a
    curve's hardware, policy and block size."""
    keys = {(c.hardware, c.policy, c.block_size) for c in curves}
    out: dict[tuple[str, object], list[tuple[int, float]]] = {}
    for a in anchors:
        if not (isinstance(a, StepAnchor) and a.from_records):
            continue
        pt = a.point
        if (pt.hardware.key, pt.policy, pt.block_size) in keys:
            out.setdefault((pt.hardware.key, pt.policy), []).append((pt.budget, a.tokens_per_s))
    return {k: sorted(v) for k, v in out.items()}
