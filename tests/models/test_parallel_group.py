"""The parallel target over a real 2-process gloo group on the bundled demo pair: logits at
TP = 2 and EP = 2 equal one process, DDTree at TP = 2 equals AR at TP = 1, input errors keep
the ranks in step. Faults (dead, stalled, missing ranks) are in ``test_parallel_faults.py``."""

from __future__ import annotations

import pytest
import torch
from tests.trees import make_tree

from ddtree.commands._decode import DEMO_DIR, TextCodec, demo_prompts
from ddtree.distributed import spawn_group
from ddtree.engine import DecodeConfig, generate
from ddtree.models import load_drafter
from ddtree.models.adapters.mla_moe import MlaMoeTarget
from ddtree.models.adapters.parallel import (
    ParallelTarget,
    SessionSpec,
    release,
    serve_spawned,
)
from ddtree.models.loading.checkpoint import CheckpointError, read_config
from ddtree.perf.cost.step import CONTROL_BROADCASTS_PER_CALL, DEPLOYMENTS, collectives_per_forward
from ddtree.perf.shapes.model import shape_from_config

TARGET = DEMO_DIR / "target"
# float64 for the comparisons: a rank's attention runs over fewer heads than one process's, so
# its kernels block differently and float32 rounding alone differs by ~1e-6 of the logits
DTYPE = "float64"
TOL = 1e-5
# seconds: generous for a loaded 2-core machine, short enough that a hang fails the test
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def whole():
    return MlaMoeTarget.from_pretrained(TARGET, dtype=getattr(torch, DTYPE))


@pytest.fixture(scope="module")
def group():
    """Rank 0 here, rank 1 spawned and serving; sessions open and close on it."""
    g = spawn_group(2, serve_spawned, (1,), timeout_s=TIMEOUT_S)
    yield g
    release(g)
    assert [p.exitcode for p in g.processes] in ([], [0])


def count_calls(monkeypatch, name: str) -> list[int]:
    """Count calls of ``torch.distributed.<name>`` on this rank."""
    calls = [0]
    original = getattr(torch.distributed, name)

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, name, counting)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_tp2_logits_equal_one_process(group, whole, ep, monkeypatch):
    """Prefill, decode and tree verify at TP = 2 (experts TP-split, or EP = 2) equal the
    single-process logits within 1e-5 (float64); each forward does exactly the cost model's all-reduces
    (two per layer) and each Target call its control broadcasts (header, payload)."""
    deployment = DEPLOYMENTS["tp-ep" if ep > 1 else "tp"]
    shape = shape_from_config(read_config(TARGET))
    per_forward = collectives_per_forward(shape, deployment).all_reduce  # the cost model's
    assert per_forward == 2 * whole.config.num_hidden_layers
    with ParallelTarget.open(group, SessionSpec(path=str(TARGET), ep=ep, dtype=DTYPE)) as tp2:
        assert (tp2.info.tp, tp2.info.ep, tp2.info.n_params) == (2, ep, whole.info.n_params)
        all_reduces = count_calls(monkeypatch, "all_reduce")
        broadcasts = count_calls(monkeypatch, "broadcast")
        whole.reset()
        tp2.reset()
        prompt = torch.arange(40, 90)
        tree = make_tree([4, 8, 15, 16, 23, 42, 99], [-1, 0, 0, 1, 1, 2, 5])
        steps = [
            lambda t: t.prefill(prompt).logits,
            lambda t: t.verify(make_tree([7], [-1])).logits,
            lambda t: t.commit(torch.tensor([0])),
            lambda t: t.verify(tree).logits,
            lambda t: t.commit(torch.tensor([0, 2, 6])),
            lambda t: t.verify(make_tree([1, 2], [-1, 0])).logits,
        ]
        for i, step in enumerate(steps):
            before = (all_reduces[0], broadcasts[0])
            expected, got = step(whole), step(tp2)
            if expected is not None:
                assert (got - expected).abs().max() <= TOL, i
                assert all_reduces[0] - before[0] == per_forward, i
            assert broadcasts[0] - before[1] == CONTROL_BROADCASTS_PER_CALL, i
        assert tp2.seq_len == whole.seq_len == 50 + 1 + 3


@pytest.mark.slow
def test_ddtree_at_tp2_equals_ar_at_tp1(group, whole):
    """Greedy DDTree with the bundled drafter over a TP = 2 target = AR on one process."""
    codec = TextCodec(TARGET)
    prompts = [codec.encode(p) for p in demo_prompts()[:2]]
    ar = DecodeConfig(policy="ar", max_new_tokens=40)
    tree = DecodeConfig(policy="ddtree", block_size=8, budget=16, max_new_tokens=40)
    with ParallelTarget.open(group, SessionSpec(path=str(TARGET), ep=1, dtype=DTYPE)) as tp2:
        drafter = load_drafter(DEMO_DIR / "drafter", tp2)
        for prompt in prompts:
            expected = generate(whole, None, prompt, ar).tokens
            got = generate(tp2, drafter, prompt, tree)
            assert got.tokens == expected
            assert got.mean_tau > 1.5  # the tree really accepted drafts


@pytest.mark.slow
def test_input_errors_leave_the_group_in_step(group, whole, tmp_path):
    """A bad request raises on rank 0 and the group keeps working: a prompt past the
    positions, then a session on a directory without a checkpoint."""
    spec = SessionSpec(path=str(TARGET), ep=2, dtype=DTYPE)
    with ParallelTarget.open(group, spec) as tp2:
        too_long = torch.zeros(whole.config.max_position_embeddings + 1, dtype=torch.int64)
        with pytest.raises(ValueError, match="max_position_embeddings"):
            tp2.prefill(too_long)
        whole.reset()
        prompt = torch.arange(3, 20)
        assert (tp2.prefill(prompt).logits - whole.prefill(prompt).logits).abs().max() <= TOL
    with pytest.raises(CheckpointError, match="config.json"):
        ParallelTarget.open(group, SessionSpec(path=str(tmp_path), ep=1, dtype=DTYPE))
    with ParallelTarget.open(group, spec) as tp2:
        whole.reset()
        assert (tp2.prefill(prompt).logits - whole.prefill(prompt).logits).abs().max() <= TOL
