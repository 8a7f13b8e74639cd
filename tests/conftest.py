"""Suite-wide collection order: the longest test files first.

CI runs the suite on two processes with ``--dist loadfile`` (``.ci/run``): each file goes
whole to one process, in collection order, and the run lasts as long as the busier process.
A long file collected late (``tests/test_readme.py`` comes after most directories) started
when the other process had little left, and ran alone at the end. Handing out the longest
files first (longest-processing-time-first) lets the short ones fill in around them.
Measured one process, one file at a time (``pytest --durations``, 2026-12-07): the corpus
scoring of tests/perf/test_validate.py 409 s (it runs its fits in worker processes of its own),
tests/test_readme.py 322 s, then tests/perf/test_scenario_fuzz.py 105 s and
tests/test_records_fuzz.py 87 s; no other file over 80 s.
"""

import pytest

LONGEST_FIRST = (
    "tests/perf/test_validate.py",
    "tests/test_readme.py",
    "tests/perf/test_scenario_fuzz.py",
    "tests/test_records_fuzz.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """Move the files of ``LONGEST_FIRST`` to the front, in that order; every other test
    keeps its place (a stable sort), and so does the order of tests within a file. A file of
    the list that is gone (renamed, split) stops the run: the order would rot silently."""
    gone = [path for path in LONGEST_FIRST if not (config.rootpath / path).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names no file at {gone}")

    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
