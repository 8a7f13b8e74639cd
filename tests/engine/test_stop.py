"""Stop conditions as transformers' ``generate`` applies them: the prefill's token can stop a
request, taus count only returned tokens, the first stop in token order wins, and stop strings
are decoded incrementally (linear in the output)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.engine import DecodeConfig, engine_run_record, generate
from ddtree.engine.stop import IncrementalText, StopCondition

from .helpers import ScriptedDrafter, tiny_hf_target, tiny_mla_target

PROMPT = [1, 2, 3, 4, 5]
POLICIES = ("ar", "chain", "ddtree")


class WordTokenizer:
    """Token t decodes to ``"wt"``, tokens joined by spaces; counts decoded characters."""

    def __init__(self) -> None:
        self.decoded_chars = 0

    def decode(self, ids) -> str:
        text = " ".join(f"w{i}" for i in ids)
        self.decoded_chars += len(text)
        return text


@pytest.fixture(scope="module")
def target():
    return tiny_mla_target(seed=0)


@pytest.fixture(scope="module")
def ar_tokens(target):
    cfg = DecodeConfig("ar", max_new_tokens=60, eos_token_ids=())
    return generate(target, None, PROMPT, cfg).tokens


def _run(target, ar_tokens, policy, tokenizer=None, hit=0.9, **kw):
    drafter = None
    if policy != "ar":
        drafter = ScriptedDrafter(PROMPT + ar_tokens, target.info.vocab_size, 8, hit=hit)
    cfg = DecodeConfig(policy, block_size=8, budget=16, **kw)
    return generate(target, drafter, PROMPT, cfg, tokenizer=tokenizer)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_eos_chosen_by_the_prefill_stops_the_request(target, ar_tokens, policy):
    out = _run(target, ar_tokens, policy, max_new_tokens=20, eos_token_ids=(ar_tokens[0],))
    assert out.tokens == ar_tokens[:1] and out.stop_reason == "eos"
    assert out.taus == [] and out.steps == []


@pytest.mark.parametrize("policy", POLICIES)
def test_a_stop_string_completed_by_the_prefill_token_stops_the_request(target, ar_tokens, policy):
    stop = f"w{ar_tokens[0]}"
    out = _run(
        target,
        ar_tokens,
        policy,
        WordTokenizer(),
        max_new_tokens=20,
        eos_token_ids=(),
        stop_strings=(stop,),
    )
    assert out.tokens == ar_tokens[:1] and out.stop_reason == "stop_string"
    assert out.text == stop


@pytest.mark.parametrize("policy", ["ar", "chain", "ddtree"])
def test_the_first_token_stops_like_transformers_generate(policy):
    target = tiny_hf_target("qwen3", seed=3)
    model = target.model
    prompt = torch.tensor([PROMPT])
    free = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None)
    first = int(free[0, len(PROMPT)])
    theirs = model.generate(
        prompt, max_new_tokens=6, do_sample=False, eos_token_id=first, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    assert theirs[0] == first and (len(theirs) == 1 or theirs[1] == 0)  # stopped, then padding
    script = PROMPT + free[0, len(PROMPT) :].tolist()
    drafter = None if policy == "ar" else ScriptedDrafter(script, 61, 4, hit=1.0)
    cfg = DecodeConfig(policy, block_size=4, budget=8, max_new_tokens=6, eos_token_ids=(first,))
    out = generate(target, drafter, PROMPT, cfg)
    assert out.tokens == [first] and out.stop_reason == "eos"


@pytest.mark.parametrize("n", [2, 9, 30, 31])
def test_taus_and_the_record_count_only_returned_tokens_at_max_new_tokens(target, ar_tokens, n):
    # a perfect chain commits whole blocks of 8: 1 (prefill) + 8 + 8 + ... is cut at n
    out = _run(target, ar_tokens, "chain", hit=1.0, max_new_tokens=n, eos_token_ids=())
    assert out.tokens == ar_tokens[:n] and out.stop_reason == "max_new_tokens"
    full, rest = divmod(n - 1, 8)
    assert out.taus == [8] * full + ([rest] if rest else [])
    assert [s.tau for s in out.steps] == out.taus
    record = engine_run_record([out], DecodeConfig("chain"), target.info, None)
    assert record.summary["tokens_per_s"] == pytest.approx((n - 1) / out.decode_s)
    assert [p["tau"] for p in record.points] == out.taus


def _first_new(tokens: list[int], lo: int, hi: int) -> int:
    """An index in lo..hi-1 whose token does not occur before it."""
    for i in range(lo, hi):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError(f"no new token among positions {lo}..{hi - 1}: pick another prompt")


def test_taus_count_only_returned_tokens_at_an_eos(target, ar_tokens):
    i = _first_new(ar_tokens, 10, 16)  # inside the second step (tokens 9..16)
    out = _run(
        target, ar_tokens, "chain", hit=1.0, max_new_tokens=40, eos_token_ids=(ar_tokens[i],)
    )
    assert out.tokens == ar_tokens[: i + 1] and out.stop_reason == "eos"
    assert out.taus == [8, i + 1 - 9] and sum(out.taus) == len(out.tokens) - 1


def test_an_eos_past_max_new_tokens_is_not_the_stop_reason(target, ar_tokens):
    # the step that crosses max_new_tokens=12 commits tokens 9..16; the EOS sits after 12
    i = _first_new(ar_tokens, 12, 17)
    out = _run(
        target, ar_tokens, "chain", hit=1.0, max_new_tokens=12, eos_token_ids=(ar_tokens[i],)
    )
    assert out.tokens == ar_tokens[:12] and out.stop_reason == "max_new_tokens"


def test_the_first_stop_in_token_order_wins(target, ar_tokens):
    # one step commits tokens 9..16: a stop string completed at 11 beats an EOS at 14
    j = _first_new(ar_tokens, 13, 17)
    stop = f"w{ar_tokens[10]} w{ar_tokens[11]}"
    out = _run(
        target,
        ar_tokens,
        "chain",
        WordTokenizer(),
        hit=1.0,
        max_new_tokens=40,
        eos_token_ids=(ar_tokens[j],),
        stop_strings=(stop,),
    )
    first_stop = min(i for i in range(1, 12) if stop in WordTokenizer().decode(ar_tokens[: i + 1]))
    assert out.stop_reason == "stop_string" and out.tokens == ar_tokens[: first_stop + 1]


def test_stop_strings_decode_linearly_in_the_output_length(target, ar_tokens):
    chars = {}
    for n in (30, 60):
        tokenizer = WordTokenizer()
        out = _run(
            target,
            ar_tokens,
            "ar",
            tokenizer,
            max_new_tokens=n,
            eos_token_ids=(),
            stop_strings=("never in the output",),
        )
        assert out.stop_reason == "max_new_tokens" and len(out.tokens) == n
        chars[n] = tokenizer.decoded_chars / len(out.text)
    # incremental: a few characters decoded per output character, whatever the length
    # (re-decoding the whole output per token costs about n / 2 per character)
    assert chars[30] < 6 and chars[60] < 6


def test_stop_condition_checks_each_token_once_across_scans():
    tokenizer = WordTokenizer()
    cond = StopCondition(100, frozenset({99}), ("w3 w4",), tokenizer)
    tokens = [1, 2, 3]
    assert cond.scan(tokens, 0) is None
    tokens += [4, 5]
    assert cond.scan(tokens, 3) == "stop_string" and tokens == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        StopCondition(10, frozenset(), ("x",))
    with pytest.raises(ValueError, match="non-empty"):
        StopCondition(10, frozenset(), ("",), tokenizer)


@pytest.fixture(scope="module")
def byte_level():
    from ddtree.commands._decode import DEMO_DIR, TextCodec

    return TextCodec(DEMO_DIR / "target")


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_incremental_text_equals_decoding_the_whole_output(byte_level, text):
    # byte-level BPE: multi-byte characters split over tokens come out whole, once
    ids = byte_level.encode(text)
    inc = IncrementalText(byte_level)
    assert "".join(inc.push(t) for t in ids) == byte_level.decode(ids)
