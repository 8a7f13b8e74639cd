import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tree.reference import build_tree_ref, visibility_ref

from ddtree.tree import build_tree, build_trees, load_backend
from ddtree.tree.batched import _candidate_pairs, _pair_count
from ddtree.tree.types import BackendUnavailable


def _builders():
    """Every host builder that loads here (the python one always; native when built)."""
    out = []
    for name in ("python", "native"):
        try:
            out.append(load_backend(name).build_tree)
        except BackendUnavailable:
            pass
    return out


def _assert_same(tree, ref):
    tokens, parents, depth, scores = ref
    assert tree.tokens.tolist() == tokens.tolist()
    assert tree.parents.tolist() == parents.tolist()
    assert tree.depth.tolist() == depth.tolist()
    assert np.array_equal(tree.scores.numpy(), scores)  # bit-exact
    assert np.array_equal(tree.visibility.numpy(), visibility_ref(parents))


def _sorted_lp(rng, n_depth, k, values=None):
    if values is None:
        lp = np.log(rng.dirichlet(np.ones(k * 2), size=n_depth)[:, :k]).astype(np.float32)
    else:
        lp = rng.choice(np.asarray(values, dtype=np.float32), size=(n_depth, k))
    return torch.from_numpy(-np.sort(-lp, axis=1))


def _tokens(rng, n_depth, k, vocab=50):
    return torch.from_numpy(np.stack([rng.choice(vocab, k, replace=False) for _ in range(n_depth)]))


def test_worked_example_from_the_docstring():
    lp = torch.tensor([[-0.1, -2.0], [-0.5, -0.7]])
    tok = torch.tensor([[7, 8], [3, 4]])
    tree = build_tree(5, lp, tok, 3)
    assert tree.tokens.tolist() == [5, 7, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 1]
    assert tree.depth.tolist() == [0, 1, 2, 2]


def test_cross_depth_tie_goes_to_the_lexicographically_smaller_tuple():
    # (0, 0) scores -1 + -1 = -2, the same as (1) = -2; (0, 0) < (1) lexicographically
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -3.0]])
    tok = torch.tensor([[10, 11], [20, 21]])
    tree = build_tree(0, lp, tok, 3)
    assert tree.tokens.tolist() == [0, 10, 20, 11]
    batch = build_trees(torch.tensor([0]), lp[None], tok[None], 3).tree(0)
    assert batch.tokens.tolist() == [0, 10, 20, 11]


@pytest.mark.parametrize("seed", range(20))
def test_both_builders_match_the_reference_on_random_inputs(seed):
    rng = np.random.default_rng(seed)
    n_depth, k, budget = rng.integers(1, 4), rng.integers(1, 4), int(rng.integers(0, 20))
    values = None if seed % 2 else [0.0, -0.5, -1.0, -1.5, float("-inf")]
    lp, tok = _sorted_lp(rng, n_depth, k, values), _tokens(rng, n_depth, k)
    ref = build_tree_ref(3, lp.numpy(), tok.numpy(), budget)
    for builder in _builders():
        _assert_same(builder(3, lp, tok, budget), ref)
    _assert_same(build_trees(torch.tensor([3]), lp[None], tok[None], budget).tree(0), ref)


@settings(max_examples=60, deadline=None)
@given(
    n_depth=st.integers(1, 3),
    k=st.integers(1, 3),
    budget=st.integers(0, 40),
    r=st.integers(1, 3),
    data=st.data(),
)
def test_property_batched_equals_cpu_equals_reference(n_depth, k, budget, r, data):
    # few distinct values -> many ties; -inf entries included; budgets beyond all nodes
    vals = st.sampled_from([0.0, -0.25, -0.5, -1.0, -2.0, float("-inf")])
    lps, toks, roots = [], [], []
    for _ in range(r):
        rows = [
            sorted(data.draw(st.lists(vals, min_size=k, max_size=k)), reverse=True)
            for _ in range(n_depth)
        ]
        lps.append(torch.tensor(rows, dtype=torch.float32))
        perm = data.draw(st.permutations(list(range(2 * k))))
        toks.append(torch.tensor([perm[:k]] * n_depth, dtype=torch.int64))
        roots.append(data.draw(st.integers(0, 99)))
    batch = build_trees(torch.tensor(roots), torch.stack(lps), torch.stack(toks), budget)
    for i in range(r):
        ref = build_tree_ref(roots[i], lps[i].numpy(), toks[i].numpy(), budget)
        for builder in _builders():
            _assert_same(builder(roots[i], lps[i], toks[i], budget), ref)
        _assert_same(batch.tree(i), ref)


def _prefix_closed(nodes):
    return all(n[:-1] in nodes or len(n) == 1 for n in nodes)


@pytest.mark.parametrize("seed", range(6))
def test_oracle_builder_maximises_expected_accepted_length(seed):
    """Among all prefix-closed trees of N nodes, the builder's maximises the sum of path
    probabilities (the expected accepted length under factorised marginals)."""
    rng = np.random.default_rng(100 + seed)
    n_depth, k, budget = 2, 3, int(rng.integers(2, 6))
    lp, tok = _sorted_lp(rng, n_depth, k), _tokens(rng, n_depth, k)
    p = np.exp(lp.numpy().astype(np.float64))
    candidates = [c for d in range(1, n_depth + 1) for c in itertools.product(range(k), repeat=d)]

    def value(nodes):
        return sum(math.prod(p[i, r] for i, r in enumerate(n)) for n in nodes)

    best = max(
        value(s) for s in itertools.combinations(candidates, budget) if _prefix_closed(set(s))
    )
    tree = build_tree(0, lp, tok, budget)
    assert tree.n_nodes == budget + 1
    assert value(rank_tuples(tree, tok)) == pytest.approx(best, rel=1e-12)


def rank_tuples(tree, tok):
    """Each node's rank tuple, read back from tokens (distinct ids per depth)."""
    out = [()]
    for i in range(1, tree.n_nodes):
        d = int(tree.depth[i])
        rank = tok[d - 1].tolist().index(int(tree.tokens[i]))
        out.append(out[int(tree.parents[i])] + (rank,))
    return out[1:]


def test_order_is_non_increasing_and_parents_first():
    rng = np.random.default_rng(7)
    lp, tok = _sorted_lp(rng, 7, 16), _tokens(rng, 7, 16, vocab=1000)
    tree = build_tree(1, lp, tok, 64)
    assert tree.n_nodes == 65
    assert (tree.scores[1:-1] >= tree.scores[2:]).all()
    assert (tree.parents[1:] < torch.arange(1, 65)).all()
    assert (tree.depth[1:] == tree.depth[tree.parents[1:]] + 1).all()


def test_small_trees_when_few_nodes_exist():
    lp = torch.tensor([[-0.1, float("-inf")]])
    tree = build_tree(0, lp, torch.tensor([[1, 2]]), 10)
    assert tree.tokens.tolist() == [0, 1]
    assert build_tree(0, lp, torch.tensor([[1, 2]]), 0).n_nodes == 1
    batch = build_trees(
        torch.tensor([0, 4]), lp[None].repeat(2, 1, 1), torch.tensor([[[1, 2]]] * 2), 10
    )
    assert batch.n_nodes.tolist() == [2, 2]


@pytest.mark.parametrize(
    "lp, message",
    [
        (torch.tensor([[-0.1, float("nan")]]), "NaN"),
        (torch.tensor([[-2.0, -0.1]]), "sorted descending"),
    ],
)
def test_bad_input_is_a_clear_error(lp, message):
    for builder in _builders():
        with pytest.raises(ValueError, match=message):
            builder(0, lp, torch.tensor([[1, 2]]), 4)
    with pytest.raises(ValueError, match=message):
        build_trees(torch.tensor([0]), lp[None], torch.tensor([[[1, 2]]]), 4)


def test_shape_mismatch_and_negative_budget():
    for builder in _builders():
        with pytest.raises(ValueError, match="topk_tokens"):
            builder(0, torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.int64), 4)
        with pytest.raises(ValueError, match="budget"):
            builder(0, torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64), -1)


@pytest.mark.parametrize("seed", range(12))
def test_batched_candidate_pruning_is_exact_with_wide_k_and_ties(seed):
    # the batched builder only scores (parent rank i, child rank j) with (i+1)(j+1) <= N;
    # wide K, budgets below P*K and many ties exercise that bound
    rng = np.random.default_rng(100 + seed)
    n_depth, k, budget = 4, 8, int(rng.integers(1, 40))
    values = [0.0, -0.5, -1.0, -1.5, float("-inf")] if seed % 2 else None
    lps = torch.stack([_sorted_lp(rng, n_depth, k, values) for _ in range(3)])
    toks = torch.stack([_tokens(rng, n_depth, k) for _ in range(3)])
    batch = build_trees(torch.tensor([1, 2, 3]), lps, toks, budget)
    for i in range(3):
        ref = build_tree_ref(i + 1, lps[i].numpy(), toks[i].numpy(), budget)
        _assert_same(batch.tree(i), ref)


def test_candidate_pairs_worked_example_and_count():
    i, j = _candidate_pairs(3, 4, 4, "cpu")  # the docstring's example
    assert i.tolist() == [0, 0, 0, 0, 1, 1, 2] and j.tolist() == [0, 1, 2, 3, 0, 1, 0]
    for p, k, n in itertools.product(range(1, 12), range(1, 12), range(0, 40)):
        pairs = [(a, b) for a in range(p) for b in range(k) if (a + 1) * (b + 1) <= n]
        assert _pair_count(p, k, n) == len(pairs)
        if n in (0, 7, 39):
            i, j = _candidate_pairs(p, k, n, "cpu")
            assert list(zip(i.tolist(), j.tolist(), strict=True)) == pairs


# ops that read device data on the host or carry data-dependent (unbacked) sizes: none may
# appear in the batched builder's graph, or it could not run inside a captured CUDA graph
HOST_SYNC_OPS = (
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "item",
    "_assert_async",
    "_assert_scalar",
    "sym_size",
    "sym_numel",
    "sym_stride",
)


def _graph_ops(fn, *args, **kwargs) -> tuple[object, set[str]]:
    """Run ``fn`` through torch.compile(fullgraph=True) (a graph break raises) and return its
    result and the aten ops of the captured graph."""
    from torch._dynamo.backends.common import aot_autograd

    ops: set[str] = set()

    def record(gm, example_inputs):
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=record))
    return compiled(*args, **kwargs), ops


@pytest.mark.slow
def test_batched_builder_compiles_to_one_graph_without_host_synchronisation():
    """The CPU proxy for CUDA-graph capture: one graph (fullgraph), no op that syncs."""
    rng = np.random.default_rng(5)
    lps = torch.stack([_sorted_lp(rng, 3, 6, [0.0, -0.5, -1.0, float("-inf")]) for _ in range(2)])
    toks = torch.stack([_tokens(rng, 3, 6) for _ in range(2)])
    roots = torch.tensor([4, 9])
    batch, ops = _graph_ops(build_trees, roots, lps, toks, 8, check_values=False)
    aten = {op.split(".")[1] for op in ops if op.startswith("aten.")}  # aten.sort.stable -> sort
    assert "sort" in aten and "gather" in aten  # the builder's graph, not an empty one
    assert not aten & set(HOST_SYNC_OPS), sorted(aten)
    # symbolic-size arithmetic (sym_sum, sym_min, ..) means a shape depends on data
    assert {op for op in ops if not op.startswith("aten.")} <= {"<built-in function getitem>"}
    for i in range(2):
        ref = build_tree_ref(int(roots[i]), lps[i].numpy(), toks[i].numpy(), 8)
        _assert_same(batch.tree(i), ref)


def test_value_checks_are_what_breaks_a_graph():
    """With the NaN / sortedness checks on, fullgraph tracing fails (they read values on the
    host): check_values=False is needed inside a captured graph, and only there."""
    lp = torch.tensor([[[-0.1, -0.2]]])
    with pytest.raises(Exception, match="(?i)data-dependent|graph break|unsupported"):
        _graph_ops(build_trees, torch.tensor([0]), lp, torch.tensor([[[1, 2]]]), 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_builder_replays_in_a_cuda_graph():
    """On CUDA: capture build_trees once, replay it on new inputs copied into the captured
    input tensors, and get the reference trees."""
    rng = np.random.default_rng(9)
    device = torch.device("cuda")

    def inputs():
        lps = torch.stack([_sorted_lp(rng, 4, 8, [0.0, -0.5, -1.0, -2.0]) for _ in range(3)])
        toks = torch.stack([_tokens(rng, 4, 8) for _ in range(3)])
        return torch.tensor([1, 2, 3]), lps, toks

    static = [t.to(device) for t in inputs()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build_trees(*static, 16, check_values=False)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_trees(*static, 16, check_values=False)
    for _ in range(2):
        fresh = inputs()
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for i in range(3):
            ref = build_tree_ref(int(fresh[0][i]), fresh[1][i].numpy(), fresh[2][i].numpy(), 16)
            tree = out.tree(i)
            assert tree.tokens.tolist() == ref[0].tolist()
            assert tree.parents.tolist() == ref[1].tolist()
