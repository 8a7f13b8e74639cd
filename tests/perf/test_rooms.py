"""The estimator's rooms import downwards only: a module imports its own room or rooms of a
lower rank, never a higher one (function-level imports included). Read from the source with
``ast``, so nothing is imported to check it."""

import ast
from pathlib import Path

import ddtree.perf

PERF = Path(ddtree.perf.__file__).parent

RANK = {
    "hardware": 1,  # units and the catalog
    "shapes": 2,  # model shapes and config readers
    "cost": 3,  # the step cost model and physics
    "inputs": 4,  # scenario files, acceptance, anchors from records
    "projection": 5,  # calibration, uncertainty, estimate, tune
    "validation": 6,  # the corpus scores, diagnose
    "report": 7,  # tables, JSON, plots
}


def perf_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``ddtree.perf...`` module the file imports."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "ddtree.perf":  # from ddtree.perf import hardware
                found += [(node.lineno, f"ddtree.perf.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import; write ddtree.perf...")
    return [(line, m) for line, m in found if m.startswith("ddtree.perf.")]


def room_of(module: str) -> str:
    return module.split(".")[2]


def test_every_module_sits_in_a_ranked_room():
    """No module at the top of perf/ and no room missing from the table."""
    top = sorted(p.name for p in PERF.glob("*.py") if p.name != "__init__.py")
    assert top == []
    rooms = {p.parent.name for p in PERF.glob("*/*.py")}
    assert rooms == set(RANK)


def test_a_room_never_imports_a_higher_room():
    bad = []
    for path in sorted(PERF.glob("*/*.py")):
        rank = RANK[path.parent.name]
        for line, module in perf_imports(path):
            other = room_of(module)
            assert other in RANK, f"{path}:{line}: {module} is in no room"
            if RANK[other] > rank:
                bad.append(f"{path.relative_to(PERF)}:{line} ({path.parent.name}) imports {module}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_violation(tmp_path):
    """The parser finds function-level and package-form imports, so a violation is caught."""
    f = tmp_path / "x.py"
    f.write_text(
        "def f():\n    from ddtree.perf.report import render\n"
        "from ddtree.perf import projection\nimport ddtree.perf.cost.step\n"
    )
    rooms = [room_of(m) for _, m in perf_imports(f)]
    assert sorted(rooms) == ["cost", "projection", "report"]
