"""Compare two train leave-one-source-out residual files (``scripts/train_loso.py --residuals``):
the cost model as it is (BASE) and a variant of it (VARIANT, scored from a copy of ``src`` with
one change). Prints the scores of each, whether the variant passes the margin rule
(``ddtree.perf.validation.compare.passes_margin``), the sources whose held-out error moved most
and the AR-paired speculative points whose speedup sign turned. Run (a second):
`python scripts/compare_loso.py /tmp/base.json /tmp/variant.json`."""

import argparse
import json
import sys

from ddtree.perf.validation.compare import MAPE_MARGIN, compare


def _load(path: str) -> list[dict]:
    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        sys.exit(f"{path}: not a residual file of scripts/train_loso.py --residuals ({exc})")
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and {"point", "source", "rel_error", "speculative"} <= r.keys()
        for r in rows
    ):
        sys.exit(f"{path}: expected a list of residual rows with point, source, rel_error and "
                 "speculative (scripts/train_loso.py --residuals)")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="residuals of the cost model as it is")
    ap.add_argument("variant", help="residuals of the variant")
    ap.add_argument("--top", type=int, default=12, help="sources to list (largest moves first)")
    args = ap.parse_args()
    try:
        cmp = compare(_load(args.base), _load(args.variant), args.variant)
    except ValueError as exc:
        sys.exit(str(exc))
    print(f"{'':10s} {'points':>6s} {'MAPE':>7s} {'spec MAPE':>9s} {'sign right':>10s}")
    for label, s in (("base", cmp.base), ("variant", cmp.variant)):
        print(f"{label:10s} {s.points:6d} {s.mape:7.2%} {s.mape_speculative:9.2%} "
              f"{s.sign_right:10.1%} of {s.pairs}")  # fmt: skip
    verdict = "passes" if cmp.passes_margin else "misses"
    print(f"margin rule (MAPE down {MAPE_MARGIN * 100:g} point or more, speculative MAPE and sign "
          f"no worse): {verdict}")  # fmt: skip
    print("\nsources whose held-out error moved most (their mean |error|, then the MAPE points "
          "the move is worth)")  # fmt: skip
    for s in cmp.shifts[: args.top]:
        print(f"  {s.source:58s} {s.points:3d} points  {s.base / s.points:7.1%} -> "
              f"{s.variant / s.points:7.1%}  ({100 * s.change / cmp.base.points:+.2f} points)")  # fmt: skip
    print(f"\nspeedup signs turned: {len(cmp.turned)}")
    for name, right in cmp.turned:
        print(f"  {name}: now {'right' if right else 'wrong'}")


if __name__ == "__main__":
    main()
