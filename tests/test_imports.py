"""The import contracts of pyproject.toml ([tool.importlinter]: no circles, layers downwards
only, an estimator without torch, a pure tree core) hold, and they catch what they name.

import-linter counts every import, those inside functions too (an import moved into a function
to dodge a circle is still one). Its circle contract (``acyclic_siblings``) looks at the
modules and subpackages of each package; a package's ``__init__`` importing one of its own
modules that imports the package back is not a circle between siblings, and it does not see
that one (grimp cannot tell ``from ddtree.tree import _native``, a compiled module, from an
import of the package, so such a check would misfire here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import ddtree

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACTS = [
    c["name"] for c in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
]


def lint_imports(src: Path, config: Path = PYPROJECT) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``ddtree`` (or other root package) found first under ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def copy_package(tmp_path: Path) -> Path:
    """The .py files of this ddtree under ``tmp_path/src`` (what the contracts read)."""
    package = Path(ddtree.__file__).resolve().parent
    src = tmp_path / "src"
    shutil.copytree(
        package,
        src / "ddtree",
        ignore=lambda folder, names: [
            n for n in names if not n.endswith(".py") and not (Path(folder) / n).is_dir()
        ],
    )
    return src


def test_ddtree_keeps_its_import_contracts():
    result = lint_imports(Path(ddtree.__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(CONTRACTS) >= 5
    for name in CONTRACTS:
        assert f"{name} KEPT" in result.stdout, result.stdout


def test_the_contracts_catch_an_upward_import_and_its_circle(tmp_path):
    """models importing engine inside a function: the layers break, and so does the circle
    (engine imports models)."""
    src = copy_package(tmp_path)
    (src / "ddtree" / "models" / "probe.py").write_text(
        "def f():\n    from ddtree.engine import loop\n"
    )
    result = lint_imports(src)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "layers import downwards only BROKEN" in out
    assert "no import circles among the modules and subpackages of any ddtree package BROKEN" in out
    assert "ddtree.models.probe -> ddtree.engine.loop" in out


def test_the_contracts_catch_torch_in_the_estimator(tmp_path):
    src = copy_package(tmp_path)
    (src / "ddtree" / "perf" / "probe.py").write_text("import torch\n")
    result = lint_imports(src)
    assert result.returncode == 1, result.stdout + result.stderr
    broken = [line for line in result.stdout.splitlines() if line.endswith(" BROKEN")]
    assert broken == [
        "the estimator reads records and configs: no torch, no models, no engine BROKEN"
    ]


def test_the_circle_contract_sees_a_function_local_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import a\n")
    (pkg / "sub" / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.a import x\n")
    (pkg / "leaf.py").write_text("import pkg.b\n")
    config = tmp_path / "contracts.toml"
    config.write_text(
        '[tool.importlinter]\nroot_package = "pkg"\n\n[[tool.importlinter.contracts]]\n'
        'name = "circles"\ntype = "acyclic_siblings"\nancestors = ["pkg"]\n'
    )
    result = lint_imports(tmp_path, config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "circles BROKEN" in result.stdout
    assert "- .sub -> .b (1 import)" in result.stdout
