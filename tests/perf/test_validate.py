"""The published-measurement validation set and the leave-one-source-out check (issue 10)."""

import json
from pathlib import Path

import pytest

from ddtree.perf import validate
from ddtree.perf.cost import Drafter, Point, default_params, params_at, step_cost
from ddtree.perf.model import PRESETS
from ddtree.perf.scenario import ScenarioError
from ddtree.records import Policy

FOLDER = Path(__file__).resolve().parents[2] / "examples" / "validation"


def test_the_validation_set_covers_what_the_issue_asks():
    points = validate.load_points(FOLDER)
    assert len(points) >= 12
    assert len({p.source.key for p in points}) >= 4
    assert len({p.anchor.point.hardware.key for p in points}) >= 3
    policies = {p.anchor.point.policy for p in points}
    assert Policy.AR in policies and policies - {Policy.AR}
    moe = {p.anchor.model.n_routed_experts > 0 for p in points}
    assert moe == {True, False}  # dense and MoE
    assert max(p.anchor.point.concurrency for p in points) > 1
    for p in points:
        assert p.source.url and p.what and p.engine_name and p.measured, p.name
        assert p.anchor.point.engine in ("eager", "graphs", "native"), p.name


@pytest.mark.slow
def test_leave_one_source_out_meets_the_goal_and_explains_every_miss(capsys):
    from ddtree.cli import main

    assert main(["estimate", "--validate", str(FOLDER), "--json", "--samples", "500"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mode"] == "leave-one-source-out" and doc["mape"] <= 0.20
    assert doc["unexplained"] == []
    for row in doc["points"]:
        assert row["source"] not in row["calibrated_on"]
        if abs(row["rel_error"]) > doc["explain_above"]:
            assert row["explanation"], row["point"]


def _toml(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def _write_source(folder: Path, key: str, points: list[dict]) -> None:
    lines = [f'[source]\nkey = "{key}"\nurl = "https://example.org/{key}"\n']
    for p in points:
        lines.append("[[point]]")
        lines += [f"{k} = {_toml(v)}" for k, v in p.items()]
        lines.append("")
    (folder / f"{key}.toml").write_text("\n".join(lines))


def _synthetic_point(name, hw, budget, truth):
    model = PRESETS["qwen3-8b"]
    drafter = Drafter(params=1e9, layers=5)
    policy = Policy.AR if budget == 0 else Policy.CHAIN
    pt = Point(load_hw(hw), 1, 1, 512.0, 16 if budget else 1, budget, "graphs",
               drafter if budget else None, policy=policy)  # fmt: skip
    tau = 4.0 if budget else 1.0
    step = float(step_cost(model, pt, truth, tau).step_s)
    row = {"name": name, "what": "synthetic", "engine_name": "test", "measured": "synthetic",
           "model": {"preset": "qwen3-8b"}, "hardware": hw, "engine": "graphs",
           "policy": str(policy), "context": "512 tok", "step": f"{step * 1e3:.6f} ms"}  # fmt: skip
    if budget:
        row |= {"block_size": 16, "tau": tau,
                "drafter": {"params": 1e9, "layers": 5, "precision": "bf16"}}  # fmt: skip
    return row


def load_hw(key):
    from ddtree.perf.catalog import load_catalog

    return load_catalog()[key]


def test_held_out_sources_are_predicted_from_the_others(tmp_path, capsys):
    truth = params_at(default_params(), {"weights_efficiency": 0.62, "graphs.step_overhead": 1e-3})
    for key, hw in (("a", "h100-sxm"), ("b", "h200"), ("c", "b200")):
        _write_source(tmp_path, key, [_synthetic_point(f"{key}-ar", hw, 0, truth),
                                      _synthetic_point(f"{key}-chain", hw, 15, truth)])  # fmt: skip
    v = validate.run(tmp_path, samples=300)
    assert [r.point.source.key for r in v.rows] == ["a", "a", "b", "b", "c", "c"]
    assert all(r.point.source.key not in r.calibrated_on for r in v.rows)
    assert v.mape < 0.05, [round(r.rel_error, 3) for r in v.rows]
    # a source off by 2x is flagged; a note explains it
    _write_source(tmp_path, "d", [{**_synthetic_point("d-ar", "a800", 0, truth),
                                   "step": "0.5 ms", "noise": 0.9}])  # fmt: skip
    from ddtree.cli import main

    assert main(["estimate", "--validate", str(tmp_path), "--json", "--samples", "200"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["unexplained"] == ["d-ar"]
    assert main(["estimate", "--validate", str(tmp_path), "--samples", "200"]) == 0
    out = capsys.readouterr().out
    assert "d-ar (" in out and "UNEXPLAINED" in out


@pytest.mark.parametrize(
    "text,field",
    [
        ('[source]\nkey = "x"\n[[point]]\nname = "p"\n', "[source] needs 'key' and 'url'"),
        ('[source]\nkey = "x"\nurl = "u"\n[[point]]\nname = "p"\nwhat = "w"\nmodel = '
         '{preset = "qwen3-8b"}\nhardware = "h100-sxm"\npolicy = "ar"\nspeed = 3\n',
         "point[0] (p): unknown field(s) speed"),
        ('[source]\nkey = "x"\nurl = "u"\n[[point]]\nname = "p"\nwhat = "w"\nmodel = '
         '{preset = "qwen3-8b"}\nhardware = "h100-sxm"\npolicy = "ar"\ntokens_per_s = "0 tok/s"\n',
         "point[0] (p).tokens_per_s: '0 tok/s' must be a positive"),
        ('[source]\nkey = "x"\nurl = "u"\n', "no [[point]] entries"),
    ],
)  # fmt: skip
def test_bad_validation_files_name_file_and_field(tmp_path, capsys, text, field):
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ScenarioError, match="bad.toml") as exc:
        validate.load_points(tmp_path)
    assert field in str(exc.value)
    from ddtree.cli import main

    assert main(["estimate", "--validate", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]
