"""The report figures keep their rules (issue 22: 18 breakdown parts on 10 colours, hardware
lines over each other, no band, tau axes past the block size, tau held fixed against the
budget, tune plots without the measured runs), and the tau(N) model behind the budget plot."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.collections import PathCollection, PolyCollection
from matplotlib.colors import to_hex
from tests.perf.test_tune import TAUS, acceptance, scenario

from ddtree.perf.inputs.acceptance import DEPTH_DECAY, fit_top1, modelled_tau, tau_by_budget
from ddtree.perf.inputs.scenario import Range, StepAnchor
from ddtree.perf.projection.calibrate import calibrate
from ddtree.perf.projection.estimate import estimate, load
from ddtree.perf.projection.tune import tune
from ddtree.perf.report import plots
from ddtree.vocab import POLICIES


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.fixture(scope="module")
def seed():
    return estimate(load(None), samples=400, seed=0)


def test_modelled_tau_worked_example_and_its_fit():
    # the docstring's example: a_1 = 0.5, a_2 = 0.25 at B = 3
    assert [modelled_tau(0.5, 0.5, 3, n) for n in (0, 1, 2, 3)] == [1.0, 1.5, 1.75, 1.875]
    # decay 1, top-1 1: every depth accepted, the chain of B - 1 is the best tree
    assert modelled_tau(1.0, 1.0, 8, 7) == 8.0 and modelled_tau(1.0, 1.0, 8, 64) == 8.0
    a = fit_top1(3.6, 0.8, 8, 8)
    assert modelled_tau(a, 0.8, 8, 8) == pytest.approx(3.6, abs=1e-9)
    assert fit_top1(7.9, 0.6, 8, 8) is None  # out of reach when the drafter decays that fast


def test_tau_by_budget_passes_through_the_given_tau_and_grows_with_the_budget():
    budgets = [2, 4, 8, 16, 32, 64, 128]
    taus = tau_by_budget(3.636, 8, 8, budgets)
    assert taus[8] == pytest.approx(3.636)
    mids = [v.mid if isinstance(v, Range) else v for v in taus.values()]
    assert mids == sorted(mids) and mids[-1] < 8
    # the bundled pair's replay (README, "Measured acceptance"): from its N = 8 tau alone the
    # model's mode lands within 13% at every other budget
    replay = {2: 2.353, 4: 3.004, 16: 3.918, 32: 4.294, 64: 4.634, 128: 4.810}
    for n, measured in replay.items():
        assert taus[n].mid == pytest.approx(measured, rel=0.13), n
    # a range in, a range out; at the case's own budget it is the case's range
    wide = tau_by_budget(Range(12, 16), 16, 32, [16, 32, 64])
    assert (wide[32].low, wide[32].high) == pytest.approx((12, 16))
    assert wide[64].low > 12 and wide[16].low < 12
    assert DEPTH_DECAY.low < DEPTH_DECAY.mid < DEPTH_DECAY.high == 1.0


def test_breakdown_has_no_more_parts_than_colours(seed):
    comps = {c.name for r in seed.results for c in r.point.components}
    assert len(comps) > plots.MAX_PARTS  # the seed has 18: the case the issue found
    parts = plots.breakdown_parts(seed.results)
    assert len(parts) == plots.MAX_PARTS
    other = parts[-1]
    assert other.name.startswith("other (") and len(other.members) == len(comps) - 9
    for i, r in enumerate(seed.results):  # every case's parts add up to its step
        assert sum(p.ms[i] for p in parts) == pytest.approx(float(r.point.step_s) * 1e3)
    kept = {p.name for p in parts[:-1]}
    assert {"routed MoE", "framework overhead", "attention (weights + KV)"} <= kept
    # few components: every one keeps its name
    few = plots.breakdown_parts(seed.results, max_parts=len(comps))
    assert [p.name for p in few] == list(dict.fromkeys(
        c.name for r in seed.results for c in r.point.components))  # fmt: skip
    fig = plots.breakdown_figure(seed.results)
    ax = fig.axes[0]
    assert len(ax.containers) == len(parts)
    colours = [to_hex(bars.patches[0].get_facecolor()) for bars in ax.containers]
    assert len(set(colours)) == len(parts)
    assert colours[-1] == plots.OTHER_COLOUR


def test_close_curves_are_one_line():
    x = np.arange(3.0)
    a = plots.Curve(["a"], x, x + 1, x + 2, x + 3)
    b = plots.Curve(["b"], x, x + 1, (x + 2) * 1.01, x + 3)
    c = plots.Curve(["c"], x, x + 1, (x + 2) * 1.05, x + 3)
    merged = plots.merge_close([a, b, c])
    assert [m.labels for m in merged] == [["a", "b"], ["c"]]
    assert a.labels == ["a"]  # the inputs are left as they were


def _lines(ax):
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def test_tau_figure_stops_at_the_block_size_and_merges_twins(seed):
    r = seed.results[-1]  # native engine, block 16, tau 12-16
    curves, left_out = plots.tau_curves(seed.scenario, r, 300, 0)
    assert {c.labels[0] for c in curves} | set(left_out) == set(seed.scenario.sweep_hardware)
    assert all(c.x[-1] == r.case.point.block_size for c in curves)
    assert all(np.all(c.p10 < c.p50) and np.all(c.p50 < c.p90) for c in curves)
    # a hardware priced the same as another (here: a copy under another name) shares its line
    twin = plots.Curve(["twin"], curves[0].x, curves[0].p10, curves[0].p50, curves[0].p90)
    merged = plots.merge_close([*curves, twin])
    assert len(merged) <= len(curves)
    group = next(m for m in merged if "twin" in m.labels)
    assert group.labels[0] == curves[0].labels[0]
    fig = plots.tau_figure(seed.scenario, r, 300)
    ax = fig.axes[0]
    assert ax.get_xlim() == (1.0, 16.0)
    lines = _lines(ax)
    drawn = plots.merge_close(curves)  # the figure draws one line per group of twins
    assert len(lines) == len(drawn)
    for m in drawn:
        assert any(ln.get_label().startswith(" = ".join(m.labels)) for ln in lines)
    # one band: the case's own hardware's (a span marks the case's tau range besides)
    bands = [p for p in ax.collections if isinstance(p, PolyCollection)]
    assert len(bands) == 1
    assert all("p10-p90" in ln.get_label() for ln in lines)


def test_a_hardware_the_model_does_not_fit_is_left_out(seed):
    sf = seed.scenario
    r = seed.results[0]
    small = {**sf.hardware, "tiny": _with_memory(sf.hardware["h100-sxm"], 10e9)}
    sf2 = type(sf)(**{**sf.__dict__, "hardware": small, "sweep_hardware": ["b300", "tiny"]})
    curves, left_out = plots.tau_curves(sf2, r, 200, 0)
    assert [c.labels for c in curves] == [["b300"]] and left_out == ["tiny"]


def _with_memory(hw, nbytes):
    import dataclasses

    return dataclasses.replace(hw, key="tiny", memory_bytes=nbytes)


def test_budget_plot_moves_tau_with_the_budget(seed):
    curves = plots.budget_curves(seed.scenario, seed.results, 300, 0)
    swept = [r for r in seed.results if plots.sweeps_budget(r)]
    assert [c.case for c in curves] == [r.case.name for r in swept] and len(curves) == 5
    for c, r in zip(curves, swept, strict=True):
        mids = [v.mid if isinstance(v, Range) else v for v in c.tau.values()]
        assert mids == sorted(mids) and mids[0] < mids[-1]  # not held fixed
        own = c.tau[c.budget]
        assert (own.mid if isinstance(own, Range) else own) == pytest.approx(
            r.case.tau.mid if isinstance(r.case.tau, Range) else r.case.tau
        )
        assert max(v.high if isinstance(v, Range) else v for v in c.tau.values()) <= c.block_size
        # at its own budget the summary's p50, within the noise of 300 resampled draws (and a
        # uniform tau range drawn as a triangle with its mid as mode): 10%, or a quarter of
        # the band's width where the band is wide (an eager setup no anchor ran on: p10..p90
        # spans 4x, and the median of 300 draws moves by ~5% a standard error)
        k = list(c.tau).index(c.budget)
        width = np.log(r.tokens_per_s[90] / r.tokens_per_s[10])
        assert c.tokens.p50[k] == pytest.approx(r.tokens_per_s[50], rel=max(0.1, width / 4))
    fig = plots.budget_figure(seed.scenario, seed.results, 300)
    top, bottom = fig.axes[:2]
    assert bottom.get_ylim() == (1.0, 16.0)
    assert len(_lines(top)) == len(plots.merge_close([c.tokens for c in curves]))
    assert len(_lines(bottom)) == 2  # two distinct tau inputs: 4.4 at B = 8, 12-16 at B = 16


def test_budget_plot_needs_a_case_with_a_tree(tmp_path):
    path = tmp_path / "ar.toml"
    path.write_text('[model]\npreset = "llama-3.1-8b"\n[[scenario]]\nhardware = "h100-sxm"\n'
                    'policy = "ar"\n')  # fmt: skip
    est = estimate(load(path), samples=200)
    assert plots.budget_figure(est.scenario, est.results, 100) is None


def test_tune_figure_shows_the_measured_runs_and_stops_tau_at_the_block(tmp_path):
    from ddtree.perf.inputs.acceptance import from_record

    sf = load(scenario(tmp_path, "tau = 3.0"))
    measured = [from_record(acceptance(n, t, t - 0.2, t + 0.3), "acc") for n, t in TAUS.items()]
    cal = calibrate([], sf.specs, sf.fixed)
    curves = tune(sf, cal, ["b300", "h200"], measured, samples=200)
    runs = [
        StepAnchor(f"run{n}", sf.model, sf.point_at("b300", POLICIES["ddtree"], 8, n), 3.0,
                   3.0 / tps, "m", from_records=True)
        for n, tps in ((8, 500.0), (16, 480.0), (256, 300.0))
    ]  # fmt: skip
    assert plots.measured_runs(curves, runs) == {
        ("b300", POLICIES["ddtree"]): [(8, 500.0), (16, 480.0), (256, 300.0)]
    }
    top, bottom = plots.tune_figure(curves, runs).axes[:2]
    scatters = [c for c in top.collections if isinstance(c, PathCollection)]
    assert len(scatters) == 1 and "measured engine runs" in scatters[0].get_label()
    assert scatters[0].get_offsets().shape == (3, 2)
    assert bottom.get_ylim() == (1.0, 8.0)
    no_runs = plots.tune_figure(curves, []).axes[0]
    assert not [c for c in no_runs.collections if isinstance(c, PathCollection)]
