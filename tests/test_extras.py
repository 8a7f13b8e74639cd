"""The optional extras: the base install decodes and estimates without them, and a command
that needs one fails in one line that names it (each run in a subprocess with the extras'
packages hidden by a meta-path finder, as if they were not installed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import ddtree
from ddtree.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = sorted(m for modules in EXTRAS.values() for m in modules)

# Runs `ddtree ARGV...` with HIDDEN missing; prints what tried to import them, then the status.
WITHOUT_EXTRAS = f"""
import sys
from importlib.abc import MetaPathFinder

HIDDEN = {HIDDEN!r}
tried = []


class Hide(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            tried.append(name)
            raise ModuleNotFoundError("No module named %r" % name, name=name)
        return None


sys.meta_path.insert(0, Hide())
from ddtree.cli import main

code = main(sys.argv[1:])
print("tried", tried)
print("exit", code)
"""


def ddtree_without_extras(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``ddtree ARGV`` in ``cwd``, importing this ddtree (the one under test)."""
    env = {**os.environ, "PYTHONPATH": str(Path(ddtree.__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS, *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_extras_list_the_modules_of_pyproject_extras():
    """EXTRAS names the import name of every package of each extra in pyproject.toml, and the
    dev extra pulls every extra (so `make test` runs every command)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra, modules in EXTRAS.items():
        packages = [re.split(r"[<>=!~\[; ]", p)[0] for p in extras[extra]]
        assert sorted(p.lower().replace("-", "_") for p in packages) == sorted(modules), extra
    assert set(extras) == {*EXTRAS, "dev"}
    assert f"ddtree[{','.join(EXTRAS)}]" in extras["dev"]


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "--samples", "200"],
        ["generate", "--max-new-tokens", "4", "--prompt", "def parse("],
    ],
    ids=["estimate", "generate"],
)
def test_the_base_install_runs_without_the_extras(argv, tmp_path):
    run = ddtree_without_extras(*argv, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-2:] == ["tried []", "exit 0"], run.stdout + run.stderr


@pytest.mark.parametrize(
    "argv, line",
    [
        (["serve"], "ddtree serve needs the [serve] extra"),
        (["bench", "serve"], "ddtree bench serve needs the [serve] extra"),
        (["estimate", "--report", "out"], "ddtree estimate --report needs the [report] extra"),
        # before the scenario and records are read (these do not exist)
        (
            ["tune", "none.toml", "--acceptance", "none.jsonl", "--report", "out"],
            "ddtree tune --report needs the [report] extra",
        ),
    ],
    ids=["serve", "bench-serve", "estimate-report", "tune-report"],
)
def test_a_command_without_its_extra_says_which_to_install(argv, line, tmp_path):
    run = ddtree_without_extras(*argv, cwd=tmp_path)
    extra = re.search(r"\[(\w+)\]", line).group(1)
    first = EXTRAS[extra][0]
    assert run.stderr == (
        f"error: {line} (No module named '{first}'): pip install 'ddtree[{extra}]'\n"
    )
    assert run.stdout.splitlines()[-2:] == [f"tried ['{first}']", "exit 2"]
    assert not (tmp_path / "out").exists()  # it stopped before any work
