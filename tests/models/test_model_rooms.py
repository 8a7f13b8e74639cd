"""models/ in rooms (pyproject.toml's "models' rooms" contract): presets -> adapters (and the
oracle drafter) -> nn -> loading -> base (the protocols) -> static (compile machinery). Every
module sits in a room the contract names, and the contract breaks on an upward import."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.test_imports import PYPROJECT, copy_package, lint_imports

import ddtree.models

MODELS = Path(ddtree.models.__file__).parent
CONTRACT = next(
    c
    for c in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    if c.get("containers") == ["ddtree.models"]
)
ROOMS = [name.strip() for layer in CONTRACT["layers"] for name in layer.split("|")]


def test_the_rooms_in_order():
    assert CONTRACT["type"] == "layers"
    assert ROOMS == ["presets", "adapters", "oracle", "nn", "loading", "base", "static"]


def test_every_module_sits_in_a_room():
    """No module of models/ outside the contract (the registry, ``__init__``, aside)."""
    top = {p.stem for p in MODELS.glob("*.py") if p.name != "__init__.py"}
    rooms = {p.name for p in MODELS.iterdir() if (p / "__init__.py").is_file()}
    assert top | rooms == set(ROOMS)
    assert rooms == {"adapters", "nn", "loading"}


def test_the_contract_catches_an_nn_module_importing_an_adapter(tmp_path):
    src = copy_package(tmp_path)
    (src / "ddtree" / "models" / "nn" / "probe.py").write_text(
        "def f():\n    from ddtree.models.adapters import target\n"
    )
    result = lint_imports(src)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{CONTRACT['name']} BROKEN" in result.stdout
    assert "ddtree.models.nn.probe -> ddtree.models.adapters.target" in result.stdout
