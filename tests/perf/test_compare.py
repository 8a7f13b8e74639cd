"""The margin rule a cost-model variant is kept by, and the comparison of two residual files."""

import pytest

from ddtree.perf.validation.compare import MAPE_MARGIN, Scores, compare, passes_margin, scores


def _row(point, source, rel_error, speculative=False, sign_right=None):
    row = {"point": point, "source": source, "rel_error": rel_error, "speculative": speculative}
    if sign_right is not None:
        row["sign_right"] = sign_right
    return row


BASE = [
    _row("a-ar", "a", 0.10),
    _row("a-spec", "a", -0.20, True, sign_right=True),
    _row("b-ar", "b", 0.40),
    _row("b-spec", "b", 0.30, True, sign_right=False),
]


def test_scores_are_the_mean_absolute_errors_and_the_paired_signs():
    s = scores(BASE)
    assert (s.points, s.pairs) == (4, 2)
    assert s.mape == pytest.approx(0.25)  # (0.1 + 0.2 + 0.4 + 0.3) / 4
    assert s.mape_speculative == pytest.approx(0.25)  # (0.2 + 0.3) / 2
    assert s.sign_right == pytest.approx(0.5)


def test_the_sources_that_moved_most_come_first_and_turned_signs_are_named():
    variant = [
        _row("a-ar", "a", 0.12),
        _row("a-spec", "a", -0.18, True, sign_right=True),
        _row("b-ar", "b", 0.05),
        _row("b-spec", "b", 0.10, True, sign_right=True),
    ]
    cmp = compare(BASE, variant)
    assert [s.source for s in cmp.shifts] == ["b", "a"]
    assert cmp.shifts[0].change == pytest.approx(0.15 - 0.70)
    assert cmp.shifts[1].change == pytest.approx(0.0)
    assert cmp.turned == [("b-spec", True)]
    assert cmp.variant.mape == pytest.approx(0.1125)
    assert cmp.passes_margin


def test_the_margin_rule_needs_a_point_of_mape_and_nothing_worse():
    base = Scores(100, 0.2648, 0.2617, 0.808, 52)
    gain = 0.2648 - MAPE_MARGIN
    assert passes_margin(base, Scores(100, gain, 0.2617, 0.808, 52))
    assert not passes_margin(base, Scores(100, gain + 1e-4, 0.25, 0.85, 52))  # short of a point
    assert not passes_margin(base, Scores(100, 0.20, 0.2618, 0.85, 52))  # speculative worse
    assert not passes_margin(base, Scores(100, 0.20, 0.25, 0.788, 52))  # one sign pair worse


def test_files_of_different_points_are_refused_naming_the_points():
    with pytest.raises(ValueError, match=r"variant.json: .*missing \['b-spec'\], extra \['c-ar'\]"):
        compare(BASE, [*BASE[:3], _row("c-ar", "c", 0.1)], "variant.json")
