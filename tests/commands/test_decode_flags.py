"""The decode flags come from one table (``DECODE_FLAGS``): each names a ``DecodeConfig``
field whose default it shares, and ``decode_config`` fills every field from its flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ddtree.commands._decode import (
    DECODE_FLAGS,
    MAX_NEW_TOKENS,
    add_decode_arguments,
    decode_config,
)
from ddtree.engine import DecodeConfig
from ddtree.vocab import AUTO_MAX_BUDGET

FIELDS = {f.name: f for f in dataclasses.fields(DecodeConfig)}


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_decode_arguments(p, max_new_tokens=17)
    return p.parse_args(argv)


@pytest.mark.parametrize("flag", [f for f in DECODE_FLAGS if f.field], ids=lambda f: f.flag)
def test_a_flag_defaults_to_its_field_default(flag):
    assert flag.field in FIELDS
    if flag.default is not MAX_NEW_TOKENS:
        assert flag.to_config(flag.default) == FIELDS[flag.field].default


def test_the_flags_in_their_order():
    assert [f.flag for f in DECODE_FLAGS] == [
        "--block",
        "--budget",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--max-new-tokens",
        "--draft-vocab",
        "--buckets",
    ]
    assert parse().max_new_tokens == 17 and parse().draft_vocab is None


def test_every_flag_reaches_its_field():
    args = parse(
        *("--block", "4", "--budget", "12", "--temperature", "0.5", "--top-k", "3"),
        *("--top-p", "0.9", "--seed", "7", "--max-new-tokens", "5", "--buckets", "1,16"),
    )
    config = decode_config(args, "ddtree", engine_mode="compiled")
    got = {f: getattr(config, f) for f in ("block_size", "budget", "temperature", "top_k")}
    assert got == {"block_size": 4, "budget": 12, "temperature": 0.5, "top_k": 3}
    assert (config.top_p, config.seed, config.max_new_tokens) == (0.9, 7, 5)
    assert config.buckets == (1, 16) and config.engine_mode == "compiled"
    assert not config.auto_budget
    assert decode_config(args, "ddtree", budget=6).budget == 6


def test_budget_auto_only_where_the_policy_uses_a_budget():
    args = parse("--budget", "auto")
    tree = decode_config(args, "ddtree")
    assert (tree.budget, tree.auto_budget) == (AUTO_MAX_BUDGET, True)
    chain = decode_config(args, "chain")
    assert (chain.budget, chain.auto_budget) == (32, False)
