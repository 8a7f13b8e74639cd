"""The DDTree core: pure functions over tensors (build, verify layout, acceptance, compaction).

No models, no configs, no I/O. Vocabulary: block size B, depth L = B - 1, budget N (non-root
nodes), verify width M = N + 1.
"""

from ddtree.tree.accept import (
    accept_greedy,
    accept_greedy_batch,
    accept_sampled,
    accept_sampled_batch,
    accepted_mask,
    process_logits,
    sample_token,
)
from ddtree.tree.build import DraftTreeBatch, build_tree, build_trees
from ddtree.tree.layout import (
    CompactionPlan,
    VerifyLayout,
    compaction_indices,
    pack_bits,
    verify_layout,
)
from ddtree.tree.topk import TopK, topk_logprobs
from ddtree.tree.types import AcceptResult, DraftTree

__all__ = [
    "AcceptResult",
    "CompactionPlan",
    "DraftTree",
    "DraftTreeBatch",
    "TopK",
    "VerifyLayout",
    "accept_greedy",
    "accept_greedy_batch",
    "accept_sampled",
    "accept_sampled_batch",
    "accepted_mask",
    "build_tree",
    "build_trees",
    "compaction_indices",
    "pack_bits",
    "process_logits",
    "sample_token",
    "topk_logprobs",
    "verify_layout",
]
