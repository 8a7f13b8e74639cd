"""A policy is one registry entry: a new one runs through the engine, its records, the replay
and the cost model with no other edit (nothing tests a policy's name)."""

from __future__ import annotations

import pytest
from tests.replay.helpers import EXAMPLE, make_trace, replay_prompt

from ddtree.engine import DecodeConfig, engine_run_record, generate
from ddtree.perf.cost import step as cost
from ddtree.perf.hardware.catalog import load_catalog
from ddtree.perf.shapes.model import load_model
from ddtree.records import read_records, write_records
from ddtree.replay.simulate import replay_points
from ddtree.vocab import POLICIES, Drafting, Policy

from .helpers import ScriptedDrafter, tiny_mla_target

NARROW = Policy("narrow", "best-first over two candidates per depth", Drafting.BLOCK, 2)


@pytest.fixture
def narrow(monkeypatch):
    monkeypatch.setitem(POLICIES, NARROW.name, NARROW)
    return NARROW


def test_a_new_policy_decodes_losslessly_and_records_its_own_rules(narrow, tmp_path):
    target = tiny_mla_target(seed=0)
    prompt = [1, 2, 3, 4, 5]
    ar = generate(target, None, prompt, DecodeConfig("ar", max_new_tokens=30))
    drafter = ScriptedDrafter(prompt + ar.tokens, target.info.vocab_size, 8, hit=0.6)
    cfg = DecodeConfig("narrow", block_size=8, budget=16, max_new_tokens=30)
    assert cfg.width_buckets() == (17,)
    out = generate(target, drafter, prompt, cfg)
    assert out.tokens == ar.tokens
    path = write_records(tmp_path / "r.jsonl", [engine_run_record([out], cfg, target.info, None)])
    (back,) = read_records(path)
    assert (back.policy, back.block_size, back.budget) == ("narrow", 8, 16)


def test_a_new_policy_replays_with_its_own_candidates(narrow):
    trace = make_trace(**EXAMPLE)  # K = 2 stored per depth
    # ddtree at N = 3 wants K = 3 > 2 stored: the replay flags it; two candidates fit
    assert replay_prompt(trace, 0, "ddtree", 3).limited_steps == 1
    assert replay_prompt(trace, 0, "narrow", 3).limited_steps == 0
    assert replay_points(trace, ["narrow"], [1, 3]) == [("narrow", 1), ("narrow", 3)]


def test_a_new_policy_is_costed_with_its_own_candidates(narrow):
    model = load_model({"preset": "kimi-k2"}, "test")
    drafter = cost.Drafter(params=1e9, layers=5)
    point = cost.Point(load_catalog()["b300"], 8, 1, 2048, 8, 64, "eager", drafter, policy=narrow)
    assert cost.candidates(model, point) == 2
    ddtree = cost.candidates(model, cost.Point(**{**vars(point), "policy": POLICIES["ddtree"]}))
    assert ddtree == 64


def test_a_policy_the_engine_has_no_proposer_for_is_refused_before_any_work(monkeypatch):
    # a drafting kind only the estimator prices (k sequential draft steps, say)
    priced_only = Policy("steps", "k sequential draft steps", drafting="sequential")
    monkeypatch.setitem(POLICIES, priced_only.name, priced_only)
    with pytest.raises(ValueError, match="policy 'steps': the engine has no proposer"):
        DecodeConfig("steps")
