"""The tensor/expert-parallel target: split plans, slice reading, the control payloads, and a
whole group simulated with one thread per rank (same shard code, an all-reduce over threads).
The real multi-process group (gloo) is tested in ``test_parallel_group.py``."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.engine.helpers import TINY, per_expert, tiny_mla_target
from tests.trees import make_tree

from ddtree.models.adapters.mla_moe import MlaMoeTarget
from ddtree.models.adapters.parallel import (
    ParallelConfigError,
    ParallelPlan,
    decode_tree,
    encode_tree,
    load_shard,
    unpack_bits,
)
from ddtree.models.loading.checkpoint import CheckpointError, CheckpointSlices, save_safetensors
from ddtree.models.nn.mla_moe import MlaMoeConfig
from ddtree.perf.cost.step import DEPLOYMENTS, collectives_per_forward
from ddtree.perf.shapes.model import shape_from_config
from ddtree.tree.layout import pack_bits

TOL = 1e-5
# 4 heads, dense intermediate 48, 8 experts of intermediate 16, one shared expert
PLANS = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)]


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory):
    """A tiny random MLA+MoE checkpoint in the fused expert layout (our state_dict)."""
    target = tiny_mla_target(seed=3)
    path = tmp_path_factory.mktemp("tiny_fused")
    save_safetensors(path, target.model.state_dict(), TINY)
    return path


@pytest.fixture(scope="module")
def per_expert_ckpt(fused_ckpt, tmp_path_factory):
    """The same weights with experts stored one by one (published DeepSeek/Kimi layout)."""
    whole = MlaMoeTarget.from_pretrained(fused_ckpt)
    state = per_expert(whole.model.state_dict())
    path = tmp_path_factory.mktemp("tiny_per_expert")
    save_safetensors(path, state, TINY)
    return path


class ThreadGroup:
    """``world`` ranks as threads; ``reduce_for(rank)`` sums the ranks' tensors in rank order
    (what an all-reduce does), and counts the calls."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world

    def reduce_for(self, rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.parts[rank] = x.clone()
            self.barrier.wait()
            total = self.parts[0].clone()
            for part in self.parts[1:]:
                total += part
            self.barrier.wait()
            return x.copy_(total)

        return reduce

    def run(self, fn) -> list:
        """``fn(rank)`` on every rank at once; the results in rank order."""
        results: list = [None] * self.world
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as err:
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def shards(path, tp: int, ep: int) -> tuple[ThreadGroup, list[MlaMoeTarget]]:
    group = ThreadGroup(tp)
    plan = ParallelPlan(tp, ep)
    return group, [load_shard(path, plan, r, group.reduce_for(r)) for r in range(tp)]


@pytest.mark.parametrize("tp,ep", PLANS)
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_shards_equal_the_whole_model(tp, ep, layout, fused_ckpt, per_expert_ckpt):
    """Prefill, one-token decode and a tree verify at tp/ep: rank 0's logits equal the
    single-process model's within 1e-5, with two all-reduces per layer on every rank."""
    path = fused_ckpt if layout == "fused" else per_expert_ckpt
    whole = MlaMoeTarget.from_pretrained(path)
    group, ranks = shards(path, tp, ep)
    shape = shape_from_config(TINY)
    per_forward = collectives_per_forward(shape, DEPLOYMENTS["tp-ep" if ep > 1 else "tp"])
    prompt = torch.tensor([5, 9, 2, 33, 7, 1, 60, 12])
    tree = make_tree([4, 8, 15, 16, 23, 42], [-1, 0, 0, 1, 1, 2])
    steps = [
        ("prefill", lambda t: t.prefill(prompt).logits),
        ("decode", lambda t: t.verify(make_tree([3], [-1])).logits),
        ("commit", lambda t: t.commit(torch.tensor([0]))),
        ("verify", lambda t: t.verify(tree).logits),
    ]
    for what, step in steps:
        expected = step(whole)
        got = group.run(lambda r, step=step: step(ranks[r]))
        if expected is None:
            continue
        assert got[0].shape == expected.shape, what
        assert (got[0] - expected).abs().max() <= TOL, what
        assert all(g.shape[-1] == 0 for g in got[1:]), "only rank 0 computes logits"
        assert group.calls == [per_forward.all_reduce] * tp, what
        group.calls = [0] * tp
    assert all(t.seq_len == whole.seq_len for t in ranks)


def test_each_rank_reads_only_its_slices(per_expert_ckpt, monkeypatch):
    """The elements a rank reads equal the elements of its shard: never whole tensors it
    does not keep (and rank 1, without the LM head, reads far less than the checkpoint)."""
    read = []
    original = CheckpointSlices.read

    def counting(self, name, index=()):
        tensor = original(self, name, index)
        read.append(tensor.numel())
        return tensor

    monkeypatch.setattr(CheckpointSlices, "read", counting)
    rank1 = load_shard(per_expert_ckpt, ParallelPlan(2, 2), 1, lambda x: x)
    kept = sum(p.numel() for p in rank1.model.parameters()) + sum(
        b.numel() for n, b in rank1.model.named_buffers() if "e_score_correction_bias" in n
    )
    whole = sum(p.numel() for p in MlaMoeTarget.from_pretrained(per_expert_ckpt).model.parameters())
    assert sum(read) == kept
    assert kept < 0.6 * whole


def test_plan_ranges_cover_every_head_column_and_expert_once():
    config = MlaMoeConfig.from_hf(TINY, source="tiny")
    for tp, ep in PLANS:
        plan = ParallelPlan(tp, ep)
        plan.check(config)
        ranges = [plan.ranges(config, r) for r in range(tp)]
        for field, total in (
            ("heads", config.num_attention_heads),
            ("dense", config.intermediate_size),
            ("shared", config.moe_intermediate_size * config.n_shared_experts),
        ):
            covered = sorted(i for r in ranges for i in getattr(r, field))
            assert covered == list(range(total)), (tp, ep, field)
        cells = sorted((e, i) for r in ranges for e in r.experts for i in r.expert_intermediate)
        everything = [(e, i) for e in range(8) for i in range(16)]
        assert cells == everything, (tp, ep)


@pytest.mark.parametrize(
    "tp,ep,overrides,message",
    [
        (3, 1, {}, "num_attention_heads=4 does not split into 3"),
        (4, 3, {}, "ep=3 must divide tp=4"),
        (4, 4, {"n_routed_experts": 6}, "n_routed_experts=6 does not split into 4"),
        (4, 2, {"moe_intermediate_size": 6}, "moe_intermediate_size x n_shared_experts=6"),
        (2, 1, {"intermediate_size": 47}, "intermediate_size=47 does not split into 2"),
        (0, 1, {}, "tp and ep must be >= 1"),
    ],
)
def test_plan_errors_name_the_field(tp, ep, overrides, message):
    config = MlaMoeConfig.from_hf(dict(TINY, **overrides), source="tiny")
    with pytest.raises(ParallelConfigError, match=message):
        ParallelPlan(tp, ep).check(config, "tiny/config.json")


def test_shard_of_a_checkpoint_missing_a_tensor_names_it(fused_ckpt, tmp_path):
    state = MlaMoeTarget.from_pretrained(fused_ckpt).model.state_dict()
    del state["model.layers.1.self_attn.o_proj.weight"]
    save_safetensors(tmp_path, state, TINY)
    with pytest.raises(CheckpointError, match="missing tensors: model.layers.1.self_attn.o_proj"):
        load_shard(tmp_path, ParallelPlan(2), 0, lambda x: x)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 150), st.integers(0, 2**31 - 1))
def test_unpack_bits_inverts_pack_bits(m, seed):
    g = torch.Generator().manual_seed(seed)
    vis = torch.rand(m, m, generator=g) < 0.5
    assert torch.equal(unpack_bits(pack_bits(vis), m), vis)


@pytest.mark.parametrize("m", [1, 7, 64, 65, 130])
def test_tree_payload_round_trip(m):
    """What rank 0 sends for a verify rebuilds the same tree (each rank lays it out itself)."""
    g = torch.Generator().manual_seed(m)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, m)]
    tree = make_tree(torch.randint(0, 1000, (m,), generator=g).tolist(), parents)
    got_tree = decode_tree(encode_tree(tree), m)
    for name in ("tokens", "parents", "depth", "visibility"):
        assert torch.equal(getattr(got_tree, name), getattr(tree, name)), name
