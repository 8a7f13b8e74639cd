"""The decode policies' rules, asked of the one registry (ddtree.vocab)."""

from __future__ import annotations

import pytest

from ddtree.vocab import AR, DEFAULT_POLICY, POLICIES, get_policy


@pytest.mark.parametrize(
    "name, drafter, block, budget, k, min_budget, uses_budget",
    [
        # B = 8, N = 32, V = 100: ar verifies the root alone, chain the 7-node path with K = 1,
        # ddtree N nodes with K = min(N, V)
        ("ar", False, 1, 0, 32, 0, False),
        ("chain", True, 8, 7, 1, 0, False),
        ("ddtree", True, 8, 32, 32, 1, True),
        # eagle and mtp: B - 1 = 7 draft steps, a tree of N nodes verified
        ("eagle", True, 8, 32, 32, 1, True),
        ("mtp", True, 8, 32, 32, 1, True),
    ],
)
def test_each_policy_states_its_rules(name, drafter, block, budget, k, min_budget, uses_budget):
    p = get_policy(name)
    assert (p.needs_drafter, p.block(8), p.budget(8, 32)) == (drafter, block, budget)
    assert (p.candidates(32, 100), p.min_budget, p.uses_budget) == (k, min_budget, uses_budget)
    assert str(p) == name and f"{p}" == name


def test_ddtree_takes_at_most_the_vocabulary_and_at_least_one_candidate():
    ddtree = get_policy("ddtree")
    assert ddtree.candidates(1024, 61) == 61
    assert ddtree.candidates(0, 61) == 1


def test_registry_and_baseline():
    assert list(POLICIES) == ["ar", "chain", "ddtree", "eagle", "mtp", "ngram", "medusa"]
    drafting = {n: p.drafting for n, p in POLICIES.items()}
    assert [n for n, d in drafting.items() if d is not None and d.in_steps] == ["eagle", "mtp"]
    # n-gram lookup and Medusa heads are described by SGLang's step fields, but draft in one
    # pass (or none)
    assert [n for n, d in drafting.items() if d is not None and d.step_fields] == [
        "eagle", "mtp", "ngram", "medusa"]  # fmt: skip
    assert POLICIES["ar"] is AR and not AR.needs_drafter
    assert DEFAULT_POLICY in POLICIES
    with pytest.raises(ValueError, match="policy 'beam': expected one of ar, chain, ddtree, eagle"):
        get_policy("beam")
