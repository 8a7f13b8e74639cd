"""The batched engine (``ddtree.engine.batch``): every row lossless on its own, whatever the
other rows do. Greedy rows equal AR token for token (float32); sampled rows equal the same
request decoded alone with the same seed. Rows join and leave between steps (continuous
batching), are cancelled, stop on EOS, stop strings and max_new_tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree.engine import DecodeConfig, generate
from ddtree.engine.batch import BatchEngine, BatchRequest
from ddtree.engine.stop import StopCondition
from ddtree.models.adapters.rows import Segment, pack
from ddtree.models.static import (
    EngineModeError,
    EnginePlan,
    packed_rows_mask,
    static_attention_mask,
)

from .helpers import (
    ScriptedDrafter,
    decoder_from_hf,
    random_dflash_drafter,
    tiny_hf_target,
    tiny_mla_target,
)

VOCAB = 61
LONGEST = 28  # max_new_tokens of the AR references: every trial asks for at most this many
POOL_SIZE = 24


class Letters:
    """A tokenizer for stop strings over the tiny vocabulary: token i is one letter."""

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(scope="module")
def target():
    return tiny_mla_target(seed=0)


@pytest.fixture(scope="module")
def drafter(target):
    return random_dflash_drafter(target, 8, output_multiplier=0.3)


@pytest.fixture(scope="module")
def pool(target):
    """Prompts and their AR continuations of ``LONGEST`` tokens (no EOS), made once."""
    gen = torch.Generator().manual_seed(7)
    prompts = []
    for _ in range(POOL_SIZE):
        n = int(torch.randint(1, 20, (), generator=gen))
        prompts.append(torch.randint(0, VOCAB, (n,), generator=gen).tolist())
    config = DecodeConfig(policy="ar", max_new_tokens=LONGEST, eos_token_ids=())
    return [(p, generate(target, None, p, config).tokens) for p in prompts]


def _expected(ar: list[int], config: DecodeConfig) -> tuple[list[int], str]:
    """AR's output under ``config``'s stop conditions: the reference continuation cut by
    the same rule the engine applies (``StopCondition``), token by token."""
    tokens = list(ar)
    stop = StopCondition(
        config.max_new_tokens, frozenset(config.eos_token_ids), config.stop_strings, Letters()
    )
    return tokens, stop.scan(tokens, 0)


request_spec = st.fixed_dictionaries(
    {
        "prompt": st.integers(0, POOL_SIZE - 1),
        "policy": st.sampled_from(["ar", "chain", "ddtree", "ddtree"]),
        "budget": st.integers(1, 40),
        "max_new": st.integers(1, LONGEST),
        "eos": st.lists(st.integers(0, VOCAB - 1), max_size=2),
        "stop": st.sampled_from([(), (), ("ab",), ("q", "zz")]),
        "scripted": st.booleans(),
        "hit": st.sampled_from([0.5, 0.9]),
        "sampled": st.integers(0, 9).map(lambda x: x == 0),  # one request in ten
        "joins_at": st.integers(0, 6),  # the step before which it is submitted
        "cancel_at": st.one_of(st.none(), st.integers(1, 8)),
    }
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_rows=st.integers(1, 8), specs=st.lists(request_spec, min_size=1, max_size=7))
def test_every_row_is_lossless_whatever_the_other_rows_do(target, drafter, pool, max_rows, specs):
    engine = BatchEngine(target, drafter, max_rows=max_rows, row_capacity=96, tokenizer=Letters())
    requests = []
    for i, s in enumerate(specs):
        prompt, ar = pool[s["prompt"]]
        config = DecodeConfig(
            policy=s["policy"], budget=max(s["budget"], 1), max_new_tokens=s["max_new"],
            eos_token_ids=tuple(s["eos"]), stop_strings=s["stop"],
            temperature=0.8 if s["sampled"] else 0.0, seed=i,
        )  # fmt: skip
        own = None
        if s["scripted"]:  # a drafter state of its own that knows the answer (deep trees)
            own = ScriptedDrafter(prompt + ar, VOCAB, 8, hit=s["hit"], seed=i)
            own.target_layer_ids = list(drafter.target_layer_ids)  # what the engine captures
        requests.append((s, prompt, ar, config, own))
    ids: dict[int, int] = {}  # request index -> engine id
    results = {}
    step = 0
    while len(ids) < len(requests) or not engine.idle:
        for i, (s, prompt, _, config, own) in enumerate(requests):
            if i not in ids and s["joins_at"] <= step:
                ids[i] = engine.submit(BatchRequest(prompt, config, drafter=own))
            if i in ids and s["cancel_at"] == step and i % 3 == 0:
                engine.cancel(ids[i])
        results.update(engine.step().finished)
        step += 1
        assert engine.running.keys() <= set(ids.values())
        assert len(engine.running) <= max_rows
    for i, (s, prompt, ar, config, own) in enumerate(requests):
        got = results[ids[i]]
        if config.greedy:
            tokens, reason = _expected(ar, config)
        else:  # the same request alone, with the same seed and a fresh drafter state
            alone_drafter = (
                ScriptedDrafter(prompt + ar, VOCAB, 8, hit=s["hit"], seed=i) if own else drafter
            )
            alone = generate(target, alone_drafter, prompt, config, Letters())
            tokens, reason = alone.tokens, alone.stop_reason
        if got.stop_reason == "cancelled":  # what it made by then: a prefix of the answer
            assert got.tokens == tokens[: len(got.tokens)], (i, s)
            continue
        assert got.tokens == tokens, (i, s)
        assert got.stop_reason == reason, (i, s)
        assert sum(got.taus) + 1 == len(got.tokens)  # the prefill's token, then the steps'


def test_rows_join_as_others_leave_first_come_first_served(target, drafter, pool):
    """Five requests through two rows: at most two run, each starts as soon as a row frees,
    in submission order, and every greedy output equals AR."""
    engine = BatchEngine(target, drafter, max_rows=2, row_capacity=96)
    lengths = [3, 9, 5, 12, 2]
    ids = [
        engine.submit(BatchRequest(pool[i][0], DecodeConfig(max_new_tokens=n)))
        for i, n in enumerate(lengths)
    ]
    started, done = [], {}
    while not engine.idle:
        for request_id in engine.running:
            if request_id not in started:
                started.append(request_id)
        assert len(engine.running) <= 2
        done.update(engine.step().finished)
    assert started == ids
    for i, n in enumerate(lengths):
        assert done[ids[i]].tokens == pool[i][1][:n]


def _naive_twin(target):
    """The same MLA+MoE weights with the naive (materialised keys) attention."""
    from ddtree.models.adapters.mla_moe import MlaMoeTarget
    from ddtree.models.nn.mla_moe import MlaMoeModel

    model = MlaMoeModel(target.model.config, attn_impl="naive")
    model.load_state_dict(target.model.state_dict())
    return MlaMoeTarget(model, capacity=64)


@pytest.mark.parametrize("family", ["mla-absorbed", "mla-naive", "qwen3-decoder"])
def test_every_target_family_decodes_rows_equal_to_ar(target, pool, family):
    model = {
        "mla-absorbed": lambda: target,
        "mla-naive": lambda: _naive_twin(target),
        "qwen3-decoder": lambda: decoder_from_hf(tiny_hf_target("qwen3").model),
    }[family]()
    drafter = random_dflash_drafter(model, 8, output_multiplier=0.3)
    configs = [
        DecodeConfig(policy=p, max_new_tokens=12) for p in ("ddtree", "chain", "ar", "ddtree")
    ]
    prompts = [pool[i][0] for i in range(len(configs))]
    expected = [
        generate(model, None, x, DecodeConfig(policy="ar", max_new_tokens=12)).tokens
        for x in prompts
    ]
    engine = BatchEngine(model, drafter, max_rows=3, row_capacity=64)
    results = engine.run([BatchRequest(x, c) for x, c in zip(prompts, configs, strict=True)])
    assert [r.tokens for r in results] == expected


def test_rows_of_a_reduced_draft_vocabulary_equal_ar(target, pool):
    """--draft-vocab K: every row's drafter (forks of one) proposes over the same K ids with
    the same head rows, and every greedy row still equals AR."""
    drafter = random_dflash_drafter(target, 8, output_multiplier=0.3)
    drafter.restrict_vocab(torch.arange(0, VOCAB, 3))
    twin = drafter.fork()
    assert twin.draft_head is drafter.draft_head and torch.equal(
        twin.draft_tokens, drafter.draft_tokens
    )
    engine = BatchEngine(target, drafter, max_rows=3, row_capacity=96)
    results = engine.run(
        [BatchRequest(pool[i][0], DecodeConfig(max_new_tokens=15)) for i in range(5)]
    )
    assert [r.tokens for r in results] == [pool[i][1][:15] for i in range(5)]


def test_forks_draft_together_as_each_drafts_alone(target):
    """One forward for several requests' blocks (``propose_many``) gives each the logits its
    own propose gives, over contexts of different lengths, twice in a row (the second
    appends a few committed rows to each cache)."""
    base = random_dflash_drafter(target, 8, output_multiplier=0.3)
    base.set_engine_mode(EnginePlan())
    gen = torch.Generator().manual_seed(3)
    features = base.config.context_features
    steps = [
        [torch.randn(n, features, generator=gen) for n in (5, 1, 12)],
        [torch.randn(n, features, generator=gen) for n in (2, 3, 1)],
    ]
    roots = [[4, 9, 60], [1, 2, 3]]
    alone = [base.fork() for _ in range(3)]
    together = [base.fork() for _ in range(3)]
    for ctx, root in zip(steps, roots, strict=True):
        expected = [d.propose(c, r) for d, c, r in zip(alone, ctx, root, strict=True)]
        got = type(base).propose_many(together, ctx, root)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert [d.seen for d in together] == [d.seen for d in alone] == [7, 4, 13]


def test_a_cancelled_row_frees_its_slot_and_keeps_what_it_made(target, drafter, pool):
    engine = BatchEngine(target, drafter, max_rows=1, row_capacity=96)
    first = engine.submit(BatchRequest(pool[0][0], DecodeConfig(max_new_tokens=LONGEST)))
    second = engine.submit(BatchRequest(pool[1][0], DecodeConfig(max_new_tokens=4)))
    engine.step()
    engine.step()
    engine.cancel(first)
    finished = dict(engine.step().finished)
    assert finished[first].stop_reason == "cancelled"
    assert 2 <= len(finished[first].tokens) < LONGEST
    assert finished[first].tokens == pool[0][1][: len(finished[first].tokens)]
    assert list(engine.running) == [second]


def test_requests_that_cannot_run_are_refused_at_submit(target, drafter):
    engine = BatchEngine(target, drafter, max_rows=2, row_capacity=40)
    with pytest.raises(ValueError, match="needs 83 cache slots; a row holds 40"):
        engine.submit(BatchRequest([1] * 20, DecodeConfig(max_new_tokens=30)))
    with pytest.raises(ValueError, match="this batch engine runs 'eager'"):
        engine.submit(BatchRequest([1], DecodeConfig(engine_mode="compiled")))
    with pytest.raises(ValueError, match="generate decodes one request, got a batch of 2"):
        engine.submit(BatchRequest([[1, 2], [3, 4]], DecodeConfig()))
    no_drafter = BatchEngine(target, None, max_rows=2, row_capacity=40)
    with pytest.raises(ValueError, match="needs a drafter"):
        no_drafter.submit(BatchRequest([1], DecodeConfig(policy="ddtree", max_new_tokens=4)))
    assert engine.idle and no_drafter.idle


def test_the_transformers_wrapper_is_refused_naming_what_runs_batched():
    hf = tiny_hf_target("qwen3")
    with pytest.raises(EngineModeError, match="decodes one request at a time"):
        BatchEngine(hf, None, max_rows=2)


def test_the_packed_mask_is_each_rows_own_static_mask():
    """Packed rows see exactly what each would see alone (``static_attention_mask`` over its
    own region), and nothing of the other rows' regions."""
    gen = torch.Generator().manual_seed(0)
    cap, lengths = 10, [3, 0, 6]
    segments = []
    for row, m in ((0, 3), (2, 4), (1, 2)):
        vis = torch.rand(m, m, generator=gen) < 0.5
        vis = (vis.tril() | torch.eye(m, dtype=torch.bool)).contiguous()
        segments.append(Segment(row, torch.zeros(m, dtype=torch.int64), torch.arange(m), vis))
    inputs = pack(segments, lengths, cap)
    keys = torch.arange(3 * cap)
    mask = packed_rows_mask(inputs.row_lo, inputs.row_new, inputs.visibility, keys, torch.float32)
    at = 0
    for s in segments:
        m = s.tokens.shape[0]
        own = static_attention_mask(
            torch.tensor(lengths[s.row]), s.visibility, torch.arange(cap), torch.float32
        )
        expected = torch.full((m, 3 * cap), torch.finfo(torch.float32).min)
        expected[:, s.row * cap : (s.row + 1) * cap] = own
        assert torch.equal(mask[at : at + m], expected), s.row
        at += m


def test_the_worked_example_of_the_packed_mask():
    row_lo = torch.tensor([0, 0, 4])
    row_new = torch.tensor([2, 2, 5])
    vis = torch.tensor([[1, 0], [1, 1], [1, 0]], dtype=torch.bool)
    mask = packed_rows_mask(row_lo, row_new, vis, torch.arange(6), torch.float32)
    visible = [set(torch.nonzero(r == 0).flatten().tolist()) for r in mask]
    assert visible == [{0, 1, 2}, {0, 1, 2, 3}, {4, 5}]


@pytest.mark.slow
def test_compiled_rows_equal_ar_and_the_same_requests_alone(target, drafter, pool):
    """Compiled mode: trees through the compiled width buckets, joining prompts eagerly."""
    engine = BatchEngine(
        target, drafter, max_rows=3, row_capacity=96, engine_mode="compiled", width=33
    )
    assert engine.compile_s > 0
    configs = [
        DecodeConfig(policy=p, max_new_tokens=n, engine_mode="compiled")
        for p, n in (("ddtree", 20), ("chain", 9), ("ar", 14), ("ddtree", 25), ("ddtree", 5))
    ]
    results = engine.run([BatchRequest(pool[i][0], c) for i, c in enumerate(configs)])
    for i, (got, c) in enumerate(zip(results, configs, strict=True)):
        assert got.tokens == pool[i][1][: c.max_new_tokens], i


def test_the_steady_state_keeps_the_steps_with_every_row_decoding():
    from ddtree.engine.batch import BatchStep
    from ddtree.engine.sweep import steady_state

    def step(rows, decoding, seconds, tokens):
        return BatchStep(rows, [], seconds, tokens, decoding, {"verify": seconds / 2})

    steps = [step(4, 0, 9.0, 4), step(4, 4, 1.0, 12), step(4, 4, 3.0, 8), step(3, 3, 0.5, 3)]
    got = steady_state(steps, 4)  # the prefill-only step and the 3-row tail are left out
    assert got["tokens_per_s"] == 20 / 4.0 and got["step_s_mean"] == 2.0
    assert got["mean_tau"] == 20 / 8 and got["rows_mean"] == 4 and got["steps"] == 2
    assert got["stage_s_mean"] == {"verify": 1.0}
    assert steady_state(steps, 8)["rows_mean"] == 11 / 3  # never 8 rows: every decode step


def test_a_batch_whose_cache_does_not_fit_is_refused_naming_its_size(target, monkeypatch):
    import ddtree.models.adapters.rows as rows

    monkeypatch.setattr(rows, "available_bytes", lambda device: 10_000)
    with pytest.raises(MemoryError, match=r"a batch of 8 rows x 96 cache slots needs 0\.\d+ GB"):
        BatchEngine(target, None, max_rows=8, row_capacity=96)
    monkeypatch.setattr(rows, "available_bytes", lambda device: 10**12)
    assert BatchEngine(target, None, max_rows=8, row_capacity=96).idle


def test_auto_builds_the_next_tree_at_twice_its_choice():
    from ddtree.engine.budget import next_build

    assert [next_build(n, 64) for n in (3, 0, 40, 64)] == [6, 4, 64, 64]
    assert next_build(3, 5) == 5  # never past the request's own budget


def test_generate_with_auto_budget_equals_ar_and_verifies_smaller_trees(target, pool, monkeypatch):
    """generate --budget auto: greedy output still equals AR, every verified tree is within
    the request's budget, and the trees follow the choice (not all of the largest size). The
    verify cost is given, not timed (a measured curve on a busy machine can come out flat,
    and then 64 nodes are rightly worth it): each token past the first costs a fifth of one."""
    import ddtree.engine.budget as budget

    steep = budget.VerifyCost((1, 64), (1.0, 1.0 + 63 / 5))
    monkeypatch.setattr(budget, "target_verify_cost", lambda *args, **kwargs: steep)
    drafter = random_dflash_drafter(target, 8, output_multiplier=0.3)
    prompt, ar = pool[2]
    config = DecodeConfig(policy="ddtree", budget=64, auto_budget=True, max_new_tokens=20)
    got = generate(target, drafter, prompt, config)
    assert got.tokens == ar[:20]
    assert got.tree_nodes and max(got.tree_nodes) <= 64 and min(got.tree_nodes) < 64
