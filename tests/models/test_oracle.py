"""The synthetic oracle drafter: its spec, its calibration (the true token sits at each rank as
often as the drafter says), determinism, and lossless decoding at an acceptance it sets."""

from __future__ import annotations

import pytest
import torch
from tests.engine.helpers import tiny_mla_target

from ddtree.engine import DecodeConfig, generate
from ddtree.models.oracle import OracleDrafter, OracleSpec, OracleSpecError, parse_oracle_spec

V, B = 500, 8


def test_spec_parsing_and_its_errors():
    spec = parse_oracle_spec("oracle:p=0.7,spread=0.3,ranks=4,seed=2")
    assert spec == OracleSpec(p=0.7, spread=0.3, ranks=4, seed=2)
    assert parse_oracle_spec("oracle:") == OracleSpec()
    for bad, message in [
        ("dflash:p=1", "start with 'oracle:'"),
        ("oracle:q=1", "NAME one of p, decay, spread, ranks, seed"),
        ("oracle:p=x", "p='x' is not a number"),
        ("oracle:p=nan", "not finite"),
        ("oracle:p=1.5", "p=1.5: expected p in \\[0, 1\\]"),
        ("oracle:ranks=0", "ranks=0"),
        ("oracle:spread=1", "spread=1.0"),
    ]:
        with pytest.raises(OracleSpecError, match=message):
            parse_oracle_spec(bad)


def test_rank_profile_worked_example():
    # p_2 = 0.8 * 0.5; the rest (0.6) geometric with ratio 0.5: 0.3, 0.15
    spec = OracleSpec(p=0.8, decay=0.5, spread=0.5, ranks=3)
    assert spec.rank_probs(2) == pytest.approx([0.4, 0.3, 0.15])


def test_the_true_token_sits_at_each_rank_as_often_as_proposed():
    """Calibration: over many positions, the rank of the true token follows rank_probs (the
    drafter's own stated probabilities), within 4 standard errors."""
    spec = OracleSpec(p=0.6, spread=0.5, ranks=4)
    oracle = OracleDrafter(spec, block_size=B, vocab_size=V)
    reference = torch.randint(0, V, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    oracle.expect(reference)
    counts = torch.zeros(spec.ranks + 1)
    n = 0
    for p in range(0, 2800, 3):
        logits = oracle.logits_at(p, reference[p])
        order = logits.argsort(dim=-1, descending=True)  # [B-1, V]
        for d in range(B - 1):
            where = (order[d, : spec.ranks] == reference[p + d + 1]).nonzero()
            counts[int(where) if where.numel() else spec.ranks] += 1
            n += 1
    expected = torch.tensor([*spec.rank_probs(1), 1 - sum(spec.rank_probs(1))])
    stderr = (expected * (1 - expected) / n).sqrt()
    assert ((counts / n - expected).abs() <= 4 * stderr + 1e-9).all(), (counts / n, expected)


def test_draws_depend_on_position_only_and_off_track_proposes_no_truth():
    oracle = OracleDrafter(OracleSpec(p=1.0), block_size=B, vocab_size=V)
    reference = list(range(100, 200))
    oracle.expect(reference)
    a, b = oracle.logits_at(10, reference[10]), oracle.logits_at(10, reference[10])
    assert torch.equal(a, b)
    assert a.argmax(-1).tolist() == reference[11 : 11 + B - 1]  # p = 1: always first
    wrong = oracle.logits_at(10, reference[10] + 1)  # the decode left the reference
    blind = OracleDrafter(OracleSpec(p=1.0), block_size=B, vocab_size=V)  # told nothing
    assert torch.equal(wrong, blind.logits_at(10, reference[10]))  # decoys only
    assert not torch.equal(wrong, a)
    assert torch.isfinite(a).all()


@pytest.mark.parametrize("policy,budget", [("chain", B - 1), ("ddtree", 24)])
def test_decoding_with_the_oracle_is_lossless_and_its_accuracy_sets_tau(policy, budget):
    target = tiny_mla_target()
    prompt = [3, 5, 7, 11, 13, 17]
    ar = generate(target, None, prompt, DecodeConfig("ar", max_new_tokens=120))
    taus = []
    for p in (0.3, 0.9):
        oracle = OracleDrafter(
            OracleSpec(p=p, spread=0.4), block_size=B, vocab_size=61, target_layer_ids=[1]
        )
        oracle.expect(prompt + ar.tokens)
        cfg = DecodeConfig(policy, block_size=B, budget=budget, max_new_tokens=120)
        out = generate(target, oracle, prompt, cfg)
        assert out.tokens == ar.tokens
        taus.append(out.mean_tau)
    assert taus[1] > taus[0] + 1
    assert (
        oracle.info.name.startswith("synthetic-oracle(")
        and "no drafter forward" in oracle.info.name
    )
