"""Judge a change to the cost model by its train leave-one-source-out, against the model as it is.

``scripts/train_loso.py --residuals F`` writes every held-out train point's residual; a variant
of the cost model (a copy of ``src`` with one change) writes its own. ``compare`` reads both and
says what moved: the scores of each, the sources whose held-out error moved most, the AR-paired
speculative points whose speedup sign turned, and whether the variant passes the margin rule
the team keeps a change by (``passes_margin``). Example: base MAPE 26.48%, variant 25.60%,
speculative 26.17% -> 25.63%, sign 80.8% -> 78.8% (one pair turned): MAPE is down 0.88 of a
point, short of the 1-point margin, and one sign pair is worse: not kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.perf.validation.corpus import mean_abs_error

MAPE_MARGIN = 0.01
"""A variant is kept when its train MAPE is at least this much lower (one point), its
speculative MAPE no higher and its speedup sign right no less often (``passes_margin``): the
held-out score of 82 sources moves by a few tenths of a point with any refit, so smaller gains
are not told apart from chance."""


@dataclass(frozen=True)
class Scores:
    """The scores of one residual file (``scores``)."""

    points: int
    mape: float
    mape_speculative: float
    sign_right: float  # share of AR-paired speculative points whose speedup sign is right
    pairs: int


@dataclass(frozen=True)
class SourceShift:
    """One source's held-out absolute error, summed over its points, in each file."""

    source: str
    points: int
    base: float  # sum of |rel_error| of its points in the base file
    variant: float

    @property
    def change(self) -> float:
        return self.variant - self.base


@dataclass(frozen=True)
class Comparison:
    base: Scores
    variant: Scores
    shifts: list[SourceShift]  # largest |change| first
    turned: list[tuple[str, bool]]  # (speculative point, its sign right in the variant)

    @property
    def passes_margin(self) -> bool:
        return passes_margin(self.base, self.variant)


def scores(rows: list[dict]) -> Scores:
    """MAPE overall and over the speculative points, and the share of AR-paired points (those
    with ``sign_right``) whose predicted speedup is on the measured side of 1."""
    paired = [r["sign_right"] for r in rows if "sign_right" in r]
    return Scores(
        len(rows),
        mean_abs_error(r["rel_error"] for r in rows),
        mean_abs_error(r["rel_error"] for r in rows if r["speculative"]),
        float(np.mean(paired)) if paired else float("nan"),
        len(paired),
    )


def passes_margin(base: Scores, variant: Scores) -> bool:
    """The margin rule: MAPE down by ``MAPE_MARGIN`` or more, speculative MAPE and speedup sign
    no worse."""
    return (
        variant.mape <= base.mape - MAPE_MARGIN
        and variant.mape_speculative <= base.mape_speculative
        and variant.sign_right >= base.sign_right
    )


def compare(base: list[dict], variant: list[dict], where: str = "variant") -> Comparison:
    """Both residual files must hold the same points (one corpus, one split); a point in one
    only is an error naming it and the file (``where``) it is missing from or extra in."""
    b = {r["point"]: r for r in base}
    v = {r["point"]: r for r in variant}
    missing, extra = sorted(b.keys() - v.keys()), sorted(v.keys() - b.keys())
    if missing or extra:
        raise ValueError(
            f"{where}: the two residual files hold different points (scored on another corpus?): "
            f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}, "
            f"extra {extra[:3]}{' ...' if len(extra) > 3 else ''}"
        )
    by_source: dict[str, list[str]] = {}
    for name, r in b.items():
        by_source.setdefault(r["source"], []).append(name)
    shifts = [
        SourceShift(
            src,
            len(names),
            sum(abs(b[n]["rel_error"]) for n in names),
            sum(abs(v[n]["rel_error"]) for n in names),
        )  # fmt: skip
        for src, names in by_source.items()
    ]
    shifts.sort(key=lambda s: (-abs(s.change), s.source))
    turned = [
        (name, v[name]["sign_right"])
        for name in sorted(b)
        if "sign_right" in b[name] and b[name]["sign_right"] != v[name].get("sign_right")
    ]
    return Comparison(scores(base), scores(variant), shifts, turned)
