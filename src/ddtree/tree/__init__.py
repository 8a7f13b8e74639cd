"""The DDTree core: pure functions over tensors (build, verify layout, acceptance, compaction).

No models, no configs, no I/O. Vocabulary: block size B, depth L = B - 1, budget N (non-root
nodes), verify width M = N + 1.

Host work (``build_tree``, ``verify_layout``, ``accept_greedy``) runs on one backend chosen
once per process: the compiled core when built, else the Python reference; ``backend()``
names it (see ``ddtree.tree.backends``).
"""

from ddtree.tree.accept import accept_greedy_batch, accepted_mask, process_logits, sample_token
from ddtree.tree.backends import (
    BACKENDS,
    accept_greedy,
    accept_sampled,
    backend,
    build_tree,
    load_backend,
)
from ddtree.tree.batched import DraftTreeBatch, build_trees
from ddtree.tree.build import build_tree_python
from ddtree.tree.layout import (
    CompactionPlan,
    LayoutBuffer,
    VerifyLayout,
    compaction_indices,
    pack_bits,
    verify_layout,
)
from ddtree.tree.topk import TopK, topk_logprobs
from ddtree.tree.types import AcceptResult, BackendUnavailable, DraftTree, TreeBackend

__all__ = [
    "BACKENDS",
    "AcceptResult",
    "BackendUnavailable",
    "CompactionPlan",
    "DraftTree",
    "DraftTreeBatch",
    "LayoutBuffer",
    "TopK",
    "TreeBackend",
    "VerifyLayout",
    "accept_greedy",
    "accept_greedy_batch",
    "accept_sampled",
    "accepted_mask",
    "backend",
    "build_tree",
    "build_tree_python",
    "build_trees",
    "compaction_indices",
    "load_backend",
    "pack_bits",
    "process_logits",
    "sample_token",
    "topk_logprobs",
    "verify_layout",
]
