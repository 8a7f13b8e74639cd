"""The bad-input tables together (issue 21's goal): at least 200 cases, ids unique across the
tables, and every command of the CLI in at least one case."""

from __future__ import annotations

import test_bad_input
import test_bad_input_checkpoints
import test_bad_input_cli
import test_bad_input_estimate
from ddtree.cli import COMMANDS

TABLES = (test_bad_input, test_bad_input_cli, test_bad_input_estimate, test_bad_input_checkpoints)
ALL_CASES = [case for table in TABLES for case in table.CASES]


def test_the_tables_hold_at_least_200_cases_with_unique_ids():
    assert len(ALL_CASES) >= 200
    assert len({c.id for c in ALL_CASES}) == len(ALL_CASES)


def test_every_command_has_a_case():
    def runs(case, path: tuple[str, ...]) -> bool:
        return tuple(case.argv.split()[: len(path)]) == path

    missing = [" ".join(p) for p, _, _ in COMMANDS if not any(runs(c, p) for c in ALL_CASES)]
    assert not missing
