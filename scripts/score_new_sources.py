"""Score staged corpus files BEFORE they join the corpus: how the model as it stands does on
published points it never saw (issue 27: run today's model on every new point first).

Each staged source is predicted as ``--validate`` will predict it once it is in the corpus
(``corpus.staged_fits``): a staged train source from a calibration on every other train
source, bundled or staged; the staged test sources from one calibration on every train point.
The band carries the model-form error of ``data/model_form.toml``. Prints one row per point
and a summary line per split; no bundled source is predicted. Run (a minute or two on two
cores): `OMP_NUM_THREADS=1 python scripts/score_new_sources.py STAGED_FOLDER`."""

import argparse

from ddtree.commands._args import available_cpus
from ddtree.perf.validation import corpus as c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("staged", help="folder of new corpus files (*.toml), not yet in the corpus")
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=available_cpus(), help="worker processes")
    args = ap.parse_args()
    rows = c.score_staged(
        c.load_points(c.BUNDLED), c.load_points(args.staged), args.samples, args.seed, args.jobs
    )
    print(f"{'point':58s} {'split':5s} {'measured':>9s} {'p50':>9s} {'error':>6s} in p10-p90")
    for r in rows:
        print(
            f"{r.point.name:58s} {r.split:5s} {r.measured_tokens_per_s:9.1f} "
            f"{r.predicted_tokens_per_s:9.1f} {r.rel_error:+6.2f} {'yes' if r.inside(10, 90) else 'no'}"
        )
    for split in ("train", "test", None):
        part = [r for r in rows if split is None or r.split == split]
        if part:
            print(
                f"# {split or 'all'}: {len(part)} points, "
                f"{len({r.point.source.key for r in part})} sources, MAPE {c.mape(part):.1%}, "
                f"inside p10-p90 {c.coverage(part, 10, 90):.1%}"
            )


if __name__ == "__main__":
    main()
