"""The two protocols the decode loop drives, so it never cares which model it has.

Sequence bookkeeping (batch of one request):

- The target's KV cache holds ``seq_len`` committed tokens. The root of the next tree is the
  last committed token *not yet in the cache*: the previous step's bonus token, or after
  ``prefill(prompt)`` the target's own token after the last prompt position.
- ``verify(tree, layout)`` runs one forward over the tree's ``M`` tokens at positions
  ``seq_len + depth`` with an ancestor-only mask over the tree and full view of the prefix;
  their KV entries are appended provisionally.
- ``commit(accepted)`` keeps the KV entries of the accepted nodes (root first) at
  ``seq_len .. seq_len + tau - 1`` and drops the rest; ``seq_len`` grows by ``tau``.

The drafter sees target hidden states of the committed tokens only, in order, and proposes
``B - 1`` distributions for the positions after the root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ddtree.errors import NonFiniteLogitsError  # noqa: F401  (re-exported for models)
from ddtree.models.static import EnginePlan
from ddtree.tree.layout import VerifyLayout
from ddtree.tree.types import DraftTree


@dataclass
class ModelInfo:
    """Identity and size of a model, as written into measurement records."""

    name: str  # folder name or preset
    architecture: str  # e.g. "DeepseekV3ForCausalLM", "Qwen3ForCausalLM", "DFlashDraftModel"
    implementation: str  # "mla_moe" (ours), "hf" (transformers wrapper), "dflash"
    n_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str  # "float32", "bfloat16", ...
    max_position: int = 0
    eos_token_ids: tuple[int, ...] = ()
    tp: int = 1  # ranks the model is split over (tensor parallel)
    ep: int = 1  # groups its routed experts are split into (expert parallel)
    # how the checkpoint stored its weights ("": floats), e.g. "fp8 e4m3 weights, 128x128
    # block scales"; they run dequantized into ``dtype`` (ddtree.models.loading.quant)
    quantization: str = ""
    # the kernel of its linear layers (ddtree.models.nn.linear): "aten" or "onednn-packed"
    linear_kernel: str = "aten"
    # a drafter's draft vocabulary: the K rows of the LM head its proposes compute
    # (ddtree.models.adapters.draft_vocab); 0: the full vocabulary
    draft_vocab: int = 0


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [T, V] float, next-token logits at each input position
    hidden: torch.Tensor | None  # [T, n_capture * H], captured layer outputs concatenated, or None


@runtime_checkable
class Target(Protocol):
    info: ModelInfo
    seq_len: int  # committed tokens in the KV cache
    engine_modes: tuple[str, ...]  # the engine modes it runs (ddtree.vocab.EngineMode values)
    device: torch.device  # where its forwards run (trees and tokens are moved there)
    dtype: torch.dtype  # its parameters' and caches' dtype
    embed_tokens: torch.nn.Module  # the input embedding (a DFlash drafter shares it)
    lm_head: torch.nn.Module  # the output head (likewise)

    def set_capture_layers(self, layer_ids: list[int]) -> None:
        """Hidden states to return with every forward (HF ``hidden_states`` indexing: 0 is the
        embedding output, i is the output of decoder layer i-1; the last index, num_layers, is
        taken after the final norm, as transformers returns it)."""

    def reset(self) -> None:
        """Drop the KV cache (seq_len becomes 0)."""

    def set_engine_mode(self, plan: EnginePlan) -> float:
        """Eager or compiled forwards for the next requests (``ddtree.models.static``); resets
        the cache. ``plan.capture_layers`` (None: keep those of ``set_capture_layers``) are
        the hidden states its forwards return. Returns the seconds spent compiling (warm-up),
        0 when nothing compiled. A target that cannot run ``plan.mode`` raises
        ``EngineModeError``."""

    def layout(self, tree: DraftTree):
        """What ``verify`` takes for ``tree`` after the committed prefix: ``verify_layout``
        in eager mode, the tree copied into preallocated static inputs in compiled mode."""

    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        """``input_ids`` [T] int64: append T tokens to the cache (all committed)."""

    def verify(self, tree: DraftTree, layout: VerifyLayout | None = None) -> TargetOutput:
        """One forward over the tree's M tokens; returns logits [M, V] and hidden [M, F].
        ``layout`` is ``layout(tree)`` when the caller built it (the engine does, to time it
        as its own stage); None builds it here."""

    def commit(self, accepted: torch.Tensor) -> None:
        """``accepted`` [tau] int64 node indices of the last verified tree, root first."""


@runtime_checkable
class Drafter(Protocol):
    info: ModelInfo
    engine_modes: tuple[str, ...]
    block_size: int  # B: one root slot + B-1 mask slots
    target_layer_ids: list[int]  # which target hidden states it conditions on (HF indexing)
    # the draft vocabulary: [K] int64 vocabulary ids, ascending, column j of propose's logits
    # standing for id draft_tokens[j]; None (or absent, for drafters written before it): the
    # full vocabulary, column = id (ddtree.models.adapters.draft_vocab)
    draft_tokens: torch.Tensor | None

    def reset(self) -> None:
        """Drop the drafter's context cache."""

    def set_engine_mode(self, plan: EnginePlan) -> float:
        """As ``Target.set_engine_mode``, for ``propose``."""

    def propose(self, context_hidden: torch.Tensor, root_token: int) -> torch.Tensor:
        """Append ``context_hidden`` [T_new, F] (target hidden states of the tokens committed
        since the last call, in order) to the context, then run the block
        ``[root, MASK x (B-1)]`` placed right after the context. Returns logits [B-1, K] for
        the B-1 positions after the root, over the K ids of ``draft_tokens`` (K = V with no
        draft vocabulary). The target verifies whatever ids these become over the full
        vocabulary, so a draft vocabulary can cost tau, never losslessness."""
