"""Fit the cost model on the TRAIN split of the bundled corpus and write the fitted values to
``src/ddtree/perf/data/corpus_prior.toml``: the centres ``ddtree estimate`` starts every
scenario's priors from (``ddtree.perf.cost.step.corpus_params``), so a question with no
anchor of its own is answered from what the published measurements say, not from the
hand-set defaults. The test sources are never read. The slow test
``test_corpus_prior_file_is_the_train_fit`` keeps the file equal to this fit. Run (about 20 s):
`OMP_NUM_THREADS=1 python scripts/fit_corpus_prior.py`."""

from ddtree.perf.cost.step import CORPUS_PRIOR_FILE
from ddtree.perf.validation import corpus


def main() -> None:
    fit = corpus.fit_corpus_prior()
    lines = [
        "# Centres of the cost model's priors for `ddtree estimate`: the calibration on every",
        "# TRAIN point of the bundled corpus (src/ddtree/perf/data/validation; the test sources",
        "# are never read), from the hand-set defaults of ddtree.perf.cost.step. A scenario's",
        "# priors keep their widths and start here; its anchors, [engine] and [parameters]",
        "# tables move them as before. `--validate` never reads this file (its leave-one-",
        "# source-out starts from the defaults). Regenerate: scripts/fit_corpus_prior.py",
        f"points = {fit.points}",
        f"sources = {fit.sources}",
        "",
        "[values]",
        *(f'"{name}" = {value:.6g}' for name, value in sorted(fit.values.items())),
        "",
    ]
    path = CORPUS_PRIOR_FILE
    path.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {path}: {len(fit.values)} values from {fit.points} points, {fit.sources} sources")


if __name__ == "__main__":
    main()
