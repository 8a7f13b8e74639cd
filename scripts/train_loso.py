"""The bundled corpus's TRAIN split scored leave-one-source-out, alone: the figure a change to
the cost model is chosen by (issue 27). Only train points are handed to ``validate``, so no test
source is calibrated on, predicted or printed. Prints the scores as ``--validate`` reports them
(MAPE, speculative and AR MAPE, p10-p90 and p25-p75 coverage, speedup sign of the AR-paired
points, the model-form sigmas) and, given a path, writes every held-out point's residual and
band as JSON. Run (about 4.5 minutes with two worker processes on two cores, one fit from the
priors' centres per source; the scores are the same whatever ``--jobs`` is):
`OMP_NUM_THREADS=1 python scripts/train_loso.py --samples 500 --residuals /tmp/train.json`.
Two such files (the model as it is, a variant) are compared by ``scripts/compare_loso.py``."""

import argparse
import json
import time

import numpy as np

from ddtree.commands._args import available_cpus
from ddtree.perf.validation import corpus as c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--residuals", help="write each held-out train point's residual (JSON)")
    ap.add_argument("--jobs", type=int, default=available_cpus(), help="worker processes")
    args = ap.parse_args()
    start = time.time()
    train = [p for p in c.load_points(c.BUNDLED) if c.split_of(p.source.key) == "train"]
    result = c.validate(train, args.samples, args.seed, args.jobs)
    rows = result.rows
    assert all(r.split == "train" for r in rows)
    spec = [r for r in rows if r.speculative]
    ar = [r for r in rows if not r.speculative]
    paired = c.pairs(rows)
    scores = {
        "points": len(rows),
        "sources": len({r.point.source.key for r in rows}),
        "mape": c.mape(rows),
        "mape_speculative": c.mape(spec),
        "mape_ar": c.mape(ar),
        "inside_p10_p90": c.coverage(rows, 10, 90),
        "inside_p25_p75": c.coverage(rows, 25, 75),
        "speedup_sign_right": float(np.mean([p.sign_right for p in paired])) if paired else None,
        "pairs": len(paired),
        "model_form_sigma": result.model_form_sigma,
        "samples": args.samples,
        "seconds": round(time.time() - start, 1),
    }
    print(json.dumps(scores))
    if args.residuals:
        paired_with = {p.spec.point.name: p for p in paired}
        out = [
            {
                "point": r.point.name,
                "source": r.point.source.key,
                "stack": r.point.anchor.point.stack,
                "engine": r.point.anchor.point.engine,
                "hardware": r.point.anchor.point.hardware.key,
                "speculative": r.speculative,
                "measured_tokens_per_s": r.measured_tokens_per_s,
                "predicted_tokens_per_s": r.predicted_tokens_per_s,
                "band_tokens_per_s": r.band_tokens_per_s,
                "model_form_sigma": r.model_form_sigma,
                "rel_error": r.rel_error,
                **(
                    {
                        "paired_ar": pair.ar.point.name,
                        "measured_speedup": pair.measured_speedup,
                        "predicted_speedup": pair.predicted_speedup,
                        "sign_right": pair.sign_right,
                    }
                    if (pair := paired_with.get(r.point.name))
                    else {}
                ),
            }
            for r in rows
        ]
        with open(args.residuals, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
